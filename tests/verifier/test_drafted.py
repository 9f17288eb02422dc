"""Draft-OPD's targets: the verifier's forward on drafted blocks (forward.drafted_hidden).

Slot j of the block after anchor p must hold what a direct forward gives for the prefix
"the document's tokens before p, then the block's tokens 0..j": each anchor's prefix is
run through :func:`hidden_states` on its own, and the two agree within the round-off bound
of two fp32 evaluations (tests/verifier/bounds.py: 2 * depth * U * sum |dL/dp| |p|).
A prefix with one block token changed lies outside that bound. Random weights, config
dicts only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.verifier import hidden_states
from dspark_jax.verifier.forward import drafted_blocks_supported, drafted_hidden
from dspark_jax.verifier.weights import params_from_numpy
from tests.numerics import U
from tests.verifier.bounds import chain_depth, pack_documents, projection_sensitivity
from tests.verifier.test_scan import GEMMA2, QWEN3_MOE, config, random_params, row

BK = 4  # block slots
ANCHORS = np.array([3, 9, 12, 15], np.int32)  # 12 starts document 1: no context at all


def test_drafted_blocks_equal_a_direct_forward():
    """Qwen3-MoE (the experts see the blocks' tokens flattened); a dense Qwen3 verifier is
    checked end to end in tests/train/test_opd.py."""
    cfg = config(3, **QWEN3_MOE)
    params = params_from_numpy(random_params(cfg), cfg)
    ids, pos, doc = row()
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 64, (len(ANCHORS), BK)).astype(np.int32)
    blocks[:, 0] = ids[ANCHORS]  # slot 0 holds the anchor's own token, as in training
    got = np.asarray(
        jax.jit(lambda p, *a: drafted_hidden(p, cfg, *a, kv_chunk=8))(
            params, *map(jnp.asarray, (ids, pos, doc, ANCHORS, blocks))
        )
    )
    assert got.shape == (len(ANCHORS), BK, cfg.hidden_size)
    # Each anchor's prefix (its document before it, then its block) as one document of a
    # packed row: one plain forward and one sensitivity computation for all of them.
    N, length = cfg.num_hidden_layers, 64
    prefixes = [
        np.concatenate([ids[int(np.argmax(doc == doc[p])) : p], blk])
        for p, blk in zip(ANCHORS, blocks, strict=True)
    ]
    seq, pos, docs, ends = pack_documents(prefixes, length)
    run = jax.jit(lambda p, s, q, d: hidden_states(p, cfg, s, q, d, (N,))[:, 0])
    rows = np.concatenate([np.arange(e - BK, e) for e in ends])
    flat = got.reshape(len(rows), -1)
    c = np.zeros((length, 1, cfg.hidden_size), np.float32)
    c[rows, 0] = rng.standard_normal(flat.shape)
    sens = projection_sensitivity(params, cfg, seq, pos, docs, (N,), c)[rows, 0]
    bound = 2 * chain_depth(cfg, N, length) * U * sens

    def within(x):
        return np.abs(np.einsum("jh,jh->j", c[rows, 0], x - flat)) <= bound

    assert within(np.asarray(run(params, seq, pos, docs))[rows]).all()
    # Planted: each block's second-to-last token changed moves its last slot beyond the bound.
    other = blocks.copy()
    other[:, BK - 2] = (other[:, BK - 2] + 1) % 64
    changed = [np.concatenate([x[: len(x) - BK], o]) for x, o in zip(prefixes, other, strict=True)]
    off = ~within(np.asarray(run(params, *pack_documents(changed, length)[:3]))[rows])
    assert off.reshape(len(ANCHORS), BK)[:, -1].all()


def test_sliding_window_verifiers_are_refused():
    cfg = config(2, **GEMMA2)
    assert drafted_blocks_supported(cfg) == "sliding-window attention layers"
    with pytest.raises(ValueError, match="drafted_hidden: the verifier has sliding-window"):
        drafted_hidden(
            {}, cfg, *map(jnp.asarray, row()), jnp.asarray(ANCHORS), jnp.zeros((4, 2), jnp.int32)
        )
