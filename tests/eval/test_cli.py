"""``python -m dspark_jax.eval`` end to end on tiny checkpoints: outputs, formats, a trained drafter."""

from __future__ import annotations

import copy
import csv
import json
import math
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from dspark_jax.checkpoint import orbax_io
from dspark_jax.convert.export import export_checkpoint
from dspark_jax.eval import calibration
from dspark_jax.eval import report as eval_report
from dspark_jax.eval import runner as dspark_eval
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
        "summary.json", "calibration.json", "acceptance_by_position.png", "acceptance_by_context.png",
        "calibration_sampled.png", "calibration_greedy.png",
    } <= names  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 3 and summary["draft_positions"] == 4
    assert summary["datasets"]["train"]["documents"] == eval_setup.data.n_docs
    assert summary["datasets"]["heldout"]["documents"] == eval_setup.heldout.n_docs
    md = (out / "acceptance.md").read_text()
    # The four methods' tables and the served-equivalent one (its header goes on).
    assert md.count("| data | pos0 | pos1 | pos2 | pos3 | acceptance length |") == 5
    assert "| data | pos0 | pos1 | pos2 | pos3 | acceptance length | tokens/pass |" in md
    for name in ("train", "heldout"):
        # Every generated token is the prefill's, an accepted one or a bonus; a response
        # whose accepted tokens reach its end has no bonus at its last step.
        w = summary["datasets"][name]["served"]
        assert w["passes"] == w["drafts"] + w["responses"]
        no_bonus = w["responses"] + w["drafts"] + w["accepted"] - w["generated"]
        assert 0 <= no_bonus <= w["responses"]
    # The Markdown, CSV and JSON agree.
    rows = list(csv.DictReader((out / "acceptance.csv").open()))
    for name in ("train", "heldout"):
        acc = summary["datasets"][name]["acceptance"]["analytic/free_running"]
        mine = [r for r in rows if r["dataset"] == name and r["rule"] == "analytic"
                and r["conditioning"] == "free_running"]  # fmt: skip
        # The CSV and the JSON both write Python's repr of the float: it reads back exactly.
        assert [float(r["cumulative"]) for r in mine] == acc["cumulative"]
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
        # The file holds the fitted float64 temperatures (JSON repr: exact), and the
        # metrics are recomputed from the same values by the same code: equal.
        assert applied == fitted
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
            # A float32 export is the Orbax params bit for bit (test_float32_export_is_exact),
            # evaluated on the same data by the same program: the same numbers.
            assert mine["cumulative"] == curve["cumulative"], method
    assert (folder / "confidence_temperatures.json").exists()


@pytest.fixture(scope="module")
def trained(eval_setup, tmp_path_factory):
    """A few optax steps on the training data: (checkpoint, losses)."""
    cfg = eval_setup.cfg
    params, losses = train_tiny(cfg, eval_setup.verifier, eval_setup.data.data_path, steps=40)
    ckpt = tmp_path_factory.mktemp("trained") / "ckpt"
    orbax_io.save_params_checkpoint(ckpt, 40, cfg, params)
    return ckpt, losses


def _folded_ece_bound(folder, cfg, positions: int) -> float:
    """How far the exported head's ECE may sit from eval's calibrated one, from fp32 alone.

    Eval computes ``z = fl(w . x + b)`` and divides by T in float64; the export holds
    ``w' = fl(w / T)``, ``b' = fl(b / T)`` and the engine computes ``fl(w' . x + b')``. With
    the drafter's other weights bit-exact, x is the same, and the two logits differ by at
    most two dot products' rounding plus the fold's: ``(2 (F + 1) + 1) u A`` with
    ``A = sum |w'_i x_i| + |b'|`` and u = 2^-24 (Higham's gamma_n, first order).
    x is the final RMSNorm's output (``|x_i| <= sqrt(H) |g_i|``) and Markov W1 rows
    (``|x_i| <= max_v |W1[v, i]|``). A survival at position k is a product of k sigmoids
    (slope <= 1/4), so it moves by ``delta <= N dz / 4`` (N positions); with the same blocks in every
    bin, a bin's mean prediction moves by at most ``2 delta`` (a block crossing a bin edge
    is swapped for one within delta of the same edge), and so does the ECE."""
    t = load_file(str(folder / "model.safetensors"))
    w = np.abs(t["confidence_head.proj.weight"].astype(np.float64)).reshape(-1)
    b = float(np.abs(t["confidence_head.proj.bias"].astype(np.float64)).sum())
    h = cfg.hidden_size
    xmax = [np.sqrt(h) * np.abs(t["norm.weight"].astype(np.float64))]
    if cfg.confidence_head_with_markov:
        xmax.append(np.abs(t["markov_head.markov_w1.weight"].astype(np.float64)).max(0))
    xmax = np.concatenate(xmax)
    assert xmax.shape == w.shape
    a = float(w @ xmax) + b
    dz = (2 * (w.size + 1) + 1) * 2.0**-24 * a * (1 + 1e-3)  # 1e-3: second-order terms
    return 2 * positions * dz / 4


