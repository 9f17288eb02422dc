"""dspark_jax.optim without torch: partition, schedules, clipping, Muon/AdamW semantics, flags.

The torch-side comparison (the reference's own optimisers and schedulers) is in
tests/reference/test_optim_parity.py.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

from dspark_jax import optim
from dspark_jax.config import DSparkConfig
from dspark_jax.model.draft import DSparkDraftModel
from dspark_jax.model.params import leaf_key
from dspark_jax.optim import muon
from tests.numerics import U, assert_within


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
    # fp32 vs float64. Warmup s / 10, then lr * that (lr itself rounded to fp32): 3u.
    np.testing.assert_allclose([at(1), at(5), at(10)], [lr / 10, lr / 2, lr], rtol=4 * U)
    # Halfway through the decay (progress 45 / 90 = 0.5 exact). linear: 3u. cosine: the
    # fp32 pi / 2 is 4.4e-8 (0.73u) off, so cos is ~0.73u instead of 0 (+ its <= 1 ulp
    # error), 1 + cos rounds (u), times lr (2u): < 4u.
    np.testing.assert_allclose(at(55), lr / 2, rtol=4 * U)
    # linear: (100 - 100) / 90 = 0 exactly; cosine: cos(fp32 pi) = -1 + 4e-15 rounds to -1,
    # and a cos within 1 ulp of that leaves 1 + cos <= 2^-24: lr * 0.5 * 2^-24 at most.
    np.testing.assert_allclose(at(100), 0.0, rtol=0, atol=lr * U)
    if kind == "cosine":
        # progress 0.25: argument pi / 4 within 0.4u, cos within 1 ulp (2u), 1 + cos (u),
        # lr (2u): 6u -> 8u.
        np.testing.assert_allclose(at(32.5), lr * 0.5 * (1 + math.cos(math.pi * 0.25)), rtol=8 * U)
        # unclamped, like transformers: progress 1.5 -> cos(1.5 pi) = 0 -> half the lr again.
        # The argument 1.5 pi (4.7) is within 2 * 4.7u, |cos'| = 1: cos ~ +-9.4u + 1 ulp,
        # then 1 + cos (u) and lr (2u): 13u -> 16u.
        np.testing.assert_allclose(at(145), lr / 2, rtol=16 * U)
    else:
        np.testing.assert_allclose(at(32.5), lr * 0.75, rtol=4 * U)  # 67.5 / 90 = 0.75: 3u
        assert at(150) == 0.0
    steps = np.arange(120)
    py = [
        lr * optim.lr_lambda(int(s), scheduler_type=kind, warmup_steps=10, total_steps=100)
        for s in steps
    ]
    # Every step: arguments up to 1.21 pi (3.8): cos within 2 * 3.8u + 2u, halved, plus
    # 1 + cos and the lr product: <= 8u of lr absolute -> 16u (warmup / linear: 3u).
    np.testing.assert_allclose(np.asarray(jax.vmap(sched)(steps)), py, rtol=0, atol=lr * 16 * U)


def test_schedule_no_warmup_and_none():
    cos = optim.make_schedule(1.0, scheduler_type="cosine", warmup_steps=0, total_steps=10)
    assert float(cos(0)) == 1.0
    lin = optim.make_schedule(1.0, scheduler_type="linear", warmup_steps=0, total_steps=10)
    np.testing.assert_allclose(float(lin(3)), 0.7, rtol=2 * U)  # 7 / 10 rounded once, * 1.0
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
    # End of warmup: cos(0) = 1 exactly, so fp32(lr) * 1: the lr's own rounding, <= u.
    np.testing.assert_allclose([float(s["muon"](10)), float(s["adamw"](10))], [1e-2, 1e-3], rtol=U)
    _, s = optim.build_optimizer(params, optimizer="muon", lr=4e-3, total_steps=100)
    assert float(s["muon"](50)) == float(s["adamw"](50))  # muon_lr None -> lr: same schedule
    _, s = optim.build_optimizer(params, optimizer="adamw", lr=1e-3, total_steps=100)
    assert set(s) == {"adamw"}
    lrs = optim.current_lrs(s, 1)
    # warmup 100 // 100 = 1; step 1: linear (100 - 1) / 99 = 1 exactly: fp32(1e-3), <= u.
    np.testing.assert_allclose(float(lrs["adamw"]), 1e-3, rtol=U)


def test_flags_helper_reads_the_flag_names_and_cli_defaults():
    # Hand-written expectations; the comparison with the reference's own CLI defaults is
    # tests/reference/test_optim_parity.py::test_defaults_match_reference_cli.
    _, params = params_of(tiny_config())
    _, s = optim.build_optimizer_from_flags(params, {"lr": 2e-3, "scheduler_total_steps": 40}, None)
    # CLI defaults: muon optimizer, linear schedule, warmup 40 // 100 = 0, muon_lr = lr
    assert set(s) == {"muon", "adamw"}
    # (40 - 0) / 40 = 1 and (40 - 30) / 40 = 0.25 are exact: only fp32(2e-3), <= u.
    np.testing.assert_allclose(float(s["muon"](0)), 2e-3, rtol=U)
    np.testing.assert_allclose(float(s["muon"](30)), 2e-3 * 10 / 40, rtol=U)


# ------------------------------------------------------------------------ clipping


def test_clip_matches_torch_formula():
    clip = optim.clip_by_global_norm_torch(1.0)
    g = {"a": jnp.full((4,), 6.0), "b": {"c": jnp.full((2, 2), 8.0)}}  # norms 12, 16 -> 20
    assert float(optim.global_grad_norm(g)) == 20.0
    out, _ = clip.update(g, clip.init(g))
    coef = np.float32(1.0) / (np.float32(20.0) + np.float32(1e-6))
    np.testing.assert_array_equal(np.asarray(out["a"]), np.float32(6.0) * coef)
    # 20 / (20 + 1e-6) = 1 - 5e-8 (0.84u); coef (2u), 8 squares summed (8u) under a
    # sqrt (halved) and the 2-leaf norm (2u): < 8u.
    np.testing.assert_allclose(float(optim.global_grad_norm(out)), 1.0, rtol=8 * U)
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

    lr = 1e-2
    txs = {
        m: optim.build_optimizer(
            params, optimizer="muon", lr=lr, scheduler_type="none", max_grad_norm=m,
            weight_decay=0.0, muon_weight_decay=0.0,
        )[0]
        for m in (1.0, 1e30)
    }  # fmt: skip
    updates = {m: jax.jit(tx.update) for m, tx in txs.items()}

    def run(max_grad_norm, grads):
        update, state = updates[max_grad_norm], txs[max_grad_norm].init(params)
        for g in grads:
            u, state = update(g, state, params)
        return u, state

    hand = [pre_clip(g) for g in gs]
    clipped, by_hand, unclipped = run(1.0, gs), run(1e30, hand), run(1e30, gs)
    # The same optimiser on |pre-clipped gradients|: the absolute evaluation of the
    # momenta (linear in g; Adam's second moment is the same).
    absolute = run(1e30, [jax.tree.map(jnp.abs, g) for g in hand])
    # Both clip coefficients come from fp32 norms of the same leaves in possibly other
    # orders: each within ((n + L) / 2 + 2)u of the exact norm (n = 640, the largest leaf;
    # L = 7 leaves; sum of squares, then sqrt), then 1 / (norm + eps) and g * coef: the
    # clipped gradients differ by d <= (n + L + 10)u relative. A momentum is a positive
    # combination of them (2 lerps: 8u); the second moment is quadratic: 2d + 8u.
    d = (640 + 7 + 10) * U
    states = [jax.tree.leaves(r[1]) for r in (clipped, by_hand, absolute)]
    for a, b, c in zip(*states, strict=True):
        if a.dtype == jnp.int32:
            assert int(a) == int(b)
        else:
            assert_within(a, b, (2 * d + 8 * U) * np.abs(np.asarray(c)), "optimizer state")

    # AdamW updates (fp32): -lr m_hat / (sqrt(v_hat) + eps): the momentum's error as
    # above, plus d + 24u relative from the second moment and ~16 roundings.
    def flat(tree):
        return {leaf_key(p)[0]: np.asarray(x) for p, x in
                jax.tree_util.tree_flatten_with_path(tree)[0]}  # fmt: skip

    ua, ub, uc = (flat(r[0]) for r in (clipped, by_hand, absolute))
    for key in ua.keys() - set(SMALL_MUON):
        assert_within(ua[key], ub[key], (2 * d + 32 * U) * (np.abs(uc[key]) + np.abs(ub[key])), key)
    # Muon updates go through the bf16 Newton-Schulz, which can turn those fp32
    # differences into bf16 ulps; their inputs, the momenta, are checked above.
    far = 0.0
    for a, c in zip(jax.tree.leaves(clipped[0]), jax.tree.leaves(unclipped[0]), strict=True):
        a, c = np.asarray(a), np.asarray(c)
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
    # Gradients on a grid of 1/8 and mu = 3/4: every momentum / Nesterov value is a short
    # dyadic fraction, so both lerps are exact in fp32 and the Newton-Schulz input below
    # is bit for bit the one inside the update.
    g1, g2 = (rng.integers(-16, 17, (16, 48)).astype(np.float32) / 8 for _ in range(2))
    lr, wd, mu = 0.02, 0.1, 0.75
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
    np.testing.assert_array_equal(buf, (1 - mu) * g2 + mu * (1 - mu) * g1)  # exact, see above
    nesterov = (1 - mu) * g2 + mu * buf
    o = np.asarray(
        jax.jit(optim.newton_schulz_torch)(jnp.asarray(nesterov.T)).astype(jnp.float32)
    ).T
    for fn, ratio in (("match_rms_adamw", 0.2 * math.sqrt(48)), ("original", math.sqrt(48 / 16))):
        expected = -lr * ratio * o - lr * wd * k
        # fp32: ratio, wd and lr rounded (3u), ratio * o, wd * k, their sum, * lr (4u):
        # <= 7u of lr (ratio |o| + wd |k|).
        bound = 8 * U * lr * (ratio * np.abs(o) + wd * np.abs(k))
        assert_within(np.asarray(outs[fn]), expected, bound, fn)
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


def _ns_scalar_replay(sig, coefficients, steps=5):
    """Newton-Schulz of a matrix with one nonzero per row and column, value by value.

    Such a matrix stays one (X X^T and its square are diagonal), every matmul sum has a
    single nonzero term, so the fp32 accumulations are exact and only the roundings the
    product documents remain: the fp32 norm of exact squares, then bf16; the fp32 division,
    then bf16; and per step bf16(X X^T), bf16(b G + c G^2) and bf16(a X + G' X), each sum
    formed exactly, rounded to fp32, then to bf16 (``_addmm_bf16``). float64 holds every
    exact value here (<= 40 significant bits).
    """

    def r32(v):
        return np.asarray(v, np.float64).astype(np.float32).astype(np.float64)

    def rb(v):
        return r32(v).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)

    a, b, c = (float(np.float32(v)) for v in coefficients)
    x = rb(sig)
    norm = rb(np.sqrt(np.float32(np.sum(x * x))))  # the squares' sum is exact in fp32
    x = rb(np.float32(x) / np.float32(norm))
    for _ in range(steps):
        g = rb(x * x)
        g = rb(r32(b * g + c * g * g))
        x = rb(r32(a * x + g * x))
    return x


def test_newton_schulz_equals_its_scalar_replay_bit_for_bit():
    """The quintic's coefficients, the normalisation and every bf16 rounding, checked
    without torch: a wrong coefficient in its 3rd decimal changes several entries."""
    rng = np.random.default_rng(5)
    m, n = 16, 24
    # k / 8 with k <= 16: exact in bf16, squares on a 1/64 grid whose sum (< 64) is exact.
    sig = rng.permutation(np.arange(1, 17)) / 8.0 * rng.choice([-1.0, 1.0], m)
    rows, cols = rng.permutation(m), rng.permutation(n)[:m]
    x = np.zeros((m, n), np.float32)
    x[rows, cols] = sig
    ns = jax.jit(optim.newton_schulz_torch)
    want = np.zeros((m, n))
    want[rows, cols] = _ns_scalar_replay(sig, (3.4445, -4.7750, 2.0315))  # torch's quintic
    np.testing.assert_array_equal(np.asarray(ns(jnp.asarray(x)), np.float64), want)
    np.testing.assert_array_equal(np.asarray(ns(jnp.asarray(x.T)), np.float64), want.T)  # tall


def test_equal_shape_leaves_each_get_their_own_orthogonalisation():
    """Leaves of one shape (once stacked and vmapped together) are each exactly NS of
    themselves, whatever the neighbours: the same bf16 program on the same bits."""
    rng = np.random.default_rng(3)
    shapes = [(16, 32), (32, 16), (16, 32), (8, 8), (8, 8)]
    leaves = [jnp.asarray(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    flags = [True, False, False, True, False]
    got = jax.jit(lambda ls: optim.orthogonalize_leaves(ls, flags))(leaves)
    ns = jax.jit(optim.newton_schulz_torch)
    for x, t, b in zip(leaves, flags, got, strict=True):
        single = ns(x.T if t else x).astype(jnp.float32)
        single = single.T if t else single
        np.testing.assert_array_equal(np.asarray(b), np.asarray(single))
    # Equal shapes with other values give other results (no result is shared).
    assert not np.array_equal(np.asarray(got[0]), np.asarray(got[2]))
    assert not np.array_equal(np.asarray(got[3]), np.asarray(got[4]))


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
        # Zero gradients: NS(0) = 0, Adam's 0 / (0 + eps) = 0, so du = -lr * (wd * p) in
        # fp32: lr, wd rounded and two products: <= 4u relative.
        np.testing.assert_allclose(np.asarray(du), -rate * p, rtol=4 * U, atol=0, err_msg=key)


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
    # fp32, every term of one sign per entry so relative errors add: m = w1 g (2u), v (3u),
    # bias corrections via expm1 (3u each), sqrt and the divisions (~6u), + wd p and * lr
    # (4u): <= 17u -> rtol 32u.
    np.testing.assert_allclose(np.asarray(u["norm"]["weight"]), expected, rtol=32 * U)
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
            # The same transform on the same values, through nnx or by hand: bit for bit.
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
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
