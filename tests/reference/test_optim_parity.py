"""dspark_jax.optim against speculators 0.9.0's own optimiser construction and step order.

The reference side is built by the reference's code: ``build_optimizers`` (called
through ``Trainer.setup_optimizer``, which also makes the LambdaLR schedulers with
``_resolve_scheduler_steps``) on the reference DSparkDraftModel holding our initial
weights, and stepped like ``Trainer.train_epoch``: set grads, ``clip_grad_norm_(
model.parameters(), 1.0)``, ``_optimizers_step``, read the lrs, ``_schedulers_step``.
Our side: ``build_optimizer`` on the Flax param tree with the same flags, fed the
same (large, so clipping is active) fixed random gradients.

Tolerances are derived from the arithmetic; each bound says how next to it. U = 2^-24
is the fp32 unit roundoff (one rounding moves a value by at most U times its size).

* AdamW and the momentum buffers: both sides evaluate the same fp32 formulas with
  other rounding orders, so each step differs by a few U times the *absolute*
  size of what was summed; the bounds (``_adam_bound``, ``_lerp_bound``) are built
  from the float64 absolute EMAs of the clipped gradients and grow with the step.
* Muon, "exact" variant: Newton-Schulz (NS) replaced on both sides by the same
  float64 NS (our ``newton_schulz_torch`` and torch's ``_zeropower_via_newtonschulz``
  patched), so what is left is fp32 arithmetic: the NS input (Nesterov momentum)
  agrees to a few U, NS is Lipschitz (``NS_LIPSCHITZ``) and the parameter update to a
  few U. Any error in momentum, Nesterov, NS coefficients, lr adjustment ratio, weight
  decay or lr is far above that bound (the bound is also asserted to be < 0.2% of
  the step's update, 1% for AdamW).
* Muon with the real bf16 NS: a bf16 NS is chaotic under rounding flips (see
  ``test_newton_schulz_matches_torch``); two evaluations may decorrelate down to
  their bf16 rounding error against the exact NS, which we measure on the
  reference (``eps_ref``), so the update may differ by ~2.5 * eps_ref per step.
"""

from __future__ import annotations

import contextlib
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("speculators")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.reference

import optax  # noqa: E402
from flax import nnx  # noqa: E402

from dspark_jax import optim  # noqa: E402
from dspark_jax.model.draft import DSparkDraftModel  # noqa: E402
from dspark_jax.model.params import leaf_key, to_speculators  # noqa: E402
from dspark_jax.optim import muon  # noqa: E402
from tests.reference.harness import build_reference_model  # noqa: E402
from tests.reference.test_model_parity import base_config, make_frozen  # noqa: E402

TOTAL = 6  # scheduler horizon = steps run; warmup int(6 * 0.34) = 2
STEPS = 6
GRAD_SCALE = 3.0  # global grad norm ~ 3 * sqrt(#elements) >> 1: clipping always active
U = 2.0**-24  # fp32 unit roundoff

# torch's own NS constants (the reference passes none, so torch's defaults apply).
_TORCH_MUON = pytest.importorskip("torch.optim._muon")
TORCH_NS = (_TORCH_MUON.DEFAULT_A, _TORCH_MUON.DEFAULT_B, _TORCH_MUON.DEFAULT_C)
TORCH_NS_STEPS, TORCH_NS_EPS = _TORCH_MUON.DEFAULT_NS_STEPS, _TORCH_MUON.EPS


def _ns_lipschitz(coef, steps: int) -> float:
    """Frobenius Lipschitz constant of the exact NS map on Frobenius-normalised input.

    NS applies the odd polynomial p(s) = a s + b s^3 + c s^5 to the singular values;
    the derivative of such a matrix function is bounded by the Lipschitz constant of p
    on [0, s_max] (its divided differences f'(s_i), (p(s_i) -+ p(s_j)) / (s_i -+ s_j)
    and p(s)/s all are). Step 1 sees s <= 1 (Frobenius normalisation), later steps
    s <= max p([0, 1]) (= 1.2024 for torch's coefficients, an invariant interval):
    L = max|p'|_[0,1] * (max|p'|_[0,top])^(steps-1) (= 3.4445 * 3.964^4 = 851).
    """
    a, b, c = coef
    s = np.linspace(0.0, 1.0, 200_001)
    top = float((a * s + b * s**3 + c * s**5).max())
    s2 = np.linspace(0.0, top, 200_001)
    assert (a * s2 + b * s2**3 + c * s2**5).max() <= top * (1 + 1e-9)  # invariant
    d1 = np.abs(a + 3 * b * s**2 + 5 * c * s**4).max()
    d2 = np.abs(a + 3 * b * s2**2 + 5 * c * s2**4).max()
    return float(d1 * d2 ** (steps - 1)) * 1.001  # grid margin


NS_LIPSCHITZ = _ns_lipschitz(TORCH_NS, TORCH_NS_STEPS)


