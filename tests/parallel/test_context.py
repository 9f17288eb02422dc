"""The ``context`` mesh axis (docs/design.md, "Context parallelism") on 8 simulated CPU
devices: a row's tokens split over 2 or 4 devices give the numbers of one device."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax import parallel
from dspark_jax.anchors import sample_anchors, select_anchors
from dspark_jax.model import attention as att
from dspark_jax.model.draft import DSparkDraftModel, LossSettings, batch_loss, row_loss
from tests.model.test_attention import _assert_bounded, _bounds, _tensors, _vg
from tests.model.test_draft import random_batch, random_frozen, tiny_config
from tests.numerics import DRAFTER_DEPTH, U, assert_within, model_roundoff

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


def test_the_trainer_refuses_a_split_it_cannot_feed():
    parallel.check_context_split(_mesh("fsdp=2,context=4"), 64)
    with pytest.raises(ValueError, match="--total-seq-len 66 must be a multiple of the mesh's"):
        parallel.check_context_split(_mesh("fsdp=2,context=4"), 66)
    # One process holds every row whole; a context group over processes (each holding
    # its tokens) and the refusal of interleaved tokens: tests/train/test_multiprocess.py.
    assert parallel.process_rows(_mesh("fsdp=2,context=4"), 4, 64) == ((0, 1, 2, 3), (0, 64))


def test_global_batch_puts_whole_rows_of_one_process_on_the_mesh():
    """One process: its batch holds every row whole; global_batch splits it over the
    (data, fsdp) rows and context tokens, bit for bit, and checks the row count."""
    mesh = _mesh("data=2,fsdp=2,context=2")
    rng = np.random.default_rng(0)
    local = {
        "hidden_states": rng.standard_normal((4, 64, 6)).astype(np.float32),
        "input_ids": rng.integers(0, 100, (4, 64)).astype(np.int32),
        "error_records": np.arange(4, dtype=np.int32),
    }
    out = parallel.global_batch(local, mesh, 4)
    for k, v in local.items():
        assert out[k].sharding.is_equivalent_to(parallel.batch_sharding(mesh, v.ndim), v.ndim)
        np.testing.assert_array_equal(np.asarray(out[k]), v, err_msg=k)
    with pytest.raises(ValueError, match="has 4 rows; this process holds 8 of the 8"):
        parallel.global_batch(local, mesh, 8)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("spec", MESHES)
def test_sequence_take(spec, dtype):
    """Exact in any float dtype, -0.0 and NaN included. bf16 is the hidden states' default:
    its psum in a shard_map manual over some mesh axes aborted XLA's CPU compiler
    (docs/xla_cpu_bf16_psum.md)."""
    x = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    x[16, 0], x[17, 1] = -0.0, np.nan
    x = jnp.asarray(x, dtype)
    idx = jnp.asarray([0, 15, 16, 17, 63, 31, 32, 5], jnp.int32)
    got = _run(jax.jit(parallel.sequence_take), spec, x, idx)
    want = np.asarray(x)[np.asarray(idx)]
    assert got.dtype == want.dtype
    # Bit for bit (one term per row): compared as integers, so -0.0 and NaN count too.
    bits = f"uint{8 * want.dtype.itemsize}"
    np.testing.assert_array_equal(got.view(bits), want.view(bits))


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


# Planted bugs the split's bounds must catch: the shards' own arithmetic, each wrong in one
# way a context split can be wrong.
_SHARD_VIEW, _CHUNKS_OF = att._shard_view, att._chunks_of


def _offset_off_by_one(k_loc, v_loc, doc_loc, ancg, cfg):
    ctx, offset, anc_doc, ranges = _SHARD_VIEW(k_loc, v_loc, doc_loc, ancg, cfg)
    return ctx, offset + 1, anc_doc, ranges


def _window_stops_at_the_edge(lo, hi, offset, length, kv_chunk):
    """A group sees only the shard holding its last visible column."""
    return _CHUNKS_OF(jnp.maximum(lo, (hi - 1) // length * length), hi, offset, length, kv_chunk)


def _documents_numbered_per_shard(k_loc, v_loc, doc_loc, ancg, cfg):
    """Document ids counted from 0 on every shard: documents of different shards merge."""
    new = jnp.concatenate([jnp.ones(1, bool), doc_loc[1:] != doc_loc[:-1]])
    local = jnp.where(doc_loc >= 0, jnp.cumsum(new & (doc_loc >= 0)) - 1, -1).astype(doc_loc.dtype)
    return _SHARD_VIEW(k_loc, v_loc, local, ancg, cfg)


@pytest.mark.parametrize(
    "name,fake",
    [
        ("_shard_view", _offset_off_by_one),
        ("_chunks_of", _window_stops_at_the_edge),
        ("_shard_view", _documents_numbered_per_shard),
    ],
)
def test_planted_split_bugs_break_the_bounds(name, fake, monkeypatch):
    W, causal = 6, True  # windows of anchors 17, 33, 50 cross shard edges at context=4
    doc, anc = _doc(), jnp.asarray(ANCHORS, jnp.int32)
    *xs, cot = _tensors(7, doc.shape[0], len(ANCHORS))
    bounds = _bounds(xs, anc, doc, cot, W, causal, rel=12 * U)
    dense = _dense_vg(W, causal, xs, anc, doc, cot)
    monkeypatch.setattr(att, name, fake)
    _attention_vg.cache_clear()  # trace again, with the bug
    try:
        split = _run(_attention_vg(W, causal), "data=2,context=4", xs, anc, doc, cot)
    finally:
        _attention_vg.cache_clear()
    with pytest.raises(AssertionError):
        _assert_bounded(split, dense, bounds)


def _dense_vg(W, causal, xs, anc, doc, cot):
    def f(q, kc, vc, kb, vb, anc, doc):
        return att.dense_anchored_block_attention(
            q, kc, vc, kb, vb, anc, doc, block_size=B, sliding_window=W, causal_in_block=causal
        )

    return jax.tree.map(np.asarray, jax.jit(functools.partial(_vg, f))(xs, anc, doc, cot))


# ---------------------------------------------------------------------------------------------
# The drafter: loss, metrics and gradients of a batch with its rows' tokens split.

SEQ, ROWS = 64, 4
DRAFT_MESHES = ("data=2,fsdp=2,context=2", "fsdp=2,context=4")


@functools.cache
def _drafter():
    """Tiny drafter (a sliding layer whose window 24 is more than a 16-token shard, a full
    layer), a batch whose 3 documents cross shard boundaries, the jitted loss-and-grad of
    the batch and the per-row gradients (for the bounds)."""
    cfg = tiny_config(sliding_window=24)
    rng = np.random.default_rng(1)
    batch = random_batch(rng, cfg, rows=ROWS, seq=SEQ)
    # Documents [0, 20), [20, 45), [45, 56), padding after: each crosses a shard boundary
    # at context=4 (16, 32, 48) and the second at context=2 (32).
    lengths = (20, 25, 11)
    pad = SEQ - sum(lengths)
    doc = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)] + [np.full(pad, -1)])
    pos = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(pad, int)])
    batch["document_ids"] = jnp.asarray(np.tile(doc, (ROWS, 1)), jnp.int32)
    batch["position_ids"] = jnp.asarray(np.tile(pos, (ROWS, 1)), jnp.int32)
    batch["loss_mask"] = batch["loss_mask"] * jnp.asarray(doc >= 0, jnp.int32)
    frozen = random_frozen(rng, cfg)
    model = DSparkDraftModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
    graphdef, params = nnx.split(model, nnx.Param)
    settings = LossSettings.from_loss_fn('{"ce":0.1,"tv":0.9}', num_anchors=8, vocab_chunk_tokens=8)

    def loss(p, fr, b, key):
        return batch_loss(nnx.merge(graphdef, p), fr, b, key, settings)

    def row_grad(p, row, k):
        anchors, valid = select_anchors(k, row["loss_mask"], settings.num_anchors, cfg.block_size)
        return jax.grad(lambda p: row_loss(nnx.merge(graphdef, p), frozen, row, anchors, valid,
                                           settings)[0])(p)  # fmt: skip

    return SimpleNamespace(
        cfg=cfg, batch=batch, frozen=frozen, params=params, settings=settings, loss=loss,
        step=jax.jit(jax.value_and_grad(loss, has_aux=True)),
        per_row=jax.jit(jax.vmap(row_grad, in_axes=(None, 0, 0))),
    )  # fmt: skip


def _on_mesh(spec, params, frozen, batch):
    """The arguments placed as the trainer places them: rows over (data, fsdp), tokens over
    context, parameters by the logical rules."""
    mesh = _mesh(spec)
    params = jax.device_put(params, parallel.state_shardings(params, mesh))
    frozen = jax.device_put(frozen, parallel.frozen_shardings(frozen, mesh))
    local = {k: np.asarray(v) for k, v in batch.items()}
    batch = parallel.global_batch(local, mesh, len(local["input_ids"]))
    assert batch["hidden_states"].sharding.spec[1] == "context"
    return params, frozen, batch


def test_anchor_draw_does_not_depend_on_the_split():
    d = _drafter()

    def draw(mask, doc, key):
        keys = jax.random.split(key, ROWS)
        return jax.vmap(lambda m, i, k: sample_anchors(k, m, i, 8, d.cfg.block_size))(
            mask, doc, keys
        )

    key = jax.random.key(11)
    want = jax.jit(draw)(d.batch["loss_mask"], d.batch["document_ids"], key)
    for spec in DRAFT_MESHES:
        b = _on_mesh(spec, d.params, d.frozen, d.batch)[2]
        got = _run(jax.jit(draw), spec, b["loss_mask"], b["document_ids"], key)
        for x, y in zip(got, want, strict=True):
            np.testing.assert_array_equal(x, y)  # the same anchors, bit for bit


@functools.cache
def _one_device(seed):
    """The unsplit step's loss, metrics and gradients, the loss's sensitivities (for its
    bound) and the per-row gradients: the same for every mesh, computed once."""
    d = _drafter()
    key = jax.random.key(seed)
    floats = {k: v for k, v in d.batch.items() if v.dtype == jnp.float32}
    sens = jax.jit(jax.grad(lambda p, fr, fl: d.loss(p, fr, dict(d.batch, **fl), key)[0],
                            argnums=(0, 1, 2)))(d.params, d.frozen, floats)  # fmt: skip
    per_row = _run(d.per_row, None, d.params, d.batch, jax.random.split(key, ROWS))
    return _run(d.step, None, d.params, d.frozen, d.batch, key), floats, sens, per_row


@pytest.mark.parametrize("spec", DRAFT_MESHES)
def test_drafter_loss_metrics_and_grads_split_over_context(spec):
    d = _drafter()
    key = jax.random.key(5)
    ((l1, m1), g1), floats, sens, per_row = _one_device(5)
    (lc, mc), gc = _run(d.step, spec, *_on_mesh(spec, d.params, d.frozen, d.batch), key)

    # The split evaluates the same fp32 sums in other orders. Longest accumulation chain:
    # tests.numerics.DRAFTER_DEPTH (<= 64 visible keys, 2 layers) plus, per layer, the
    # context merge: a C-term psum and two rescales (C <= 4), i.e. 2 x 6 roundings.
    depth = DRAFTER_DEPTH + 2 * 6
    assert_within(lc, l1, model_roundoff(sens, (d.params, d.frozen, floats), depth), "loss")
    # Metrics: the counts are integer-valued fp32 sums (exact); accept_len as in
    # tests/parallel/test_sharding.py: per block (1 + 2 + 3 + 4) x 2 depth u.
    assert set(mc) == set(m1)
    for name in set(m1) - {"accept_len_sum"}:
        assert_within(mc[name], m1[name], 2 * depth * U * abs(float(m1[name])), name)
    blocks = ROWS * d.settings.num_anchors
    assert_within(mc["accept_len_sum"], m1["accept_len_sum"], blocks * 10 * 2 * depth * U,
                  "accept_len_sum")  # fmt: skip
    # Gradients, per leaf in the Frobenius norm as in test_sharding: each row's gradient
    # within depth u |g_r| per side, the cross-row and cross-device sums (<= 4 rows + 8
    # devices) within 12 u sum_r |g_r|.
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(g1)]
    leaves = (jax.tree.leaves(t) for t in (gc, g1, per_row))
    for path, a, b, rows in zip(paths, *leaves, strict=True):
        diff = np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))
        mean_abs = np.abs(np.asarray(rows, np.float64)).mean(0)
        bound = 2 * (depth + 12) * U * np.linalg.norm(mean_abs)
        assert diff <= bound, (path, diff, bound)
