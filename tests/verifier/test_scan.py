"""The verifier's layers scanned over weights stacked by kind (forward.layer_blocks,
weights.param_specs): the split into blocks, the program size against the depth, and the
scanned forward against the same forward run one layer at a time.

Capturing every layer id makes every block a single layer (no repetition is scanned), so
``hidden_states(..., range(N + 1))`` is the layer-by-layer forward; capturing only N scans
the periodic blocks. Both run the same operations on the same operands in the same order,
so they differ only where XLA compiles a loop body otherwise than the unrolled layers
(fusion, accumulation order): within the round-off bound of two fp32 evaluations
(tests/verifier/bounds.py; tests/verifier/test_forward.py compares them with
transformers). Random weights, no HF model: config dicts only.
"""

from __future__ import annotations

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.verifier import hidden_states
from dspark_jax.verifier.config import verifier_config
from dspark_jax.verifier.forward import Block, layer_blocks
from dspark_jax.verifier.weights import layer_key, param_specs, params_from_numpy
from tests.numerics import U
from tests.verifier.bounds import chain_depth, projection_sensitivity

BASE = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=24,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    max_position_embeddings=64,
)
GEMMA2 = dict(model_type="gemma2", sliding_window=4, query_pre_attn_scalar=8)
GEMMA3 = dict(  # 3 sliding : 1 full, two RoPE kinds
    model_type="gemma3_text",
    sliding_window=4,
    sliding_window_pattern=4,
    query_pre_attn_scalar=8,
    attn_logit_softcapping=None,
)
QWEN3_MOE = dict(  # a dense first layer, then experts
    model_type="qwen3_moe",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=8,
    mlp_only_layers=[0],
)

# Kimi-K3 (flat config): attention-residual blocks of 3 layers, so layers 1-2, 4-5 and
# 7-8 scan between the unrolled block starts (KDA but layer 4, MLA; experts after layer 0)
KIMI_K3 = dict(
    model_type="kimi_k3",
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=8,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    num_experts=4,
    num_experts_per_token=2,
    num_expert_group=2,
    topk_group=1,
    moe_intermediate_size=8,
    num_shared_experts=1,
    first_k_dense_replace=1,
    moe_renormalize=True,
    routed_scaling_factor=2.5,
    linear_attn_config=dict(
        head_dim=8,
        num_heads=2,
        short_conv_kernel_size=4,
        kda_layers=[1, 2, 3, 4, 6, 7, 8, 9],
        full_attn_layers=[5],
        use_full_rank_gate=True,
    ),  # fmt: skip
    attn_res_block_size=3,
    hidden_act="situ",
    activation_situ_beta=1.5,
    activation_situ_linear_beta=2.0,
    mla_use_output_gate=True,
    routed_expert_hidden_size=32,
    latent_moe_use_norm=True,
)


def config(layers: int, **family):
    return verifier_config({**BASE, "model_type": "qwen3", **family, "num_hidden_layers": layers})