def test_exported_head_has_the_calibrated_ece(trained, eval_setup, tmp_path):
    """The global temperature of calibration.json, folded into the exported confidence
    head (fp32, as vLLM serves it): the exported drafter's raw ECE on the held-out split
    is the calibrated ECE eval reported."""
    ckpt, _ = trained
    out = tmp_path / "eval"
    cal = dspark_eval.run(_argv(eval_setup, ckpt, out, "--no-plots", datasets=("heldout",)))[
        "calibration"
    ]
    record = json.loads((out / "calibration.json").read_text())
    t = cal["global_temperature"]["sampled"]
    assert record["rule"] == "sampled" and record["temperature"] == t
    assert calibration.T_MIN < t < calibration.T_MAX and abs(t - 1) > 0.05
    held = cal["all"]["sampled"]
    assert record["ece"] == {
        "uncalibrated": held["uncalibrated"]["summary"]["ece"],
        "calibrated": held["global"]["summary"]["ece"],
    }
    folder = tmp_path / "drafter"
    export_checkpoint(ckpt, folder, dtype="float32", verifier_path=eval_setup.verifier,
                      calibration=out / "calibration.json")  # fmt: skip
    got = dspark_eval.run(
        _argv(eval_setup, folder, tmp_path / "out", "--no-plots", "--no-save-temperatures",
              datasets=("heldout",))
    )["calibration"]["all"]["sampled"]["uncalibrated"]  # fmt: skip
    bound = _folded_ece_bound(folder, eval_setup.cfg, len(got["per_position"]))
    assert got["summary"]["ece"] == pytest.approx(held["global"]["summary"]["ece"], abs=bound)
    for mine, want in zip(got["per_position"], held["global"]["per_position"], strict=True):
        assert mine["n"] == want["n"] and mine["ece"] == pytest.approx(want["ece"], abs=bound)
        # The same blocks in every bin (the labels do not depend on the head), so the ECE
        # moves only by the predictions' own error (_folded_ece_bound).
        assert [(b["lo"], b["count"], b["label"]) for b in mine["reliability"]] == [
            (b["lo"], b["count"], b["label"]) for b in want["reliability"]
        ]
    # The temperature changed the numbers (the equality is not a no-op).
    assert abs(held["uncalibrated"]["summary"]["ece"] - got["summary"]["ece"]) > 1e-3


def test_errors_name_the_flag(eval_setup, tmp_path, capsys):
    rc = dspark_eval.main(_argv(eval_setup, tmp_path / "nope", tmp_path))
    assert rc == 2 and "--checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        dspark_eval.main(["--checkpoint", "x", "--dataset", "no-equals-sign"])
    rc = dspark_eval.main(_argv(eval_setup, eval_setup.ckpt, tmp_path, "--hidden-states", "zzz=/x"))
    assert rc == 2 and "unknown datasets ['zzz']" in capsys.readouterr().err


def test_a_trained_drafter_prints_its_table_and_plots(
    random_run, trained, eval_setup, tmp_path, capsys
):
    """Item 4's stand-in until the demo drafter exists: a few optax steps on the training
    data, then the command on the held-out data."""
    ckpt, losses = trained
    assert losses[-1] < 0.5 * losses[0]
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
        # Prefixes only shrink: P_k+1 = P_k a with a <= 1 is <= P_k after rounding too, and
        # the means over the same blocks in the same order keep that (rounding is monotone).
        assert np.all(np.diff(trained[method]["cumulative"]) <= 0)
    import matplotlib.image

    img = matplotlib.image.imread(tmp_path / "out" / "acceptance_by_position.png")
    assert img.shape[0] > 300 and img.shape[1] > 600 and img.std() > 0.05


def plant_nan(path):
    """A NaN as the first hidden-state value of a bf16 safetensors file, in place."""
    raw = bytearray(path.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    start = json.loads(raw[8 : 8 + header_len])["hidden_states"]["data_offsets"][0]
    raw[8 + header_len + start : 8 + header_len + start + 2] = b"\xc0\x7f"  # bf16 NaN
    path.write_bytes(bytes(raw))


def test_a_nan_sample_is_one_line_naming_the_file(eval_setup, tmp_path, capsys):
    """Issue 18.10: --on-missing raise on a NaN sample: the reader's message, no traceback,
    no output written."""
    data = tmp_path / "heldout"
    shutil.copytree(eval_setup.heldout.data_path, data)
    for path in (data / "hidden_states").glob("hs_*.safetensors"):
        plant_nan(path)
    argv = ["--checkpoint", str(eval_setup.ckpt), "--verifier", str(eval_setup.verifier),
            "--dataset", f"heldout={data}", "--output-dir", str(tmp_path / "out"), *COMMON]  # fmt: skip
    assert dspark_eval.main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: {data}/hidden_states/hs_") and "non-finite" in last, last
    assert not (tmp_path / "out").exists()


def test_a_truncated_folder_is_named(eval_setup, tmp_path, capsys):
    """Issue 18.10: eval of an exported folder whose model.safetensors is cut short."""
    folder = tmp_path / "drafter"
    export_checkpoint(eval_setup.ckpt, folder, target="speculators", verifier_name_or_path="v")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    assert dspark_eval.main(_argv(eval_setup, folder, tmp_path / "out")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: --checkpoint {weights}: not a readable safetensors file")


def test_values_without_data_are_null_in_summary_json(random_run, tmp_path):
    """Issue 18.10: a NaN (an empty split, a one-class AUROC) is n/a in the tables and null
    in summary.json, which is written with the rest instead of crashing after them."""
    report = copy.deepcopy(random_run[0])
    report["datasets"]["train"]["acceptance"]["analytic/free_running"]["acceptance_length"] = (
        math.nan
    )
    report["calibration"]["all"]["sampled"]["uncalibrated"]["summary"]["auroc"] = math.nan
    files = eval_report.write_outputs(report, tmp_path, plots=False)
    summary = json.loads(files["json"].read_text())
    assert (
        summary["datasets"]["train"]["acceptance"]["analytic/free_running"]["acceptance_length"]
        is None
    )
    assert summary["calibration"]["all"]["sampled"]["uncalibrated"]["summary"]["auroc"] is None
    assert "| train |" in files["markdown"].read_text() and "n/a" in files["markdown"].read_text()


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
