"""Sharding contract on 8 simulated CPU devices: same numbers as one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dspark_jax import parallel
from dspark_jax.anchors import select_anchors as anchor_select
from dspark_jax.model.draft import DSparkDraftModel, LossSettings, batch_loss, row_loss
from tests.model.test_draft import random_batch, random_frozen, tiny_config
from tests.numerics import DRAFTER_DEPTH, U, assert_within, model_roundoff


def test_parse_mesh():
    assert parallel.parse_mesh(None, 8) == {"data": 1, "fsdp": 8, "context": 1, "tensor": 1}
    assert parallel.parse_mesh("data=2,fsdp=-1,tensor=2", 8) == {
        "data": 2, "fsdp": 2, "context": 1, "tensor": 2,
    }  # fmt: skip
    assert parallel.parse_mesh("tensor=4", 4) == {"data": 1, "fsdp": 1, "context": 1, "tensor": 4}
    assert parallel.parse_mesh("context=2,fsdp=-1", 8)["fsdp"] == 4
    with pytest.raises(ValueError, match="multiply to 4, but there are 8 devices"):
        parallel.parse_mesh("data=2,fsdp=2", 8)
    with pytest.raises(ValueError, match="bad entry 'pipeline=2'"):
        parallel.parse_mesh("pipeline=2", 8)
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        parallel.parse_mesh("data=-1,fsdp=-1", 8)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_sharded_loss_and_grads_equal_single_device():
    cfg = tiny_config()
    rng = np.random.default_rng(0)
    batch = random_batch(rng, cfg, rows=4, seq=40)
    frozen = random_frozen(rng, cfg)
    model = DSparkDraftModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
    graphdef, params = nnx.split(model, nnx.Param)
    settings = LossSettings.from_loss_fn('{"ce":0.1,"tv":0.9}', num_anchors=6, vocab_chunk_tokens=8)
    key = jax.random.key(5)

    def loss_and_grads(params, frozen, batch, key):
        def f(p):
            return batch_loss(nnx.merge(graphdef, p), frozen, batch, key, settings)

        return jax.value_and_grad(f, has_aux=True)(params)

    (l1, m1), g1 = jax.jit(loss_and_grads)(params, frozen, batch, key)

    mesh = parallel.make_mesh("data=2,fsdp=2,tensor=2")
    p_sh = parallel.state_shardings(params, mesh)
    assert p_sh["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value().spec == P(
        "fsdp", "tensor"
    )
    assert p_sh["layers"][0]["mlp"]["down_proj"]["kernel"].get_value().spec == P("tensor", "fsdp")
    params8 = jax.device_put(params, p_sh)
    frozen8 = jax.device_put(frozen, parallel.frozen_shardings(frozen, mesh))
    batch8 = parallel.global_batch({k: np.asarray(v) for k, v in batch.items()}, mesh)
    assert batch8["input_ids"].sharding.spec == P(("data", "fsdp"), "context")  # context=1
    (l8, m8), g8 = jax.jit(loss_and_grads, out_shardings=(None, p_sh))(
        params8, frozen8, batch8, key
    )

    # Sharded vs one device: the same fp32 sums split over devices and re-added, i.e. in
    # other orders. Loss: the backward-error model of tests.numerics.model_roundoff.
    floats = {k: v for k, v in batch.items() if v.dtype == jnp.float32}

    def loss_of(p, fr, fl):
        return batch_loss(nnx.merge(graphdef, p), fr, dict(batch, **fl), key, settings)[0]

    sens = jax.jit(jax.grad(loss_of, argnums=(0, 1, 2)))(params, frozen, floats)
    assert_within(l8, l1, model_roundoff(sens, (params, frozen, floats)), "loss")
    # accept_len sums per block 1 + the prefix products of <= B = 4 overlaps; an overlap is
    # within 2 depth u (probabilities within depth u relative per side), a k-factor prefix
    # within k times that: <= (1 + 2 + 3 + 4) * 2 depth u per block, 4 rows x 6 blocks.
    blocks = 4 * settings.num_anchors
    assert_within(m8["accept_len_sum"], m1["accept_len_sum"], blocks * 10 * 2 * DRAFTER_DEPTH * U,
                  "accept_len_sum")  # fmt: skip
    # Gradients: the mean over rows of per-row gradients g_r. Model: each g_r within
    # depth u |g_r| per side, the cross-row / cross-device sums (<= 4 + 8 terms) within
    # 12 u sum_r |g_r|: 2 (depth + 12) u mean_r |g_r|. Applied per leaf in the Frobenius
    # norm: elementwise it undercounts entries that cancel inside one row (the embedding
    # rows of tokens seen twice with opposite cotangents), which weigh nothing norm-wise.
    keys = jax.random.split(key, 4)

    def row_grad(p, row, k):
        anchors, valid = anchor_select(k, row["loss_mask"], settings.num_anchors, cfg.block_size)
        return jax.grad(lambda p: row_loss(nnx.merge(graphdef, p), frozen, row, anchors, valid,
                                           settings)[0])(p)  # fmt: skip

    per_row = jax.jit(jax.vmap(row_grad, in_axes=(None, 0, 0)))(params, batch, keys)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(g1)]
    leaves = (jax.tree.leaves(t) for t in (g8, g1, per_row))
    for path, a, b, rows in zip(paths, *leaves, strict=True):
        mean_abs = np.abs(np.asarray(rows, np.float64)).mean(0)
        diff = np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))
        bound = 2 * (DRAFTER_DEPTH + 12) * U * np.linalg.norm(mean_abs)
        assert diff <= bound, (path, diff, bound)
    assert g8["fc"]["kernel"][...].sharding.spec == P(None, "fsdp")
