"""Sharding contract on 8 simulated CPU devices: same numbers as one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dspark_jax import parallel
from dspark_jax.model.draft import DSparkDraftModel, LossSettings, batch_loss
from tests.model.test_draft import random_batch, random_frozen, tiny_config


def test_parse_mesh():
    assert parallel.parse_mesh(None, 8) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert parallel.parse_mesh("data=2,fsdp=-1,tensor=2", 8) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert parallel.parse_mesh("tensor=4", 4) == {"data": 1, "fsdp": 1, "tensor": 4}
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
    assert p_sh["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value().spec == P("fsdp", "tensor")
    assert p_sh["layers"][0]["mlp"]["down_proj"]["kernel"].get_value().spec == P("tensor", "fsdp")
    params8 = jax.device_put(params, p_sh)
    frozen8 = jax.device_put(frozen, parallel.frozen_shardings(frozen, mesh))
    batch8 = parallel.global_batch({k: np.asarray(v) for k, v in batch.items()}, mesh)
    assert batch8["input_ids"].sharding.spec == P(("data", "fsdp"), None)
    (l8, m8), g8 = jax.jit(loss_and_grads, out_shardings=(None, p_sh))(params8, frozen8, batch8, key)

    np.testing.assert_allclose(l8, l1, rtol=1e-5)
    np.testing.assert_allclose(m8["accept_len_sum"], m1["accept_len_sum"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g8, g1)
    assert g8["fc"]["kernel"][...].sharding.spec == P(None, "fsdp")
