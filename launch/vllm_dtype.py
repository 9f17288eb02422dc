"""The dtype vLLM 0.33.0 runs a verifier in, and so writes its hidden states in.

vLLM's ``--dtype`` (``config/model.py``, ``_get_and_verify_dtype``): an explicit
value is used as given (``half`` = float16, ``float`` = float32); ``auto`` takes the
config's dtype, except that a float32 config is downcast to the GPU's preferred
dtype and a dtype the GPU lacks falls back to it (``_resolve_auto_dtype``). The GPU
class decides (``platforms/cuda.py``, ``supported_dtypes``, preferred first): bf16,
fp16, fp32 from compute capability 8.0; fp16, fp32 from 6.0; else fp32. So a
float32 config is served in bf16 on an A100/H100/H200.

The launchers resolve ``auto`` here and pass the result to ``vllm serve --dtype``,
so the served dtype is the one the client checks and ``extraction_config.json``
records, whatever the server would have guessed.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

DTYPE_NAMES = {
    "half": "float16",
    "float16": "float16",
    "float": "float32",
    "float32": "float32",
    "bfloat16": "bfloat16",
}
# model types vLLM refuses float16 for (config/model.py, _FLOAT16_NOT_SUPPORTED_MODELS)
FP16_UNSUPPORTED = ("gemma2", "gemma3", "gemma3_text", "glm4")
# the class of every GPU vLLM's datacenter users run (A100, H100, H200, B200)
DEFAULT_CAPABILITY = (8, 0)
_SUB_CONFIGS = ("vision_config", "encoder_config")
_ST_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def parse_capability(text: str) -> tuple[int, int]:
    """``"9.0"`` -> ``(9, 0)`` (the ``--compute-capability`` flag)."""
    major, dot, minor = text.partition(".")
    if not (major.isdigit() and (not dot or minor.isdigit())):
        raise ValueError(f"--compute-capability must look like 9.0, got {text!r}")
    return int(major), int(minor or 0)


def target_capability(flag: str | None = None) -> tuple[int, int]:
    """The flag's capability, else this machine's first GPU's, else 8.0."""
    if flag:
        return parse_capability(flag)
    if torch.cuda.is_available():
        return tuple(torch.cuda.get_device_capability(0))
    return DEFAULT_CAPABILITY


def supported_dtypes(capability: tuple[int, int]) -> list[str]:
    """``CudaPlatform.supported_dtypes``; the first is the fallback for ``auto``."""
    cc = capability[0] * 10 + capability[1]
    if cc >= 80:
        return ["bfloat16", "float16", "float32"]
    if cc >= 60:
        return ["float16", "float32"]
    return ["float32"]


def _text(config):
    return getattr(config, "text_config", None) or config


def _safetensors_dtype(model: str) -> str | None:
    """The widest float dtype of a local folder's weights (vLLM's
    ``common_broadcastable_dtype`` over the safetensors headers), or None."""
    found = set()
    for path in Path(model).glob("*.safetensors") if Path(model).is_dir() else []:
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        found |= {_ST_TORCH[v["dtype"]] for k, v in header.items() if v.get("dtype") in _ST_TORCH}
    if not found:
        return None
    if torch.float32 in found or len(found) == 1:
        return str(max(found, key=lambda d: torch.finfo(d).bits)).removeprefix("torch.")
    raise ValueError(f"{model}: weights mix bfloat16 and float16 and config.json names no dtype")


def config_dtype(config, model: str) -> str:
    """The verifier's own dtype as vLLM reads it (``get_torch_dtype``): the config's
    ``dtype`` (else its text, vision or encoder config's), else the local weights',
    else float32."""
    for cfg in (config, _text(config), *(getattr(config, k, None) for k in _SUB_CONFIGS)):
        dt = getattr(cfg, "dtype", None)
        if dt is not None:
            return str(dt).removeprefix("torch.")
    return _safetensors_dtype(model) or "float32"


def resolve_dtype(
    requested: str, model_dtype: str, model_type: str, capability: tuple[int, int]
) -> str:
    """The dtype vLLM 0.33.0 serves in for ``--dtype requested`` on a GPU of
    ``capability``: ``bfloat16``, ``float16`` or ``float32``."""
    requested = requested.lower()
    if requested != "auto":
        if requested not in DTYPE_NAMES:
            raise ValueError(
                f"--dtype must be auto or one of {list(DTYPE_NAMES)}, got {requested!r}"
            )
        dtype = DTYPE_NAMES[requested]
    else:
        supported = [
            d
            for d in supported_dtypes(capability)
            if not (model_type in FP16_UNSUPPORTED and d == "float16")
        ]
        preferred = supported[0]
        dtype = preferred if model_dtype == "float32" else model_dtype
        if dtype not in supported:
            dtype = preferred
    if model_type in FP16_UNSUPPORTED and dtype == "float16":
        raise ValueError(f"--dtype float16: vLLM refuses it for model type {model_type!r}")
    return dtype


def serving_dtype(requested: str, config, model: str, capability: tuple[int, int]) -> str:
    """:func:`resolve_dtype` for a loaded transformers config of ``model``."""
    model_type = getattr(config, "model_type", "") or ""
    return resolve_dtype(requested, config_dtype(config, model), model_type, capability)
