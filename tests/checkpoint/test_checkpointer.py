"""dspark_jax.checkpoint.checkpointer.Checkpointer: composite save/restore, retention, meta."""

from __future__ import annotations

import re

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dspark_jax import parallel
from dspark_jax.checkpoint.checkpointer import Checkpointer, KeepLatestAndBest


def _iterator(start=0):
    it = iter(grain.MapDataset.range(10).to_iter_dataset())
    for _ in range(start):
        next(it)
    return it


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_roundtrip_with_data_iterator_onto_another_mesh(tmp_path):
    mesh = parallel.make_mesh("data=2,fsdp=4")
    w = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("fsdp", None)))
    state = {"params": {"layers": {0: {"w": w}}}, "opt": (jnp.int32(3), {"m": w * 2})}
    ckpt = Checkpointer(tmp_path, max_to_keep=2)
    it = _iterator(start=3)
    assert ckpt.save(7, state, {"global_step": 7, "note": "x"}, it)
    ckpt.wait()
    assert ckpt.meta(7) == {"global_step": 7, "note": "x"}

    other = parallel.make_mesh("fsdp=2,tensor=4")
    sh = NamedSharding(other, P(None, "tensor"))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=sh if x.ndim else NamedSharding(other, P())
        ),
        state,
    )
    it2 = _iterator()
    restored, meta = ckpt.restore(None, abstract, it2)
    assert meta["global_step"] == 7 and next(it2) == 3
    np.testing.assert_array_equal(
        restored["params"]["layers"][0]["w"], np.arange(32.0).reshape(8, 4)
    )
    assert restored["params"]["layers"][0]["w"].sharding == sh
    assert int(restored["opt"][0]) == 3
    ckpt.close()


def test_retention_keeps_the_newest_and_the_best(tmp_path):
    ckpt = Checkpointer(tmp_path, max_to_keep=2, async_save=False, with_data=False)
    for step in range(1, 6):
        if step == 2:
            ckpt.best_step = 2
        ckpt.save(step, {"x": np.float32(step)}, {"step": step})
    assert ckpt.all_steps() == [2, 4, 5]
    ckpt.best_step = 5
    ckpt.save(6, {"x": np.float32(6)}, {"step": 6})
    assert ckpt.all_steps() == [5, 6]
    ckpt.delete_all()
    assert ckpt.all_steps() == [] and ckpt.latest_step() is None
    ckpt.close()


def test_policy_edge_cases():
    class Info:
        def __init__(self, step):
            self.step = step

    infos = [Info(s) for s in (3, 1, 2)]
    assert KeepLatestAndBest(None).should_preserve(infos, context=None) == [True] * 3
    assert KeepLatestAndBest(0, best_step=1).should_preserve(infos, context=None) == [
        False,
        True,
        False,
    ]
    assert KeepLatestAndBest(1).should_preserve(infos, context=None) == [True, False, False]


def test_restore_without_checkpoint_raises(tmp_path):
    ckpt = Checkpointer(tmp_path, with_data=False)
    with pytest.raises(FileNotFoundError, match="no checkpoint to restore"):
        ckpt.restore(None, {"x": jax.ShapeDtypeStruct((), jnp.float32)})
    ckpt.close()


# A full disk, for real and without root: a file-size limit makes Orbax's own writes
# fail (EFBIG) in a child process that ignores SIGXFSZ.
FULL_DISK_CHILD = r"""
import resource, signal, sys
import numpy as np
from dspark_jax.cli import guarded
from dspark_jax.checkpoint.checkpointer import Checkpointer
from dspark_jax.train.trainer import setup_logging

def main(argv):
    setup_logging()
    ckpt = Checkpointer(argv[0], with_data=False)
    w = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    ckpt.save(1, {"w": w}, {"step": 1}, force=True, reason="epoch_end")
    ckpt.wait()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, resource.RLIM_INFINITY))
    try:
        ckpt.save(2, {"w": w}, {"step": 2}, force=True, reason="epoch_end")
        print("started step 2", file=sys.stderr)
        ckpt.wait()
    finally:
        ckpt.close()
    return 0

sys.exit(guarded(main))
"""


