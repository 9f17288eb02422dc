"""Draft-OPD's targets: the verifier's forward on drafted blocks (forward.drafted_hidden).

Slot j of the block after anchor p must hold what a direct forward gives for the prefix
"the document's tokens before p, then the block's tokens 0..j": each anchor's prefix is
run through :func:`hidden_states` on its own, and the two agree within the round-off bound
of two fp32 evaluations (tests/verifier/bounds.py: 2 * depth * U * sum |dL/dp| |p|).
A prefix with one block token changed lies outside that bound. Random weights, config
dicts only (Qwen3 and Qwen3-MoE, the families the block pass serves).
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
from tests.verifier.bounds import chain_depth, projection_sensitivity
from tests.verifier.test_scan import GEMMA2, QWEN3_MOE, config, random_params, row

BK = 4  # block slots
ANCHORS = np.array([3, 9, 12, 15], np.int32)  # 12 starts document 1: no context at all


def direct(params, cfg, ids, doc, anchor, block, length):
    """The prefix of ``anchor``'s block as one document, padded to ``length``."""
    start = int(np.argmax(doc == doc[anchor]))
    seq = np.concatenate([ids[start:anchor], block]).astype(np.int32)
    n = len(seq)
    seq = np.pad(seq, (0, length - n))
    pos = np.arange(length, dtype=np.int32)
    d = np.where(np.arange(length) < n, 0, -1).astype(np.int32)
    return seq, pos, d, n


@pytest.mark.parametrize("family", [{}, QWEN3_MOE], ids=["qwen3", "qwen3_moe"])
def test_drafted_blocks_equal_a_direct_forward(family):
    cfg = config(3, **family)
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
    N, length = cfg.num_hidden_layers, 16
    run = jax.jit(lambda p, s, q, d: hidden_states(p, cfg, s, q, d, (N,))[:, 0])
    depth = chain_depth(cfg, N, length)
    for a, anchor in enumerate(ANCHORS):
        seq, q, d, n = direct(params, cfg, ids, doc, anchor, blocks[a], length)
        want = np.asarray(run(params, seq, q, d))[n - BK : n]
        c = np.zeros((length, 1, cfg.hidden_size), np.float32)
        c[n - BK : n, 0] = rng.standard_normal((BK, cfg.hidden_size))
        sens = projection_sensitivity(params, cfg, seq, q, d, (N,), c)[n - BK : n, 0]
        bound = 2 * depth * U * sens

        def within(x, a=a, n=n, c=c, bound=bound):
            return (np.abs(np.einsum("jh,jh->j", c[n - BK : n, 0], x - got[a])) <= bound).all()

        assert within(want), (a, anchor)
        # Planted: the last drafted token changed changes the last slot beyond the bound.
        other = blocks[a].copy()
        other[BK - 2] = (other[BK - 2] + 1) % 64
        seq2, *_ = direct(params, cfg, ids, doc, anchor, other, length)
        assert not within(np.asarray(run(params, seq2, q, d))[n - BK : n]), (a, anchor)


def test_sliding_window_verifiers_are_refused():
    cfg = config(2, **GEMMA2)
    assert drafted_blocks_supported(cfg) == "sliding-window attention layers"
    with pytest.raises(ValueError, match="drafted_hidden: the verifier has sliding-window"):
        drafted_hidden(
            {}, cfg, *map(jnp.asarray, row()), jnp.asarray(ANCHORS), jnp.zeros((4, 2), jnp.int32)
        )
