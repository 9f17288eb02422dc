"""The ``context`` mesh axis (docs/design.md, "Context parallelism") on 8 simulated CPU
devices: a row's tokens split over 2 or 4 devices give the numbers of one device."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import parallel
from dspark_jax.model import attention as att
from tests.model.test_attention import _assert_bounded, _bounds, _tensors, _vg
from tests.numerics import U

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

B = 4  # block size of tests.model.test_attention's shapes
# 64 columns: 4 shards of 16 (or 2 of 32). Document 1 runs over columns 5..44, across shards
# 0, 1 and 2; document 2 starts inside shard 2; padding fills shard 3's end.
LENGTHS, N_PAD = (5, 40, 11), 8
ANCHORS = (2, 9, 16, 17, 31, 32, 40, 44, 46, 50, 0, 0)  # sorted, then padding anchors
G, KV_CHUNK = 2, 8  # 2 chunks per shard at context=4
# Sliding windows: 6 (inside one shard or across one boundary), 20 (more than a 16-column
# shard: reaches two shards back) and full attention.
CONFIGS = [(6, True), (20, False), (None, True), (None, False)]
MESHES = ("context=2,fsdp=4", "data=2,context=4")


def _doc():
    ids = np.concatenate([np.full(n, i) for i, n in enumerate(LENGTHS)] + [np.full(N_PAD, -1)])
    return jnp.asarray(ids, jnp.int32)


@functools.cache
def _mesh(spec):
    return parallel.make_mesh(spec)


@functools.cache
def _attention_vg(W, causal):
    def f(q, kc, vc, kb, vb, anc, doc):
        return att.anchored_block_attention(
            q, kc, vc, kb, vb, anc, doc, block_size=B, sliding_window=W, causal_in_block=causal,
            q_block_group=G, kv_chunk=KV_CHUNK,
        )  # fmt: skip

    return jax.jit(functools.partial(_vg, f))


def _run(fn, spec, *args):
    """fn traced and run on no mesh (spec None) or under the mesh of spec."""
    if spec is None:
        return jax.tree.map(np.asarray, fn(*args))
    with jax.set_mesh(_mesh(spec)):
        return jax.tree.map(np.asarray, fn(*args))


def test_mesh_has_a_context_axis():
    assert parallel.parse_mesh("context=4,fsdp=-1", 8) == {
        "data": 1, "fsdp": 2, "context": 4, "tensor": 1,
    }  # fmt: skip
    mesh = _mesh("data=2,context=4")
    assert mesh.axis_names == ("data", "fsdp", "context", "tensor")
    assert parallel.batch_sharding(mesh, 3).spec == jax.sharding.PartitionSpec(
        ("data", "fsdp"), "context", None
    )
    assert parallel.LOGICAL_RULES["sequence"] == "context"
    with jax.set_mesh(mesh):
        assert parallel.context_size() == 4
    assert parallel.context_size() == 1


@pytest.mark.parametrize("spec", MESHES)
def test_sequence_take(spec):
    x = jnp.arange(64 * 3, dtype=jnp.float32).reshape(64, 3)
    idx = jnp.asarray([0, 15, 16, 17, 63, 31, 32, 5], jnp.int32)
    got = _run(jax.jit(parallel.sequence_take), spec, x, idx)
    np.testing.assert_array_equal(got, np.asarray(x)[np.asarray(idx)])  # exact: one term


@pytest.mark.parametrize("W,causal", CONFIGS)
def test_attention_split_over_context_matches_one_device(W, causal):
    doc, anc = _doc(), jnp.asarray(ANCHORS, jnp.int32)
    *xs, cot = _tensors(7, doc.shape[0], len(ANCHORS))
    # Every side against the dense fp32 oracle (float64 bounds of tests/model/test_attention:
    # the same sums in other orders). The split adds per side a C-term psum of the partial
    # sums (and of dq) and two rescales: (C + 2) roundings, C <= 4, relative to the absolute
    # evaluation: the `rel` term, 2 sides x 6 u.
    bounds = _bounds(xs, anc, doc, cot, W, causal, rel=12 * U)
    # Any two fp32 evaluations (dense, one device, split) differ by at most that.
    dense = _dense_vg(W, causal, xs, anc, doc, cot)
    one = _run(_attention_vg(W, causal), None, xs, anc, doc, cot)
    _assert_bounded(one, dense, bounds)
    for spec in MESHES:
        split = _run(_attention_vg(W, causal), spec, xs, anc, doc, cot)
        _assert_bounded(split, one, bounds)
        _assert_bounded(split, dense, bounds)


def _dense_vg(W, causal, xs, anc, doc, cot):
    def f(q, kc, vc, kb, vb, anc, doc):
        return att.dense_anchored_block_attention(
            q, kc, vc, kb, vb, anc, doc, block_size=B, sliding_window=W, causal_in_block=causal
        )

    return jax.tree.map(np.asarray, jax.jit(functools.partial(_vg, f))(xs, anc, doc, cot))
