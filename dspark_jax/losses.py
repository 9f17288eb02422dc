"""DSpark loss and metrics, numerically matching speculators 0.9.0 (docs/math.md §6-§10).

Two stages, mirroring ``speculators.models.dspark.metrics.compute_metrics``:

* :func:`per_position_values` does every vocabulary-sized computation. It walks the
  Q = A*B slots of one packed row in token chunks inside ``lax.scan``; each chunk
  builds its draft and target logits ([C, Vd], fp32) and reduces them to per-slot
  values ([C]). The chunk body is ``jax.checkpoint``-ed, so the backward pass
  recomputes one chunk's logits at a time and no fp32 [Q, Vd] array ever exists
  (at Kimi-K3 scale one such array is 5.4 GB); only the chunk's per-row statistics
  (log-sum-exps, CE labels, overlap: [C] each) are kept, so the backward redoes the
  matmuls but none of the forward's vocab-row reductions.
* :func:`dspark_loss` turns those [Q] vectors into the loss (masked, position
  weighted terms + the confidence BCE) and the reference's metric dict.

Per-slot formulas are the reference's eager ones (``speculators.losses.eager``);
``q = softmax(draft logits)``, ``p = softmax(target logits)``:

========== =====================================================================
``ce``        ``logsumexp(z) - z[argmax t]`` (first max on ties, like torch.argmax)
``tv``        ``1 - sum_v min(q_v, p_v)``
``kl_div``    ``sum_v p_v (log p_v - log q_v)``
``rkl``       ``sum_v q_v (log q_v - log p_v)``
``jsd``       ``0.5 KL(p || m) + 0.5 KL(q || m)``, ``m = (p + q) / 2``
``nla``       ``-log(max(sum_v min(q_v, p_v), 1e-5))``
``lk_hybrid`` ``lam KL(p || q) + (1 - lam) TV``, ``lam = exp(-3 sg(sum_v min(q_v, p_v)))``
``renyi_half`` ``-2 log sum_v sqrt(p_v q_v)`` (Renyi-1/2; D-PARD's actor, docs/math.md §7)
========== =====================================================================

``--per-position-loss-weight dpard`` (:func:`dpard_weights`, :func:`cumulative_reach_weights`)
is D-PARD, from speculators' unmerged PR #1078 (not in 0.9.0): docs/math.md §7-§8.
"""

from __future__ import annotations

import json
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

__all__ = [
    "PER_POSITION_TERMS",
    "cumulative_reach_weights",
    "dpace_weights",
    "dpard_weights",
    "draft_opd_loss",
    "dspark_loss",
    "fixed_exp_decay_weights",
    "parse_loss_fn",
    "per_position_values",
    "soft_cap",
]

# Names as in speculators' loss maps (``_EAGER_LOSS_FN_MAP``); all are implemented.
# renyi_half is D-PARD's actor (speculators PR #1078, not in 0.9.0's maps).
PER_POSITION_TERMS = ("ce", "tv", "kl_div", "rkl", "jsd", "nla", "lk_hybrid", "renyi_half")
PER_POSITION_LOSS_WEIGHTS = ("fixed-exp-decay", "dpace", "dpard")

_LOSS_REDUCTION_EPS = 1e-5  # speculators.losses.utils._LOSS_REDUCTION_EPS
_CONF_EPS = 1e-8  # speculators.models.dspark.metrics._EPS
_NLA_EPS = 1e-5  # speculators.losses.eager._NLA_EPS
_LK_HYBRID_ETA = 3.0  # lk_hybrid_loss's default, the one the loss map uses
_OPD_EPS = 1e-5  # speculators.models.opd_loss._EPS (a clamp, not an addend)


# --------------------------------------------------------------------------------------
# Loss spec parsing (--loss-fn)
# --------------------------------------------------------------------------------------


def parse_loss_fn(spec: str) -> dict[str, float]:
    """Parse a ``--loss-fn`` value into ``{name: weight}`` (insertion order kept).

    Accepts exactly what ``speculators.losses.resolve_loss_config`` accepts, with the
    same messages: a plain loss name (``"kl_div"`` -> ``{"kl_div": 1.0}``) or a
    non-empty JSON dict of names to numeric weights (``'{"ce": 0.1, "tv": 0.9}'``).
    """
    known = sorted(PER_POSITION_TERMS)
    if spec in PER_POSITION_TERMS:
        return {spec: 1.0}
    try:
        parsed = json.loads(spec)
    except json.JSONDecodeError:
        raise ValueError(
            f"Unknown loss function '{spec}'. Pass a known name "
            f"({known}) or a JSON dict, "
            f'e.g. \'{{"ce": 0.1, "tv": 0.9}}\'.'
        ) from None
    if not isinstance(parsed, dict) or not parsed:
        raise ValueError(
            "Loss config must be a non-empty JSON dict mapping loss names to weights, "
            f'e.g. \'{{"ce": 0.1, "tv": 0.9}}\'. Got: {spec}'
        )
    weights: dict[str, float] = {}
    for name, weight in parsed.items():
        if name not in PER_POSITION_TERMS:
            raise ValueError(f"Unknown loss function '{name}' in loss config. Choose from: {known}")
        # bool is an int subclass: the reference accepts true/false as 1.0/0.0, so do we.
        if not isinstance(weight, (int, float)):
            raise ValueError(  # noqa: TRY004 -- the reference raises ValueError
                f"Loss weight for '{name}' must be a number, got {type(weight).__name__}"
            )
        weights[name] = float(weight)
    return weights


