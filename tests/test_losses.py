"""dspark_jax.losses: docs/math.md "Golden example", chunked == full-logit oracle, spec parsing."""

import math
from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dspark_jax.losses import (
    PER_POSITION_TERMS,
    cumulative_reach_weights,
    dpace_weights,
    dpard_weights,
    draft_opd_loss,
    dspark_loss,
    fixed_exp_decay_weights,
    parse_loss_fn,
    per_position_values,
)
from tests.numerics import BF16_U, U, assert_within, log_softmax64, overlap_bound
from tests.numerics import logit_chain_bound as _fp32_scales

HIGHEST = jax.lax.Precision.HIGHEST

# Tolerances (issue 13): u = 2^-24 is fp32's unit roundoff (half an ulp of 1). Two fp32
# evaluations of one formula that differ only in accumulation order / arrangement differ
# by at most k * u * S, S the sum of |terms| ("absolute evaluation"), k the roundings on
# the longest path, counted for both sides. Every S below is computed from the inputs.


def naive_per_position_values(
    draft_hidden,
    lm_head,
    target_hidden,
    verifier_head,
    markov_feature=None,
    markov_w2=None,
    *,
    terms,
):
    """Oracle: the same values from full [Q, Vd] logits, written straight from the formulas."""
    z = jnp.dot(draft_hidden, lm_head, precision=HIGHEST, preferred_element_type=jnp.float32)
    if markov_feature is not None:
        z = z + jnp.dot(
            markov_feature, markov_w2, precision=HIGHEST, preferred_element_type=jnp.float32
        )
    t = jax.lax.stop_gradient(
        jnp.dot(target_hidden, verifier_head, precision=HIGHEST, preferred_element_type=jnp.float32)
    )
    q, p = jax.nn.softmax(z, axis=-1), jax.nn.softmax(t, axis=-1)
    logq, logp = jax.nn.log_softmax(z, axis=-1), jax.nn.log_softmax(t, axis=-1)
    labels = jnp.argmax(t, axis=-1)
    overlap = jnp.minimum(q, p).sum(-1)
    kl = (jax.scipy.special.xlogy(p, p) - p * logq).sum(-1)
    log_m = jnp.log(0.5 * (p + q))
    formulas = {
        "ce": lambda: (
            jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, labels[:, None], 1)[:, 0]
        ),
        "tv": lambda: 1.0 - overlap,
        "kl_div": lambda: kl,
        "rkl": lambda: (q * (logq - logp)).sum(-1),
        "jsd": lambda: 0.5 * ((p * (logp - log_m)).sum(-1) + (q * (logq - log_m)).sum(-1)),
        "nla": lambda: -jnp.log(jnp.maximum(overlap, 1e-5)),
        "lk_hybrid": lambda: (
            jnp.exp(-3.0 * jax.lax.stop_gradient(overlap)) * kl
            + (1.0 - jnp.exp(-3.0 * jax.lax.stop_gradient(overlap))) * (1.0 - overlap)
        ),
        "renyi_half": lambda: -2.0 * jnp.log(jnp.sqrt(p * q).sum(-1)),
    }
    out = {name: formulas[name]() for name in terms}
    out["accept"] = jax.lax.stop_gradient(overlap)
    out["pred_ids"] = jnp.argmax(z, axis=-1).astype(jnp.int32)
    out["target_ids"] = labels.astype(jnp.int32)
    return out


# --------------------------------------------- golden example, docs/math.md "Golden example"

GOLDEN_MASK = np.array([1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0, 0], np.int32)


def _golden_inputs():
    ti = np.arange(16, dtype=np.float64)[:, None]
    vi = np.arange(8, dtype=np.float64)[None, :]
    z = (3.0 * np.sin(0.37 * ti + 1.3 * vi)).astype(np.float32)
    t = (3.0 * np.cos(0.23 * ti - 0.7 * vi)).astype(np.float32)
    conf = np.linspace(-2.0, 2.0, 16, dtype=np.float32)
    return jnp.asarray(z), jnp.asarray(t), jnp.asarray(conf)


@pytest.mark.parametrize("chunk_size", [5, 1024])
def test_golden_example_of_spec(chunk_size):
    z, t, conf = _golden_inputs()
    eye = jnp.eye(8, dtype=jnp.float32)  # H = V: the heads pass the logits through
    weights = parse_loss_fn('{"ce":0.1,"tv":0.9}')

    @jax.jit
    def run(z, t, conf, mask):
        values = per_position_values(z, eye, t, eye, terms=tuple(weights), chunk_size=chunk_size)
        return dspark_loss(
            values,
            conf,
            mask,
            block_size=8,
            loss_weights=weights,
            gamma=4.0,
            confidence_head_alpha=1.0,
        )

    loss, m = run(z, t, conf, jnp.asarray(GOLDEN_MASK))
    # The SPEC's numbers are the exact values rounded to 6 decimals (<= 5e-7 off), so
    # tolerance = 5e-7 + the fp32 evaluation bound. The logits are exact (x @ I). With
    # |z|, |t| <= 3 and V = 8, each log-prob entry is within e = 40u: x - max (6u),
    # exp (2u rel), the 8-term sum (7u rel), log (8u), max + log (4u), x - lse (8u).
    # q, p are then within 42u (relative), an overlap / accept value within 49u, tv
    # within 50u, a BCE term (|logit| <= 2) within 110u. A loss term is a masked mean
    # with weights <= 1 (adds 21u |value|: the weights, products, the 16-term sum);
    # accept_rate sums 12 accept values; accept_len sums block 0's prefix products
    # P_k (k <= 7 factors <= 1, |dP_k| <= k (49u + u): 28 * 50u), block 1's are exact 0.
    bound = {"ce": 70, "tv": 56, "main": 60, "conf": 119, "loss": 180, "rate": 640, "len": 1423}
    atol = {k: 5e-7 + n * U for k, n in bound.items()}
    np.testing.assert_allclose(m["ce_loss_sum"], 1.438992, rtol=0, atol=atol["ce"])
    np.testing.assert_allclose(m["tv_loss_sum"], 0.283568, rtol=0, atol=atol["tv"])
    main = loss - m["confidence_loss_sum"]
    np.testing.assert_allclose(main, 0.399110, rtol=0, atol=atol["main"])
    np.testing.assert_allclose(m["confidence_loss_sum"], 0.436568, rtol=0, atol=atol["conf"])
    np.testing.assert_allclose(loss, 0.835678, rtol=0, atol=atol["loss"])
    np.testing.assert_array_equal(m["loss_sum"], loss)  # the same value, stop_gradient-ed
    np.testing.assert_allclose(m["accept_rate_sum"], 4.741989, rtol=0, atol=atol["rate"])
    assert float(m["accept_rate_total"]) == 12.0
    np.testing.assert_allclose(m["accept_len_sum"], 2.809987, rtol=0, atol=atol["len"])
    assert float(m["accept_len_total"]) == 2.0