def random_params(cfg, seed=0):
    """HF-named random tensors (O(1) activations), stacked by params_from_numpy."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, spec in param_specs(cfg).items():
        for key in [layer_key(name, i) for i in spec.layers] if spec.layers else [name]:
            shape = spec.shape[1:] if spec.layers else spec.shape
            r = rng.standard_normal(shape).astype(np.float32)
            tensors[key] = r / shape[-1] ** 0.5 if len(shape) >= 2 and "embed" not in key else r
            if "norm" in key:
                tensors[key] = 0.3 * r
    return tensors


def row(S=20):
    ids = np.random.default_rng(1).integers(0, 64, S).astype(np.int32)
    pos = np.concatenate([np.arange(12), np.arange(S - 12)]).astype(np.int32)
    doc = np.concatenate([np.zeros(12), np.ones(S - 12)]).astype(np.int32)
    return ids, pos, doc


def test_layer_blocks():
    uniform = [0] * 36
    assert layer_blocks(uniform, 0, 36) == [Block(0, 1, 36)]
    assert layer_blocks(uniform, 2, 18) == [Block(2, 1, 16)]
    assert layer_blocks(["d"] + ["m"] * 5, 0, 6) == [Block(0, 1, 1), Block(1, 1, 5)]
    alternating = ["s", "f"] * 23  # Gemma 2
    assert layer_blocks(alternating, 0, 46) == [Block(0, 2, 23)]
    assert layer_blocks(alternating, 3, 18) == [Block(3, 2, 7), Block(17, 1, 1)]
    g3 = ["f" if (i + 1) % 6 == 0 else "s" for i in range(62)]  # Gemma 3, 5:1
    assert layer_blocks(g3, 0, 62) == [Block(0, 6, 10), Block(60, 1, 2)]


def _eqns(jaxpr) -> int:
    """Equations of a jaxpr and of every jaxpr nested in it."""
    n = 0
    for e in jaxpr.eqns:
        n += 1
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                if isinstance(sub, jex.ClosedJaxpr):
                    n += _eqns(sub.jaxpr)
                elif isinstance(sub, jex.Jaxpr):
                    n += _eqns(sub)
    return n


@pytest.mark.parametrize(
    "family", [{}, GEMMA2, GEMMA3, QWEN3_MOE], ids=lambda f: f.get("model_type", "qwen3")
)
def test_program_size_does_not_grow_with_depth(family):
    """The traced forward of 24 layers has as many equations as that of 12 (it grew by
    one layer body per layer when the layers were unrolled)."""
    ids, pos, doc = row()

    def size(layers):
        cfg = config(layers, **family)
        abstract = {
            n: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16) for n, s in param_specs(cfg).items()
        }
        f = lambda p: hidden_states(p, cfg, ids, pos, doc, (2, layers))  # noqa: E731
        return _eqns(jax.make_jaxpr(f)(abstract).jaxpr)

    assert size(24) == size(12)


@pytest.mark.parametrize(
    "family", [GEMMA2, GEMMA3, QWEN3_MOE, KIMI_K3], ids=lambda f: f["model_type"]
)
def test_scanned_equals_layer_by_layer(family):
    cfg = config(9, **family)
    params = params_from_numpy(random_params(cfg), cfg)
    ids, pos, doc = row()
    blocks = layer_blocks([cfg.kind(i) for i in range(9)], 0, 9)
    assert any(b.repeats > 1 for b in blocks), blocks  # something is scanned
    run = jax.jit(lambda p, ls: hidden_states(p, cfg, ids, pos, doc, ls, q_block=8, kv_chunk=8),
                  static_argnums=1)  # fmt: skip
    each = np.asarray(run(params, tuple(range(10))))[:, 9]
    c = np.random.default_rng(2).standard_normal((len(ids), 1, cfg.hidden_size))
    sens = projection_sensitivity(params, cfg, ids, pos, doc, (9,), c.astype(np.float32))[:, 0]
    bound = 2 * chain_depth(cfg, 9, 12) * U * sens  # 12: the longer document

    def off(p):
        """|<c, scanned> - <c, layer by layer>| / bound, worst token."""
        got = np.asarray(run(p, (9,)))[:, 0].astype(np.float64)
        return (np.abs(np.einsum("th,th->t", c[:, 0], got - each)) / bound).max()

    assert off(params) <= 1.0
    # a stack holding its layers in another order (a wrong slice per layer) fails
    j = next(j for j, (_, layers) in enumerate(cfg.layer_stacks) if len(layers) > 1)
    swapped = {n: a[::-1] if n.startswith(f"stacks.{j}.") else a for n, a in params.items()}
    assert off(swapped) > 1.0


def test_stacks_hold_each_layers_tensor():
    cfg = config(5, **GEMMA2)
    tensors = random_params(cfg)
    params = params_from_numpy(tensors, cfg)
    specs = param_specs(cfg)
    assert [layers for _, layers in cfg.layer_stacks] == [(0, 2, 4), (1, 3)]
    name = "stacks.1.self_attn.q_proj.weight"
    assert specs[name].axes == ("layers", "heads", "embed") and specs[name].shape == (2, 16, 16)
    np.testing.assert_array_equal(params[name][1], tensors["layers.3.self_attn.q_proj.weight"])
