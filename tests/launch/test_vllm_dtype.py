"""launch/vllm_dtype.py: vLLM 0.33.0's --dtype, for a GPU class (config/model.py
``_get_and_verify_dtype`` + ``_resolve_auto_dtype``, platforms/cuda.py
``supported_dtypes``)."""

from __future__ import annotations

import json
import struct
from types import SimpleNamespace

import pytest

from launch.vllm_dtype import config_dtype, parse_capability, resolve_dtype, supported_dtypes

H200, A100, T4, V100, P100, K80 = (9, 0), (8, 0), (7, 5), (7, 0), (6, 0), (3, 7)


@pytest.mark.parametrize(
    ("requested", "own", "model_type", "gpu", "served"),
    [
        ("auto", "float32", "qwen3", H200, "bfloat16"),  # float32 configs are downcast
        ("auto", "float32", "qwen3", A100, "bfloat16"),
        ("auto", "float32", "qwen3", T4, "float16"),  # no bf16 before Ampere
        ("auto", "bfloat16", "qwen3", V100, "float16"),  # unsupported: the fallback
        ("auto", "float16", "qwen3", H200, "float16"),
        ("auto", "bfloat16", "qwen3", H200, "bfloat16"),
        ("auto", "float32", "qwen3", K80, "float32"),
        ("auto", "float32", "gemma2", P100, "float32"),  # fp16 is never picked for gemma2
        ("half", "float32", "qwen3", H200, "float16"),  # explicit values are kept
        ("float", "bfloat16", "qwen3", H200, "float32"),
        ("BFloat16", "float32", "qwen3", T4, "bfloat16"),
    ],
)
def test_resolve_dtype_is_vllms(requested, own, model_type, gpu, served):
    assert resolve_dtype(requested, own, model_type, gpu) == served


def test_refusals_and_capabilities():
    with pytest.raises(ValueError, match="--dtype must be auto or one of"):
        resolve_dtype("fp16", "float32", "qwen3", H200)
    with pytest.raises(ValueError, match="refuses it for model type 'gemma2'"):
        resolve_dtype("float16", "float32", "gemma2", H200)
    assert parse_capability("9.0") == (9, 0) and parse_capability("12") == (12, 0)
    with pytest.raises(ValueError, match="--compute-capability must look like 9.0"):
        parse_capability("sm90")
    assert supported_dtypes((8, 9))[0] == "bfloat16" and supported_dtypes((6, 1))[0] == "float16"


def _safetensors(path, dtypes):
    header = {
        f"w{i}": {"dtype": d, "shape": [1], "data_offsets": [0, 0]} for i, d in enumerate(dtypes)
    }
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_config_dtype_as_vllm_reads_it(tmp_path):
    text = SimpleNamespace(dtype="bfloat16")
    assert config_dtype(SimpleNamespace(dtype=None, text_config=text), str(tmp_path)) == "bfloat16"
    no_dtype = SimpleNamespace(dtype=None)
    assert config_dtype(no_dtype, str(tmp_path)) == "float32"  # nothing else to go by
    _safetensors(tmp_path / "model.safetensors", ["F16", "I64"])
    assert config_dtype(no_dtype, str(tmp_path)) == "float16"  # the weights'
    _safetensors(tmp_path / "b.safetensors", ["BF16", "F32"])
    assert config_dtype(no_dtype, str(tmp_path)) == "float32"  # the widest