# ---------------------------------------------------------------- chunked == full logits

Q, H, V, R = 24, 8, 40, 4


def _random_inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    return (
        jax.random.normal(ks[0], (Q, H)),
        jax.random.normal(ks[1], (H, V)) * 0.8,
        jax.random.normal(ks[2], (Q, H)),
        jax.random.normal(ks[3], (H, V)) * 0.8,
        jax.random.normal(ks[4], (Q, R)),
        jax.random.normal(ks[5], (R, V)),
    )


@pytest.fixture(scope="module")
def oracle():
    args = _random_inputs()
    vals = jax.jit(lambda *a: naive_per_position_values(*a, terms=PER_POSITION_TERMS))(*args)
    grads = jax.jit(jax.grad(_weighted_sum(naive_per_position_values), argnums=(0, 1, 4, 5)))(*args)
    return args, vals, grads


def _logit_cotangent(args, fn):
    """d fn / d logits [Q, Vd] (fp32, the oracle's): the logits fed through identity heads."""
    h, w, th, wv, *markov = args
    z = jnp.dot(h, w, precision=HIGHEST)
    if markov:
        z = z + jnp.dot(markov[0], markov[1], precision=HIGHEST)
    t = jnp.dot(th, wv, precision=HIGHEST)
    eye = jnp.eye(z.shape[1], dtype=jnp.float32)
    return np.asarray(jax.jit(jax.grad(lambda z: fn(z, eye, t, eye)))(z), np.float64)


def _grad_bounds(args, g, q, p, k_extra=0.0):
    """Elementwise bounds on |d(param) - d(param)_other| for (h, lm_head[, f, w2]).

    Each parameter gradient is one contraction of an activation with the logit
    cotangent g ([Q, Vd]): d lm_head = h^T g (Q terms), d h = g lm_head^T (Vd terms). An
    entry of g is a softmax-VJP sum of terms <= |g| + q + p (the two softmax Jacobians),
    each accurate as the values are (k_values). So |diff| <= (2 (Q + Vd) + k_values) u
    |x|^T (|g| + q + p), and the same with the weights for the activation gradients;
    ``k_extra`` adds further relative round-off (the bf16 cotangent rounding).
    """
    h, w, *markov = (np.asarray(a, np.float64) for a in (args[0], args[1], *args[4:]))
    Q, V = g.shape
    k, _, _, _ = _fp32_scales(*args[:4], *args[4:])
    G = np.abs(g) + q + p
    r = (2 * (Q + V) + k) * U + k_extra
    out = [r * (G @ np.abs(w).T), r * (np.abs(h).T @ G)]
    if markov:
        f, w2 = markov
        out += [r * (G @ np.abs(w2).T), r * (np.abs(f).T @ G)]
    return out


def _weighted_sum(fn, **kw):
    # A different slot weighting per term, so every term's gradient is exercised.
    def f(*args):
        vals = fn(*args, terms=PER_POSITION_TERMS, **kw)
        total = 0.0
        for i, name in enumerate(PER_POSITION_TERMS):
            total = total + jnp.sum(vals[name] * jnp.cos(jnp.arange(Q) * 0.3 + i))
        return total

    return f


@pytest.mark.parametrize("chunk_size", [1, 5, 24, 1000])
def test_chunked_values_and_grads_match_full_logits(oracle, chunk_size):
    args, want, want_grads = oracle
    got = jax.jit(
        lambda *a: per_position_values(*a, terms=PER_POSITION_TERMS, chunk_size=chunk_size)
    )(*args)
    assert set(got) == set(PER_POSITION_TERMS) | {"accept", "pred_ids", "target_ids"}
    # Same formulas in fp32, other chunking and arrangement: <= k u A per slot, see
    # _fp32_scales (k = 2 (V + K + 8) = 120 here, A ~ 20..60: ~3e-4 absolute).
    k, A, q, p = _fp32_scales(*args)
    for name in (*PER_POSITION_TERMS, "accept"):
        assert got[name].shape == (Q,) and got[name].dtype == jnp.float32, name
        assert_within(got[name], want[name], k * U * A, name)
    for name in ("pred_ids", "target_ids"):
        assert got[name].dtype == jnp.int32
        np.testing.assert_array_equal(got[name], want[name])
    grads = jax.jit(
        jax.grad(_weighted_sum(per_position_values, chunk_size=chunk_size), argnums=(0, 1, 4, 5))
    )(*args)
    cot = _logit_cotangent(args, _weighted_sum(naive_per_position_values))
    bounds = _grad_bounds(args, cot, q, p)  # ~2e-5 of the largest gradient entry
    for g, w, bound, name in zip(
        grads, want_grads, bounds, ("draft_hidden", "lm_head", "markov_feature", "markov_w2")
    ):
        assert_within(g, w, bound, name)


def test_targets_get_no_gradient_and_markov_is_optional(oracle):
    args, _, _ = oracle
    h, w, th, wv, _, _ = args
    g_th, g_wv = jax.jit(
        jax.grad(
            lambda th, wv: per_position_values(h, w, th, wv, terms=("kl_div",), chunk_size=7)[
                "kl_div"
            ].sum(),
            argnums=(0, 1),
        )
    )(th, wv)
    assert not np.any(g_th) and not np.any(g_wv)
    got = jax.jit(lambda *a: per_position_values(*a, terms=("ce",), chunk_size=7))(h, w, th, wv)
    want = jax.jit(lambda *a: naive_per_position_values(*a, terms=("ce",)))(h, w, th, wv)
    k, A, _, _ = _fp32_scales(h, w, th, wv)  # as in the chunked test, no Markov term
    assert_within(got["ce"], want["ce"], k * U * A, "ce")
    assert set(got) == {"ce", "accept", "pred_ids", "target_ids"}


def _softcap_oracle(z, t, cap):
    """float64 per-slot values with targets softmax(cap * tanh(t / cap)) (cap None: t)."""
    z64, t64 = np.asarray(z, np.float64), np.asarray(t, np.float64)
    if cap is not None:
        t64 = cap * np.tanh(t64 / cap)
    logq, logp = log_softmax64(z64), log_softmax64(t64)
    q, p = np.exp(logq), np.exp(logp)
    overlap = np.minimum(q, p).sum(-1)
    want = {
        "kl_div": (p * (logp - logq)).sum(-1),
        "rkl": (q * (logq - logp)).sum(-1),
        "tv": 1.0 - overlap,
        "accept": overlap,
    }
    spread = ((q + p) * (1 + np.abs(logq) + np.abs(logp))).sum(-1)
    return want, t64.argmax(-1), spread


