"""The in-step verifier's forward split over the ``context`` mesh axis (docs/design.md,
"In-step verifier under a context split"), on 8 simulated CPU devices.

A packed row of 32 tokens (two documents and padding) is split in 2, 4 or 8 shards of
16, 8 or 4 tokens: both documents cross shard edges, and the 4-token sliding windows of
``mistral`` (every layer) and ``gemma2`` (alternate layers, soft caps) cross them too.
The split forward, like the unsplit one, is checked against transformers per document
with tests/verifier/test_forward.py's derived bound (the split evaluates the same sums:
each query's key chunks in the same order, only on other devices). Planted bugs in the
shards' arithmetic break the bound: an off-by-one shard offset, keys of other shards
invisible (a window or document stopping at the shard edge), documents numbered per shard.

Linear attention (KDA, Gated DeltaNet) runs each shard's tokens and hands the recurrent
state over (verifier/delta_rule.py). Its bound is the same: each state is the product of
the same per-chunk affine maps, composed once per earlier shard (dk + 1 roundings a
shard, under the chain's per-token dk + 12). Planted bugs there: the state dropped at a
shard edge, only the previous shard's state handed over, a state carried into a document
that starts on a shard's first token, the convolution's taps before the shard dropped.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import parallel
from dspark_jax.verifier import attention as vatt
from dspark_jax.verifier import delta_rule
from dspark_jax.verifier.forward import _causal_conv as fwd_conv
from dspark_jax.verifier.forward import batch_hidden_states
from dspark_jax.verifier.weights import param_shardings
from tests.verifier.test_forward import BLOCKS, LAYER_IDS, Case

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

LENGTHS, PAD = (11, 13), 8  # edges at 4k / 8k / 16: both documents cross several
MESHES = {2: "context=2,tensor=4", 4: "context=4,tensor=2", 8: "context=8"}


def _row():
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 64, n) for n in LENGTHS]
    ids = np.concatenate([*docs, np.zeros(PAD, np.int64)]).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in LENGTHS] + [np.arange(PAD)]).astype(np.int32)
    doc = np.concatenate([np.full(n, i) for i, n in enumerate(LENGTHS)] + [np.full(PAD, -1)])
    return docs, ids, pos, doc.astype(np.int32)


def _edge_row():
    """Two documents of 12 tokens and 8 of padding. At context=8 (shards of 4) each
    document spans three whole shards (the hand-off composes two shards' maps) and the
    second starts on shard 3's first token; at context=4 shard 1 holds the edge."""
    rng = np.random.default_rng(6)
    docs = [rng.integers(0, 64, 12) for _ in range(2)]
    ids = np.concatenate([*docs, np.zeros(8, np.int64)]).astype(np.int32)
    pos = np.concatenate([np.arange(12), np.arange(12), np.arange(8)]).astype(np.int32)
    doc = np.repeat(np.array([0, 1, -1], np.int32), [12, 12, 8])
    return docs, ids, pos, doc


_CASES: dict[tuple, Case] = {}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    def get(name, row=_row):
        if (name, row) not in _CASES:
            _CASES[name, row] = Case(name, tmp_path_factory.mktemp(name), row=row())
        return _CASES[name, row]

    return get


def _split_run(c: Case, context: int) -> np.ndarray:
    """The row's hidden states with its tokens split over ``context`` devices, as the
    trainer places a batch (parallel.global_batch), the rows vmapped."""
    mesh = parallel.make_mesh(MESHES[context])
    local = {"input_ids": c.ids[None], "position_ids": c.pos[None], "document_ids": c.doc[None]}
    batch = parallel.global_batch(local, mesh, 1)
    assert batch["input_ids"].sharding.spec[1] == parallel.CONTEXT_AXIS
    params = jax.device_put(c.params, param_shardings(c.cfg, mesh))  # heads over tensor
    with jax.set_mesh(mesh):
        assert parallel.context_size() == context
        f = jax.jit(lambda p, b: batch_hidden_states(p, c.cfg, b, LAYER_IDS, **BLOCKS))
        out = f(params, batch)
        # Each device computed its own tokens' states: the output stays split.
        assert out.sharding.spec[1] == parallel.CONTEXT_AXIS
    return np.asarray(out[0].astype(jnp.float32))[: c.n]


@pytest.mark.parametrize("context", [2, 4, 8])
@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_split_forward_matches_hf(case, name, context):
    c = case(name)
    c.check(c.run(), what=" (one device)")
    c.check(_split_run(c, context), what=f" (context={context})")


def test_split_forward_sinks(case):
    """gpt-oss's sinks (passed to every shard) beside windows crossing shard edges."""
    c = case("gpt_oss")
    c.check(_split_run(c, 4), what=" (context=4)")


@pytest.mark.parametrize(
    "name,context", [("kimi_linear", 4), ("kimi_linear", 8), ("qwen3_next", 8)]
)
def test_split_linear_attention_hands_the_state_over(case, name, context):
    """Kimi's KDA (and its MLA), Qwen3-Next's Gated DeltaNet (and its gated attention):
    each shard runs its own tokens, the state and the convolution's taps crossing edges."""
    c = case(name, _edge_row)
    c.check(_split_run(c, context), what=f" (context={context})")


def _state_dropped(maps, s, dv):
    return jnp.zeros((*maps.shape[1:3], dv), maps.dtype)


def _previous_shard_only(maps, s, dv):
    """The previous shard's end state from zero, as if no earlier shard existed."""
    return jnp.where(s > 0, maps[jnp.maximum(s - 1, 0), ..., :dv], 0.0)


@pytest.mark.parametrize(
    "bug", ["state_dropped", "previous_shard_only", "document_on_shard_edge", "conv_halo"]
)
def test_planted_hand_off_bugs_break_the_bound(case, monkeypatch, bug):
    c = case("kimi_linear", _edge_row)
    if bug == "state_dropped":
        monkeypatch.setattr(delta_rule, "hand_off", _state_dropped)
    elif bug == "previous_shard_only":
        monkeypatch.setattr(delta_rule, "hand_off", _previous_shard_only)
    elif bug == "document_on_shard_edge":  # the state assumed to continue the shard's first
        monkeypatch.setattr(delta_rule, "incoming_document", lambda doc: doc[0])
    else:  # the first K - 1 taps of every shard read zeros
        rows = parallel.previous_shard_rows
        monkeypatch.setattr(
            parallel, "previous_shard_rows",
            lambda x, n, fill: rows(x, n, fill) if n == 1 else jnp.zeros_like(x[:n]),
        )  # fmt: skip
    with pytest.raises(AssertionError, match="projection off"):
        c.check(_split_run(c, 8), what=" (planted)")


def _offset_off_by_one(k, v, doc):
    *kvd, offset = _SHARD_KEYS(k, v, doc)
    return *kvd, offset + 1


def _other_shards_invisible(k, v, doc):
    """Keys outside this shard get a document no query has: windows and documents stop
    at the shard's edge."""
    k_all, v_all, doc_all, offset = _SHARD_KEYS(k, v, doc)
    col = jnp.arange(doc_all.shape[0])
    mine = (col >= offset) & (col < offset + k.shape[0])
    return k_all, v_all, jnp.where(mine, doc_all, -7), offset


def _documents_numbered_per_shard(k, v, doc):
    """Each shard numbers its documents from 0: documents of different shards merge."""
    new = jnp.concatenate([jnp.ones(1, bool), doc[1:] != doc[:-1]])
    local = jnp.where(doc >= 0, jnp.cumsum(new & (doc >= 0)) - 1, -1).astype(doc.dtype)
    return _SHARD_KEYS(k, v, local)


_SHARD_KEYS = vatt._shard_keys


@pytest.mark.parametrize(
    "fake", [_offset_off_by_one, _other_shards_invisible, _documents_numbered_per_shard]
)
def test_planted_split_bugs_break_the_bound(case, fake, monkeypatch):
    c = case("mistral")
    monkeypatch.setattr(vatt, "_shard_keys", fake)
    with pytest.raises(AssertionError, match="projection off"):
        c.check(_split_run(c, 4), what=" (planted)")


def _collective_shapes(hlo: str) -> set[tuple[int, ...]]:
    """The result shapes of the compiled program's collectives."""
    ops = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
    found = set()
    for line in hlo.splitlines():
        if "=" in line and any(f" {op}(" in line or f" {op}-start(" in line for op in ops):
            result = line.split("=", 1)[1].split(maxsplit=1)[0]
            for dims in re.findall(r"\[([\d,]*)\]", result):
                found.add(tuple(int(d) for d in dims.split(",") if d))
    return found


def test_split_linear_attention_moves_no_row():
    """Compiled over context=8, the delta rule moves each shard's end-state map [B | A]
    and one document id, the convolution K - 1 tokens and their documents: nothing else
    (before the hand-off the partitioner gathered every input of the row)."""
    T, H, dk, dv, D, C, K = 64, 2, 6, 5, 7, 8, 4
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((T, H, dk)), jnp.float32) for _ in "qk")
    v = jnp.asarray(rng.standard_normal((T, H, dv)), jnp.float32)
    g = -jnp.asarray(rng.random((T, H, dk)), jnp.float32)
    beta = jnp.asarray(rng.random((T, H)), jnp.float32)
    doc = jnp.asarray(np.repeat([0, 1, -1], [30, 26, 8]), jnp.int32)
    x, w = jnp.asarray(rng.standard_normal((T, D)), jnp.float32), jnp.ones((D, 1, K))
    mesh = parallel.make_mesh(f"context={C}")
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("context"))
    with jax.set_mesh(mesh):
        rule = jax.jit(lambda *a: delta_rule.chunked(*a, chunk=4))
        args = [jax.device_put(a, split) for a in (q, k, v, g, beta, doc)]
        moved_rule = _collective_shapes(rule.lower(*args).compile().as_text())
        conv = jax.jit(fwd_conv).lower(jax.device_put(x, split), w, args[-1])
        moved_conv = _collective_shapes(conv.compile().as_text())
    assert moved_rule == {(C, H, dk, dv + dk), (1,)}, moved_rule
    assert moved_conv == {(K - 1, D), (K - 1,)}, moved_conv
