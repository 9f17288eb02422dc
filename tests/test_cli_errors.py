"""Issue 18: every command line answers a bad input with one line and no Python
traceback; the traceback comes back with ``DSPARK_DEBUG=1`` or ``--debug``
(dspark_jax/cli.py).

Each input goes through the command's ``main`` (argparse, the guard, stdout and
stderr at the file-descriptor level); one input per entry point also runs as a user
runs it, ``python -m ...`` in a subprocess. The inputs are tiny and built here from
the shared test helpers (no training, no compilation: each command stops at its
input).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_jax.cli import guarded, one_line, reraise_if_debug

ROOT = Path(__file__).resolve().parents[1]
DEMO_VERIFIER = ROOT / "configs" / "demo" / "verifier"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Bad inputs, one per path the issue lists."""
    from safetensors.numpy import load_file, save_file

    from dspark_jax.checkpoint import orbax_io
    from dspark_jax.convert.export import export_params
    from launch.prepare_data import prepare
    from tests.converters.helpers import base_config, random_params
    from tests.data.conftest import make_tiny_data
    from tests.eval.conftest import eval_config, write_eval_data
    from tests.eval.conftest import write_verifier as write_eval_verifier
    from tests.eval.test_cli import plant_nan
    from tests.train.conftest import write_verifier

    root = tmp_path_factory.mktemp("bad_inputs")
    cfg = base_config()
    src = root / "src"
    export_params(cfg, random_params(cfg), src, verifier_name_or_path="v")
    run = root / "run"  # a training --save-path stand-in
    orbax_io.save_params_checkpoint(run, 5, cfg, random_params(cfg, seed=1))
    (run / "run.yaml").write_text("train: {}\n")
    types = root / "types"
    shutil.copytree(src, types)
    config = json.loads((types / "config.json").read_text())
    config["mask_token_id"] = 3.5
    (types / "config.json").write_text(json.dumps(config))
    truncated = root / "truncated"
    shutil.copytree(src, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    (root / "a_file").write_text("not a folder")

    ecfg = eval_config()
    everifier = write_eval_verifier(root / "everifier", ecfg)
    nan_data = write_eval_data(root / "nan", everifier, ecfg, n_docs=4, seed=3).data_path
    for path in (nan_data / "hidden_states").glob("hs_*.safetensors"):
        plant_nan(path)
    orbax_io.save_params_checkpoint(root / "eckpt", 1, ecfg, random_params(ecfg))

    tverifier = write_verifier(root / "tverifier")
    tdata = make_tiny_data(root / "tdata", n_docs=8, max_len=20)
    (root / "empty.jsonl").write_text("")
    bad_verifier = root / "bad_verifier"
    shutil.copytree(DEMO_VERIFIER, bad_verifier)
    tensors = load_file(str(bad_verifier / "model.safetensors"))
    del tensors["model.embed_tokens.weight"]
    save_file(tensors, str(bad_verifier / "model.safetensors"), metadata={"format": "pt"})
    rows = root / "rows.jsonl"
    rows.write_text(json.dumps({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]}) + "\n")
    prepare(str(DEMO_VERIFIER), [str(rows)], str(root / "prepared"), seq_length=16, num_workers=1)
    return {
        "root": root, "src": src, "run": run, "types": types, "truncated": truncated,
        "weights": weights, "everifier": everifier, "nan_data": nan_data,
        "eckpt": root / "eckpt", "tverifier": tverifier, "tdata": tdata.data_path,
        "bad_verifier": bad_verifier, "prepared": root / "prepared",
    }  # fmt: skip