@pytest.mark.parametrize("cap", [None, 2.0])  # speculators' targets; the served ones
def test_target_softcap_matches_a_direct_computation(cap):
    """--verifier-logit-softcapping: the targets are softmax(cap * tanh(t / cap)) of the
    verifier logits t (vLLM's Gemma 2 logits), or softmax(t) (the reference)."""
    g = np.random.default_rng(3)
    z = jnp.asarray(g.normal(0, 3, (12, 16)), jnp.float32)
    t = jnp.asarray(g.normal(0, 6, (12, 16)), jnp.float32)  # |t| >> 2: the cap bites
    eye = jnp.eye(16, dtype=jnp.float32)  # H = V: the heads pass the logits through exactly
    terms = ("kl_div", "rkl", "tv")
    got = jax.jit(
        lambda z, t: per_position_values(
            z, eye, t, eye, terms=terms, chunk_size=5, target_softcap=cap
        )  # fmt: skip
    )(z, t)
    want, target_ids, spread = _softcap_oracle(z, t, cap)
    # fp32 vs float64: logit_chain_bound's k u A (it counts two fp32 sides, so it covers
    # one), with the capped logits as the targets; plus the cap's own round-off: t / cap,
    # tanh (XLA's fp32 tanh is a rational approximation within a few ulps: 8 allowed)
    # and the product move each capped logit by <= d = 10 u cap (|cap tanh| <= cap); a
    # shift <= d of every target logit moves log p by <= 2d and p by <= 2d relative, so a
    # kl / rkl / tv / overlap value by <= 2d (1 + sum_v (q + p)(1 + |log q| + |log p|)).
    t64 = np.asarray(t, np.float64)
    capped = t64 if cap is None else cap * np.tanh(t64 / cap)
    k, a, _, _ = _fp32_scales(z, np.eye(16), capped, np.eye(16))
    d = 0.0 if cap is None else 10 * U * cap
    bound = k * U * a + 2 * d * (1 + spread)
    for name, value in want.items():
        assert_within(got[name], value, bound, f"{name}, cap {cap}")
    np.testing.assert_array_equal(got["target_ids"], target_ids)
    if cap is not None:  # the two forms differ: the cap is live
        other, _, _ = _softcap_oracle(z, t, None)
        assert (np.abs(np.asarray(got["kl_div"]) - other["kl_div"]) > bound).all()


def test_argmax_takes_first_max_on_ties():
    logits = jnp.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 5.0]])
    eye = jnp.eye(4)
    got = per_position_values(logits, eye, logits, eye, terms=("ce",), chunk_size=2)
    np.testing.assert_array_equal(got["target_ids"], [1, 0, 3])
    np.testing.assert_array_equal(got["pred_ids"], [1, 0, 3])


def test_bf16_inputs_accumulate_in_fp32(oracle):
    args, _, _ = oracle
    bf = [a.astype(jnp.bfloat16) for a in args]
    got = jax.jit(lambda *a: per_position_values(*a, terms=("ce", "tv"), chunk_size=5))(*bf)
    want = jax.jit(lambda *a: naive_per_position_values(*a, terms=("ce", "tv")))(
        *[a.astype(jnp.float32) for a in bf]
    )
    assert got["ce"].dtype == jnp.float32
    # bf16 x bf16 products are exact in fp32 and both sides accumulate in fp32: the
    # fp32 bound of the chunked test, on the bf16-rounded inputs.
    bf32 = [a.astype(jnp.float32) for a in bf]
    k, A, q, p = _fp32_scales(*bf32)
    assert_within(got["ce"], want["ce"], k * U * A, "ce")
    assert_within(got["tv"], want["tv"], k * U * A, "tv")

    # Backward matmuls run in bf16 (the cotangent is rounded, as in the bf16 reference);
    # an fp32 master weight gets an fp32 gradient.
    def total(fn, h, w, *rest):
        vals = fn(h, w, *rest, terms=("ce", "tv"))
        return jnp.sum(vals["ce"] + vals["tv"])

    h, w = bf[0], args[1]  # bf16 activations, fp32 master lm_head
    rest = bf[2:]
    g_h, g_w = jax.jit(
        jax.grad(lambda *a: total(partial(per_position_values, chunk_size=5), *a), argnums=(0, 1))
    )(h, w, *rest)
    assert g_h.dtype == jnp.bfloat16 and g_w.dtype == jnp.float32
    # Replay of that backward in float64 from the oracle's fp32 logit cotangent g: the
    # product's g is within e = k u (|g| + q + p) of it (the fp32 bound), so its bf16
    # rounding is round(g) except where [g - e, g + e] straddles a bf16 rounding
    # boundary; there it may differ by d = |round(g + e) - round(g - e)| (one bf16 ulp).
    # d h = bf16(g_bf16 W_bf16^T): fp32 accumulation over Vd (<= Vd u of the
    # abs-evaluation), then <= 2^-8 |d h| for the output rounding. d W = h^T g_bf16 in
    # fp32 (a Q-term sum over the chunks). Elementwise, so a ~0.5% error in either fails.
    args32 = (h.astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32), *bf32[2:])
    cot = _logit_cotangent(args32, lambda *a: total(naive_per_position_values, *a))
    k, _, q, p = _fp32_scales(*args32)
    e = k * U * (np.abs(cot) + q + p)

    def bf16_round(x):
        return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)

    g_b = bf16_round(cot)
    d = np.abs(bf16_round(cot + e) - bf16_round(cot - e))
    h64, w64 = (np.asarray(a, np.float64) for a in args32[:2])
    n_q, n_v = cot.shape
    dh = g_b @ w64.T
    dh_err = (d + n_v * U * (np.abs(g_b) + d)) @ np.abs(w64).T
    assert_within(g_h.astype(jnp.float32), dh, (1 + BF16_U) * dh_err + BF16_U * np.abs(dh), "d h")
    dw = h64.T @ g_b
    dw_err = np.abs(h64).T @ (d + n_q * U * (np.abs(g_b) + d))
    assert_within(g_w, dw, dw_err, "d lm_head")