def _ns64(g: np.ndarray, coef=TORCH_NS, steps: int = TORCH_NS_STEPS, eps=TORCH_NS_EPS):
    """torch's _zeropower_via_newtonschulz in float64, no bf16 (the exact NS map)."""
    a, b, c = coef
    x = np.asarray(g, np.float64)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / max(np.linalg.norm(x), eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def _setup(seed: int = 0):
    cfg = base_config()
    model = DSparkDraftModel(cfg, rngs=nnx.Rngs(seed), dtype=jnp.float32, remat=False)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    frozen, t2d = make_frozen(np.random.default_rng(seed), cfg)
    ref = build_reference_model(cfg, nnx.state(model, nnx.Param), frozen, t2d)
    return params, ref


def _grad_sequence(ref, steps: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            n: (GRAD_SCALE * rng.standard_normal(tuple(p.shape))).astype(np.float32)
            for n, p in ref.named_parameters()
            if p.requires_grad
        }
        for _ in range(steps)
    ]


def _to_our_grads(params, grads: dict[str, np.ndarray]):
    def leaf(path, x):
        key, transpose = leaf_key((path))
        g = grads[key]
        return jnp.asarray(g.T if transpose else g)

    return jax.tree_util.tree_map_with_path(leaf, params)


@contextlib.contextmanager
def _torch_ns(exact: bool):
    """Record every call of torch's NS inside Muon.step (input, args, output); with
    ``exact`` the NS itself is the float64 ``_ns64`` (result in fp32)."""
    real = _TORCH_MUON._zeropower_via_newtonschulz
    calls: list[dict] = []

    def ns(grad, ns_coefficients, ns_steps, eps):
        if exact:
            x = _ns64(grad.numpy(), ns_coefficients, ns_steps, eps)
            out = torch.from_numpy(x.astype(np.float32))
        else:
            out = real(grad, ns_coefficients, ns_steps, eps)
        calls.append(
            dict(
                u=grad.detach().numpy().copy(),
                args=(tuple(ns_coefficients), ns_steps, eps),
                out=out.float().numpy().copy(),
            )
        )
        return out

    _TORCH_MUON._zeropower_via_newtonschulz = ns
    try:
        yield calls
    finally:
        _TORCH_MUON._zeropower_via_newtonschulz = real


@contextlib.contextmanager
def _our_exact_ns():
    """Replace our NS by the float64 ``_ns64`` (host callback); record its static args
    (at trace time) and its inputs (wide orientation, in call order)."""
    real = muon.newton_schulz_torch  # the name the Muon transform calls
    args: list[tuple] = []
    inputs: list[np.ndarray] = []

    def ns(w, ns_coefficients=optim.MUON_NS_COEFFICIENTS, ns_steps=5, eps=optim.MUON_EPS):
        args.append((tuple(ns_coefficients), ns_steps, eps))

        def host(x):
            x = np.asarray(x)
            inputs.append(x.copy())
            return _ns64(x, ns_coefficients, ns_steps, eps).astype(np.float32)

        return jax.pure_callback(host, jax.ShapeDtypeStruct(w.shape, jnp.float32), w)

    muon.newton_schulz_torch = ns
    try:
        yield args, inputs
    finally:
        muon.newton_schulz_torch = real


def _run_reference(ref, flags: dict, grads_seq):
    from speculators.train.trainer import Trainer, TrainerConfig

    config = TrainerConfig(lr=flags["lr"], num_epochs=1, save_path="unused", **flags["extra"])
    fake = types.SimpleNamespace(
        model=ref,
        config=config,
        resume_from_checkpoint=False,
        checkpointer=types.SimpleNamespace(previous_epoch=-1),
        train_loader=range(TOTAL),  # len() = steps per epoch -> total = epochs * len
    )
    Trainer.setup_optimizer(fake)  # build_optimizers + LambdaLR schedulers, as the trainer does
    snapshots, lrs, norms = [], [], []
    for grads in grads_seq:
        Trainer._optimizers_zero_grad(fake)
        for n, p in ref.named_parameters():
            if p.requires_grad:
                p.grad = torch.from_numpy(grads[n].copy())
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)))
        Trainer._optimizers_step(fake)
        lrs.append({type(opt).__name__: opt.param_groups[0]["lr"] for opt in fake.optimizers})
        Trainer._schedulers_step(fake)
        snapshots.append(
            {n: p.detach().numpy().copy() for n, p in ref.named_parameters() if p.requires_grad}
        )
    return fake.optimizers, snapshots, lrs, norms


