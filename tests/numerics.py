"""Round-off constants and an elementwise bound check for tolerances derived from the arithmetic.

A tolerance in these tests is a bound on round-off, never a value one machine showed
(issue 13). The units:

* ``U = 2^-24``: fp32's unit roundoff. One fp32 rounding moves x by <= U |x|; a k-term fp32
  sum, in any order, is within (k - 1) U sum|terms| of the exact sum. Two fp32 evaluations
  of one formula that differ in accumulation order differ by <= k U S, S the same formula
  with every term replaced by its magnitude ("absolute evaluation"), k the roundings on
  the longest path of both.
* ``BF16_U = 2^-8``: bf16's unit roundoff (8 significant bits: a rounding moves x by <= half
  an ulp = 2^-8 |x|).

Helpers: ``assert_within`` (elementwise bound check), ``model_roundoff`` (two fp32 evaluations
of a whole drafter), ``logit_chain_bound`` / ``overlap_bound`` (per-slot loss values and
acceptance overlaps computed from logits).
"""

from __future__ import annotations

import numpy as np

U = 2.0**-24
BF16_U = 2.0**-8


def assert_within(got, want, bound, err_msg: str = "") -> None:
    """|got - want| <= bound elementwise (bound broadcasts), with the worst entry reported."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    shape = np.broadcast_shapes(got.shape, want.shape)
    bound = np.broadcast_to(np.asarray(bound, np.float64), shape)
    assert got.shape == want.shape, (err_msg, got.shape, want.shape)
    diff = np.abs(got - want)
    bad = ~(diff <= bound)  # NaN differences count as failures
    if bad.any():
        ratio = np.where(bad, diff / np.maximum(bound, 1e-300), -1)
        i = np.unravel_index(np.argmax(ratio), diff.shape)
        raise AssertionError(
            f"{err_msg}: {int(bad.sum())} of {diff.size} entries over their bound; worst at "
            f"{tuple(int(j) for j in i)}: got {got[i]!r}, want {want[i]!r}, |diff| {diff[i]:.3g} > "
            f"bound {bound[i]:.3g}"
        )


def abs_sensitivity(grads, values) -> float:
    """sum |dL/dx| |x| over matching leaves: how far L moves (to first order) when every
    x is perturbed by at most its own magnitude. Times eps, it bounds the change of L when
    each input is perturbed by <= eps relatively."""
    import jax

    return float(
        sum(
            np.sum(np.abs(np.asarray(g, np.float64)) * np.abs(np.asarray(x, np.float64)))
            for g, x in zip(jax.tree.leaves(grads), jax.tree.leaves(values), strict=True)
        )
    )


# Longest fp32 accumulation chain of one drafter row (tests/model/test_draft.py's
# tiny_config: hidden 32, intermediate 64, 4 x 8 heads, <= 64 visible keys, 2 layers, 2 aux
# layers, vocab 96, r = 8): per layer the input norm 32, q/k/v 32, scores 8, softmax sum 64,
# P V 64, o_proj 32, post norm 32, gate/up 32, down 64 (= 360); then fc 64, hidden / final
# norms 64, lm_head 32, the vocab sums 96, the Markov term 8 and the slot sums 24:
# 2 * 360 + 288 = 1008 -> 1024.
DRAFTER_DEPTH = 1024


def model_roundoff(grads, values, depth: int = DRAFTER_DEPTH) -> float:
    """Bound on |L_a - L_b| for two fp32 evaluations of one model that differ in
    accumulation order (batched / per row, sharded / one device).

    Backward-error model: each evaluation equals the exact loss of its weights and inputs
    perturbed by <= depth * u relatively (depth: the longest accumulation chain, each
    rounding on it a relative u); so each is within depth * u * abs_sensitivity of exact,
    and the two within twice that.
    """
    return 2 * depth * U * abs_sensitivity(grads, values)


def logit_chain_bound(draft_hidden, lm_head, target_hidden, verifier_head, f=None, w2=None):
    """Round-off bound of per-slot loss values (ce, tv, kl, ...) computed from logits.

    Two fp32 evaluations from these operands that differ in chunking / accumulation order
    differ per slot i by <= k u A_i, with (both sides counted):

    * the logits: K-term dot products (K = H, + r with the Markov term), <= K u sum|h w|;
    * the log-softmax: max, the V-term sum of exps, log, subtract: <= V + 8 roundings;
    * the value: a V-term sum of terms bounded by (q + p)(1 + |log q| + |log p|);

    so k = 2 (V + K + 8) and A_i = max_v sum|h w| (+ Markov) + max_v sum|th wv|
    + sum_v (q + p)(1 + |log q| + |log p|) (float64, from these operands). Returns
    (k, A, q, p), q and p the float64 draft / target probabilities.
    """
    h, w, th, wv = (
        np.asarray(a, np.float64) for a in (draft_hidden, lm_head, target_hidden, verifier_head)
    )
    z, zabs = h @ w, np.abs(h) @ np.abs(w)
    K = h.shape[1]
    if f is not None:
        f, w2 = np.asarray(f, np.float64), np.asarray(w2, np.float64)
        z, zabs, K = z + f @ w2, zabs + np.abs(f) @ np.abs(w2), K + f.shape[1]
    t, tabs = th @ wv, np.abs(th) @ np.abs(wv)
    logq, logp = log_softmax64(z), log_softmax64(t)
    q, p = np.exp(logq), np.exp(logp)
    V = z.shape[1]
    A = zabs.max(-1) + tabs.max(-1) + ((q + p) * (1 + np.abs(logq) + np.abs(logp))).sum(-1)
    return 2 * (V + K + 8), A, q, p


def log_softmax64(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def overlap_bound(
    draft_hidden, lm_head, target_hidden, verifier_head, f=None, w2=None, dz_extra=0.0
):
    """Per slot, (a bound on |accept_a - accept_b|, accept) for accept = sum_v min(q_v, p_v)
    computed twice in fp32 from these operands, in other chunkings / orders.

    Per side and entry v: the logit z_v is a K-term dot (K = H, + r with the Markov term),
    within dz_v = K u sum_k |h_k w_kv| (+ ``dz_extra``, e.g. upstream round-off of the Markov
    features); log q_v = z_v - lse(z) moves to first order by dz_v - sum_u q_u dz_u, so by
    <= (1 - q_v) dz_v + sum_{u != v} q_u dz_u, plus the log-sum-exp's own (V + 4 + |lse|) u
    and u |log q_v|; likewise log p_v; log min(q_v, p_v) within the larger. The overlap
    moves by <= sum_v min(q_v, p_v) (that), plus (V + 2) u of itself for exp and the V-term
    sum. Both sides: twice. Weighted by min(q, p), entries with huge logits but no mass do
    not count.
    """
    h, w, th, wv = (
        np.asarray(a, np.float64) for a in (draft_hidden, lm_head, target_hidden, verifier_head)
    )
    z, zabs, K = h @ w, np.abs(h) @ np.abs(w), h.shape[1]
    if f is not None:
        f, w2 = np.asarray(f, np.float64), np.asarray(w2, np.float64)
        z, zabs, K = z + f @ w2, zabs + np.abs(f) @ np.abs(w2), K + f.shape[1]
    t, tabs = th @ wv, np.abs(th) @ np.abs(wv)
    V = z.shape[1]
    logq, logp = log_softmax64(z), log_softmax64(t)
    q, p = np.exp(logq), np.exp(logp)

    def log_prob_error(x, logx, prob, dx):
        # log p_v = x_v - lse(x): to first order d x_v - sum_u p_u d x_u, at most
        # (1 - p_v) dx_v + sum_{u != v} p_u dx_u (the shared part cancels on the mass).
        lse = x - logx  # the log-sum-exp, per entry (all equal)
        spread = (1 - prob) * dx + ((prob * dx).sum(-1, keepdims=True) - prob * dx)
        return spread + (V + 4 + np.abs(lse)) * U + U * np.abs(logx)

    eq = log_prob_error(z, logq, q, K * U * zabs + dz_extra)
    ep = log_prob_error(t, logp, p, th.shape[1] * U * tabs)
    overlap = np.minimum(q, p)
    accept = overlap.sum(-1)
    bound = 2 * ((overlap * np.maximum(eq, ep)).sum(-1) + (V + 2) * U * accept)
    return bound, accept