def test_a_failed_save_is_reported_once_and_never_as_saved(tmp_path):
    """Issue 18.9: no "checkpoint ... at step 2" before it is written; one error line
    naming the step; step 1 byte-identical."""
    import subprocess

    from tests.converters.helpers import tree_digest
    from tests.train.conftest import PYTHON, child_env

    env = child_env("")
    env.pop("DSPARK_DEBUG", None)
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run([PYTHON, "-c", FULL_DISK_CHILD, str(ckpt)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    # Without lines of the CUDA plugin's C++ logging (the cuda-compile extra, installed
    # by CI, announces on every CPU machine that it found no CUDA driver): not ours.
    absl = re.compile(r"^([IWEF]\d{4} \d\d:\d\d:\d\d|WARNING: All log messages before absl::)")
    lines = [ln for ln in proc.stderr.strip().splitlines() if not absl.match(ln)]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(lines) == 3, lines
    assert lines[0].endswith(f"INFO checkpoint (epoch_end) at step 1 -> {ckpt}/1")
    assert lines[1] == "started step 2"
    assert lines[2].startswith(f"error: {ckpt}/2: the checkpoint was not written: ")
    assert "File too large" in lines[2]
    assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["1"]
    digest = tree_digest(ckpt / "1")
    ckpt1 = Checkpointer(ckpt, with_data=False)
    assert ckpt1.all_steps() == [1] and ckpt1.meta(1) == {"step": 1}
    ckpt1.close()
    assert tree_digest(ckpt / "1") == digest


def _truncated_checkpoint(directory):
    """A step of many arrays whose data files lost their second half: the reads of one
    restore run concurrently, and all but the first to fail are still in flight when
    Orbax raises."""
    ckpt = Checkpointer(directory, async_save=False, with_data=False)
    state = {f"p{i}": jnp.full((37 * (i + 1), 16), float(i)) for i in range(60)}
    ckpt.save(1, state, {"step": 1})
    ckpt.wait()
    sizes = {}
    for f in (directory / "1" / "state").rglob("d/*"):
        sizes[f] = f.stat().st_size
        f.write_bytes(f.read_bytes()[: sizes[f] // 2])
    return ckpt, state, sizes


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_failed_restore_leaves_nothing_running(tmp_path, capfd, caplog, monkeypatch):
    """Issue 32: every read of a failed restore is finished inside it; nothing is printed
    or raised later (the reads used to fail on Orbax's closed event loop, printing
    "Event loop is closed" and "Task exception was never retrieved" blocks)."""
    import asyncio
    import gc

    from dspark_jax.checkpoint.checkpointer import abstract_like

    left_running = []
    close = asyncio.BaseEventLoop.close

    def spy(loop):  # what an event loop still runs when it closes
        left_running.extend(t for t in asyncio.all_tasks(loop) if not t.done())
        close(loop)

    ckpt, state, _ = _truncated_checkpoint(tmp_path)
    capfd.readouterr()
    monkeypatch.setattr(asyncio.BaseEventLoop, "close", spy)
    # Without the fix a restore leaves reads running at the close about 2 times in 3
    # (the others fail before Orbax raises): six restores miss it about once in 700.
    for _ in range(6):
        with pytest.raises(ValueError, match="is not valid for value of size"):
            ckpt.restore(1, abstract_like(state))
    monkeypatch.undo()
    ckpt.close()
    assert not left_running
    gc.collect()  # a task never retrieved is reported when it is collected
    out, err = capfd.readouterr()
    assert "Event loop is closed" not in out + err and "never retrieved" not in out + err
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text


def test_an_unreadable_step_is_described_in_one_short_line(tmp_path, monkeypatch):
    """The cause in words and the file relative to the checkpoint, not TensorStore's spec
    (kilobytes); DSPARK_DEBUG keeps the whole text."""
    from dspark_jax.checkpoint.checkpointer import abstract_like
    from dspark_jax.checkpoint.orbax_io import unreadable_reason

    ckpt, state, sizes = _truncated_checkpoint(tmp_path)
    with pytest.raises(ValueError) as caught:
        ckpt.restore(1, abstract_like(state))
    ckpt.close()
    monkeypatch.delenv("DSPARK_DEBUG", raising=False)
    reason = unreadable_reason(caught.value, tmp_path)
    rel = {str(f.relative_to(tmp_path)): size for f, size in sizes.items()}
    file, cause = reason.split(": ", 1)
    assert file in rel, (reason, rel)
    # The file kept half its bytes; the read asked for a range that ended past them.
    kept, needed = (int(n) for n in cause[len("truncated: ") : -len(" bytes")].split(" of "))
    assert cause == f"truncated: {kept} of {needed} bytes" and kept == rel[file] // 2 < needed
    assert len(reason) <= 200 and "tensorstore_spec" not in reason
    monkeypatch.setenv("DSPARK_DEBUG", "1")
    assert "tensorstore_spec" in unreadable_reason(caught.value, tmp_path)