def _run_ours(params, flags: dict, grads_seq):
    tx, schedules = optim.build_optimizer(params, total_steps=TOTAL, **flags["ours"])
    state = tx.init(params)

    @jax.jit
    def step(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    snapshots, lrs, norms = [], [], []
    for i, grads in enumerate(grads_seq):
        g = _to_our_grads(params, grads)
        norms.append(float(jax.jit(optim.global_grad_norm)(g)))
        lrs.append({k: float(s(i)) for k, s in schedules.items()})
        params, state = step(params, state, g)
        snapshots.append(to_speculators(params))
    return state, snapshots, lrs, norms


CASES = {
    # name: flags (reference TrainerConfig fields / our build_optimizer kwargs)
    "muon-cosine-warmup": dict(
        lr=2e-2,
        extra=dict(
            optimizer="muon",
            muon_lr=5e-2,
            scheduler_type="cosine",
            scheduler_warmup_ratio=0.34,
        ),
        ours=dict(
            optimizer="muon", lr=2e-2, muon_lr=5e-2, scheduler_type="cosine", warmup_ratio=0.34
        ),
    ),
    "muon-original-linear-warmupsteps": dict(
        lr=1e-2,
        extra=dict(
            optimizer="muon",
            muon_lr=3e-2,
            muon_adjust_lr_fn="original",
            muon_weight_decay=0.5,
            scheduler_type="linear",
            scheduler_warmup_steps=1,
        ),
        ours=dict(
            optimizer="muon",
            lr=1e-2,
            muon_lr=3e-2,
            muon_adjust_lr_fn="original",
            muon_weight_decay=0.5,
            scheduler_type="linear",
            warmup_steps=1,
        ),
    ),
    "adamw-cosine-warmup": dict(
        lr=2e-2,
        extra=dict(optimizer="adamw", scheduler_type="cosine", scheduler_warmup_ratio=0.34),
        ours=dict(optimizer="adamw", lr=2e-2, scheduler_type="cosine", warmup_ratio=0.34),
    ),
    "adamw-constant": dict(
        lr=1e-2,
        extra=dict(optimizer="adamw", scheduler_type="none", weight_decay=0.3),
        ours=dict(optimizer="adamw", lr=1e-2, scheduler_type="none", weight_decay=0.3),
    ),
}
MUON_CASES = [c for c in CASES if CASES[c]["ours"]["optimizer"] == "muon"]


@pytest.fixture(scope="module")
def setup():
    params, ref = _setup()
    init = {n: p.detach().numpy().copy() for n, p in ref.named_parameters()}
    return params, ref, init


def _fresh_reference(ref, init):
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(torch.from_numpy(init[n]))
            p.grad = None
    return ref


def _norm_rtol(grads: dict[str, np.ndarray]) -> float:
    """Pre-clip norm, per side: each tensor's sum of k positive squares (squares and
    additions rounded: <= k U relative in any order), its sqrt (halves that, + U), the
    same over the T squared tensor norms, the final sqrt: <= (k/2 + T/2 + 2) U; twice
    that between the two sides (k = the largest tensor)."""
    k = max(g.size for g in grads.values())
    return (k + len(grads) + 4) * U


def _clipped(grads_seq, ref_norms, our_norms):
    """float64 clipped gradients (with the reference's coefficient) and, per step, the
    relative difference of our clip coefficient 1/(norm + 1e-6): the measured norm
    difference + the add and divide (1 rounding each per side) + the product g * coef
    (1 per side)."""
    gs, delta = [], []
    for grads, n, o in zip(grads_seq, ref_norms, our_norms, strict=True):
        coef = min(1.0, 1.0 / (n + 1e-6))
        gs.append({k: g.astype(np.float64) * coef for k, g in grads.items()})
        delta.append(abs(o - n) / n + 6 * U)
    return gs, delta


def _lerp_bound(gs, key, momentum, step, delta_c):
    """|ours - ref| bound for torch Muon's buffer and Nesterov input after ``step``
    (0-based) steps. Each lerp ``start + w (end - start)`` (or its w >= 0.5 form) is 3
    fp32 roundings per side, together <= 5 U times the absolute EMA ``abs_t = mu
    abs_{t-1} + (1 - mu) |g_t|`` per side; earlier errors pass through later lerps
    with weights summing to 1, so they add: buffer <= (10 (step+1) U + dc) abs_buf,
    Nesterov u = lerp(g, buf, mu) one lerp more, on abs_u = (1-mu)|g| + mu abs_buf."""
    abs_buf = np.zeros_like(gs[0][key])
    for t in range(step + 1):
        abs_buf = momentum * abs_buf + (1 - momentum) * np.abs(gs[t][key])
    abs_u = (1 - momentum) * np.abs(gs[step][key]) + momentum * abs_buf
    dc = max(delta_c[: step + 1])
    return (10 * (step + 1) * U + dc) * abs_buf, (10 * (step + 2) * U + dc) * abs_u


def _adam_bounds(gs, keys, lrs, wd, ref_snaps, init, our_lrs, delta_c):
    """Per-element |ours - ref| bound of AdamW parameters after each step.

    Direction d = m_hat / (sqrt(v_hat) + eps): m = lerp(m, g, 0.1) carries <= 5 U of
    the absolute EMA m_abs per side and step (as in ``_lerp_bound``), v a positive
    EMA <= 5 U relative per side and step (so sqrt(v) 2.5 U), and the constant part
    (our fp32 -expm1 bias corrections ~2 U each, torch's float64 ones cast to fp32,
    sqrt, /bc2, +eps, m/bc1, the division, x lr, the decay multiply and the add) is
    <= 24 U; the clip coefficient adds dc to m and 2 dc to v. So step t (1-based) adds
    (((15 t + 24) U + 2 dc) lr + |dlr|) a, a = m_abs_hat / (sqrt(v_hat) + eps), plus
    4 U |p| (decay and add roundings, both sides) and |dlr| wd |p|; earlier parameter
    errors are carried by the factor (1 - lr wd)."""
    b1, b2 = optim.ADAMW_BETAS
    eps = optim.ADAMW_EPS
    m_abs = {k: 0.0 for k in keys}
    v = {k: 0.0 for k in keys}
    bound = {k: 0.0 for k in keys}
    out = []
    for t, (g, lr, olr) in enumerate(zip(gs, lrs, our_lrs, strict=True)):
        prev = init if t == 0 else ref_snaps[t - 1]
        dlr = abs(olr - lr)
        dc = max(delta_c[: t + 1])
        step = {}
        for k in keys:
            m_abs[k] = b1 * m_abs[k] + (1 - b1) * np.abs(g[k])
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            a = (m_abs[k] / (1 - b1 ** (t + 1))) / (np.sqrt(v[k] / (1 - b2 ** (t + 1))) + eps)
            bound[k] = (
                abs(1 - lr * wd) * bound[k]
                + (((15 * (t + 1) + 24) * U + 2 * dc) * lr + dlr) * a
                + (4 * U + dlr * wd) * np.abs(prev[k])
            )
            step[k] = bound[k].copy()
        out.append(step)
    return out


def _muon_rounding(p_prev, o, adj, lr, wd, ratio, dlr):
    """Frobenius norm of the per-step fp32 difference of ``p (1 - lr wd) - adj O``:
    torch rounds (1 - lr wd), the product, -adj and the fused add (<= 2U|p| + 3U adj|O|);
    we round ratio*O, + wd p, x lr and the add (<= 2U|p| + 4U adj|O|); plus the lr
    difference |dlr| (ratio |O| + wd |p|)."""
    e = (4 * U + dlr * wd) * np.abs(p_prev) + (8 * U * adj + dlr * ratio) * np.abs(o)
    return float(np.linalg.norm(e))


def _reference_ratio(shape, flags) -> float:
    """torch.optim._muon._adjust_lr's ratio (the reference's, not ours)."""
    return _TORCH_MUON._adjust_lr(
        1.0, flags["ours"].get("muon_adjust_lr_fn", "match_rms_adamw"), shape
    )


def _muon_keys_in_call_order(params):
    """Speculators keys of the Muon leaves, in the order our update visits them."""
    labels = jax.tree_util.tree_flatten_with_path(optim.param_labels(params))[0]
    return [leaf_key(path)[0] for path, lab in labels if lab == "muon"]


def test_partition_matches_reference(setup):
    from speculators.train.optimizers import split_named_params_for_muon

    params, ref, _ = setup
    muon_ref, adamw_ref = split_named_params_for_muon(ref)
    assert optim.muon_param_keys(params) == sorted(n for n, _ in muon_ref)
    labels = {
        leaf_key((p))[0]: lab
        for p, lab in jax.tree_util.tree_flatten_with_path(optim.param_labels(params))[0]
    }
    assert sorted(k for k, v in labels.items() if v == "adamw") == sorted(n for n, _ in adamw_ref)


def _check_common(case, grads_seq, ref_lrs, our_lrs, ref_norms, our_norms):
    flags = CASES[case]
    # clipping active and the same pre-clip norm (accumulation-order bound, _norm_rtol)
    assert min(ref_norms) > 10.0
    np.testing.assert_allclose(our_norms, ref_norms, rtol=_norm_rtol(grads_seq[0]))

    # lr of every update: reference (float64 lambda) vs our fp32 schedule. lambda is
    # formed from O(1) fp32 intermediates (s / w, progress, 0.5 (1 + cos)): a few U of
    # 1 each, the cosine a few more; 16 U of the base lr covers them.
    name = {"Muon": "muon", "AdamW": "adamw"}
    base = {"muon": flags["ours"].get("muon_lr", flags["lr"]), "adamw": flags["lr"]}
    for ref_lr, our_lr in zip(ref_lrs, our_lrs, strict=True):
        assert {name[k] for k in ref_lr} == set(our_lr)
        for k, v in ref_lr.items():
            np.testing.assert_allclose(our_lr[name[k]], v, rtol=0, atol=16 * U * base[name[k]])
    if flags["ours"].get("scheduler_type") != "none":
        assert all(
            v == 0.0 for v in ref_lrs[0].values()
        )  # warmup: the first update uses lambda(0) = 0


def _check_adamw(case, params, gs, ref_snaps, our_snaps, ref_lrs, our_lrs, init, delta_c):
    flags = CASES[case]
    muon = flags["ours"]["optimizer"] == "muon"
    muon_keys = set(optim.muon_param_keys(params)) if muon else set()
    keys = [k for k in ref_snaps[0] if k not in muon_keys]
    wd = flags["ours"].get("weight_decay", optim.CLI_DEFAULTS["weight_decay"])
    lrs = [r["AdamW"] for r in ref_lrs]
    bounds = _adam_bounds(
        gs, keys, lrs, wd, ref_snaps, init, [o["adamw"] for o in our_lrs], delta_c
    )
    for step, (r, o, b) in enumerate(zip(ref_snaps, our_snaps, bounds, strict=True)):
        for k in keys:
            err = np.abs(o[k].astype(np.float64) - r[k])
            assert np.all(err <= b[k]), (
                f"{case} step {step} {k}: max |ours - ref| {err.max():.3g}, "
                f"worst err/bound {(err / b[k]).max():.3g}"
            )
            moved = np.abs(r[k] - (init if step == 0 else ref_snaps[step - 1])[k])
            if lrs[step] > 0:  # the check can fail: an error of 1% of a step's update does
                assert np.linalg.norm(b[k]) <= 1e-2 * np.linalg.norm(moved), (case, step, k)
    return keys


@pytest.mark.parametrize("case", list(CASES))
def test_steps_match_reference(setup, case):
    """All parameters against the reference, real bf16 Newton-Schulz on both sides."""
    flags = CASES[case]
    params, ref, init = setup
    ref = _fresh_reference(ref, init)
    grads_seq = _grad_sequence(ref, STEPS)
    with _torch_ns(exact=False) as ref_calls:
        ref_opts, ref_snaps, ref_lrs, ref_norms = _run_reference(ref, flags, grads_seq)
    state, our_snaps, our_lrs, our_norms = _run_ours(params, flags, grads_seq)
    _check_common(case, grads_seq, ref_lrs, our_lrs, ref_norms, our_norms)
    gs, delta_c = _clipped(grads_seq, ref_norms, our_norms)
    _check_adamw(case, params, gs, ref_snaps, our_snaps, ref_lrs, our_lrs, init, delta_c)

    moved = max(np.abs(our_snaps[-1][k] - init[k]).max() for k in init if k in our_snaps[-1])
    assert moved > 1e-3
    if case not in MUON_CASES:
        assert not ref_calls
        return

    # Muon parameters, per step, Frobenius norm per matrix:
    # |p_ours - p_ref| <= |1 - lr wd| * previous + adj * |O_ours - O_ref| + fp32 terms.
    # |O_ours - O_ref| <= |O_ours - NS64(u_ours)| + |NS64(u_ours) - NS64(u_ref)|
    #                     + |NS64(u_ref) - O_ref|
    #                  <= 1.5 eps_ref + L * 2 |du| / |u| + eps_ref,
    # eps_ref = the reference's own bf16 error against the exact NS (measured per call),
    # ours is allowed 1.5x of it (same bf16 roundings of the same quantities; a bug
    # that stays below that is caught by the exact-NS test below), L = NS_LIPSCHITZ,
    # 2 |du| / |u| bounds the change of the normalised input (|du| from _lerp_bound).
    muon_keys = _muon_keys_in_call_order(params)
    ref_order = _reference_muon_order(ref, ref_opts)
    mu = optim.CLI_DEFAULTS["muon_momentum"]
    wd = flags["ours"].get("muon_weight_decay", optim.CLI_DEFAULTS["muon_weight_decay"])
    assert len(ref_calls) == STEPS * len(muon_keys)
    bound = {k: 0.0 for k in muon_keys}
    for step in range(STEPS):
        lr, dlr = ref_lrs[step]["Muon"], abs(our_lrs[step]["muon"] - ref_lrs[step]["Muon"])
        prev = init if step == 0 else ref_snaps[step - 1]
        for i, k in enumerate(ref_order):
            call = ref_calls[step * len(ref_order) + i]
            ratio = _reference_ratio(prev[k].shape, flags)
            eps_ref = float(np.linalg.norm(call["out"] - _ns64(call["u"], *call["args"])))
            _, du = _lerp_bound(gs, k, mu, step, delta_c)
            rel_du = 2 * float(np.linalg.norm(du) / np.linalg.norm(call["u"]))
            bound[k] = (
                abs(1 - lr * wd) * bound[k]
                + lr * ratio * (2.5 * eps_ref + NS_LIPSCHITZ * rel_du)
                + _muon_rounding(prev[k], call["out"], lr * ratio, lr, wd, ratio, dlr)
            )
            err = float(np.linalg.norm(our_snaps[step][k].astype(np.float64) - ref_snaps[step][k]))
            assert err <= bound[k], (
                f"{case} step {step} {k}: |ours - ref|_F {err:.3g} > {bound[k]:.3g}"
            )

    # momentum buffers after the last step: torch state vs ours (_lerp_bound)
    muon_opt = ref_opts[0]
    assert type(muon_opt).__name__ == "Muon"
    by_id = {id(p): n for n, p in ref.named_parameters()}
    ref_buf = {by_id[id(p)]: s["momentum_buffer"].numpy() for p, s in muon_opt.state.items()}
    ours_buf = _our_buffers(state)
    assert set(ours_buf) == set(ref_buf) == set(muon_keys)
    for k in muon_keys:
        b, _ = _lerp_bound(gs, k, mu, STEPS - 1, delta_c)
        err = np.abs(ours_buf[k].astype(np.float64) - ref_buf[k])
        assert np.all(err <= b), (k, float((err / b).max()))


def _our_buffers(state) -> dict[str, np.ndarray]:
    our_state = [
        x
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optim.TorchMuonState))
        if isinstance(x, optim.TorchMuonState)
    ]
    assert len(our_state) == 1
    out = {}
    for path, b in jax.tree_util.tree_flatten_with_path(our_state[0].momentum_buffer)[0]:
        key, transpose = leaf_key((path))
        out[key] = np.asarray(b.T if transpose else b)
    return out