# --------------------------------------------------------------------------------------
# Per-position values (chunked over tokens)
# --------------------------------------------------------------------------------------


def _precision(dtype) -> jax.lax.Precision | None:
    # fp32 operands get HIGHEST so GPU/TPU do not round them to TF32 / bf16 (the parity
    # tests run in fp32); lower-precision operands keep the default.
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


@jax.custom_vjp
def _logits_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [C, K] @ w [K, Vd]`` -> fp32 [C, Vd]; w is cast to x's dtype, fp32 accumulation.

    The custom VJP keeps the backward matmuls in the activation dtype: plain autodiff
    would hand them the fp32 logit cotangent, and JAX then promotes the bf16 head to
    fp32 — an fp32 copy of the [H, Vd] head (4.4 GB at Kimi-K3 scale) and fp32 GEMMs.
    As in the bf16 torch reference, the cotangent is rounded to the activation dtype
    (a no-op for fp32 activations); both products accumulate in fp32 and dw is returned
    in w's own dtype, so fp32 master weights accumulate their chunk sums in fp32.
    """
    return jnp.dot(
        x, w.astype(x.dtype), preferred_element_type=jnp.float32, precision=_precision(x.dtype)
    )


def _logits_matmul_fwd(x: jax.Array, w: jax.Array):
    return _logits_matmul(x, w), (x, w)


def _logits_matmul_bwd(res, g: jax.Array):
    x, w = res
    g = g.astype(x.dtype)
    prec = _precision(x.dtype)
    dx = jnp.dot(g, w.astype(x.dtype).T, preferred_element_type=jnp.float32, precision=prec)
    dw = jnp.dot(x.T, g, preferred_element_type=jnp.float32, precision=prec)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_logits_matmul.defvjp(_logits_matmul_fwd, _logits_matmul_bwd)


# The per-row statistics ([C, 1] / [C]) each chunk keeps for its backward. The chunk
# body is rematerialised there (see per_position_values); with nothing kept, XLA redid
# every vocab-row reduction of the forward in it: both log-softmaxes' maxima and sums
# and argmax(t), a variadic value+index reduce that costs ~8x a plain max on XLA:CPU
# (bench/README.md, "Where JAX is slower" item 1). With these saved, the backward
# recomputes the logit matmuls and elementwise terms, and reduces over the vocab only
# for the cotangent's own row sum (the log-softmax VJP).
# renyi_lse is renyi_half's log sum_v sqrt(p_v q_v), saved for the same reason.
_ROW_STATS = ("draft_lse", "target_lse", "target_ids", "overlap", "renyi_lse")


def _row_logsumexp(x: jax.Array) -> jax.Array:
    """[C, V] -> [C, 1], shifted by the row max as jax.nn.logsumexp does."""
    x_max = jax.lax.stop_gradient(jnp.max(x, axis=-1, initial=-jnp.inf, keepdims=True))
    return x_max + jnp.log(jnp.sum(jnp.exp(x - x_max), axis=-1, keepdims=True))


@partial(jax.custom_jvp, nondiff_argnums=(1,))
def _logsumexp(x: jax.Array, name: str) -> jax.Array:
    return _row_logsumexp(x)


@_logsumexp.defjvp
def _logsumexp_jvp(name: str, primals, tangents):
    # The JVP reads the output only (d lse = softmax(x) . dx, softmax = exp(x - lse)),
    # so the backward needs the saved lse, not the max and the sum autodiff would keep.
    # Named here, not inside the custom_jvp function, where the policy cannot see it.
    (x,), (dx,) = primals, tangents
    lse = checkpoint_name(_row_logsumexp(x), name)
    return lse, jnp.sum(jnp.exp(x - lse) * dx, axis=-1, keepdims=True)


def _log_softmax(x: jax.Array, name: str) -> jax.Array:
    """``x - logsumexp(x)`` over the last axis; the [C, 1] logsumexp is the named residual.

    One residual per row instead of the (max, sum) pair of ``jax.nn.log_softmax``: saving
    the max as well cost one more fp32 [C, Vd] buffer in XLA:CPU's schedule (+640 MiB
    compiled temp at Kimi-K3 scale). Forward values equal jax.nn.log_softmax's to
    rounding.
    """
    # Named again out here for inputs without a tangent (the target logits), where the
    # custom_jvp call is a plain call and its JVP rule's name never runs.
    return x - checkpoint_name(_logsumexp(x, name), name)


def _chunk_values(z: jax.Array, t: jax.Array, terms: tuple[str, ...]) -> dict[str, jax.Array]:
    """Per-slot values of one chunk from fp32 logits z (draft) and t (target), [C, Vd]."""
    out: dict[str, jax.Array] = {}
    logq = _log_softmax(z, "draft_lse")
    logp = _log_softmax(t, "target_lse")
    q = jnp.exp(logq)
    p = jnp.exp(logp)
    # The CE label indexes logq, so the backward needs it: saved, not re-reduced.
    target_ids = checkpoint_name(jnp.argmax(t, axis=-1).astype(jnp.int32), "target_ids")
    # Its value is read by the nla / lk_hybrid gradients: saved too.
    overlap = checkpoint_name(jnp.sum(jnp.minimum(q, p), axis=-1), "overlap")  # grad via q
    tv = 1.0 - overlap

    def kl() -> jax.Array:
        # torch.kl_div(log q, p): xlogy(p, p) - p log q; p log p == xlogy(p, p) as the
        # log-softmax is finite, and both are 0 where p underflows to 0.
        return jnp.sum(p * (logp - logq), axis=-1)

    for name in terms:
        if name == "ce":
            out[name] = -jnp.take_along_axis(logq, target_ids[:, None], axis=-1)[:, 0]
        elif name == "tv":
            out[name] = tv
        elif name == "kl_div":
            out[name] = kl()
        elif name == "rkl":
            out[name] = jnp.sum(q * (logq - logp), axis=-1)
        elif name == "jsd":
            log_m = jnp.logaddexp(logq, logp) - math.log(2.0)
            out[name] = 0.5 * (
                jnp.sum(p * (logp - log_m), axis=-1) + jnp.sum(q * (logq - log_m), axis=-1)
            )
        elif name == "nla":
            out[name] = -jnp.log(jnp.maximum(overlap, _NLA_EPS))
        elif name == "lk_hybrid":
            lam = jnp.exp(-_LK_HYBRID_ETA * jax.lax.stop_gradient(overlap))
            out[name] = lam * kl() + (1.0 - lam) * tv
        elif name == "renyi_half":
            # log sum_v sqrt(p_v q_v) = logsumexp_v((log p_v + log q_v) / 2), shifted by
            # its row max: finite even where the two barely overlap (sqrt(p q) underflows).
            log_bc = checkpoint_name(_logsumexp(0.5 * (logp + logq), "renyi_lse"), "renyi_lse")
            out[name] = -2.0 * log_bc[:, 0]
        else:  # guarded by per_position_values
            raise AssertionError(name)
    # Metrics only: nothing differentiates them, so the backward never recomputes them.
    # The reference forms accept_rate as 1 - tv_loss(...); keep that rounding.
    out["accept"] = jax.lax.stop_gradient(1.0 - tv)
    out["pred_ids"] = jnp.argmax(jax.lax.stop_gradient(z), axis=-1).astype(jnp.int32)
    out["target_ids"] = target_ids
    return out


def soft_cap(logits: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(logits / cap)`` (any shape, fp32 in and out); ``cap=None``: logits.

    vLLM's ``LogitsProcessor(soft_cap=config.final_logit_softcapping)``: the logits a
    Gemma 2 verifier serves (docs/math.md §3)."""
    if cap is None:
        return logits
    return cap * jnp.tanh(logits / cap)


