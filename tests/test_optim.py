"""dspark_jax.optim without torch: partition, schedules, clipping, Muon/AdamW semantics, flags.

The torch-side comparison (the reference's own optimisers and schedulers) is in
tests/reference/test_optim_parity.py.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dspark_jax import optim
from dspark_jax.config import DSparkConfig
from dspark_jax.model.draft import DSparkDraftModel
from dspark_jax.model.params import leaf_key
from dspark_jax.optim import muon


def tiny_config(**kw) -> DSparkConfig:
    fields = dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=2,
        vocab_size=64,
        block_size=4,
        mask_token_id=63,
        aux_hidden_state_layer_ids=(1, 3),
        markov_rank=8,
    )
    fields.update(kw)
    return DSparkConfig(**fields)


def params_of(cfg: DSparkConfig, seed: int = 0):
    model = DSparkDraftModel(cfg, rngs=nnx.Rngs(seed), dtype=jnp.float32, remat=False)
    return model, nnx.state(model, nnx.Param)


LAYER_MATRICES = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]


def expected_muon(num_layers: int, extra: tuple[str, ...] = ()) -> list[str]:
    keys = ["fc.weight", *extra]
    keys += [f"layers.{i}.{m}.weight" for i in range(num_layers) for m in LAYER_MATRICES]
    return sorted(keys)


def flat_labels(params) -> dict[str, str]:
    flat = jax.tree_util.tree_flatten_with_path(optim.param_labels(params))[0]
    return {leaf_key(path)[0]: label for path, label in flat}


def small_tree(seed: int = 0) -> dict:
    """A few drafter-named leaves (both groups, kernels tall/wide/square): compiles fast."""
    shapes = {
        "fc": {"kernel": (24, 16)},
        "layers": {
            "0": {
                "mlp": {"up_proj": {"kernel": (16, 40)}},
                "self_attn": {"q_proj": {"kernel": (16, 16)}},
                "input_layernorm": {"weight": (16,)},
            }
        },
        "markov_head": {"markov_w1": {"embedding": (40, 4)}},
        "confidence_head": {"proj": {"kernel": (20, 1), "bias": (1,)}},
    }
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: jnp.asarray(rng.standard_normal(s).astype(np.float32)),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


SMALL_MUON = ["fc.weight", "layers.0.mlp.up_proj.weight", "layers.0.self_attn.q_proj.weight"]


# ---------------------------------------------------------------------- partition


def test_partition_on_the_drafter():
    _, params = params_of(tiny_config())
    labels = flat_labels(params)
    assert optim.muon_param_keys(params) == expected_muon(2)
    adamw = sorted(k for k, v in labels.items() if v == "adamw")
    assert adamw == sorted(
        [
            "confidence_head.proj.bias",
            "confidence_head.proj.weight",  # [1, 40]: min(shape) == 1
            "hidden_norm.weight",
            "markov_head.markov_w1.weight",  # by name
            "markov_head.markov_w2.weight",  # by name
            "norm.weight",
        ]
        + [
            f"layers.{i}.{n}.weight"
            for i in range(2)
            for n in (
                "input_layernorm",
                "post_attention_layernorm",
                "self_attn.q_norm",
                "self_attn.k_norm",
            )
        ]
    )


@pytest.mark.parametrize(
    "overrides, extra",
    [
        (dict(markov_head_type="gated"), ("markov_head.gate_proj.weight",)),
        (dict(markov_head_type="rnn"), ("markov_head.joint_proj.weight",)),
        (dict(markov_rank=0, confidence_head_with_markov=False), ()),
        (dict(enable_confidence_head=False, num_hidden_layers=3), ()),
    ],
)
def test_partition_head_variants(overrides, extra):
    cfg = tiny_config(**overrides)
    _, params = params_of(cfg)
    assert optim.muon_param_keys(params) == expected_muon(cfg.num_hidden_layers, extra)
    labels = flat_labels(params)
    assert all(v == "adamw" for k, v in labels.items() if k.endswith(".bias"))


def test_is_muon_param_rule():
    assert optim.is_muon_param("layers.0.mlp.up_proj.weight", (64, 32))
    assert not optim.is_muon_param("layers.0.mlp.up_proj.weight", (1, 32))  # degenerate
    assert not optim.is_muon_param("x.weight", (32, 1))
    assert not optim.is_muon_param("norm.weight", (32,))
    assert not optim.is_muon_param("x.weight", (2, 3, 4))
    for hint in optim.ADAMW_NAME_HINTS:
        assert not optim.is_muon_param(f"a.{hint}.weight", (16, 16)), hint


def test_labels_same_on_variable_state_and_pure_tree():
    _, params = params_of(tiny_config())
    assert flat_labels(params) == flat_labels(nnx.as_pure(params))


def test_unknown_leaf_name_is_a_clear_error():
    with pytest.raises(KeyError, match="no speculators key.*foo/scale"):
        optim.param_labels({"foo": {"scale": jnp.ones((4, 4))}})


# ------------------------------------------------------------------------ schedules


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_schedule_points(kind):
    lr = 2e-3
    sched = optim.make_schedule(lr, scheduler_type=kind, warmup_steps=10, total_steps=100)
    at = lambda s: float(sched(s))  # noqa: E731
    assert at(0) == 0.0  # the first update uses lambda(0)
    np.testing.assert_allclose([at(1), at(5), at(10)], [lr / 10, lr / 2, lr], rtol=1e-6)
    np.testing.assert_allclose(at(55), lr / 2, rtol=1e-5)  # halfway through the decay
    np.testing.assert_allclose(at(100), 0.0, atol=1e-12)
    if kind == "cosine":
        np.testing.assert_allclose(at(32.5), lr * 0.5 * (1 + math.cos(math.pi * 0.25)), rtol=1e-5)
        # unclamped, like transformers: progress 1.5 -> cos(1.5 pi) = 0 -> half the lr again
        np.testing.assert_allclose(at(145), lr / 2, rtol=1e-5)
    else:
        np.testing.assert_allclose(at(32.5), lr * 0.75, rtol=1e-5)
        assert at(150) == 0.0
    steps = np.arange(120)
    py = [
        lr * optim.lr_lambda(int(s), scheduler_type=kind, warmup_steps=10, total_steps=100)
        for s in steps
    ]
    np.testing.assert_allclose(np.asarray(jax.vmap(sched)(steps)), py, rtol=0, atol=lr * 1e-6)


def test_schedule_no_warmup_and_none():
    cos = optim.make_schedule(1.0, scheduler_type="cosine", warmup_steps=0, total_steps=10)
    assert float(cos(0)) == 1.0
    lin = optim.make_schedule(1.0, scheduler_type="linear", warmup_steps=0, total_steps=10)
    np.testing.assert_allclose(float(lin(3)), 0.7, rtol=1e-6)
    const = optim.make_schedule(3e-4, scheduler_type="none", warmup_steps=5, total_steps=10)
    assert float(const(0)) == float(const(1000)) == np.float32(3e-4)


def test_resolve_scheduler_steps():
    assert optim.resolve_scheduler_steps(250) == (2, 250)  # total // 100
    assert optim.resolve_scheduler_steps(7, warmup_ratio=0.5) == (3, 7)  # int() truncates
    assert optim.resolve_scheduler_steps(100, warmup_ratio=0.0) == (0, 100)
    with pytest.warns(UserWarning, match="using scheduler_warmup_steps"):
        assert optim.resolve_scheduler_steps(100, warmup_steps=4, warmup_ratio=0.5) == (4, 100)
    with pytest.raises(ValueError, match="between 0 and 1"):
        optim.resolve_scheduler_steps(100, warmup_ratio=1.5)


def test_build_returns_group_schedules():
    _, params = params_of(tiny_config())
    _, s = optim.build_optimizer(
        params,
        optimizer="muon",
        lr=1e-3,
        muon_lr=1e-2,
        total_steps=100,
        warmup_ratio=0.1,
        scheduler_type="cosine",
    )
    assert set(s) == {"muon", "adamw"}
    np.testing.assert_allclose(
        [float(s["muon"](10)), float(s["adamw"](10))], [1e-2, 1e-3], rtol=1e-6
    )
    _, s = optim.build_optimizer(params, optimizer="muon", lr=4e-3, total_steps=100)
    np.testing.assert_allclose(float(s["muon"](50)), float(s["adamw"](50)))  # muon_lr None -> lr
    _, s = optim.build_optimizer(params, optimizer="adamw", lr=1e-3, total_steps=100)
    assert set(s) == {"adamw"}
    lrs = optim.current_lrs(s, 1)
    np.testing.assert_allclose(float(lrs["adamw"]), 1e-3 * 1 / 1)  # warmup 100 // 100 = 1


def test_flags_helper_uses_reference_names_and_defaults():
    _, params = params_of(tiny_config())
    _, s = optim.build_optimizer_from_flags(params, {"lr": 2e-3, "scheduler_total_steps": 40}, None)
    # CLI defaults: muon optimizer, linear schedule, warmup 40 // 100 = 0, muon_lr = lr
    assert set(s) == {"muon", "adamw"}
    np.testing.assert_allclose(float(s["muon"](0)), 2e-3)
    np.testing.assert_allclose(float(s["muon"](30)), 2e-3 * 10 / 40, rtol=1e-6)


# ------------------------------------------------------------------------ clipping


def test_clip_matches_torch_formula():
    clip = optim.clip_by_global_norm_torch(1.0)
    g = {"a": jnp.full((4,), 6.0), "b": {"c": jnp.full((2, 2), 8.0)}}  # norms 12, 16 -> 20
    assert float(optim.global_grad_norm(g)) == 20.0
    out, _ = clip.update(g, clip.init(g))
    coef = np.float32(1.0) / (np.float32(20.0) + np.float32(1e-6))
    np.testing.assert_array_equal(np.asarray(out["a"]), np.float32(6.0) * coef)
    np.testing.assert_allclose(float(optim.global_grad_norm(out)), 1.0, rtol=1e-6)
    small = {"a": jnp.asarray([0.3, -0.4])}
    out, _ = clip.update(small, clip.init(small))
    np.testing.assert_array_equal(np.asarray(out["a"]), np.asarray(small["a"]))  # below: untouched


def test_clip_runs_first_over_all_groups():
    """Two steps with gradient norms 1e2 and 1e4: clipped, both count the same in the
    momenta (= feeding pre-clipped gradients); unclipped, the second dominates."""
    params = small_tree()
    assert optim.muon_param_keys(params) == SMALL_MUON
    gs = [
        jax.tree.map(lambda p, s=scale: s * p, small_tree(seed))
        for seed, scale in ((1, 10.0), (2, 1e3))
    ]
    assert float(optim.global_grad_norm(gs[0])) > 10

    def pre_clip(g):  # by hand: torch's coefficient from the norm over every leaf
        coef = jnp.minimum(1.0 / (optim.global_grad_norm(g) + 1e-6), 1.0)
        return jax.tree.map(lambda x: x * coef, g)

    txs = {
        m: optim.build_optimizer(
            params, optimizer="muon", lr=1e-2, scheduler_type="none", max_grad_norm=m
        )[0]
        for m in (1.0, 1e30)
    }
    updates = {m: jax.jit(tx.update) for m, tx in txs.items()}

    def run(max_grad_norm, grads):
        update, state = updates[max_grad_norm], txs[max_grad_norm].init(params)
        for g in grads:
            u, state = update(g, state, params)
        return jax.tree.leaves(u)

    clipped = run(1.0, gs)
    by_hand = run(1e30, [pre_clip(g) for g in gs])
    unclipped = run(1e30, gs)
    far = 0.0
    for a, b, c in zip(clipped, by_hand, unclipped, strict=True):
        a, b, c = map(np.asarray, (a, b, c))
        # equal up to fp32 rounding, which the bf16 Newton-Schulz may turn into bf16 ulps
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2.0**-6 * np.abs(b).max())
        far = max(far, np.abs(a - c).max() / np.abs(a).max())
    assert far > 0.1


# ------------------------------------------------------------------- optimiser maths


def _one_matrix_tree(kernel: np.ndarray, layout: str):
    """{'m': {'kernel': K}} (our [in, out]) or {'m': {'weight': W}} (torch [out, in])."""
    return {"m": {layout: jnp.asarray(kernel)}}


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (24, 24)])
def test_kernel_layout_is_the_transpose_of_torch_layout(shape):
    """Muon on a kernel K equals, transposed, Muon on the torch weight K.T (incl. square)."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal(shape).astype(np.float32)
    gk = rng.standard_normal(shape).astype(np.float32)
    tx = optim.torch_muon(0.1, adjust_lr_fn="original")
    update = jax.jit(tx.update)
    outs = {}
    for layout, p, g in (("kernel", k, gk), ("weight", k.T, gk.T)):
        params, grads = _one_matrix_tree(p, layout), _one_matrix_tree(g, layout)
        state = tx.init(params)
        for _ in range(2):
            u, state = update(grads, state, params)
        outs[layout] = np.asarray(u["m"][layout])
    np.testing.assert_array_equal(outs["kernel"], outs["weight"].T)