def _reference_muon_order(ref, ref_opts) -> list[str]:
    by_id = {id(p): n for n, p in ref.named_parameters()}
    muon_opt = [o for o in ref_opts if type(o).__name__ == "Muon"]
    assert len(muon_opt) == 1
    return [by_id[id(p)] for p in muon_opt[0].param_groups[0]["params"]]


@pytest.mark.parametrize("case", MUON_CASES)
def test_muon_steps_match_reference_with_exact_newton_schulz(setup, case):
    """The Muon update itself: NS replaced by the same float64 NS on both sides, so only
    fp32 arithmetic differs and the bound is tight (< 0.2% of each step's update)."""
    flags = CASES[case]
    params, ref, init = setup
    ref = _fresh_reference(ref, init)
    grads_seq = _grad_sequence(ref, STEPS)
    with _torch_ns(exact=True) as ref_calls:
        ref_opts, ref_snaps, ref_lrs, ref_norms = _run_reference(ref, flags, grads_seq)
    with _our_exact_ns() as (our_args, our_inputs):
        _, our_snaps, our_lrs, our_norms = _run_ours(params, flags, grads_seq)
    _check_common(case, grads_seq, ref_lrs, our_lrs, ref_norms, our_norms)
    gs, delta_c = _clipped(grads_seq, ref_norms, our_norms)

    muon_keys = _muon_keys_in_call_order(params)
    ref_order = _reference_muon_order(ref, ref_opts)
    assert sorted(ref_order) == sorted(muon_keys)
    # NS coefficients, steps and eps: what each side hands to NS, exactly.
    assert len(our_args) == len(muon_keys)  # traced once
    assert (
        {c["args"] for c in ref_calls}
        == set(our_args)
        == {(TORCH_NS, optim.CLI_DEFAULTS["muon_ns_steps"], TORCH_NS_EPS)}
    )
    assert len(ref_calls) == len(our_inputs) == STEPS * len(muon_keys)

    mu = optim.CLI_DEFAULTS["muon_momentum"]
    wd = flags["ours"].get("muon_weight_decay", optim.CLI_DEFAULTS["muon_weight_decay"])
    bound = {k: 0.0 for k in muon_keys}
    for step in range(STEPS):
        lr, dlr = ref_lrs[step]["Muon"], abs(our_lrs[step]["muon"] - ref_lrs[step]["Muon"])
        prev = init if step == 0 else ref_snaps[step - 1]
        ref_u = {k: ref_calls[step * len(ref_order) + i] for i, k in enumerate(ref_order)}
        for i, k in enumerate(muon_keys):
            call = ref_u[k]
            u = our_inputs[step * len(muon_keys) + i]  # wide orientation of torch layout
            u = u.T if call["u"].shape[0] > call["u"].shape[1] else u
            # the NS input: momentum + Nesterov on the clipped gradient (_lerp_bound)
            _, u_bound = _lerp_bound(gs, k, mu, step, delta_c)
            du = np.abs(u.astype(np.float64) - call["u"])
            assert np.all(du <= u_bound), (
                f"{case} step {step} {k}: NS input, worst |du|/bound {(du / u_bound).max():.3g}"
            )
            # parameters (Frobenius): |1 - lr wd| * previous + adj * (L * 2|du|/|u| + the
            # fp32 rounding of both NS outputs, 2 U |O|) + the update's fp32 roundings
            ratio = _reference_ratio(prev[k].shape, flags)
            o = call["out"]
            rel_du = 2 * float(np.linalg.norm(du) / np.linalg.norm(call["u"]))
            bound[k] = (
                abs(1 - lr * wd) * bound[k]
                + lr * ratio * (NS_LIPSCHITZ * rel_du + 2 * U * float(np.linalg.norm(o)))
                + _muon_rounding(prev[k], o, lr * ratio, lr, wd, ratio, dlr)
            )
            err = float(np.linalg.norm(our_snaps[step][k].astype(np.float64) - ref_snaps[step][k]))
            assert err <= bound[k], (
                f"{case} step {step} {k}: |ours - ref|_F {err:.3g} > {bound[k]:.3g}"
            )
            if lr > 0:  # the check can fail: an error of 0.2% of a step's update does
                update = float(np.linalg.norm(ref_snaps[step][k] - prev[k]))
                assert bound[k] <= 2e-3 * update, (case, step, k, bound[k], update)


