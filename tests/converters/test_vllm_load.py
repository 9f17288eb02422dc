"""Our exports through vLLM 0.33.0's own loader: ``Qwen3DSparkForCausalLM.load_weights``
on CPU, in a separate vLLM environment (vLLM pulls a CUDA torch 2.14; it is not a
dependency here; .ci/run builds it). Set ``DSPARK_VLLM_PYTHON`` to that
environment's python (``pip install vllm==0.33.0`` in a fresh venv) to run it (under
CI=true a skip fails); ``check`` and vLLM must agree
on every folder: good ones load with every tensor where vLLM reads it, broken ones
fail in both."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import ml_dtypes
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from dspark_jax.convert.check import check_folder
from dspark_jax.convert.export import export_params
from tests.converters.helpers import base_config, make_vocab, random_params, write_verifier

pytestmark = pytest.mark.vllm
VLLM_PYTHON = os.environ.get("DSPARK_VLLM_PYTHON")


def _edit(folder: Path, fn) -> None:
    path = folder / "model.safetensors"
    with safe_open(path, "np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not VLLM_PYTHON, reason="DSPARK_VLLM_PYTHON (a vLLM 0.33.0 env) not set")
def test_vllm_loads_what_check_passes_and_refuses_what_it_refuses(tmp_path):
    reduced = base_config(draft_vocab_size=40)  # one sliding (causal) + one full layer
    bonus = base_config(sample_from_anchor=False, layer_types=None, sliding_window=None)
    verifier = write_verifier(tmp_path / "verifier", reduced)
    maps = dict(vocab_maps=make_vocab(reduced), verifier_path=verifier)
    export_params(reduced, random_params(reduced), tmp_path / "reduced", **maps,
                  verifier_name_or_path="org/v", confidence_temperature=1.5)  # fmt: skip
    export_params(bonus, random_params(bonus, seed=1), tmp_path / "bonus", verifier_path=verifier,
                  verifier_name_or_path="org/v", dtype="float32")  # fmt: skip
    broken = {
        "no-d2t": ("reduced", lambda t: t.pop("d2t")),
        "extra-key": ("reduced", lambda t: t.update(stray=t["norm.weight"])),
        "conf-shape": ("reduced", lambda t: t.update(
            {"confidence_head.proj.weight": t["confidence_head.proj.weight"][:, :32]})),
    }  # fmt: skip
    for name, (base, fn) in broken.items():
        export_params(reduced, random_params(reduced), tmp_path / name, **maps,
                      verifier_name_or_path="org/v")  # fmt: skip
        _edit(tmp_path / name, fn)
    names = ["reduced", "bonus", *broken]
    verdicts = {n: check_folder(tmp_path / n, verifier=verifier) for n in names}
    cases = {
        n: {"folder": str(tmp_path / n), "verifier": str(verifier),
            "spec_tokens": 3 if n == "bonus" else 4}
        for n in names
    }  # fmt: skip
    (tmp_path / "cases.json").write_text(json.dumps({"port": _free_port(), "cases": cases}))
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_USE_V2_MODEL_RUNNER": "1"}
    script = Path(__file__).with_name("vllm_load.py")
    out = subprocess.run([VLLM_PYTHON, str(script), str(tmp_path / "cases.json")], env=env,
                         capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    for n in names:
        assert got[n]["loaded"] == verdicts[n].ok, (n, got[n], verdicts[n].format())
    for n in ("reduced", "bonus"):
        assert got[n]["mismatches"] == [] and got[n]["compared"] > 20, got[n]
        assert got[n]["confidence_dtype"] == "torch.float32"
        assert got[n]["target_layer_ids"] == [0, 2]  # aux ids 1, 3 minus one
    # Trained causal in sliding layers, bidirectional in full ones: as vLLM runs them.
    assert got["reduced"]["causal"] == [True, False] and got["bonus"]["causal"] == [False, False]
    assert got["bonus"]["sample_from_anchor"] is False
    assert "must include a d2t mapping" in got["no-d2t"]["error"]
    assert "stray" in got["extra-key"]["error"]
    with safe_open(tmp_path / "reduced" / "model.safetensors", "np") as f:
        assert f.get_tensor("norm.weight").dtype == ml_dtypes.bfloat16
