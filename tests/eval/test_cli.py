"""``python -m dspark_jax.eval`` end to end on tiny checkpoints: outputs, formats, a trained drafter."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from dspark_jax.convert.export import export_checkpoint
from dspark_jax.eval import runner as dspark_eval
from dspark_jax.train import checkpoint as orbax_io
from tests.eval.conftest import train_tiny

COMMON = ["--total-seq-len", "128", "--anchors-per-call", "64"]


def _argv(setup, ckpt, out, *extra, datasets=("train", "heldout")):
    paths = {"train": setup.data.data_path, "heldout": setup.heldout.data_path}
    argv = ["--checkpoint", str(ckpt), "--verifier", str(setup.verifier), "--output-dir", str(out)]
    for name in datasets:
        argv += ["--dataset", f"{name}={paths[name]}"]
    return argv + COMMON + list(extra)


@pytest.fixture(scope="module")
def random_run(eval_setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_random")
    report = dspark_eval.run(_argv(eval_setup, eval_setup.ckpt, out))
    return report, out


def test_outputs_of_an_orbax_checkpoint(random_run, eval_setup, tmp_path):
    _, out = random_run
    names = {p.name for p in out.iterdir()}
    assert {
        "acceptance.md", "acceptance.csv", "acceptance_by_context.csv", "calibration.csv",
        "summary.json", "acceptance_by_position.png", "acceptance_by_context.png",
        "calibration_sampled.png", "calibration_greedy.png",
    } <= names  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 3 and summary["draft_positions"] == 4
    assert summary["datasets"]["train"]["documents"] == eval_setup.data.n_docs
    assert summary["datasets"]["heldout"]["documents"] == eval_setup.heldout.n_docs
    md = (out / "acceptance.md").read_text()
    assert md.count("| data | pos0 | pos1 | pos2 | pos3 | acceptance length |") == 4
    # The Markdown, CSV and JSON agree.
    rows = list(csv.DictReader((out / "acceptance.csv").open()))
    for name in ("train", "heldout"):
        acc = summary["datasets"][name]["acceptance"]["analytic/free_running"]
        mine = [r for r in rows if r["dataset"] == name and r["rule"] == "analytic"
                and r["conditioning"] == "free_running"]  # fmt: skip
        assert [float(r["cumulative"]) for r in mine] == pytest.approx(acc["cumulative"])
        cells = " | ".join(f"{100 * v:.1f}%" for v in acc["cumulative"])
        assert f"| {name} | {cells} | {acc['acceptance_length']:.2f} |" in md
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Temperatures beside the checkpoint; applying them again reproduces the metrics.
    temps = eval_setup.ckpt / "confidence_temperatures-3.json"
    saved = json.loads(temps.read_text())
    assert saved["rule"] == "sampled" and len(saved["temperatures"]) == 4
    assert summary["calibration"]["temperatures"]["sampled"] == saved["temperatures"]
    before = temps.stat().st_mtime_ns
    again = dspark_eval.run(
        _argv(eval_setup, eval_setup.ckpt, tmp_path, "--temperatures", str(temps))
    )
    assert temps.stat().st_mtime_ns == before  # given temperatures: nothing written
    for rule in ("sampled", "greedy"):
        fitted = summary["calibration"]["all"][rule]["calibrated"]["summary"]
        applied = again["calibration"]["all"][rule]["calibrated"]["summary"]
        assert applied == pytest.approx(fitted)
    assert again["datasets"]["train"]["acceptance"] == summary["datasets"]["train"]["acceptance"]


def test_a_speculators_folder_gives_the_same_numbers(random_run, eval_setup, tmp_path):
    report, _ = random_run
    folder = tmp_path / "drafter"
    export_checkpoint(eval_setup.ckpt, folder, dtype="float32", verifier_path=eval_setup.verifier,
                      target="speculators")  # fmt: skip
    got = dspark_eval.run(_argv(eval_setup, folder, tmp_path / "out", "--no-plots"))
    assert got["step"] is None
    for name in ("train", "heldout"):
        for method, curve in report["datasets"][name]["acceptance"].items():
            mine = got["datasets"][name]["acceptance"][method]
            assert mine["cumulative"] == pytest.approx(curve["cumulative"], abs=1e-6), method
    assert (folder / "confidence_temperatures.json").exists()


def test_errors_name_the_flag(eval_setup, tmp_path, capsys):
    rc = dspark_eval.main(_argv(eval_setup, tmp_path / "nope", tmp_path))
    assert rc == 2 and "--checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        dspark_eval.main(["--checkpoint", "x", "--dataset", "no-equals-sign"])
    rc = dspark_eval.main(_argv(eval_setup, eval_setup.ckpt, tmp_path, "--hidden-states", "zzz=/x"))
    assert rc == 2 and "unknown datasets ['zzz']" in capsys.readouterr().err


def test_a_trained_drafter_prints_its_table_and_plots(random_run, eval_setup, tmp_path, capsys):
    """Item 4's stand-in until the demo drafter exists: a few optax steps on the training
    data, then the command on the held-out data."""
    cfg = eval_setup.cfg
    params, losses = train_tiny(cfg, eval_setup.verifier, eval_setup.data.data_path, steps=40)
    assert losses[-1] < 0.5 * losses[0]
    ckpt = tmp_path / "trained"
    orbax_io.save_params_checkpoint(ckpt, 40, cfg, params)
    capsys.readouterr()
    rc = dspark_eval.main(_argv(eval_setup, ckpt, tmp_path / "out", datasets=("heldout",)))
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| heldout |" in printed and "acceptance length" in printed
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    trained = summary["datasets"]["heldout"]["acceptance"]
    fresh = random_run[0]["datasets"]["heldout"]["acceptance"]
    for method in ("analytic/free_running", "greedy/free_running"):
        assert trained[method]["acceptance_length"] > 2.0
        assert trained[method]["acceptance_length"] > fresh[method]["acceptance_length"] + 0.8
        assert np.all(np.diff(trained[method]["cumulative"]) <= 1e-12)  # prefixes only shrink
    import matplotlib.image

    img = matplotlib.image.imread(tmp_path / "out" / "acceptance_by_position.png")
    assert img.shape[0] > 300 and img.shape[1] > 600 and img.std() > 0.05


def test_verifier_norm_follows_the_verifier_unless_told(tmp_path):
    from tests.tiny_configs import base_config

    with_verifier_norm = dspark_eval.with_verifier_norm
    cfg = base_config()
    (tmp_path / "config.json").write_text(
        json.dumps({"text_config": {"model_type": "gemma3_text"}})
    )
    assert with_verifier_norm(cfg, tmp_path, "auto").verifier_norm_style == "gemma"
    assert with_verifier_norm(cfg, tmp_path, "plain").verifier_norm_style == "plain"
    recorded = cfg.replace(verifier_norm_style="gemma")
    assert with_verifier_norm(recorded, tmp_path / "none", "auto") == recorded  # no config.json