# ------------------------------------------------------------------- Newton-Schulz


def _near_bf16_midpoint(v: float, rel: float) -> bool:
    """Is |v| within ``rel`` (relative) of a bf16 rounding midpoint (8 significant bits)?"""
    m, _ = math.frexp(abs(v))  # 0.5 <= m < 1
    t = m * 256.0
    return abs(t - math.floor(t) - 0.5) < rel * t


def _bf16(v: float) -> float:
    """Round-to-nearest-even to bf16 (normal range)."""
    m, e = math.frexp(v)
    return math.ldexp(round(m * 256.0) / 256.0, e)  # round(): half to even


def _monomial(shape, rng) -> np.ndarray:
    """One nonzero per row and column (at most), integer entries |d| <= 255 times 2^-12.

    In every NS matmul each output is a sum with at most one nonzero term, and a
    product of two bf16 numbers is exact in fp32, so the accumulation order cannot
    change anything; sum(d^2) < 2^23 is an exact fp32 integer sum in any order. ``d``
    is redrawn until sqrt(sum d^2) and each d / bf16(norm) lie more than 2^-20
    (relative) away from a bf16 rounding midpoint, so an fp32 sqrt or division (or a
    reciprocal-multiply, within a few U) rounds to the same bf16 as the exact value.
    """
    m, n = shape
    r = min(m, n)
    while True:
        d = rng.integers(1, 256, r) * rng.choice([-1, 1], r)
        norm = math.sqrt(int(np.sum(d.astype(np.int64) ** 2)))
        if _near_bf16_midpoint(norm, 2.0**-20):
            continue
        nb = _bf16(norm)
        if not any(_near_bf16_midpoint(abs(int(x)) / nb, 2.0**-20) for x in d):
            break
    g = np.zeros(shape, np.float32)
    g[rng.permutation(m)[:r], rng.permutation(n)[:r]] = d * 2.0**-12
    return g


