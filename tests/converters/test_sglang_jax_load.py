"""Our sglang-jax exports through sglang-jax's own DSpark model class on the JAX CPU
backend, in a separate environment (jax 0.10.2, flax 0.12.4, transformers 4.57; sglang-jax
is not a dependency here). ``DSPARK_SGLANG_JAX_SRC`` names the ``python/`` folder holding
``sgl_jax/srt/models/dspark.py``: the vendored subset ``third_party/sglang_jax/python``
(54 unmodified files of two pinned upstream commits, used only here; its README) or an
sglang-jax checkout. ``DSPARK_SGLANG_JAX_PYTHON`` names that environment's python:
``launch/engines/build_sglang_jax_venv.sh`` builds it from the hashed
``third_party/sglang_jax/requirements-cp311.lock`` and prints it. CI (.ci/run) does both
and runs this module; there a skip fails (tests/conftest.py). README, "sglang-jax".

A good folder loads (config through ``ModelConfig``/``AutoConfig``, every tensor through
``WeightLoader``) and its forward pieces equal a numpy oracle of the same formulas
(fc + hidden_norm, per-layer context K/V with k_norm and RoPE, the Markov head's greedy
chain); broken folders fail in sglang-jax and in ``check --target sglang-jax`` alike."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from dspark_jax.convert.check import check_folder
from dspark_jax.convert.export import export_params
from dspark_jax.convert.sglang_jax_export import sglang_jax_config
from tests.converters.helpers import base_config, random_params

pytestmark = pytest.mark.sglang_jax
PYTHON = os.environ.get("DSPARK_SGLANG_JAX_PYTHON")
SRC = os.environ.get("DSPARK_SGLANG_JAX_SRC")
SCRIPT = Path(__file__).with_name("sglang_jax_load.py")
T, B = 6, 3  # context tokens, Markov chains


def _run(folder: Path, inputs: dict, tmp: Path) -> tuple[int, str, dict]:
    np.savez(tmp / "in.npz", **inputs)
    env = {**os.environ, "PYTHONPATH": SRC, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run(
        [PYTHON, str(SCRIPT), str(folder), str(tmp / "in.npz"), str(tmp / "out.npz")],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    out = dict(np.load(tmp / "out.npz")) if r.returncode == 0 else {}
    return r.returncode, r.stdout + r.stderr[-3000:], out


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    with safe_open(folder / "model.safetensors", "np") as f:
        return {k: f.get_tensor(k).astype(np.float32) for k in f.keys()}


def _rms(x, w, eps):
    x = x.astype(np.float64)
    return (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w).astype(np.float32)


def _rope_neox(x, pos, theta):
    """Rotate-half RoPE over the whole head (x: [T, heads, hd])."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = pos[:, None].astype(np.float64) * inv[None]  # [T, hd/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    a, b = x[..., : hd // 2], x[..., hd // 2 :]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1).astype(np.float32)


def _oracle(cfg, t: dict, inputs: dict) -> dict:
    eps = cfg.rms_norm_eps
    proj = _rms(inputs["target_hidden"] @ t["fc.weight"].T, t["hidden_norm.weight"], eps)
    out = {"proj": proj}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}.self_attn."
        k = (proj @ t[p + "k_proj.weight"].T).reshape(T, cfg.num_key_value_heads, cfg.head_dim)
        v = (proj @ t[p + "v_proj.weight"].T).reshape(T, cfg.num_key_value_heads, cfg.head_dim)
        k = _rope_neox(_rms(k, t[p + "k_norm.weight"], eps), inputs["positions"], cfg.rope_theta)
        out[f"k{i}"], out[f"v{i}"] = k, v
    w1, w2 = t["markov_head.markov_w1.weight"], t["markov_head.markov_w2.weight"]
    prev, toks, margins = inputs["first"], [], []
    for s in range(inputs["base_logits"].shape[1]):
        logits = inputs["base_logits"][:, s] + w1[prev] @ w2.T
        top2 = np.sort(logits, -1)[:, -2:]
        margins.append(top2[:, 1] - top2[:, 0])
        prev = logits.argmax(-1)
        toks.append(prev)
    out["tokens"] = np.stack(toks, 1)
    out["min_margin"] = float(np.min(margins))
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    if not (PYTHON and SRC):
        pytest.skip("DSPARK_SGLANG_JAX_PYTHON / DSPARK_SGLANG_JAX_SRC not set")
    root = tmp_path_factory.mktemp("sgl_load")
    cfg = base_config(layer_types=None, verifier_name_or_path="org/v")
    export_params(cfg, random_params(cfg, scale=0.3), root / "spec", dtype="float32")
    shutil.copytree(root / "spec", root / "good")
    d = json.loads((root / "spec" / "config.json").read_text())
    (root / "good" / "config.json").write_text(json.dumps(sglang_jax_config(d)))
    rng = np.random.default_rng(0)
    inputs = {
        "target_hidden": rng.standard_normal((T, 2 * cfg.verifier_hidden_size)).astype(np.float32),
        "positions": np.arange(10, 10 + T, dtype=np.int32),
        "base_logits": 3
        * rng.standard_normal((B, cfg.block_size, cfg.vocab_size)).astype(np.float32),
        "first": rng.integers(0, cfg.vocab_size, B).astype(np.int32),
    }
    return cfg, root, inputs


def test_good_export_loads_and_matches_the_oracle(exported, tmp_path):
    cfg, root, inputs = exported
    assert check_folder(root / "good", target="sglang-jax").ok
    rc, log, out = _run(root / "good", inputs, tmp_path)
    assert rc == 0, log
    want = _oracle(cfg, _tensors(root / "good"), inputs)
    # fp32 throughout; each value is a dot product of <= 64 O(1) terms plus an RMS norm
    # and a rotation: <= ~64 ulp(1) ~ 8e-6 of accumulation-order difference.
    for key in ["proj", *(f"{kv}{i}" for i in range(cfg.num_hidden_layers) for kv in "kv")]:
        np.testing.assert_allclose(out[key], want[key], rtol=1e-5, atol=1e-5, err_msg=key)
    assert want["min_margin"] > 1e-3  # no near-ties: the greedy chain is determined
    np.testing.assert_array_equal(out["tokens"], want["tokens"])


def _edit_tensors(folder: Path, fn) -> None:
    path = folder / "model.safetensors"
    with safe_open(path, "np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


BROKEN = {
    # name: (base, config edit, tensor edit)
    "speculators-format": ("spec", None, None),
    "gated-head": ("good", lambda d: d.update(markov_head_type="gated"), None),
    "rank-0": ("good", lambda d: d.update(markov_rank=0), None),
    "missing-w1": ("good", None, lambda t: t.pop("markov_head.markov_w1.weight")),
    "missing-fc": ("good", None, lambda t: t.pop("fc.weight")),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_exports_fail_in_both(exported, tmp_path, name):
    _, root, inputs = exported
    base, cfg_edit, tensor_edit = BROKEN[name]
    folder = tmp_path / "f"
    shutil.copytree(root / base, folder)
    if cfg_edit:
        d = json.loads((folder / "config.json").read_text())
        cfg_edit(d)
        (folder / "config.json").write_text(json.dumps(d))
    if tensor_edit:
        _edit_tensors(folder, tensor_edit)
    assert not check_folder(folder, target="sglang-jax").ok
    rc, log, _ = _run(folder, inputs, tmp_path)
    assert rc == 3 and "LOAD_ERROR" in log, log
