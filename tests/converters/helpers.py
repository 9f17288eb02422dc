"""Tiny configs, random params, verifier folders and vocab maps for converter tests.

numpy only (no torch): tests/reference imports these too. The geometry is
tests/reference/test_model_parity.py's ``base_config`` (not imported from there:
that module needs speculators).
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from dspark_jax.checkpoint.orbax_io import abstract_params
from dspark_jax.config import DSparkConfig
from tests.tiny_configs import VT, H, base_config  # noqa: E402,F401


def random_params(cfg: DSparkConfig, seed: int = 0, scale: float = 0.1) -> nnx.State:
    """Trainable params with random fp32 values (norm weights near 1), no JAX compute."""
    rng = np.random.default_rng(seed)

    def fill(path, var):
        base = 1.0 if path[-1] == "weight" and len(var.shape) == 1 else 0.0
        return var.replace((base + scale * rng.standard_normal(var.shape)).astype(np.float32))

    flat = nnx.to_flat_state(abstract_params(cfg))
    return nnx.from_flat_state([(p, fill(p, v)) for p, v in flat])


def flat_params(params: nnx.State) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(params)}


def make_vocab(cfg: DSparkConfig, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A reduced vocab that keeps the mask token (d2t int64 [Vd], t2d bool [Vt])."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(cfg.vocab_size - 1, cfg.draft_vocab_size - 1, replace=False)
    ids = np.sort(np.append(ids, cfg.vocab_size - 1))
    t2d = np.zeros(cfg.vocab_size, np.bool_)
    t2d[ids] = True
    return (ids - np.arange(len(ids))).astype(np.int64), t2d


def write_verifier(folder: Path, cfg: DSparkConfig, seed: int = 0) -> Path:
    """An HF Qwen3-style verifier folder holding only the three tensors the drafter
    reads (bf16, as a real verifier stores them) and its config.json."""
    rng = np.random.default_rng(seed + 1000)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vt, h = cfg.vocab_size, cfg.verifier_hidden_size
    tensors = {
        "model.embed_tokens.weight": rng.standard_normal((vt, h)),
        "lm_head.weight": 0.3 * rng.standard_normal((vt, h)),
        "model.norm.weight": 1.0 + 0.1 * rng.standard_normal(h),
    }
    tensors = {k: v.astype(np.float32).astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": h,
        "intermediate_size": 2 * h,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": h // 4,
        "num_hidden_layers": 4,
        "vocab_size": vt,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def tree_digest(root: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``root``: equal before and after a
    refused command means nothing was lost, moved or rewritten."""
    import hashlib

    root = Path(root)
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
