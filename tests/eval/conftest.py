"""Tiny drafters, verifiers and datasets for the evaluation tests.

The data is learnable on purpose: documents walk a fixed token cycle, and the
verifier's cached last hidden state at position t is its own ``lm_head`` row of the
next token, so the verifier's distribution (after its final norm and head) peaks on
the true next token. Aux hidden states carry the current token's embedding row plus
noise. A drafter trained for a few steps then accepts far more than a fresh one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from dspark_jax.checkpoint import orbax_io
from dspark_jax.config import DSparkConfig
from tests.converters.helpers import base_config, random_params, write_verifier
from tests.data.conftest import write_hs, write_prepared_dataset


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """Identical programs (a fresh Evaluator per CLI run) compile once per session."""
    path = os.environ.get("DSPARK_TEST_JAX_CACHE") or str(tmp_path_factory.mktemp("jax_cache"))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def numpy_module(ctor, seed: int = 0, scale: float = 0.1):
    """``ctor()``'s module with N(0, scale) numpy values: no JAX init ops to compile."""
    from flax import nnx

    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(nnx.eval_shape(ctor))
    rng = np.random.default_rng(seed)
    state = jax.tree.map(
        lambda s: jnp.asarray((scale * rng.standard_normal(s.shape)).astype(s.dtype)), state
    )
    return nnx.merge(graphdef, state)


def numpy_drafter(cfg: DSparkConfig, seed: int = 0, scale: float = 0.1):
    """A DSparkDraftModel (fp32 compute) with ``random_params`` weights (norms near 1)."""
    from flax import nnx

    from dspark_jax.model.draft import DSparkDraftModel

    abstract = nnx.eval_shape(
        lambda: DSparkDraftModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, remat=False)
    )
    graphdef, _ = nnx.split(abstract)
    return nnx.merge(graphdef, jax.tree.map(jnp.asarray, random_params(cfg, seed, scale)))


CYCLE = np.array([5, 17, 9, 33, 21, 2, 40, 12])  # the token walk (ids < mask token 63)


def eval_config(**kw) -> DSparkConfig:
    """tests/converters' tiny geometry with one decoder layer (compiles faster)."""
    fields = {"num_hidden_layers": 1, "layer_types": ("full_attention",)}
    fields.update(kw)
    return base_config(**fields)


@dataclass
class EvalData:
    data_path: Path
    n_docs: int


def write_eval_data(root: Path, verifier: Path, cfg: DSparkConfig, *, n_docs: int, seed: int):
    """A prepared dataset + hidden states following CYCLE (with 10% random tokens)."""
    rng = np.random.default_rng(seed)
    t = load_file(str(verifier / "model.safetensors"))
    embed = t["model.embed_tokens.weight"].astype(np.float32)
    head = t["lm_head.weight"].astype(np.float32)
    n_aux, h = cfg.num_aux_layers, cfg.verifier_hidden_size
    ids_all, masks, hs_all = [], [], []
    for _ in range(n_docs):
        n = int(rng.integers(12, 40))
        start = int(rng.integers(len(CYCLE)))
        ids = CYCLE[(start + np.arange(n + 1)) % len(CYCLE)].copy()
        noise = rng.random(n + 1) < 0.1
        ids[noise] = rng.integers(0, cfg.vocab_size - 1, noise.sum())
        mask = np.ones(n, np.int64)
        mask[:3] = 0  # a short "prompt"
        hidden = np.empty((n, n_aux + 1, h), np.float32)
        for a in range(n_aux):
            hidden[:, a] = embed[ids[:n]] + 0.3 * rng.standard_normal((n, h))
        hidden[:, n_aux] = 4.0 * head[ids[1 : n + 1]]
        ids_all.append(ids[:n])
        masks.append(mask)
        hs_all.append(hidden.astype(ml_dtypes.bfloat16))
    data = root / "prepared"
    write_prepared_dataset(data, ids_all, masks)
    (data / "hidden_states").mkdir()
    for i in range(n_docs):
        write_hs(data / "hidden_states", i, ids_all[i], hs_all[i])
    return EvalData(data, n_docs)


@dataclass
class EvalSetup:
    cfg: DSparkConfig
    verifier: Path
    data: EvalData
    heldout: EvalData
    ckpt: Path  # random-weight Orbax checkpoint (step 3)


@pytest.fixture(scope="session")
def eval_setup(tmp_path_factory) -> EvalSetup:
    root = tmp_path_factory.mktemp("eval")
    cfg = eval_config()
    verifier = write_verifier(root / "verifier", cfg)
    data = write_eval_data(root / "train", verifier, cfg, n_docs=24, seed=1)
    heldout = write_eval_data(root / "heldout", verifier, cfg, n_docs=12, seed=2)
    ckpt = root / "ckpt"
    orbax_io.save_params_checkpoint(ckpt, 3, cfg, random_params(cfg, seed=0, scale=0.1))
    return EvalSetup(cfg, verifier, data, heldout, ckpt)


def train_tiny(cfg: DSparkConfig, verifier: Path, data_path: Path, *, steps: int, seed: int = 0):
    """A few optax-adam steps of ``batch_loss`` (KL) on ``data_path``: trained params."""
    import optax
    from flax import nnx

    from dspark_jax.data.pipeline import PackedData
    from dspark_jax.eval.runner import load_frozen
    from dspark_jax.model.draft import ROW_KEYS, LossSettings, batch_loss

    frozen = load_frozen(cfg, verifier, None)
    graphdef, params = nnx.split(numpy_drafter(cfg, seed, scale=0.05))
    settings = LossSettings(num_anchors=24, vocab_chunk_tokens=64)
    tx = optax.adam(1e-2)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, batch, key):
        def f(p):
            return batch_loss(nnx.merge(graphdef, p), frozen, batch, key, settings)

        (loss, _), grads = jax.value_and_grad(f, has_aux=True)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    data = PackedData(
        data_path, total_seq_len=128, n_aux=cfg.num_aux_layers, hidden_size=cfg.verifier_hidden_size,
        train_data_ratio=1.0, rows_per_process=2, process_index=0, process_count=1, seed=seed,
    )  # fmt: skip
    it = data.train_iterator(num_epochs=1)
    batches = [{k: jnp.asarray(b[k]) for k in ROW_KEYS} for b in it]
    it.close()
    losses = []
    for s in range(steps):
        params, opt, loss = step(params, opt, batches[s % len(batches)], jax.random.key(s))
        losses.append(float(loss))
    return params, losses