def test_muon_step_semantics():
    """lr*ratio*NS(nesterov(EMA)) with torch's shape ratio, decay with the unadjusted lr."""
    rng = np.random.default_rng(1)
    k = rng.standard_normal((16, 48)).astype(np.float32)  # kernel [in, out]: torch W is [48, 16]
    g1, g2 = (rng.standard_normal((16, 48)).astype(np.float32) for _ in range(2))
    lr, wd, mu = 0.02, 0.1, 0.95
    params = _one_matrix_tree(k, "kernel")
    outs = {}
    for fn in ("match_rms_adamw", "original"):
        tx = optim.torch_muon(lr, momentum=mu, weight_decay=wd, adjust_lr_fn=fn)
        update = jax.jit(tx.update)
        state = tx.init(params)
        _, state = update(_one_matrix_tree(g1, "kernel"), state, params)
        u2, state = update(_one_matrix_tree(g2, "kernel"), state, params)
        outs[fn] = u2["m"]["kernel"]
    buf = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optim.TorchMuonState))[0]
    buf = np.asarray(buf.momentum_buffer["m"]["kernel"])
    np.testing.assert_allclose(buf, (1 - mu) * g2 + mu * (1 - mu) * g1, rtol=1e-5, atol=1e-7)
    nesterov = (1 - mu) * g2 + mu * buf
    o = np.asarray(
        jax.jit(optim.newton_schulz_torch)(jnp.asarray(nesterov.T)).astype(jnp.float32)
    ).T
    for fn, ratio in (("match_rms_adamw", 0.2 * math.sqrt(48)), ("original", math.sqrt(48 / 16))):
        expected = -lr * ratio * o - lr * wd * k
        np.testing.assert_allclose(np.asarray(outs[fn]), expected, rtol=1e-5, atol=1e-7)
    # NS output is roughly orthogonal: singular values around 1 (torch's quintic: ~[0.5, 1.5])
    sv = np.linalg.svd(o, compute_uv=False)
    assert 0.3 < sv.min() and sv.max() < 1.6


