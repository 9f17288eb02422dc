"""Our copies of vLLM 0.33.0's rules against vLLM's own functions (differential tests):
many seeded generated cases per rule, answered by vLLM in its own environment
(``DSPARK_VLLM_PYTHON``; one subprocess for the whole module, tests/launch/
vllm_rules_probe.py) and by our code here, which must agree on every case.

* ``--dtype`` (launch/vllm_dtype.py ``serving_dtype``) vs ``_get_and_verify_dtype`` on a
  CudaPlatform of each compute capability: config dtypes at the top level, in a text
  config, or only in the safetensors headers; every requested value; fp16-refusing types.
* The MLA check (launch/mla.py ``uses_mla``) vs ``ModelConfig.use_mla`` over
  ``is_deepseek_mla``: vLLM's MLA model types and others, with and without
  ``kv_lora_rank``, wrapped in a text config, bidirectional, DeepSeek-V4 compressed
  configs, ``VLLM_MLA_DISABLE``.
* The layer ids (launch/hs_files.py ``resolve_layer_ids``, what launch_vllm serves and
  the trainer reads slot by slot) vs ``EagleModelMixin._set_aux_hidden_state_layers``:
  our slot order is the order vLLM captures the served ids in.

Rules that live only inside GPU-bound classes keep their copies (tests/launch/
test_vllm_dtype.py, test_mla.py, test_launch_vllm.py cite vLLM's files).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoConfig

from launch.hs_files import resolve_layer_ids
from launch.mla import MLA_MODEL_TYPES, uses_mla
from launch.vllm_dtype import serving_dtype

pytestmark = pytest.mark.vllm
VLLM_PYTHON = os.environ.get("DSPARK_VLLM_PYTHON")
CAPABILITIES = [(3, 7), (6, 0), (6, 1), (7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0)]
REQUESTED = ["auto", "auto", "auto", "half", "float16", "float", "float32", "bfloat16", "BFloat16"]
FLOATS = ["float32", "float16", "bfloat16"]
ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
# model types transformers 5.19 builds a config for, fp16-refusing ones among them
TEXT_TYPES = ["qwen3", "llama", "mistral", "gemma2", "glm4", "qwen2"]


def _safetensors(path: Path, dtypes: list[str]) -> None:
    header = {
        f"w{i}": {"dtype": d, "shape": [1], "data_offsets": [0, 0]} for i, d in enumerate(dtypes)
    }
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def _dtype_cases(root: Path, rng: np.random.Generator, n: int = 120) -> list[dict]:
    """config.json folders: dtype at the top, in a text config (gemma3), or absent with
    safetensors weights of one or several float dtypes (plus ints), or nothing at all."""
    cases = []
    for i in range(n):
        folder = root / f"dtype-{i}"
        folder.mkdir()
        where = rng.choice(["top", "top", "text", "weights", "none"])
        own = str(rng.choice(FLOATS))
        if where == "text":
            cfg = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}}
            cfg["text_config"]["dtype"] = own
        else:
            cfg = {"model_type": str(rng.choice(TEXT_TYPES))}
            if where == "top":
                cfg["dtype"] = own
        if where == "weights":
            # one dtype, or float32 with another (vLLM takes the widest: float32)
            dtypes = [own] if rng.random() < 0.6 else ["float32", str(rng.choice(FLOATS[1:]))]
            _safetensors(folder / "model.safetensors", [ST[d] for d in dtypes] + ["I64"])
        (folder / "config.json").write_text(json.dumps(cfg))
        cases.append(
            {
                "folder": str(folder),
                "requested": str(rng.choice(REQUESTED)),
                "capability": [int(x) for x in CAPABILITIES[rng.integers(len(CAPABILITIES))]],
            }
        )
    return cases


def _mla_cases(rng: np.random.Generator, n: int = 200) -> list[dict]:
    mla_types = sorted(MLA_MODEL_TYPES)
    others = ["qwen3", "llama", "minicpm3", "mistral", "deepseek", "kimi_k3", "eagle3"]
    cases = []
    for _ in range(n):
        text = {"model_type": str(rng.choice(mla_types if rng.random() < 0.7 else others))}
        if rng.random() < 0.7:
            text["kv_lora_rank"] = int(rng.choice([128, 256, 512]))
        if rng.random() < 0.2:
            text["is_causal"] = bool(rng.random() < 0.5)
        if rng.random() < 0.25:  # DeepSeek-V4-style compressed attention
            if rng.random() < 0.5:
                text["compress_ratios"] = [int(x) for x in rng.integers(0, 4, 3)]
            else:
                text["compress_rates"] = {"sliding_attention": 0, "compressed": 4}
                text["layer_types"] = ["sliding_attention", "compressed"]
                text["num_nextn_predict_layers"] = int(rng.integers(0, 2))
            if rng.random() < 0.6:
                text["head_dim"] = 64
        text["num_attention_heads"] = 8
        config = text if rng.random() < 0.6 else {"model_type": "kimi_k3", "text_config": text}
        cases.append({"config": config, "disable": "1" if rng.random() < 0.05 else "0"})
    return cases


def _layer_cases(rng: np.random.Generator, n: int = 200) -> list[tuple]:
    """(target ids or None, verifier layers N, include_last_layer)."""
    cases = []
    for _ in range(n):
        layers = int(rng.integers(8, 96))
        if rng.random() < 0.2:
            ids = None
        else:
            k = int(rng.integers(1, 6))
            ids = [int(x) for x in rng.choice(layers + 1, k, replace=False)]  # any order
        cases.append((ids, layers, bool(rng.random() < 0.5)))
    return cases


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    """vLLM's answers to every case of every rule: one subprocess."""
    if not VLLM_PYTHON:
        pytest.skip("DSPARK_VLLM_PYTHON (a vLLM 0.33.0 env) not set")
    root = tmp_path_factory.mktemp("vllm-rules")
    rng = np.random.default_rng(30)
    dtype, mla, layers = _dtype_cases(root, rng), _mla_cases(rng), _layer_cases(rng)
    served = [resolve_layer_ids(ids, n, last) for ids, n, last in layers]
    (root / "cases.json").write_text(json.dumps({"dtype": dtype, "mla": mla, "aux": served}))
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    script = Path(__file__).with_name("vllm_rules_probe.py")
    out = subprocess.run([VLLM_PYTHON, str(script), str(root / "cases.json")], env=env,
                         capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    return {"dtype": (dtype, got["dtype"]), "mla": (mla, got["mla"]), "aux": (served, got["aux"])}


def _ours_dtype(case: dict) -> str:
    config = AutoConfig.from_pretrained(case["folder"])
    try:
        return serving_dtype(case["requested"], config, case["folder"], tuple(case["capability"]))
    except ValueError as e:
        return f"error: {e}"


def test_dtype_resolution_is_vllms(answers):
    cases, theirs = answers["dtype"]
    disagree = []
    for case, want in zip(cases, theirs, strict=True):
        got = _ours_dtype(case)
        # both refuse (the messages are ours: one line naming the flag), or agree
        if (got.startswith("error") != want.startswith("error")) or (
            not want.startswith("error") and got != want
        ):
            disagree.append((case, got, want))
    assert not disagree, disagree[:5]
    assert {w for w in theirs} >= {"bfloat16", "float16", "float32"}  # every outcome seen
    assert any(w.startswith("error") for w in theirs)


def test_mla_check_is_vllms(answers, monkeypatch):
    cases, theirs = answers["mla"]
    disagree = []
    for case, want in zip(cases, theirs, strict=True):
        monkeypatch.setenv("VLLM_MLA_DISABLE", case["disable"])
        if uses_mla(case["config"]) is not want:
            disagree.append((case, want))
    assert not disagree, disagree[:5]
    assert 20 < sum(theirs) < len(theirs) - 20  # both outcomes, many times


def test_served_layer_ids_are_in_the_order_vllm_captures_them(answers):
    served, theirs = answers["aux"]
    for ids, captured in zip(served, theirs, strict=True):
        assert ids == captured, (ids, captured)  # slot i holds layer ids[i]
