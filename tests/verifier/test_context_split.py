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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import parallel
from dspark_jax.verifier import attention as vatt
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


_CASES: dict[str, Case] = {}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    def get(name):
        if name not in _CASES:
            _CASES[name] = Case(name, tmp_path_factory.mktemp(name), row=_row())
        return _CASES[name]

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


@pytest.mark.parametrize("name", ["gpt_oss", "kimi_linear"])
def test_split_forward_sinks_and_linear_attention(case, name):
    """gpt-oss's sinks (passed to every shard) beside windows crossing shard edges; Kimi's
    KDA layers, whose chunked recurrence runs over the gathered row, and its MLA."""
    c = case(name)
    c.check(_split_run(c, 4), what=" (context=4)")


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