def test_newton_schulz_bf16_and_transposes():
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((24, 40)).astype(np.float32))
    ns = jax.jit(optim.newton_schulz_torch)
    o = ns(w)
    assert o.dtype == jnp.bfloat16 and o.shape == (24, 40)
    np.testing.assert_array_equal(np.asarray(ns(w.T)), np.asarray(o).T)
    z = ns(jnp.zeros((4, 6)))  # clamp(min=eps): zero in, zero out
    assert not np.any(np.asarray(z, np.float32))


def test_batched_orthogonalisation_equals_single():
    rng = np.random.default_rng(3)
    shapes = [(16, 32), (32, 16), (16, 32), (8, 8), (8, 8)]
    leaves = [jnp.asarray(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    flags = [True, False, False, True, False]
    batched = jax.jit(lambda ls: optim.orthogonalize_leaves(ls, flags))(leaves)
    ns = jax.jit(optim.newton_schulz_torch)
    for x, t, b in zip(leaves, flags, batched, strict=True):
        single = ns(x.T if t else x).astype(jnp.float32)
        single = single.T if t else single
        np.testing.assert_allclose(np.asarray(b), np.asarray(single), rtol=0, atol=2.0**-6)


def test_sequential_orthogonalisation_is_bitwise_per_matrix_ns():
    """One matrix at a time (with the ordering edges) == NS of each matrix alone, bitwise."""
    rng = np.random.default_rng(4)
    shapes = [(16, 32), (32, 16), (16, 32), (8, 8), (8, 8), (24, 40)]
    leaves = [jnp.asarray(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    flags = [True, False, False, True, False, True]
    got = jax.jit(lambda ls: optim.orthogonalize_leaves(ls, flags))(leaves)
    ns = jax.jit(optim.newton_schulz_torch)
    for x, t, o in zip(leaves, flags, got, strict=True):
        single = ns(x.T if t else x).astype(jnp.float32)
        np.testing.assert_array_equal(np.asarray(o), np.asarray(single.T if t else single))


def test_ordering_edge_is_an_exact_identity():
    """muon.after_previous(prev, x) is x bit for bit, whatever prev holds (NaN, inf, -0.0)."""
    x = jnp.asarray([0.0, -0.0, 1.5, -2.0, np.inf, -np.inf, np.nan, 1e-45], jnp.float32)
    after = jax.jit(muon.after_previous)
    for p in (1.0, -3.0, 0.0, -0.0, np.inf, -np.inf, np.nan):
        for dtype in (jnp.float32, jnp.bfloat16):
            prev = jnp.full((2, 3), p, dtype)
            out = np.asarray(after(prev, x))
            np.testing.assert_array_equal(out.view(np.uint32), np.asarray(x).view(np.uint32))


def _muon_update_temp_bytes(num_layers: int) -> int:
    """Compiled temp memory of clip + Muon/AdamW + apply_updates over ``num_layers`` x
    (up_proj kernel [256, 512], down_proj kernel [512, 256], a norm), structured like
    the train step: ``{"params", "opt"}`` donated in, the same structure out."""
    f32, sds = jnp.float32, jax.ShapeDtypeStruct
    params = {
        "layers": {
            str(i): {
                "mlp": {
                    "up_proj": {"kernel": sds((256, 512), f32)},  # torch [512, 256]: tall
                    "down_proj": {"kernel": sds((512, 256), f32)},  # torch [256, 512]: wide
                },
                "input_layernorm": {"weight": sds((256,), f32)},
            }
            for i in range(num_layers)
        }
    }
    tx, _ = optim.build_optimizer(params, optimizer="muon", scheduler_type="none")

    def step(state, grads):
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    state = {"params": params, "opt": jax.eval_shape(tx.init, params)}
    compiled = jax.jit(step, donate_argnums=0).lower(state, params).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_muon_update_keeps_one_matrix_of_temporaries():
    """The Muon update's temporaries are one matrix's working set, not all matrices'.

    Bound, in fp32 matrices of 256 x 512 (512 KiB): at its largest, one Newton-Schulz
    iteration holds the bf16 iterate and the next one (2 x 1/2), the fp32 product
    ``gram_update @ x`` before the bf16 addmm rounding (1) and the bf16 256 x 256
    ``gram_update`` (1/4), 2.25 in all; before the loop, the bf16 Nesterov input, the
    fp32 copy XLA:CPU reduces for the norm and the normalised bf16 iterate are less.
    So 3 (1.5 MiB) bounds one matrix's working set, whatever the number of matrices.
    With 16 matrices the previous
    structure (every matrix's bf16 Newton-Schulz input, the stacked copies of each
    equal-shape group and all fp32 results live before the first parameter is
    written) compiled to 16 MiB here (2 MiB with one layer); now 1 MiB for 1 or 8
    layers. So: below the bound, and 15 more matrices add less than half of one.
    """
    matrix = 256 * 512 * 4  # one fp32 matrix
    one, eight = _muon_update_temp_bytes(1), _muon_update_temp_bytes(8)
    assert eight <= 3 * matrix, (one, eight)
    assert eight <= one + matrix // 2, (one, eight)


def test_zero_grads_only_decay_each_group():
    params = small_tree()
    lr = 0.1
    tx, _ = optim.build_optimizer(
        params,
        optimizer="muon",
        lr=lr,
        muon_lr=0.5,
        weight_decay=0.01,
        muon_weight_decay=0.2,
        scheduler_type="none",
    )
    zeros = jax.tree.map(jnp.zeros_like, params)
    u, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
    muon = set(optim.muon_param_keys(params))
    for path, du in jax.tree_util.tree_flatten_with_path(u)[0]:
        key = leaf_key(path)[0]
        p = np.asarray(params_leaf(params, path))
        rate = 0.5 * 0.2 if key in muon else lr * 0.01
        np.testing.assert_allclose(np.asarray(du), -rate * p, rtol=1e-6, atol=1e-9, err_msg=key)


def params_leaf(tree, path):
    for k in path:
        tree = tree[getattr(k, "key", getattr(k, "idx", None))]
    return tree


def test_adamw_first_step_is_signed_lr():
    """Bias-corrected Adam's first update is g/(|g| + eps): -lr*sign(g) - lr*wd*p."""
    p = {"norm": {"weight": jnp.asarray([1.0, -2.0, 3.0])}}
    g = {"norm": {"weight": jnp.asarray([0.5, -1e-3, 2.0])}}
    tx = optim.torch_adamw(0.01, 0.01)
    u, state = tx.update(g, tx.init(p), p)
    gg = np.asarray(g["norm"]["weight"], np.float64)
    expected = -0.01 * gg / (np.abs(gg) + 1e-8) - 0.01 * 0.01 * np.asarray(p["norm"]["weight"])
    np.testing.assert_allclose(np.asarray(u["norm"]["weight"]), expected, rtol=1e-6)
    assert int(state[0].count) == 1


def test_nnx_optimizer_and_functional_use_agree():
    """nnx.Optimizer(model, tx, wrt=nnx.Param) == init/update/apply_updates on the pure
    tree; under warmup the first update (lambda(0) = 0) leaves the parameters as they are."""
    model, params = params_of(tiny_config(num_hidden_layers=1))
    pure = nnx.as_pure(params)
    tx, _ = optim.build_optimizer(
        params, optimizer="muon", lr=1e-2, total_steps=20, warmup_steps=2, scheduler_type="cosine"
    )
    key = iter(jax.random.split(jax.random.key(1), 100))
    grads = jax.tree.map(lambda x: jax.random.normal(next(key), x.shape), params)

    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def nnx_step(model, opt, grads):
        opt.update(model, grads)

    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    state = tx.init(pure)
    initial = pure
    for i in range(3):
        nnx_step(model, opt, grads)
        pure, state = step(pure, state, nnx.as_pure(grads))
        got = nnx.as_pure(nnx.state(model, nnx.Param))
        for a, b, c in zip(
            jax.tree.leaves(got), jax.tree.leaves(pure), jax.tree.leaves(initial), strict=True
        ):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7)
            if i == 0:
                np.testing.assert_array_equal(np.asarray(b), np.asarray(c))
            else:
                assert np.abs(np.asarray(b) - np.asarray(c)).max() > 0
    assert int(opt.step[...]) == 3


# ---------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(optimizer="sgd"), "Unsupported optimizer: 'sgd'"),
        (dict(scheduler_type="step"), "Unsupported scheduler_type: 'step'"),
        (dict(muon_adjust_lr_fn="spectral"), "Unsupported muon_adjust_lr_fn"),
        (dict(warmup_ratio=1.5), "scheduler_warmup_ratio must be between 0 and 1"),
        (dict(total_steps=None), "total_steps"),
        (dict(lr=-1.0), "lr must be >= 0"),
        (dict(muon_lr=-1.0), "muon_lr must be >= 0"),
        (dict(max_grad_norm=0.0), "max_grad_norm must be > 0"),
        (dict(muon_ns_steps=100), "muon_ns_steps"),
        (dict(weight_decay=-0.1), "weight decay must be >= 0"),
        (dict(muon_weight_decay=-0.1), "muon weight decay must be >= 0"),
        (dict(muon_momentum=-0.5), "momentum must be >= 0"),
    ],
)
def test_invalid_flags(kwargs, match):
    base = dict(optimizer="muon", lr=1e-3, total_steps=100)
    with pytest.raises(ValueError, match=match):
        optim.build_optimizer(None, **{**base, **kwargs})


def test_empty_params_rejected():
    with pytest.raises(ValueError, match="No trainable parameters"):
        optim.build_optimizer({}, total_steps=10)


def test_no_warning_without_both_warmup_flags():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optim.build_optimizer(None, total_steps=10, warmup_steps=3)
        optim.build_optimizer(None, total_steps=10, warmup_ratio=0.3)