def per_position_values(
    draft_hidden: jax.Array,
    lm_head: jax.Array,
    target_hidden: jax.Array,
    verifier_head: jax.Array,
    markov_feature: jax.Array | None = None,
    markov_w2: jax.Array | None = None,
    *,
    terms: tuple[str, ...],
    chunk_size: int = 1024,
    target_softcap: float | None = None,
) -> dict[str, jax.Array]:
    """Per-slot loss values of one packed row, computed in token chunks.

    Args:
        draft_hidden: [Q, H] the drafter's final (normed) hidden states.
        lm_head: [H, Vd] draft head (kernel layout, torch weight transposed). The
            result is differentiable w.r.t. it; pass ``jax.lax.stop_gradient(lm_head)``
            for the frozen head so no [H, Vd] cotangent is accumulated.
        target_hidden: [Q, H] verifier last hidden states at the aligned positions,
            already passed through the verifier norm. No gradient flows into it.
        verifier_head: [H, Vd] verifier head restricted to the draft vocab (kernel
            layout). No gradient flows into it.
        markov_feature: [Q, r] or None. The Markov bias is ``markov_feature @ markov_w2``
            for every head type (vanilla: W1[prev]; gated: sigmoid(gate) * W1[prev];
            rnn: tanh(o)).
        markov_w2: [r, Vd] or None (kernel layout of torch's ``markov_w2.weight``).
        terms: loss-term names from PER_POSITION_TERMS to compute.
        chunk_size: slots per chunk C. Peak extra memory is a few fp32 [C, Vd] arrays.
            Q need not be a multiple of C (the last chunk is zero-padded).
        target_softcap: None (speculators: the targets are the verifier head's raw
            logits) or the cap of :func:`soft_cap`, applied to each chunk's fp32 target
            logits (the logits a verifier with ``final_logit_softcapping`` serves).

    Matmul operands are cast to the activation dtype (draft_hidden's for the draft
    logits, markov_feature's for the bias, target_hidden's for the target logits) and
    accumulated in fp32; everything after is fp32. The backward matmuls also run in the
    activation dtype (the logit cotangent is rounded to it, as in the bf16 reference);
    parameter gradients come back in the parameter's dtype, so fp32 master weights with
    bf16 activations sum their per-chunk gradients in fp32.

    Returns:
        ``{term: [Q] fp32}`` for each requested term (differentiable w.r.t.
        draft_hidden, lm_head, markov_feature, markov_w2), plus ``"accept"`` [Q] fp32
        ``sum_v min(q_v, p_v)`` (no gradient), ``"pred_ids"`` / ``"target_ids"`` [Q]
        int32, the argmax of the draft / target logits (first max on ties).
    """
    terms = tuple(terms)
    for name in terms:
        if name not in PER_POSITION_TERMS:
            raise ValueError(
                f"Unknown loss term '{name}'. Choose from: {sorted(PER_POSITION_TERMS)}"
            )
    if len(set(terms)) != len(terms):
        raise ValueError(f"Duplicate loss terms in {terms}")
    if (markov_feature is None) != (markov_w2 is None):
        raise ValueError("markov_feature and markov_w2 must be given together (or neither)")
    if draft_hidden.ndim != 2 or target_hidden.shape[:1] != draft_hidden.shape[:1]:
        raise ValueError(
            "draft_hidden and target_hidden must be [Q, H] with the same Q, got "
            f"{draft_hidden.shape} and {target_hidden.shape}"
        )
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")

    num_slots = draft_hidden.shape[0]
    chunk = min(chunk_size, num_slots)
    num_chunks = -(-num_slots // chunk)
    padded = num_chunks * chunk

    def to_chunks(x: jax.Array) -> jax.Array:
        if padded != num_slots:
            # Zero rows give uniform softmaxes: finite values, sliced off below.
            x = jnp.pad(x, ((0, padded - num_slots), (0, 0)))
        return x.reshape(num_chunks, chunk, x.shape[-1])

    target_hidden = jax.lax.stop_gradient(target_hidden)
    verifier_head = jax.lax.stop_gradient(verifier_head)
    xs = (
        to_chunks(draft_hidden),
        to_chunks(target_hidden),
        None if markov_feature is None else to_chunks(markov_feature),
    )

    # Rematerialised per chunk: the forward keeps the inputs and the per-row statistics
    # (_ROW_STATS, [C] each, O(Q) over the scan); the backward recomputes the logits.
    @partial(jax.checkpoint, policy=jax.checkpoint_policies.save_only_these_names(*_ROW_STATS))
    def body(carry: None, x: tuple[jax.Array, jax.Array, jax.Array | None]):
        h, th, f = x
        z = _logits_matmul(h, lm_head)
        if f is not None:
            z = z + _logits_matmul(f, markov_w2)
        t = jnp.dot(
            th,
            verifier_head.astype(th.dtype),
            preferred_element_type=jnp.float32,
            precision=_precision(th.dtype),
        )
        return carry, _chunk_values(z, soft_cap(t, target_softcap), terms)

    _, ys = jax.lax.scan(body, None, xs)
    return {k: v.reshape(padded)[:num_slots] for k, v in ys.items()}


# --------------------------------------------------------------------------------------
# Position weights
# --------------------------------------------------------------------------------------


def fixed_exp_decay_weights(pos: jax.Array, gamma: float, sample_from_anchor: bool) -> jax.Array:
    """speculators' ``dflash_loss_decay``: [Q] weights from in-block positions [Q].

    sample_from_anchor=True (DSpark): ``exp(-pos / gamma)``. False (DFlash: slot 0 is
    the anchor): ``exp(-max(pos - 1, 0) / gamma) * [pos != 0]``.
    """
    pos = jnp.asarray(pos, jnp.float32)
    if sample_from_anchor:
        return jnp.exp(-pos / gamma)
    w = jnp.exp(-jnp.maximum(pos - 1.0, 0.0) / gamma)
    return w * (pos != 0).astype(w.dtype)


def dpace_weights(
    elementwise: jax.Array, loss_mask: jax.Array, block_size: int, dpace_alpha: float
) -> jax.Array:
    """speculators' ``dpace_loss_decay``: D-PACE weights [Q], no gradient.

    ``elementwise`` [Q] is what the reference passes: the term's per-slot loss already
    multiplied by the mask. Per block, ``s_k = (1 - a) exp(-l_k) + a`` where m_k > 0
    else 1, ``P = cumprod(s)``, ``w_k = m_k * sum_{j >= k} P_j m_j``.
    """
    num_slots = elementwise.shape[0]
    if num_slots % block_size:
        raise ValueError(f"q.shape[1] ({num_slots}) must be divisible by block_size ({block_size})")
    elementwise = jax.lax.stop_gradient(elementwise).astype(jnp.float32)
    q = jnp.exp(-elementwise).reshape(-1, block_size)
    mask = jnp.asarray(loss_mask).astype(jnp.float32).reshape(-1, block_size)
    smooth = (1.0 - dpace_alpha) * q + dpace_alpha
    smooth = jnp.where(mask > 0, smooth, jnp.ones_like(smooth))
    prefix = jnp.cumprod(smooth, axis=-1)
    weight = jnp.flip(jnp.cumsum(jnp.flip(prefix * mask, axis=-1), axis=-1), axis=-1)
    return (weight * mask).reshape(num_slots)


def _draft_slot_blocks(
    x: jax.Array, loss_mask: jax.Array, block_size: int, start_pos: int
) -> tuple[jax.Array, jax.Array]:
    """([N, B - start_pos] x, [N, B - start_pos] 0/1 mask): a row's draft slots by block."""
    num_slots = x.shape[0]
    if num_slots % block_size:
        raise ValueError(f"Q ({num_slots}) must be a multiple of block_size ({block_size})")
    if not 0 <= start_pos < block_size:
        raise ValueError(f"start_pos must be in [0, {block_size}), got {start_pos}")
    x = jax.lax.stop_gradient(x).astype(jnp.float32).reshape(-1, block_size)[:, start_pos:]
    active = (jnp.asarray(loss_mask).reshape(-1, block_size)[:, start_pos:] > 0).astype(x.dtype)
    return x, active


def _unblock(w: jax.Array, block_size: int, start_pos: int) -> jax.Array:
    """[N, B - start_pos] -> [N * B], zeros at the slots before start_pos."""
    return jnp.pad(w, ((0, 0), (start_pos, 0))).reshape(-1)


def dpard_weights(
    accept: jax.Array,
    loss_mask: jax.Array,
    block_size: int,
    dpard_alpha: float,
    start_pos: int = 0,
) -> jax.Array:
    """D-PARD's suffix credit [Q], no gradient (speculators PR #1078, ``dpard_loss_decay``).

    Per block, over the draft slots k >= start_pos: ``s_k = alpha + (1 - alpha) a_k``
    where the slot is masked in (``loss_mask > 0``), else 1; ``P_k = m_k prod_{j <= k}
    s_j``; ``W_k = m_k sum_{j >= k} P_j``. Slots before start_pos get 0.

    Args:
        accept: [Q] acceptance ``a = sum_v min(q_v, p_v)`` (detached here).
        loss_mask: [Q] slot mask (nonzero = supervised).
        block_size: B; Q must be a multiple of it.
        dpard_alpha: the smoothing floor, in (0, 1).
        start_pos: 0 with sample_from_anchor, else 1 (slot 0 is the anchor).
    """
    if not 0.0 < dpard_alpha < 1.0:
        raise ValueError(f"dpard_alpha must be strictly between 0 and 1, got {dpard_alpha}")
    a, active = _draft_slot_blocks(accept, loss_mask, block_size, start_pos)
    smooth = jnp.where(active > 0, dpard_alpha + (1.0 - dpard_alpha) * a, 1.0)
    prefix = jnp.cumprod(smooth, axis=-1) * active
    suffix = jnp.flip(jnp.cumsum(jnp.flip(prefix, axis=-1), axis=-1), axis=-1)
    return _unblock(suffix * active, block_size, start_pos)


def cumulative_reach_weights(
    accept: jax.Array, loss_mask: jax.Array, block_size: int, start_pos: int = 0
) -> jax.Array:
    """D-PARD's confidence weights [Q], no gradient (PR #1078, ``_cumulative_reach``).

    Per block, over the draft slots k >= start_pos: ``r_k = m_k prod_{start <= j < k}
    a'_j`` with ``a'_j = a_j`` where masked in, else 1 (r is 1 at the first draft slot);
    slots before start_pos get 0. r_k is the probability that rejection sampling reaches
    slot k.
    """
    a, active = _draft_slot_blocks(accept, loss_mask, block_size, start_pos)
    a = jnp.where(active > 0, a, 1.0)
    exclusive = jnp.cumprod(jnp.pad(a[:, :-1], ((0, 0), (1, 0)), constant_values=1.0), axis=-1)
    return _unblock(exclusive * active, block_size, start_pos)


# --------------------------------------------------------------------------------------
# Loss and metrics of one row
# --------------------------------------------------------------------------------------


def _draft_prefix(accept, mask_f, block_size, start_pos):
    """[A, B - start] draft-slot mask and cumulative product of the accept values."""
    num_blocks = mask_f.shape[0] // block_size
    draft_mask = mask_f.reshape(num_blocks, block_size)[:, start_pos:]
    accept_blocks = accept.reshape(num_blocks, block_size)[:, start_pos:]
    return draft_mask, jnp.cumprod(accept_blocks * draft_mask, axis=-1)


def confidence_metrics(
    conf: jax.Array,
    conf_loss: jax.Array,
    accept: jax.Array,
    mask_f: jax.Array,
    block_size: int,
    start_pos: int,
) -> dict[str, jax.Array]:
    """The reference's ``confidence_*`` metrics of [Q] confidence logits against the
    detached accept values [Q] over the masked slots (no gradient)."""
    draft_mask, accept_prefix = _draft_prefix(accept, mask_f, block_size, start_pos)
    num_blocks = mask_f.shape[0] // block_size
    mask_total = jnp.maximum(jnp.sum(mask_f), 1.0)
    conf_prob = jax.nn.sigmoid(jax.lax.stop_gradient(conf))
    conf_prefix = jnp.cumprod(
        conf_prob.reshape(num_blocks, block_size)[:, start_pos:] * draft_mask, axis=-1
    )
    return {
        "confidence_loss_sum": jax.lax.stop_gradient(conf_loss),
        "confidence_loss_total": jnp.ones((), jnp.float32),
        "confidence_abs_error_sum": jnp.sum(jnp.abs(conf_prob - accept) * mask_f),
        "confidence_abs_error_total": mask_total,
        "confidence_pred_mean_sum": jnp.sum(conf_prob * mask_f),
        "confidence_pred_mean_total": mask_total,
        "confidence_cumprod_bias_sum": jnp.sum((conf_prefix - accept_prefix) * draft_mask),
        "confidence_cumprod_bias_total": jnp.maximum(jnp.sum(draft_mask), 1.0),
    }


def acceptance_metrics(
    values: dict[str, jax.Array],
    accept: jax.Array,
    mask_f: jax.Array,
    block_size: int,
    start_pos: int,
) -> dict[str, jax.Array]:
    """The reference's acceptance metrics (``accept_rate``, ``accept_len``, ``full_acc``,
    ``position_{k}_acc``, ``eal``) of one row's slots: accept values [Q], the argmaxes in
    ``values`` and the slot mask [Q] (no gradient)."""
    num_blocks = mask_f.shape[0] // block_size
    mask_b = mask_f != 0
    mask_total = jnp.maximum(jnp.sum(mask_f), 1.0)
    draft_mask, accept_prefix = _draft_prefix(accept, mask_f, block_size, start_pos)
    metrics: dict[str, jax.Array] = {}
    metrics["accept_rate_sum"] = jnp.sum(accept * mask_f)
    metrics["accept_rate_total"] = mask_total

    # Analytical expected accepted length per block, counting the bonus token.
    block_valid = (jnp.sum(draft_mask, axis=-1) > 0).astype(jnp.float32)
    metrics["accept_len_sum"] = jnp.sum((jnp.sum(accept_prefix, axis=-1) + 1.0) * block_valid)
    metrics["accept_len_total"] = jnp.maximum(jnp.sum(block_valid), 1.0)

    # Greedy per-position accuracy over masked slots.
    correct = values["pred_ids"] == values["target_ids"]
    counted = mask_b.reshape(num_blocks, block_size).astype(jnp.float32)
    correct_per_pos = jnp.sum(
        (correct & mask_b).reshape(num_blocks, block_size).astype(jnp.float32), axis=0
    )
    total_per_pos = jnp.sum(counted, axis=0)
    metrics["full_acc_sum"] = jnp.sum(correct_per_pos[start_pos:])
    metrics["full_acc_total"] = jnp.sum(total_per_pos[start_pos:])
    for k in range(start_pos, block_size):
        metrics[f"position_{k}_acc_sum"] = correct_per_pos[k]
        metrics[f"position_{k}_acc_total"] = total_per_pos[k]

    # Greedy accepted length: leading run of correct valid draft slots + bonus token,
    # over blocks with any valid draft slot (eal_total is not clamped, as in the reference).
    valid = draft_mask != 0
    accepted = (correct.reshape(num_blocks, block_size)[:, start_pos:] & valid).astype(jnp.float32)
    eal_block_valid = jnp.any(valid, axis=-1).astype(jnp.float32)
    metrics["eal_sum"] = jnp.sum(
        (jnp.sum(jnp.cumprod(accepted, axis=-1), axis=-1) + 1.0) * eal_block_valid
    )
    metrics["eal_total"] = jnp.sum(eal_block_valid)
    return metrics


def _bce_with_logits(x: jax.Array, y: jax.Array) -> jax.Array:
    """torch's ``binary_cross_entropy_with_logits(reduction='none')`` formula."""
    return (1.0 - y) * x + jnp.logaddexp(0.0, -x)


def dspark_loss(
    values: dict[str, jax.Array],
    confidence_logits: jax.Array | None,
    loss_mask: jax.Array,
    *,
    block_size: int,
    loss_weights: dict[str, float],
    gamma: float = 4.0,
    confidence_head_alpha: float = 1.0,
    per_position_loss_weight: str = "fixed-exp-decay",
    dpace_alpha: float = 0.5,
    sample_from_anchor: bool = True,
    dpard_alpha: float = 0.5,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DSpark loss and metrics of one packed row (``compute_metrics`` of speculators 0.9.0).

    Args:
        values: :func:`per_position_values` output holding every term in loss_weights.
        confidence_logits: [Q] confidence-head logits, or None (no confidence head).
        loss_mask: [Q] aligned slot mask (any dtype; nonzero = valid for the counts).
        block_size: B; Q must be a multiple of it (in-block position = q % B).
        loss_weights: ``{term: weight}`` as returned by :func:`parse_loss_fn`.
        gamma, confidence_head_alpha, per_position_loss_weight, dpace_alpha,
        sample_from_anchor: as the reference's training flags.
        dpard_alpha: ``--dpard-alpha`` (speculators PR #1078), used with
            ``per_position_loss_weight="dpard"``, which needs loss_weights
            ``{"renyi_half": 1.0}``.

    Returns:
        (loss, metrics): fp32 scalar loss ``sum_i w_i term_i + alpha * confidence``, and
        ``*_sum`` / ``*_total`` fp32 scalars with the reference's keys, in its order
        (D-PARD adds ``dpard_loss``, ``dpard_credit`` and ``position_{k}_dpard_credit``).
        Metrics carry no gradient.
    """
    if per_position_loss_weight not in PER_POSITION_LOSS_WEIGHTS:
        raise ValueError(
            f"per_position_loss_weight must be one of {PER_POSITION_LOSS_WEIGHTS}, "
            f"got {per_position_loss_weight!r}"
        )
    if not loss_weights:
        raise ValueError("loss_weights must name at least one loss term")
    dpard = per_position_loss_weight == "dpard"
    if dpard and dict(loss_weights) != {"renyi_half": 1.0}:
        raise ValueError(
            "per_position_loss_weight 'dpard' requires loss_weights {'renyi_half': 1.0} "
            f"(--loss-fn renyi_half), got {dict(loss_weights)}"
        )
    missing = [k for k in (*loss_weights, "accept", "pred_ids", "target_ids") if k not in values]
    if missing:
        raise ValueError(f"values lacks {missing}; compute them with per_position_values")
    num_slots = loss_mask.shape[0]
    if num_slots % block_size:
        raise ValueError(f"Q ({num_slots}) must be a multiple of block_size ({block_size})")
    num_blocks = num_slots // block_size
    start_pos = 0 if sample_from_anchor else 1

    mask_f = jnp.asarray(loss_mask).astype(jnp.float32)
    pos = jnp.arange(num_slots, dtype=jnp.int32) % block_size
    fixed_w = fixed_exp_decay_weights(pos, gamma, sample_from_anchor)

    accept = jax.lax.stop_gradient(values["accept"]).astype(jnp.float32)

    # Main loss: the reference's compound_loss / loss_function.
    loss = jnp.zeros((), jnp.float32)
    term_losses: dict[str, jax.Array] = {}
    dpard_credit = None
    if dpard:
        # D-PARD (PR #1078's compute_metrics): the Renyi-1/2 actor weighted by the
        # detached suffix credit, over the plain mask count (masked_weighted_mean).
        dpard_credit = dpard_weights(accept, mask_f, block_size, dpard_alpha, start_pos)
        weighted = values["renyi_half"].astype(jnp.float32) * mask_f
        loss = jnp.sum(weighted * dpard_credit) / (jnp.sum(mask_f) + _LOSS_REDUCTION_EPS)
        actor_loss = jax.lax.stop_gradient(loss)
    for name, weight in ({} if dpard else loss_weights).items():
        weighted = values[name].astype(jnp.float32) * mask_f
        if per_position_loss_weight == "dpace":
            decay = dpace_weights(weighted, mask_f, block_size, dpace_alpha)
        else:
            decay = fixed_w
        term = jnp.sum(weighted * decay) / (jnp.sum(mask_f) + _LOSS_REDUCTION_EPS)
        if len(loss_weights) > 1:
            term_losses[f"{name}_loss"] = jax.lax.stop_gradient(term)
        loss = loss + weight * term

    mask_total = jnp.maximum(jnp.sum(mask_f), 1.0)
    one = jnp.ones((), jnp.float32)

    metrics: dict[str, Any] = {}
    if confidence_logits is not None:
        conf = confidence_logits.astype(jnp.float32)
        bce = _bce_with_logits(conf, accept)
        if dpard:
            # D-PARD weights it by the reach prod_{j<k} a_j, over the mask count + 1e-5.
            reach = cumulative_reach_weights(accept, mask_f, block_size, start_pos)
            conf_loss = jnp.sum(bce * reach * mask_f) / (jnp.sum(mask_f) + _LOSS_REDUCTION_EPS)
        else:
            # The reference keeps the confidence BCE on the fixed decay even under D-PACE.
            conf_loss = jnp.sum(bce * mask_f * fixed_w) / (jnp.sum(mask_f) + _CONF_EPS)
        loss = loss + confidence_head_alpha * conf_loss

        metrics.update(confidence_metrics(conf, conf_loss, accept, mask_f, block_size, start_pos))

    metrics["loss_sum"] = jax.lax.stop_gradient(loss)
    metrics["loss_total"] = one
    for name, value in term_losses.items():
        metrics[f"{name}_sum"] = value
        metrics[f"{name}_total"] = one
    if dpard_credit is not None:
        # SpecForge's dpard_loss (the weighted actor), PR #1078's credit metrics.
        metrics["dpard_loss_sum"] = actor_loss
        metrics["dpard_loss_total"] = one
        metrics["dpard_credit_sum"] = jnp.sum(dpard_credit)
        metrics["dpard_credit_total"] = mask_total
        credit_blocks = dpard_credit.reshape(num_blocks, block_size)
        mask_blocks = mask_f.reshape(num_blocks, block_size)
        for k in range(start_pos, block_size):
            metrics[f"position_{k}_dpard_credit_sum"] = jnp.sum(
                credit_blocks[:, k] * mask_blocks[:, k]
            )
            metrics[f"position_{k}_dpard_credit_total"] = jnp.maximum(
                jnp.sum(mask_blocks[:, k]), 1.0
            )

    metrics.update(acceptance_metrics(values, accept, mask_f, block_size, start_pos))
    return loss, metrics


def draft_opd_loss(
    values: dict[str, jax.Array],
    confidence_logits: jax.Array | None,
    loss_mask: jax.Array,
    *,
    block_size: int,
    sample_from_anchor: bool,
    gamma_opd: float = 0.8,
    lambda_acc: float = 1.0,
    lambda_rej: float = 1.0,
    gamma: float = 4.0,
    confidence_head_alpha: float = 1.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Draft-OPD loss and metrics of one packed row (docs/math.md, "Draft-OPD").

    ``values``: :func:`per_position_values` with terms ``("kl_div", "rkl")`` of the
    free-running slots, the drafter conditioned on its own greedy tokens and the targets
    the verifier's distributions on that drafted prefix. A slot is accepted when its and
    every earlier draft slot's argmaxes agree (slots before the first draft slot count as
    accepted, speculators' ``build_accept_mask``). With ``I_acc``/``I_rej`` the masked
    accepted/rejected slots and ``k`` the slot's index in its block:

        L_acc = sum_acc KL(p || q) / max(|I_acc|, 1e-5)
        L_rej = sum_rej gamma_opd^k KL(q || p) / max(sum_rej gamma_opd^k, 1e-5)
        L = (lambda_acc L_acc + lambda_rej L_rej) / (lambda_acc + lambda_rej)

    (speculators ``opd_loss``), plus ``confidence_head_alpha`` times the confidence BCE of
    :func:`dspark_loss` against these slots' accept values (the head then learns the
    acceptance of the tokens it really drafts). Metrics: ``loss``, ``opd_acc_loss``,
    ``opd_rej_loss``, ``opd_accepted`` (accepted share of the masked slots), the
    confidence and acceptance metrics of :func:`dspark_loss`.
    """
    missing = [k for k in ("kl_div", "rkl", "accept", "pred_ids", "target_ids") if k not in values]
    if missing:
        raise ValueError(f"values lacks {missing}; compute them with per_position_values")
    num_slots = loss_mask.shape[0]
    if num_slots % block_size:
        raise ValueError(f"Q ({num_slots}) must be a multiple of block_size ({block_size})")
    if lambda_acc < 0 or lambda_rej < 0 or lambda_acc + lambda_rej <= 0:
        raise ValueError(f"lambda_acc {lambda_acc}, lambda_rej {lambda_rej}: need >= 0, sum > 0")
    num_blocks = num_slots // block_size
    start_pos = 0 if sample_from_anchor else 1
    mask_f = jnp.asarray(loss_mask).astype(jnp.float32)
    pos = jnp.arange(num_slots, dtype=jnp.int32) % block_size

    match = (values["pred_ids"] == values["target_ids"]).reshape(num_blocks, block_size)
    match = match | (jnp.arange(block_size) < start_pos)[None]
    accept_mask = jnp.cumprod(match.astype(jnp.float32), axis=-1).reshape(num_slots)
    accepted = accept_mask * mask_f
    rejected = (1.0 - accept_mask) * mask_f
    fkl = values["kl_div"].astype(jnp.float32)
    rkl = values["rkl"].astype(jnp.float32)
    l_acc = jnp.sum(fkl * accepted) / jnp.maximum(jnp.sum(accepted), _OPD_EPS)
    decay = jnp.float32(gamma_opd) ** pos.astype(jnp.float32)
    l_rej = jnp.sum(rkl * rejected * decay) / jnp.maximum(jnp.sum(rejected * decay), _OPD_EPS)
    loss = (lambda_acc * l_acc + lambda_rej * l_rej) / (lambda_acc + lambda_rej)

    accept = jax.lax.stop_gradient(values["accept"]).astype(jnp.float32)
    one = jnp.ones((), jnp.float32)
    metrics: dict[str, Any] = {}
    if confidence_logits is not None:
        conf = confidence_logits.astype(jnp.float32)
        fixed_w = fixed_exp_decay_weights(pos, gamma, sample_from_anchor)
        bce = _bce_with_logits(conf, accept)
        conf_loss = jnp.sum(bce * mask_f * fixed_w) / (jnp.sum(mask_f) + _CONF_EPS)
        loss = loss + confidence_head_alpha * conf_loss
        metrics.update(confidence_metrics(conf, conf_loss, accept, mask_f, block_size, start_pos))
    metrics["loss_sum"] = jax.lax.stop_gradient(loss)
    metrics["loss_total"] = one
    metrics["opd_acc_loss_sum"] = jax.lax.stop_gradient(l_acc)
    metrics["opd_acc_loss_total"] = one
    metrics["opd_rej_loss_sum"] = jax.lax.stop_gradient(l_rej)
    metrics["opd_rej_loss_total"] = one
    metrics["opd_accepted_sum"] = jnp.sum(accepted)
    metrics["opd_accepted_total"] = jnp.maximum(jnp.sum(mask_f), 1.0)
    metrics.update(acceptance_metrics(values, accept, mask_f, block_size, start_pos))
    return loss, metrics