def _eqns(jaxpr):
    """Every equation of ``jaxpr``, those of nested (Closed)Jaxprs included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if hasattr(sub, "eqns"):  # Jaxpr
                    yield from _eqns(sub)
                elif hasattr(sub, "jaxpr") and hasattr(sub, "consts"):  # ClosedJaxpr
                    yield from _eqns(sub.jaxpr)


def _avals(jaxpr):
    for eqn in _eqns(jaxpr):
        for v in eqn.outvars:
            yield v.aval


def _chunked_loss_args(q, v, seed):
    """(h, lm_head, target h, verifier head, markov feature, markov weights)."""
    ks = jax.random.split(jax.random.key(seed), 6)
    shapes = ((q, 4), (4, v), (q, 4), (4, v), (q, 2), (2, v))
    return tuple(jax.random.normal(k, s) for k, s in zip(ks, shapes, strict=True))


def _chunked_loss(q, terms, loss_weights):
    """The chunked per-position values (chunks of 16) reduced to the DSpark loss."""

    def loss(h, w, th, wv, f, w2):
        vals = per_position_values(h, w, th, wv, f, w2, terms=terms, chunk_size=16)
        return dspark_loss(vals, None, jnp.ones(q), block_size=8, loss_weights=loss_weights)[0]

    return loss


def test_grad_program_never_builds_a_full_vocab_array():
    q, v = 64, 48
    args = _chunked_loss_args(q, v, seed=1)
    loss = _chunked_loss(q, PER_POSITION_TERMS, {"ce": 1.0, "tv": 1.0})

    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 4, 5)))(*args).jaxpr
    sizes = [math.prod(a.shape) for a in _avals(jaxpr) if hasattr(a, "shape")]
    assert max(sizes) == 16 * v  # one chunk of logits; never q * v
    # bf16 activations with a frozen head: the head is neither upcast to fp32 for the
    # backward matmul nor given a (discarded) [H, Vd] gradient.
    bf = [a.astype(jnp.bfloat16) for a in args]
    frozen = jax.jit(
        jax.grad(
            lambda h, w, th, wv, f, w2: loss(h, jax.lax.stop_gradient(w), th, wv, f, w2),
            argnums=(0, 4, 5),
        )
    )
    assert f"tensor<4x{v}xf32>" not in frozen.lower(*bf).as_text()
    # Sanity: the oracle does build one.
    naive = jax.make_jaxpr(
        jax.grad(lambda *a: naive_per_position_values(*a, terms=("ce",))["ce"].sum())
    )(*args).jaxpr
    assert max(math.prod(a.shape) for a in _avals(naive) if hasattr(a, "shape")) == q * v


_ROW_REDUCTIONS = ("reduce_max", "reduce_min", "argmax", "argmin", "reduce_sum")


def _vocab_row_reductions(jaxpr, vocab):
    """Count of each reduction over a last axis of size ``vocab``, nested jaxprs included."""
    counts = dict.fromkeys(_ROW_REDUCTIONS, 0)
    for eqn in _eqns(jaxpr):
        if eqn.primitive.name in counts:
            shape = eqn.invars[0].aval.shape
            if shape and shape[-1] == vocab and (len(shape) - 1) in eqn.params["axes"]:
                counts[eqn.primitive.name] += 1
    return counts


@pytest.mark.parametrize("terms", [(t,) for t in PER_POSITION_TERMS] + [PER_POSITION_TERMS])
def test_backward_recomputes_no_vocab_row_reduction(terms):
    # The chunk is rematerialised in the backward; its per-row statistics (both
    # log-sum-exps, argmax(t), the overlap) are saved, so the backward adds no max /
    # argmax over the vocab and one row sum only: the log-softmax cotangent's. With
    # nothing saved it redid the maxima, argmax(t) and the sums of exponentials.
    q, v = 32, 40
    args = _chunked_loss_args(q, v, seed=2)
    loss = _chunked_loss(q, terms, dict.fromkeys(terms, 1.0))

    fwd = _vocab_row_reductions(jax.make_jaxpr(loss)(*args).jaxpr, v)
    both = _vocab_row_reductions(
        jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 4, 5)))(*args).jaxpr, v
    )
    # labels, predictions; 2 softmaxes (+ renyi_half's log-sum-exp of (log p + log q) / 2)
    assert fwd["argmax"] == 2 and fwd["reduce_max"] == 2 + ("renyi_half" in terms)
    backward = {k: both[k] - fwd[k] for k in _ROW_REDUCTIONS}
    assert backward == {**dict.fromkeys(_ROW_REDUCTIONS, 0), "reduce_sum": 1}, backward


def test_vmap_over_rows_matches_per_row(oracle):
    args, _, _ = oracle
    rows = [args, _random_inputs(seed=3)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *rows)
    mask = jnp.ones((2, Q)).at[1, :8].set(0)
    conf = jnp.linspace(-1, 1, 2 * Q).reshape(2, Q)

    def row_loss(a, c, m):
        vals = per_position_values(*a, terms=("ce", "tv"), chunk_size=5)
        return dspark_loss(vals, c, m, block_size=8, loss_weights={"ce": 0.1, "tv": 0.9})

    batched = jax.jit(jax.vmap(row_loss))(stacked, conf, mask)
    for i, a in enumerate(rows):
        single = jax.jit(row_loss)(a, conf[i], mask[i])
        # Both sides run the same fp32 program, batched or not: per-slot values agree to
        # b = k u A (_fp32_scales). The loss's terms are masked means with weights <= 1 of
        # values and of BCEs (d BCE / d accept = -logit, |logit| <= 1): <= 2 b, plus the
        # means' own (Q + 4)-term round-off. A summed metric adds <= Q slots, each slot
        # value entering <= (B + 1) / 2 of them on average (prefix products of a block):
        # <= Q (B + 1) / 2 b. Row mix-ups or wrong per-row anchors move these by O(1).
        k_, A, _, _ = _fp32_scales(*a)
        b = float((k_ * U * A).max())
        loss_bound = 2 * b + 2 * (Q + 4) * U * abs(float(single[0]))
        assert_within(batched[0][i], single[0], loss_bound, "loss")
        # Counts come from argmax ids: equal when no top-2 logit gap is within twice the
        # logits' round-off (K u max sum|h w| each side, K = H + R), true for these rows.
        h64, w64, th64, wv64, f64, w2_64 = (np.asarray(x, np.float64) for x in a)
        for logits, absval in (
            (h64 @ w64 + f64 @ w2_64, np.abs(h64) @ np.abs(w64) + np.abs(f64) @ np.abs(w2_64)),
            (th64 @ wv64, np.abs(th64) @ np.abs(wv64)),
        ):
            top2 = np.sort(logits, axis=-1)[:, -2:]
            assert (top2[:, 1] - top2[:, 0]).min() > 4 * (H + R) * U * absval.max()
        for name, value in single[1].items():
            if name.endswith("_total") or name.startswith(("position_", "full_acc", "eal")):
                np.testing.assert_array_equal(batched[1][name][i], value, err_msg=name)
            else:
                tol = Q * (8 + 1) / 2 * b + 2 * Q * U * abs(float(value))
                assert_within(batched[1][name][i], value, tol, name)


# ---------------------------------------------------------------- weights and loss assembly


def test_fixed_exp_decay_weights():
    pos = jnp.array([0, 1, 2, 3, 0, 1, 2, 3])
    # pos / 2 is exact; fp32 exp vs float64: <= 1 ulp of the approximation + the final
    # rounding, <= 2 ulp = 4u relative (an ulp is <= 2u |x|).
    np.testing.assert_allclose(
        fixed_exp_decay_weights(pos, 2.0, True),
        np.exp(-np.array([0, 1, 2, 3] * 2) / 2.0),
        rtol=4 * U,
    )
    want = np.exp(-np.array([0, 0, 1, 2] * 2) / 2.0) * np.array([0, 1, 1, 1] * 2)
    np.testing.assert_allclose(fixed_exp_decay_weights(pos, 2.0, False), want, rtol=4 * U)


def test_dpace_weights_by_hand():
    loss = jnp.array([0.5, 1.0, 2.0, 0.0, 0.3, 0.0, 0.7, 0.1])
    mask = jnp.array([1, 1, 0, 1, 1, 0, 1, 1])
    a = 0.5
    w = np.asarray(dpace_weights(loss * mask, mask, 4, a))
    for b in range(2):
        lb, mb = (
            np.asarray(loss[4 * b : 4 * b + 4]) * np.asarray(mask[4 * b : 4 * b + 4]),
            np.asarray(mask[4 * b : 4 * b + 4]),
        )
        s = np.where(mb > 0, (1 - a) * np.exp(-lb) + a, 1.0)
        p = np.cumprod(s)
        want = mb * np.array([(p[k:] * mb[k:]).sum() for k in range(4)])
        # fp32 vs float64, all terms positive, so relative errors add: s_k = (1 - a)
        # exp(-l) + a within 6u (exp 4u, 2 roundings), a prefix product of <= 4 of them
        # 4 * 6u + 3u, a <= 4-term suffix sum + 3u, the 0/1 mask exact: 30u -> rtol 32u.
        np.testing.assert_allclose(w[4 * b : 4 * b + 4], want, rtol=32 * U)
    g = jax.grad(lambda x: dpace_weights(x, mask, 4, a).sum())(loss)
    assert not np.any(g)
    with pytest.raises(ValueError, match="divisible by block_size"):
        dpace_weights(loss, mask, 3, a)


def test_single_term_has_no_per_term_metrics_and_total_is_the_term(oracle):
    args, _, _ = oracle
    vals = jax.jit(lambda *a: per_position_values(*a, terms=("kl_div",), chunk_size=8))(*args)
    mask = jnp.ones(Q)
    loss, m = jax.jit(
        lambda v: dspark_loss(v, None, mask, block_size=8, loss_weights={"kl_div": 1.0})
    )(vals)
    assert not any(k.startswith(("kl_div_loss", "confidence")) for k in m)
    w = fixed_exp_decay_weights(jnp.arange(Q) % 8, 4.0, True)
    # Same positive terms (kl >= 0, w > 0) summed in two orders: (Q - 1) u relative each,
    # plus the products, the division and the weights (exp: 4u): rtol 2 (Q + 6) u.
    np.testing.assert_allclose(loss, jnp.sum(vals["kl_div"] * w) / (Q + 1e-5), rtol=2 * (Q + 6) * U)
    assert {f"position_{k}_acc_sum" for k in range(8)} <= set(m)
    _, m = jax.eval_shape(
        lambda v: dspark_loss(
            v, None, mask, block_size=8, loss_weights={"kl_div": 1.0}, sample_from_anchor=False
        ),
        vals,
    )
    assert "position_0_acc_sum" not in m and "position_7_acc_sum" in m


def test_dspark_loss_rejects_bad_arguments(oracle):
    args, _, _ = oracle
    vals = per_position_values(*args, terms=("ce",), chunk_size=8)
    mask = jnp.ones(Q)
    with pytest.raises(ValueError, match="lacks"):
        dspark_loss(vals, None, mask, block_size=8, loss_weights={"tv": 1.0})
    with pytest.raises(ValueError, match="multiple of block_size"):
        dspark_loss(vals, None, mask, block_size=5, loss_weights={"ce": 1.0})
    with pytest.raises(ValueError, match="per_position_loss_weight"):
        dspark_loss(
            vals, None, mask, block_size=8, loss_weights={"ce": 1.0}, per_position_loss_weight="exp"
        )
    with pytest.raises(ValueError, match="Unknown loss term"):
        per_position_values(*args, terms=("xent",))
    with pytest.raises(ValueError, match="together"):
        per_position_values(*args[:5], terms=("ce",))


# ---------------------------------------------------------------- D-PARD (docs/math.md §7-§8)

DP_B, DP_V = 8, 40
DP_Q = 3 * DP_B
# Holes inside blocks, a block's tail masked, and a block without one valid slot.
DP_MASK = np.array([1, 1, 1, 0, 1, 1, 1, 1] + [1, 1, 1, 1, 1, 0, 0, 0] + [0] * 8, np.int32)


def _dpard_inputs(seed=0):
    rng = np.random.default_rng(seed)
    z = (2.0 * rng.standard_normal((DP_Q, DP_V))).astype(np.float32)
    # Targets near the drafts (acceptances ~0.3-0.8), as in training.
    t = (z + 1.5 * rng.standard_normal((DP_Q, DP_V))).astype(np.float32)
    conf = rng.uniform(-2.0, 2.0, DP_Q).astype(np.float32)
    return z, t, conf


def dpard_oracle(z, t, conf, mask, *, alpha, conf_alpha, start):
    """Float64, straight from the definitions (speculators docs dspark.md, PR #1078):
    D_t = -2 log sum_v sqrt(p q), a_t = sum_v min(p, q), W_t = sum_{k >= t} prod_{i <= k}
    (alpha + (1 - alpha) a_i) over the block's masked-in draft slots, r_t = prod_{i < t}
    a_i, loss = sum W D m / (sum m + 1e-5) + conf_alpha sum BCE(conf, a) r m / (same);
    and the analytic gradients d loss / d z = W m / N (q - tilted), tilted = sqrt(p q) /
    sum sqrt(p q), d loss / d conf = conf_alpha r m / N (sigmoid(conf) - a)."""
    z, t, conf = (np.asarray(x, np.float64) for x in (z, t, conf))
    q, p = np.exp(log_softmax64(z)), np.exp(log_softmax64(t))
    root = np.sqrt(p * q)
    d = -2.0 * np.log(root.sum(-1))
    a = np.minimum(p, q).sum(-1)
    w, r = np.zeros(len(mask)), np.zeros(len(mask))
    for first in range(0, len(mask), DP_B):
        slots = [i for i in range(first + start, first + DP_B) if mask[i]]
        for j in slots:
            w[j] = sum(
                math.prod(alpha + (1 - alpha) * a[i] for i in slots if i <= k)
                for k in slots
                if k >= j
            )
            r[j] = math.prod(a[i] for i in slots if i < j)
    n = mask.sum() + 1e-5
    actor = (w * d * mask).sum() / n
    bce = (1 - a) * conf + np.logaddexp(0.0, -conf)
    conf_loss = (bce * r * mask).sum() / n
    tilted = root / root.sum(-1, keepdims=True)
    return {
        "D": d, "a": a, "W": w, "r": r, "actor": actor, "conf": conf_loss, "bce": bce,
        "loss": actor + conf_alpha * conf_loss, "q": q, "tilted": tilted,
        "grad_z": (w * mask / n)[:, None] * (q - tilted),
        "grad_conf": conf_alpha * r * mask / n * (1 / (1 + np.exp(-conf)) - a),
    }  # fmt: skip


def _dpard_run(z, t, conf, mask, *, alpha, conf_alpha, sample_from_anchor, chunk_size):
    eye = jnp.eye(DP_V, dtype=jnp.float32)  # identity heads: the logits pass through exactly

    def loss(z, conf):
        values = per_position_values(z, eye, t, eye, terms=("renyi_half",), chunk_size=chunk_size)
        total, metrics = dspark_loss(
            values, conf, mask, block_size=DP_B, loss_weights={"renyi_half": 1.0},
            confidence_head_alpha=conf_alpha, per_position_loss_weight="dpard",
            dpard_alpha=alpha, sample_from_anchor=sample_from_anchor,
        )  # fmt: skip
        return total, (values, metrics)

    (total, (values, metrics)), grads = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    )(z, conf)
    return total, values, metrics, grads


def _dpard_bounds(z, t, conf, mask, want, *, alpha, conf_alpha):
    """Round-off bounds of the fp32 computation against the float64 oracle.

    * D_t: k u A_t (tests/numerics.py logit_chain_bound; it bounds two fp32 evaluations,
      so one exact side halves the need). a_t: overlap_bound's da_t (likewise).
    * s_i = alpha + (1 - alpha) a_i: (1 - alpha) da_i + 3u s_i (1 - alpha, the product,
      the sum); P_k = prod_{i <= k} s_i: relative sum_i ds_i / s_i + B u (the cumprod);
      W_t = sum_{k >= t} P_k: sum_k dP_k + B u W_t (the suffix sum). r_t = prod_{i < t} a_i:
      relative sum da_i / a_i + B u.
    * a loss sum(x y m) / N over Q slots: sum (dx y + x dy) m / N + (Q + 4) u sum|x y m| / N
      (products, the Q-term sum, the division, N's + 1e-5). BCE(x, a): |x| da + 8u
      (|x| + softplus(-x)) (the two products, the 1 - a, the softplus, the sum).
    * d loss / d z_v = c_t (q_v S_t - tilted_v), c_t = W_t m_t / N, S_t = sum tilted (= 1):
      each of q, tilted within k u A_t relatively (the values' log-prob chain), c_t within
      dW_t / W_t + 4u: |dg| <= c_t (k u A_t + dW_t / W_t + 4u) (q_v + tilted_v) + V u c_t q_v
      (S_t's V-term sum). d loss / d conf_t = conf_alpha r_t m_t / N (sigmoid - a): dr, da
      and 6u of the sigmoid, the difference and the products.
    First-order bounds; the second-order terms are < 1e-3 of them here (all relative
    errors < 1e-4): x 1.01.
    """
    eye = np.eye(DP_V)
    k, big_a, _, _ = _fp32_scales(z, eye, t, eye)
    d_d = k * U * big_a
    d_a, _ = overlap_bound(z, eye, t, eye)
    a, big_w, r, m = want["a"], want["W"], want["r"], mask.astype(np.float64)
    s = alpha + (1 - alpha) * a
    rel_s = ((1 - alpha) * d_a + 3 * U * s) / s
    d_w, d_r = np.zeros(DP_Q), np.zeros(DP_Q)
    for first in range(0, DP_Q, DP_B):
        blk = range(first, first + DP_B)
        on = [i for i in blk if m[i]]
        for j in on:
            # P_k for each masked-in k >= j, with its relative error.
            for kk in (x for x in on if x >= j):
                prefix = [i for i in on if i <= kk]
                p_k = math.prod(s[i] for i in prefix)
                d_w[j] += p_k * (sum(rel_s[i] for i in prefix) + DP_B * U)
            d_w[j] += DP_B * U * big_w[j]
            d_r[j] = r[j] * (sum(d_a[i] / a[i] for i in on if i < j) + DP_B * U)
    n = m.sum() + 1e-5
    d_actor = ((d_w * want["D"] + big_w * d_d) * m).sum() / n + (DP_Q + 4) * U * np.abs(
        big_w * want["D"] * m
    ).sum() / n
    c = np.asarray(conf, np.float64)
    bce = want["bce"]
    d_bce = np.abs(c) * d_a + 8 * U * (np.abs(c) + np.logaddexp(0.0, -c))
    d_conf = ((d_bce * r + bce * d_r) * m).sum() / n + (DP_Q + 4) * U * (bce * r * m).sum() / n
    d_loss = d_actor + conf_alpha * d_conf + 2 * U * abs(want["loss"])
    rel_c = np.where(big_w > 0, d_w / np.where(big_w > 0, big_w, 1.0), 0.0) + 4 * U
    c_t = (big_w * m / n)[:, None]
    q, tilted = want["q"], want["tilted"]
    d_gz = c_t * ((d_d + rel_c)[:, None] * (q + tilted) + DP_V * U * q)
    sig = 1 / (1 + np.exp(-c))
    d_gc = conf_alpha * m / n * (d_r * np.abs(sig - a) + r * (d_a + 6 * U))
    f = 1.01
    return {
        "D": f * d_d, "a": f * d_a, "W": f * d_w, "r": f * d_r, "actor": f * d_actor,
        "conf": f * d_conf, "loss": f * d_loss, "grad_z": f * d_gz, "grad_conf": f * d_gc,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("alpha", "sample_from_anchor", "chunk_size"),
    [(0.5, True, 5), (0.5, True, DP_Q), (0.3, False, 7)],
)
def test_dpard_terms_loss_and_gradient_match_float64_definitions(
    alpha, sample_from_anchor, chunk_size
):
    z, t, conf = _dpard_inputs()
    start, conf_alpha = (0 if sample_from_anchor else 1), 0.7
    want = dpard_oracle(z, t, conf, DP_MASK, alpha=alpha, conf_alpha=conf_alpha, start=start)
    bound = _dpard_bounds(z, t, conf, DP_MASK, want, alpha=alpha, conf_alpha=conf_alpha)
    total, values, metrics, (g_z, g_conf) = _dpard_run(
        jnp.asarray(z), jnp.asarray(t), jnp.asarray(conf), jnp.asarray(DP_MASK), alpha=alpha,
        conf_alpha=conf_alpha, sample_from_anchor=sample_from_anchor, chunk_size=chunk_size,
    )  # fmt: skip
    assert_within(values["renyi_half"], want["D"], bound["D"], "D_t")
    assert_within(values["accept"], want["a"], bound["a"], "a_t")
    credit = dpard_weights(values["accept"], DP_MASK, DP_B, alpha, start)
    reach = cumulative_reach_weights(values["accept"], DP_MASK, DP_B, start)
    assert_within(credit, want["W"], bound["W"], "W_t")
    assert_within(reach, want["r"], bound["r"], "r_t")
    assert_within(metrics["dpard_loss_sum"], want["actor"], bound["actor"], "actor")
    assert_within(metrics["confidence_loss_sum"], want["conf"], bound["conf"], "confidence")
    assert_within(total, want["loss"], bound["loss"], "loss")
    assert_within(g_z, want["grad_z"], bound["grad_z"], "d loss / d z")
    assert_within(g_conf, want["grad_conf"], bound["grad_conf"], "d loss / d conf")
    # The credit metrics: sums of W over masked slots, per position and in all.
    m = DP_MASK.reshape(-1, DP_B)
    w_blocks = want["W"].reshape(-1, DP_B)
    assert float(metrics["dpard_credit_total"]) == DP_MASK.sum()
    assert_within(metrics["dpard_credit_sum"], want["W"].sum(), bound["W"].sum(), "credit")
    for k in range(DP_B):
        key = f"position_{k}_dpard_credit"
        if k < start:
            assert f"{key}_sum" not in metrics
            continue
        assert float(metrics[f"{key}_total"]) == max(m[:, k].sum(), 1)
        w_bound = bound["W"].reshape(-1, DP_B)[:, k].sum()
        assert_within(metrics[f"{key}_sum"], (w_blocks[:, k] * m[:, k]).sum(), w_bound, key)


def test_dpard_chunked_equals_unchunked():
    z, t, conf = (jnp.asarray(x) for x in _dpard_inputs(seed=1))
    kw = dict(alpha=0.5, conf_alpha=1.0, sample_from_anchor=True)
    one = _dpard_run(z, t, conf, jnp.asarray(DP_MASK), chunk_size=DP_Q, **kw)
    many = _dpard_run(z, t, conf, jnp.asarray(DP_MASK), chunk_size=5, **kw)
    # Each side is within the float64 bound; so they are within twice it.
    want = dpard_oracle(*_dpard_inputs(seed=1), DP_MASK, alpha=0.5, conf_alpha=1.0, start=0)
    bound = _dpard_bounds(*_dpard_inputs(seed=1), DP_MASK, want, alpha=0.5, conf_alpha=1.0)
    assert_within(many[0], one[0], 2 * bound["loss"], "loss")
    assert_within(many[3][0], one[3][0], 2 * bound["grad_z"], "d loss / d z")


def test_dpard_weights_by_hand_and_without_gradient():
    # speculators PR #1078's hand-worked values (tests/unit/models/test_dpard.py):
    # s = [0.9, 0.8, 0.85], prefix [0.9, 0.72, 0.612], suffix [2.232, 1.332, 0.612];
    # with slot 0 the anchor: s = [0.9, 0.8] -> [0, 1.62, 0.72]. fp32 vs exact decimals:
    # the products and sums of <= 3 terms of <= 3 factors, each input rounded: 16u rel.
    np.testing.assert_allclose(
        dpard_weights(jnp.array([0.8, 0.6, 0.7]), jnp.ones(3), 3, 0.5),
        [2.232, 1.332, 0.612],
        rtol=16 * U,
    )
    np.testing.assert_allclose(
        dpard_weights(jnp.array([0.2, 0.8, 0.6]), jnp.ones(3), 3, 0.5, start_pos=1),
        [0.0, 1.62, 0.72],
        rtol=16 * U,
    )
    # A masked slot adds no factor and no credit; blocks are independent.
    acc = jnp.array([0.8, 0.6, 0.7, 0.4, 0.9, 0.2])
    mask = jnp.array([1, 1, 0, 1, 1, 1])
    w = np.asarray(dpard_weights(acc, mask, 3, 0.5))
    np.testing.assert_allclose(w[:3], [0.9 + 0.72, 0.72, 0.0], rtol=16 * U)
    np.testing.assert_array_equal(w[3:], dpard_weights(acc[3:], mask[3:], 3, 0.5))
    np.testing.assert_allclose(
        cumulative_reach_weights(acc, mask, 3), [1.0, 0.8, 0.0, 1.0, 0.4, 0.36], rtol=4 * U
    )
    # Detached: no gradient through the credit or the reach.
    g = jax.grad(lambda x: dpard_weights(x, mask, 3, 0.5).sum())(acc)
    assert not np.any(g)
    g = jax.grad(lambda x: cumulative_reach_weights(x, mask, 3).sum())(acc)
    assert not np.any(g)
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        dpard_weights(acc, mask, 3, 1.0)
    with pytest.raises(ValueError, match="multiple of block_size"):
        dpard_weights(acc, mask, 4, 0.5)


def test_dpard_requires_renyi_half_alone(oracle):
    args, _, _ = oracle
    vals = per_position_values(*args, terms=("renyi_half", "ce"), chunk_size=8)
    for weights in ({"renyi_half": 1.0, "ce": 0.1}, {"renyi_half": 0.5}, {"ce": 1.0}):
        with pytest.raises(ValueError, match="requires loss_weights"):
            dspark_loss(
                vals, None, jnp.ones(Q), block_size=8, loss_weights=weights,
                per_position_loss_weight="dpard",
            )  # fmt: skip
    # Without dpard, renyi_half is an ordinary term (fixed decay), named like the others.
    _, m = dspark_loss(
        vals, None, jnp.ones(Q), block_size=8, loss_weights={"renyi_half": 0.5, "ce": 0.5}
    )
    assert "renyi_half_loss_sum" in m and not any(k.startswith("dpard") for k in m)


# ---------------------------------------------------------------- --loss-fn parsing


def test_parse_loss_fn_accepts_names_and_json():
    assert parse_loss_fn("kl_div") == {"kl_div": 1.0}
    assert parse_loss_fn("lk_hybrid") == {"lk_hybrid": 1.0}
    got = parse_loss_fn('{"tv": 0.9, "ce": 1}')
    assert got == {"tv": 0.9, "ce": 1.0} and list(got) == ["tv", "ce"]
    assert all(isinstance(w, float) for w in got.values())


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("xent", "Unknown loss function 'xent'. Pass a known name"),
        ("{}", "non-empty JSON dict"),
        ('["ce"]', "non-empty JSON dict"),
        ('"ce"', "non-empty JSON dict"),
        ('{"ce": 1, "bogus": 2}', "Unknown loss function 'bogus' in loss config"),
        ('{"ce": "1"}', "Loss weight for 'ce' must be a number, got str"),
        ('{"ce": null}', "must be a number, got NoneType"),
    ],
)
def test_parse_loss_fn_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_loss_fn(spec)


# --------------------------------------------------------------------------------------
# Draft-OPD (speculators docs/draft-opd.md, src/speculators/models/opd_loss.py)

OPD_B, OPD_A = 4, 6


def _opd_inputs(seed, sample_from_anchor):
    """Per-slot values as per_position_values hands them: KL terms, argmaxes that agree on
    most slots (so blocks have accepted prefixes of every length), a mask with holes."""
    rng = np.random.default_rng(seed)
    q = OPD_A * OPD_B
    target = rng.integers(0, 5, q).astype(np.int32)
    pred = np.where(rng.random(q) < 0.7, target, (target + 1) % 5).astype(np.int32)
    mask = (rng.random(q) < 0.85).astype(np.float32)
    if not sample_from_anchor:
        mask[::OPD_B] = 0.0  # slot 0 is the anchor itself
    values = {
        "kl_div": rng.exponential(1.0, q).astype(np.float32),
        "rkl": rng.exponential(1.0, q).astype(np.float32),
        "accept": rng.random(q).astype(np.float32),
        "pred_ids": pred,
        "target_ids": target,
    }
    return values, mask


def _opd_oracle(values, mask, *, start, gamma_opd, la, lr, prefix=True):
    """Float64, from the definitions: accepted = every draft slot up to this one matches
    (slots before ``start`` count as matching), L_acc = sum FKL over accepted masked slots /
    max(count, 1e-5), L_rej = sum gamma^k RKL over rejected masked slots / max(sum gamma^k,
    1e-5), k the slot's index in its block; L = (la L_acc + lr L_rej) / (la + lr)."""
    acc = np.zeros(len(mask))
    for first in range(0, len(mask), OPD_B):
        ok = True
        for k in range(OPD_B):
            i = first + k
            match = k < start or values["pred_ids"][i] == values["target_ids"][i]
            ok = (ok or not prefix) and match
            acc[i] = float(ok)
    m = mask.astype(np.float64)
    fkl, rkl = (values[n].astype(np.float64) for n in ("kl_div", "rkl"))
    decay = gamma_opd ** (np.arange(len(mask)) % OPD_B)
    a, r = acc * m, (1 - acc) * m
    l_acc = (fkl * a).sum() / max(a.sum(), 1e-5)
    l_rej = (rkl * r * decay).sum() / max((r * decay).sum(), 1e-5)
    scale = (fkl * a).sum() / max(a.sum(), 1e-5) + (rkl * r * decay).sum() / max(
        (r * decay).sum(), 1e-5
    )
    return (la * l_acc + lr * l_rej) / (la + lr), l_acc, l_rej, a.sum(), scale


@pytest.mark.parametrize("sample_from_anchor", [True, False])
@pytest.mark.parametrize("gamma_opd,la,lr", [(0.8, 1.0, 1.0), (0.5, 2.0, 0.5)])
def test_draft_opd_loss_matches_the_definition(sample_from_anchor, gamma_opd, la, lr):
    values, mask = _opd_inputs(3, sample_from_anchor)
    start = 0 if sample_from_anchor else 1
    loss, metrics = jax.jit(
        lambda v, m: draft_opd_loss(
            v,
            None,
            m,
            block_size=OPD_B,
            sample_from_anchor=sample_from_anchor,
            gamma_opd=gamma_opd,
            lambda_acc=la,
            lambda_rej=lr,
        )  # fmt: skip
    )({k: jnp.asarray(v) for k, v in values.items()}, jnp.asarray(mask))
    want, l_acc, l_rej, n_acc, scale = _opd_oracle(
        values, mask, start=start, gamma_opd=gamma_opd, la=la, lr=lr
    )
    # fp32 against float64: each of the two ratios is two sums of Q rounded products and
    # one division ((Q + 3) u relative of its sum of |terms|), gamma^k by a power (<= B u
    # relative), the weighted mean 3 u: (Q + B + 6) u times the sum of both ratios.
    bound = (OPD_A * OPD_B + OPD_B + 6) * U * scale
    assert abs(float(loss) - want) <= bound
    assert abs(float(metrics["opd_acc_loss_sum"]) - l_acc) <= bound * (la + lr) / max(la, 1e-9)
    assert abs(float(metrics["opd_rej_loss_sum"]) - l_rej) <= bound * (la + lr) / max(lr, 1e-9)
    assert float(metrics["opd_accepted_sum"]) == n_acc
    assert 0 < n_acc < mask.sum()  # both sides are exercised
    # Planted: a slot accepted on its own match, not its block's prefix of matches, moves
    # the loss beyond the bound. (A decay counted from another origin would not: it
    # scales L_rej's numerator and denominator alike.)
    alone = _opd_oracle(values, mask, start=start, gamma_opd=gamma_opd, la=la, lr=lr, prefix=False)
    assert abs(alone[0] - want) > 2 * bound


def test_draft_opd_loss_with_confidence_and_its_errors():
    values, mask = _opd_inputs(4, True)
    conf = np.random.default_rng(5).standard_normal(len(mask)).astype(np.float32)
    v = {k: jnp.asarray(x) for k, x in values.items()}
    base, _ = draft_opd_loss(v, None, jnp.asarray(mask), block_size=OPD_B, sample_from_anchor=True)
    total, metrics = draft_opd_loss(
        v, jnp.asarray(conf), jnp.asarray(mask), block_size=OPD_B, sample_from_anchor=True,
        confidence_head_alpha=0.5,
    )  # fmt: skip
    # The confidence term is dspark_loss's: BCE(conf, accept) on the fixed decay.
    _, ref = dspark_loss(
        {**v, "ce": v["kl_div"]}, jnp.asarray(conf), jnp.asarray(mask), block_size=OPD_B,
        loss_weights={"ce": 1.0}, sample_from_anchor=True,
    )  # fmt: skip
    conf_loss = float(ref["confidence_loss_sum"])
    assert float(metrics["confidence_loss_sum"]) == conf_loss
    np.testing.assert_allclose(float(total), float(base) + 0.5 * conf_loss, rtol=4 * U)
    for name in ("accept_len_sum", "eal_sum", "full_acc_sum", "confidence_abs_error_sum"):
        assert float(metrics[name]) == float(ref[name]), name
    with pytest.raises(ValueError, match="values lacks \\['rkl'\\]"):
        draft_opd_loss(
            {k: x for k, x in v.items() if k != "rkl"}, None, jnp.asarray(mask),
            block_size=OPD_B, sample_from_anchor=True,
        )  # fmt: skip
    with pytest.raises(ValueError, match="lambda_acc 0.0, lambda_rej 0.0"):
        draft_opd_loss(
            v, None, jnp.asarray(mask), block_size=OPD_B, sample_from_anchor=True,
            lambda_acc=0.0, lambda_rej=0.0,
        )  # fmt: skip