_OUR_NS = jax.jit(optim.newton_schulz_torch)  # the product's defaults


def _torch_ns_ref(g: np.ndarray) -> np.ndarray:
    """torch's bf16 NS with torch's own coefficients (not ours), as fp32."""
    out = _TORCH_MUON._zeropower_via_newtonschulz(
        torch.from_numpy(g), TORCH_NS, TORCH_NS_STEPS, TORCH_NS_EPS
    )
    return out.float().numpy()


def _our_ns(g: np.ndarray) -> np.ndarray:
    return np.asarray(_OUR_NS(jnp.asarray(g)).astype(jnp.float32))


CHAINS = 256  # monomial entries compared per shape


def _check_newton_schulz(shape, seed: int) -> dict:
    """Both NS checks for one shape and seed; returns the statistics (for seed sweeps)."""
    rng = np.random.default_rng([seed, *shape])

    # 1. Exact inputs (``_monomial``): every nonzero entry evolves on its own through 5
    # steps of scalar bf16 arithmetic (x^2, b g + c g^2, a x + u x): every sum has one
    # term, so only the roundings remain. We form the addmm epilogue beta*C + alpha*acc
    # exactly before its bf16 rounding (_addmm_bf16); oneDNN fuses it; torch's generic
    # CPU gemm (no AVX-512) uses up to 3 fp32 roundings: error e <= U (|beta C| +
    # |alpha acc| + |out|) <= U (kappa + 1) |out|, and the bf16 rounding flips only if a
    # midpoint lies within
    # e, probability <= 2 e / ulp(out) < 2^-15 (kappa + 1) (ulp(out) > 2^-8 |out|).
    # kappa = (|beta C| + |alpha acc|) / |out| <= 9.8 on NS's range (a x + u x with
    # a + u >= 0.639; 4.2 for b g + c g^2), 10 such roundings per entry: <= 3.3e-3 of
    # the entries may differ, 0.85 expected of 256. Entries do not interact, so a flip
    # stays in its entry (later steps may grow it to several ulps). Allowed: 256/32 = 8
    # (a Poisson(0.85) tail < 1e-6); a coefficient wrong in the 3rd decimal changes
    # >= 10% of the entries.
    samples = math.ceil(CHAINS / min(shape))
    differ = 0
    for _ in range(samples):
        g = _monomial(shape, rng)
        ours, ref = _our_ns(g), _torch_ns_ref(g)
        assert np.count_nonzero(ref) == min(shape)  # still one entry per row/column
        differ += int(np.sum(ours != ref))
    n = samples * min(shape)
    assert differ <= n // 32, f"{shape} seed {seed}: {differ} of {n} entries differ (cap {n // 32})"

    # 2. Gaussian input (sums of up to 256 terms). A flipped rounding (the fp32
    # accumulation order is the BLAS's business: XLA vs oneDNN vs the generic gemm)
    # moves the iterate by one bf16 ulp; later roundings turn sub-ulp differences into
    # ulp-sized ones with probability ~ their size and NS amplifies up to
    # NS_LIPSCHITZ = 851, so the two runs may decorrelate to rounding-noise level
    # (measured at 256 x 128: up to 70% of the entries differ, 38% by > 1 ulp, 0.8%
    # in norm) - no flip count or ulp bound separates that from a small bug here;
    # part 1 does. What holds: each run's error against the exact NS (float64,
    # torch's coefficients) is the bf16 rounding error of the same operations, eps;
    # ours may carry 1.5 eps, so |ours - ref|_F <= 2.5 eps (catches a missing
    # normalisation, a transposed or wrongly oriented result, a wrong step count).
    g = (rng.standard_normal(shape) * 0.01).astype(np.float32)
    ours, ref = _our_ns(g), _torch_ns_ref(g)
    eps = float(np.linalg.norm(ref - _ns64(g)))
    diff = float(np.linalg.norm(ours - ref))
    assert diff <= 2.5 * eps, f"{shape} seed {seed}: |ours - ref|_F {diff:.3g} > 2.5 * {eps:.3g}"
    return dict(differ=differ, n=n, gauss=diff / eps)


