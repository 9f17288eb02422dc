"""Issue 4, test 5: an interrupted extraction, run again, completes without redoing
finished files and without leaving partial ones."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from datasets import load_from_disk

from launch.extract_hidden_states import main, parse_args, run
from launch.hs_files import load_and_check

from .conftest import DEMO_TARGET_LAYERS, REPO, demo_conversations, write_jsonl


@pytest.fixture(scope="module")
def bigger_prepared(tmp_path_factory, verifier_path):
    from launch.prepare_data import prepare

    root = tmp_path_factory.mktemp("resume")
    data = write_jsonl(root / "c.jsonl", demo_conversations(30, start=100))
    prepare(verifier_path, [str(data)], str(root / "data"), seq_length=160, num_workers=1)
    return root / "data"


def _argv(verifier_path, data, out):
    return [
        "--backend",
        "hf",
        "--model",
        verifier_path,
        "--preprocessed-data",
        str(data),
        "--output",
        str(out),
        "--target-layer-ids",
        *map(str, DEMO_TARGET_LAYERS),
        "--batch-size",
        "1",
        "--device",
        "cpu",
        "--threads",
        "1",
    ]


# The child is the real CLI, slowed down between writing a file and renaming it into
# place, so that the interruption lands mid-run (and usually mid-write) on any machine.
CHILD = """
import sys, time
import launch.hs_files as h
from launch.extract_hidden_states import main
commit = h.commit_file
def slow_commit(tmp, final):
    time.sleep(0.15)
    commit(tmp, final)
h.commit_file = slow_commit
sys.exit(main(sys.argv[1:]))
"""


def _start(argv, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    log = open(tmp_path / "child.log", "wb")  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, *argv],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _wait_for_files(proc, out, n, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out.is_dir() and sum(1 for p in out.iterdir() if p.name.startswith("hs_")) >= n:
            return
        if proc.poll() is not None:
            pytest.fail(f"extraction exited early with {proc.returncode}")
        time.sleep(0.01)
    pytest.fail("no files appeared")


def _check_all_final_files(out, rows, n_slots):
    names = sorted(p.name for p in out.iterdir() if p.name.startswith("hs_"))
    for name in names:
        i = int(name[3:].split(".")[0])
        load_and_check(out / name, rows[i]["input_ids"], num_slots=n_slots, dtype="bfloat16")
    return names


def test_killed_extraction_resumes(tmp_path, verifier_path, bigger_prepared):
    rows = load_from_disk(str(bigger_prepared)).with_format(None)
    n, n_slots = len(rows), len(DEMO_TARGET_LAYERS) + 1
    out = tmp_path / "hs"
    argv = _argv(verifier_path, bigger_prepared, out)
    proc = _start(argv, tmp_path)
    _wait_for_files(proc, out, 3)
    proc.send_signal(signal.SIGKILL)  # a crash: no cleanup at all
    proc.wait()
    done = _check_all_final_files(out, rows, n_slots)  # every final name is a whole file
    assert 3 <= len(done) < n, "the run was not interrupted mid-way"
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("hs_*")}

    # a file truncated by some non-atomic copy, and a stale partial of another run
    victim = out / done[0]
    victim.write_bytes(victim.read_bytes()[:100])
    (out / ".hs_999.safetensors.partial-1").write_bytes(b"junk")

    fast = [*argv, "--batch-size", "16", "--threads", "2"]  # batch size does not matter here
    summary = run(parse_args(fast))
    assert not summary.failed
    assert summary.invalid_existing == 1
    assert summary.skipped_valid == len(done) - 1
    assert summary.written == n - len(done) + 1
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    assert len(_check_all_final_files(out, rows, n_slots)) == n
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("hs_*")}
    for name, stamp in before.items():  # finished files were not redone
        if name != victim.name:
            assert after[name] == stamp, name
    # a third run has nothing to do
    again = run(parse_args(fast))
    assert again.written == 0 and again.skipped_valid == n


def test_ctrl_c_leaves_no_partial_file(tmp_path, verifier_path, bigger_prepared, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) while a file is written but not yet renamed: exit
    status 130, the temporary file is removed, the next run completes."""
    import launch.hs_files as h

    rows = load_from_disk(str(bigger_prepared)).with_format(None)
    out = tmp_path / "hs"
    argv = [*_argv(verifier_path, bigger_prepared, out), "--batch-size", "16", "--threads", "2"]
    commit, calls = h.commit_file, []

    def interrupted_commit(tmp, final):
        calls.extend([final] if final.name.startswith("hs_") else [])
        if len(calls) == 3:
            assert tmp.exists() and not final.exists()
            raise KeyboardInterrupt
        commit(tmp, final)

    monkeypatch.setattr(h, "commit_file", interrupted_commit)
    assert main(argv) == 130
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
    assert len(_check_all_final_files(out, rows, len(DEMO_TARGET_LAYERS) + 1)) == 2
    monkeypatch.setattr(h, "commit_file", commit)
    assert main(argv) == 0
    assert len(_check_all_final_files(out, rows, len(DEMO_TARGET_LAYERS) + 1)) == len(rows)


def test_other_layer_ids_refused_in_same_folder(tmp_path, verifier_path, small_prepared, capsys):
    out = tmp_path / "hs"
    base = [
        "--backend",
        "hf",
        "--model",
        verifier_path,
        "--preprocessed-data",
        str(small_prepared),
        "--output",
        str(out),
        "--max-samples",
        "1",
        "--device",
        "cpu",
    ]
    assert main([*base, "--target-layer-ids", "1", "2", "3"]) == 0
    assert main([*base, "--target-layer-ids", "1", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "other settings" in err[-1]