# (module, argv template, what the one line says); {name} is an input above.
CASES = {
    "import into a run": (
        "converters", "import {src} {run}", "import failed: {run} is not empty"),
    "import a config of wrong types": (
        "converters", "import {types} {root}/t_out",
        "import failed: {types}/config.json: mask_token_id must be an int or null, got 3.5"),
    "import a truncated model.safetensors": (
        "converters", "import {truncated} {root}/tr_out",
        "import failed: {weights}: not a readable safetensors file"),
    "export over the checkpoint": (
        "converters", "export {run} {run} --overwrite", "export failed: --overwrite refused"),
    "export under a file": (
        "converters", "export {run} {root}/a_file/out", "export failed: cannot write {root}/a_file/out: File exists ({root}/a_file)"),
    "eval a truncated folder": (
        "dspark_jax.eval",
        "--checkpoint {truncated} --dataset d={nan_data} --output-dir {root}/e1",
        "error: --checkpoint {weights}: not a readable safetensors file"),
    "eval a NaN sample": (
        "dspark_jax.eval", "--checkpoint {eckpt} --verifier {everifier} --dataset d={nan_data} "
        "--output-dir {root}/e2 --total-seq-len 128", "error: {nan_data}/hidden_states/hs_"),
    "train on a mesh the devices do not fit": (
        "dspark_jax.train", "--verifier-name-or-path {tverifier} --data-path {tdata} "
        "--target-layer-ids 1 2 --mask-token-id 1023 --num-layers 1 --save-path {root}/s "
        "--log-dir {root}/l --on-missing raise --mesh data=3", "error: --mesh: axis sizes"),
    "prepare an empty jsonl": (
        "launch.prepare_data", f"--model {DEMO_VERIFIER} --data {{root}}/empty.jsonl "
        "--output {root}/p1", "error: --data {root}/empty.jsonl: the file is empty"),
    "prepare a draft vocab larger than the vocabulary": (
        "launch.prepare_data", f"--model {DEMO_VERIFIER} --data {{root}}/empty.jsonl "
        "--output {root}/p2 --draft-vocab-size 5000",
        "error: --draft-vocab-size 5000 exceeds the verifier vocabulary (4096 tokens)"),
    "extract with a verifier missing a tensor": (
        "launch.extract_hidden_states", "--backend hf --model {bad_verifier} "
        "--preprocessed-data {prepared} --output {root}/hs --device cpu --target-layer-ids 1 2",
        "error: {bad_verifier}: the verifier's weights do not match its config.json"),
}  # fmt: skip


MAINS = {
    "converters": "converters.__main__",
    "dspark_jax.eval": "dspark_jax.eval.runner",
    "dspark_jax.train": "dspark_jax.train.trainer",
    "launch.prepare_data": "launch.prepare_data",
    "launch.extract_hidden_states": "launch.extract_hidden_states",
}
# One input per entry point, also run as `python -m` (a few seconds each).
SUBPROCESS = ("export under a file", "eval a truncated folder", "prepare an empty jsonl",
              "train on a mesh the devices do not fit", "extract with a verifier missing a tensor")  # fmt: skip


def _expand(inputs, case: str) -> tuple[str, list[str], str]:
    module, argv, message = CASES[case]
    values = {k: str(v) for k, v in inputs.items()}
    return module, argv.format(**values).split(), message.format(**values)


def _run(module: str, argv: list[str], debug: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("DSPARK_DEBUG", None)
    if debug:
        env["DSPARK_DEBUG"] = "1"
    return subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_no_command_prints_a_traceback(inputs, case, capfd, monkeypatch):
    monkeypatch.delenv("DSPARK_DEBUG", raising=False)
    module, argv, message = _expand(inputs, case)
    rc = importlib.import_module(MAINS[module]).main(argv)
    out, err = capfd.readouterr()
    assert rc in (1, 2), (out + err)[-3000:]
    assert "Traceback" not in out + err, (out + err)[-3000:]
    assert err.strip().splitlines()[-1].startswith(message), err[-3000:]


@pytest.mark.parametrize("case", SUBPROCESS)
def test_python_m_prints_one_line(inputs, case):
    module, argv, message = _expand(inputs, case)
    proc = _run(module, argv)
    output = proc.stdout + proc.stderr
    assert proc.returncode in (1, 2), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(message), output[-3000:]


def test_dspark_debug_shows_the_traceback(inputs):
    module, argv, _ = _expand(inputs, "train on a mesh the devices do not fit")
    proc = _run(module, argv, debug=True)
    assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr
    assert "ValueError: --mesh: axis sizes" in proc.stderr


def test_the_guard(capsys, monkeypatch):
    monkeypatch.setenv("DSPARK_DEBUG", "0")  # off; and removed again after the test

    def fails(argv):
        raise KeyError(f"no {argv}")

    assert guarded(fails, ["x"]) == 1
    assert capsys.readouterr().err == "error: KeyError: \"no ['x']\"\n"
    with pytest.raises(KeyError):
        guarded(fails, ["x", "--debug"])  # --debug is removed before the command sees it
    assert os.environ["DSPARK_DEBUG"] == "1"  # and seen by every part of the process
    monkeypatch.setenv("DSPARK_DEBUG", "0")
    assert guarded(lambda argv: len(argv), ["a", "--", "--debug"]) == 3  # after --: not ours
    monkeypatch.setenv("DSPARK_DEBUG", "1")
    with pytest.raises(KeyError):
        guarded(fails, [])
    with pytest.raises(ValueError, match="known"):  # a command's own error line, too
        try:
            raise ValueError("known")
        except ValueError:
            reraise_if_debug()
    error = ValueError('line one\n  line two [tensorstore_spec=\'{"driver": "zarr"}\']')
    assert one_line(error) == "line one line two"