@pytest.mark.parametrize(
    "shape", [(32, 32), (16, 32), (64, 32), (2, 40), (40, 2), (8, 8), (256, 128)]
)
def test_newton_schulz_matches_torch(shape):
    """Our bf16 NS on the torch layout vs torch.optim._muon._zeropower_via_newtonschulz."""
    _check_newton_schulz(shape, seed=0)


def test_newton_schulz_constants_are_torchs():
    assert optim.MUON_NS_COEFFICIENTS == TORCH_NS
    assert optim.MUON_EPS == TORCH_NS_EPS
    assert optim.CLI_DEFAULTS["muon_ns_steps"] == TORCH_NS_STEPS


def test_lr_lambdas_match_transformers():
    """Every step (incl. past the horizon) of both schedule types vs transformers' lambdas."""
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    for total, warm, cycles in [(50, 5, 0.5), (40, 0, 0.5), (30, 7, 1.25)]:
        for kind in ("linear", "cosine"):
            p = torch.nn.Parameter(torch.zeros(1))
            opt = torch.optim.AdamW([p], lr=3e-3)
            if kind == "linear":
                sch = get_linear_schedule_with_warmup(opt, warm, total)
            else:
                sch = get_cosine_schedule_with_warmup(opt, warm, total, num_cycles=cycles)
            ours = optim.make_schedule(
                3e-3,
                scheduler_type=kind,
                warmup_steps=warm,
                total_steps=total,
                num_cosine_cycles=cycles,
            )
            ref_lrs = []
            for _ in range(total + 10):
                ref_lrs.append(opt.param_groups[0]["lr"])
                opt.step()
                sch.step()
            got = np.asarray(jax.vmap(ours)(jnp.arange(total + 10)))
            # fp32 schedule vs float64 lambda: lambda is built from O(1) fp32
            # intermediates (a few U of 1 each, the cosine a few more), 16 U of the base lr
            np.testing.assert_allclose(
                got, ref_lrs, rtol=0, atol=16 * U * 3e-3, err_msg=f"{kind} {total} {warm}"
            )
            py = [
                3e-3
                * optim.lr_lambda(
                    s,
                    scheduler_type=kind,
                    warmup_steps=warm,
                    total_steps=total,
                    num_cosine_cycles=cycles,
                )
                for s in range(total + 10)
            ]
            # the same float64 formulas as transformers, then torch's base_lr * lambda
            np.testing.assert_array_equal(py, ref_lrs)


def test_resolve_scheduler_steps_matches_reference():
    from speculators.train.trainer import TrainerConfig, _resolve_scheduler_steps

    for kw in (
        {},
        {"scheduler_warmup_ratio": 0.05},
        {"scheduler_warmup_ratio": 0.333},
        {"scheduler_warmup_steps": 7},
        {"scheduler_total_steps": 321},
        {"max_steps": 77},
    ):
        cfg = TrainerConfig(lr=1e-3, num_epochs=3, save_path="unused", **kw)
        ref = _resolve_scheduler_steps(cfg, 250)
        total = kw.get("scheduler_total_steps") or kw.get("max_steps") or 3 * 250
        ours = optim.resolve_scheduler_steps(
            total, kw.get("scheduler_warmup_steps"), kw.get("scheduler_warmup_ratio")
        )
        assert ours == ref, kw


def test_defaults_match_reference_cli():
    from speculators.train.config.schema import OptimizerArgs, SchedulerArgs

    ref = {**OptimizerArgs().model_dump(), **SchedulerArgs().model_dump()}
    for k, v in optim.CLI_DEFAULTS.items():
        assert ref[k] == v, k
