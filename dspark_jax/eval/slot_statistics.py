"""Per-slot acceptance statistics of a drafter on one packed row (JAX, jit-able).

The evaluation counterpart of :func:`dspark_jax.model.draft.row_loss`: the same
forward pass, targets and slot mask, reduced not to a loss but to per-slot values
for the acceptance tables (:mod:`dspark_jax.eval.acceptance`) and the confidence
calibration (:mod:`dspark_jax.eval.calibration`).

Notation (anchor p, slot k of its block; ``start`` = 0 with sample_from_anchor, else 1):

* ``p_k``: the verifier's distribution over the draft vocabulary at row position
  ``p + k`` (sample_from_anchor; ``p + k - 1`` otherwise), from its cached last hidden
  state: the training target. It is always the one along the *dataset's* tokens:
  the hidden-state files hold nothing else ("fixed targets").
* ``q_k(. | c)``: the drafter's distribution at slot k when its Markov head (and the
  confidence head's Markov input) conditions on the token ``c``.

Two ways to choose ``c`` for slot k > start (slots <= start condition on the real
context token, as in serving):

* **teacher forcing** (``tf``): ``c = input_ids[p + k]``, the dataset's token, as in
  training. ``accept_tf = sum_v min(q_k, p_k)`` is exactly the loss code's ``accept``
  and ``greedy_tf = argmax q_k == argmax p_k`` its ``pred_ids == target_ids``.
* **free running** (``fr``): ``c`` is the drafter's own token for slot k-1, drafted
  left to right as vLLM does:

  - analytic path: ``accept_fr[k] = sum_v min(q_k(. | d_{k-1}), p_k)``, and the
    drafter's token is then drawn as ``d_k ~ min(q_k, p_k) / accept_fr[k]``, the exact
    law of the drafted token *given that rejection sampling accepted it* (Gumbel-max,
    seeded). With fixed targets, ``E[prod_{j<=k} accept_fr[j]]`` is then exactly the
    probability that rejection sampling (temperature 1) accepts slots start..k.
  - greedy path: ``d_k = argmax q_k(. | d_{k-1})``, ``greedy_fr[k] = d_k == argmax p_k``.
    On an accepted prefix the drafter's tokens are the verifier's argmax tokens.

  Confidence logits are returned for both free-running paths (``conf_fr_sampled``,
  ``conf_fr_greedy``): the head sees the token the drafter would really have drafted.

Vocabulary-sized work is chunked: the teacher-forced values come from
:func:`dspark_jax.losses.per_position_values` (token chunks), and the free-running scan
goes over the B slots of ``anchor_chunk`` blocks at a time, so the largest logits
array is [anchor_chunk, Vd], never [Q, Vd].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax import anchors as anchor_ops
from dspark_jax import losses
from dspark_jax.model.draft import DSparkDraftModel, FrozenWeights, target_hidden
from dspark_jax.model.heads import ConfidenceHead, MarkovHead

STAT_KEYS = (
    "accept_tf",  # [A, B] f32
    "greedy_tf",  # [A, B] bool
    "accept_fr",  # [A, B] f32
    "greedy_fr",  # [A, B] bool
    "draft_fr",  # [A, B] int32: the free-running greedy token, verifier ids (eval/served.py)
    "draft_margin_fr",  # [A, B] f32: its logit's lead over the runner-up (near-ties)
    "conf_tf",  # [A, B] f32 logits (absent without a confidence head)
    "conf_fr_sampled",
    "conf_fr_greedy",
)


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [C, K] @ w [K, V] -> fp32, w cast to x's dtype (as losses._logits_matmul)."""
    prec = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32, precision=prec)


def _confidence(
    conf_head: ConfidenceHead | None, hidden: jax.Array, prev_emb: jax.Array | None
) -> jax.Array | None:
    if conf_head is None:
        return None
    if prev_emb is None:
        return conf_head(hidden)
    return conf_head(jnp.concatenate([hidden, prev_emb.astype(hidden.dtype)], axis=-1))


def _free_running_chunk(
    hidden: jax.Array,  # [C, B, H]
    tgt_hidden: jax.Array,  # [C, B, Ht]
    teacher_prev: jax.Array,  # [C, B] verifier ids
    key: jax.Array,
    *,
    lm_head: jax.Array,
    verifier_head: jax.Array,
    markov_head: MarkovHead,
    conf_head: ConfidenceHead | None,
    conf_with_markov: bool,
    d2t: jax.Array | None,
    start_pos: int,
    target_softcap: float | None,
) -> dict[str, jax.Array]:
    num, block = teacher_prev.shape
    w2 = markov_head.w2_kernel()
    state0 = markov_head.initial_state(num, markov_head.dtype)
    prev0 = teacher_prev[:, 0]

    def to_verifier_ids(draft_ids: jax.Array) -> jax.Array:
        if d2t is None:
            return draft_ids.astype(teacher_prev.dtype)
        return (draft_ids + d2t[draft_ids]).astype(teacher_prev.dtype)

    def path(prev, state, h_k, base):
        emb = markov_head.prev_embeddings(prev)  # [C, r]
        state, feat = markov_head.step(state, emb, h_k)
        logq = jax.nn.log_softmax(base + _dot(feat, w2), axis=-1)
        conf = _confidence(conf_head, h_k, emb if conf_with_markov else None)
        return state, logq, conf

    def step(carry, xs):
        prev_s, prev_g, state_s, state_g, key = carry
        k, h_k, th_k, tp_k = xs
        key, sub = jax.random.split(key)
        base = _dot(h_k, lm_head)  # [C, Vd] fp32, shared by both paths
        logp = jax.nn.log_softmax(
            losses.soft_cap(_dot(th_k, verifier_head), target_softcap), axis=-1
        )
        target = jnp.argmax(logp, axis=-1)
        teacher = k <= start_pos
        prev_s = jnp.where(teacher, tp_k, prev_s)
        prev_g = jnp.where(teacher, tp_k, prev_g)

        state_s, logq_s, conf_s = path(prev_s, state_s, h_k, base)
        log_overlap = jnp.minimum(logq_s, logp)  # log min(q, p), finite everywhere
        accept = jnp.sum(jnp.exp(log_overlap), axis=-1)
        drawn = jnp.argmax(log_overlap + jax.random.gumbel(sub, log_overlap.shape), axis=-1)

        state_g, logq_g, conf_g = path(prev_g, state_g, h_k, base)
        greedy = jnp.argmax(logq_g, axis=-1)
        drafted = to_verifier_ids(greedy)
        top2 = jax.lax.top_k(logq_g, 2)[0]
        out = {"accept_fr": accept, "greedy_fr": greedy == target, "draft_fr": drafted,
               "draft_margin_fr": top2[:, 0] - top2[:, 1]}  # fmt: skip
        if conf_s is not None:
            out["conf_fr_sampled"], out["conf_fr_greedy"] = conf_s, conf_g
        carry = (to_verifier_ids(drawn), drafted, state_s, state_g, key)
        return carry, out

    xs = (
        jnp.arange(block),
        hidden.swapaxes(0, 1),
        tgt_hidden.swapaxes(0, 1),
        teacher_prev.swapaxes(0, 1),
    )
    _, ys = jax.lax.scan(step, (prev0, prev0, state0, state0, key), xs)
    return {name: v.swapaxes(0, 1) for name, v in ys.items()}


def _greedy_margin(hidden: jax.Array, lm_head: jax.Array, chunk: int) -> jax.Array:
    """[Q] the top logit's lead over the runner-up, ``chunk`` slots at a time."""
    q = hidden.shape[0]
    n = -(-q // chunk)
    x = jnp.pad(hidden, ((0, n * chunk - q), (0, 0))).reshape(n, chunk, -1)
    top = jax.lax.map(lambda h: jax.lax.top_k(_dot(h, lm_head), 2)[0], x).reshape(-1, 2)[:q]
    return top[:, 0] - top[:, 1]


def slot_statistics(
    hidden: jax.Array,
    tgt_hidden: jax.Array,
    lm_head: jax.Array,
    verifier_head: jax.Array,
    teacher_prev: jax.Array,
    key: jax.Array,
    *,
    markov_head: MarkovHead | None = None,
    conf_head: ConfidenceHead | None = None,
    conf_with_markov: bool = False,
    markov_feature_tf: jax.Array | None = None,
    conf_tf: jax.Array | None = None,
    d2t: jax.Array | None = None,
    start_pos: int = 0,
    anchor_chunk: int = 64,
    vocab_chunk_tokens: int = 1024,
    target_softcap: float | None = None,
) -> dict[str, jax.Array]:
    """Per-slot acceptance values of A blocks of B slots (see the module docstring).

    Args:
      hidden: [A, B, H] the drafter's final normed hidden states.
      tgt_hidden: [A, B, Ht] the verifier's normed last hidden states at the targets.
      lm_head, verifier_head: [H, Vd] kernels (draft head; verifier head rows).
      teacher_prev: [A, B] verifier token ids the Markov head conditions on under
        teacher forcing (``anchors.previous_tokens``).
      key: PRNG key of the free-running analytic path's draws.
      markov_head, conf_head: the drafter's heads (None when absent).
      markov_feature_tf: [A, B, r] teacher-forced Markov features (None: computed).
      conf_tf: [A, B] teacher-forced confidence logits (None: computed).
      d2t: [Vd] draft -> verifier id offsets (None: full vocabulary).
      start_pos: 0 (sample_from_anchor) or 1 (slot 0 is the anchor itself).
      anchor_chunk: blocks per free-running chunk ([anchor_chunk, Vd] logits).
      vocab_chunk_tokens: slots per chunk of the teacher-forced values.
      target_softcap: cap on the verifier logits (``losses.soft_cap``; None: raw).

    Returns ``{name: [A, B]}`` for the names in :data:`STAT_KEYS` (the ``conf_*`` ones
    only with a confidence head).
    """
    num, block = teacher_prev.shape
    if markov_head is not None and markov_feature_tf is None:
        markov_feature_tf = markov_head.features(markov_head.prev_embeddings(teacher_prev), hidden)
    if conf_head is not None and conf_tf is None:
        emb = (
            markov_head.prev_embeddings(teacher_prev)
            if conf_with_markov and markov_head is not None
            else None
        )
        conf_tf = _confidence(conf_head, hidden, emb)

    def flat(x):
        return None if x is None else x.reshape(num * block, -1)

    values = losses.per_position_values(
        flat(hidden),
        lm_head,
        flat(tgt_hidden),
        verifier_head,
        flat(markov_feature_tf),
        None if markov_head is None else markov_head.w2_kernel(),
        terms=(),
        chunk_size=vocab_chunk_tokens,
        target_softcap=target_softcap,
    )
    out = {
        "accept_tf": values["accept"].reshape(num, block),
        "greedy_tf": (values["pred_ids"] == values["target_ids"]).reshape(num, block),
    }
    if conf_tf is not None:
        out["conf_tf"] = conf_tf.astype(jnp.float32).reshape(num, block)

    if markov_head is None:
        # Nothing conditions on previous tokens: free running is teacher forcing.
        out["accept_fr"], out["greedy_fr"] = out["accept_tf"], out["greedy_tf"]
        pred = values["pred_ids"]
        pred = pred if d2t is None else pred + d2t[pred]
        out["draft_fr"] = pred.astype(teacher_prev.dtype).reshape(num, block)
        out["draft_margin_fr"] = _greedy_margin(flat(hidden), lm_head, anchor_chunk).reshape(
            num, block
        )
        if conf_tf is not None:
            out["conf_fr_sampled"] = out["conf_fr_greedy"] = out["conf_tf"]
        return out

    chunk = max(1, min(anchor_chunk, num))
    n_chunks = -(-num // chunk)
    pad = n_chunks * chunk - num

    def chunks(x):
        if pad:
            x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(n_chunks, chunk, *x.shape[1:])

    keys = jax.random.split(key, n_chunks)

    def run(args):
        h, th, tp, k = args
        return _free_running_chunk(
            h,
            th,
            tp,
            k,
            lm_head=lm_head,
            verifier_head=verifier_head,
            markov_head=markov_head,
            conf_head=conf_head,
            conf_with_markov=conf_with_markov,
            d2t=d2t,
            start_pos=start_pos,
            target_softcap=target_softcap,
        )

    fr = jax.lax.map(run, (chunks(hidden), chunks(tgt_hidden), chunks(teacher_prev), keys))
    for name, v in fr.items():
        out[name] = v.reshape(n_chunks * chunk, block)[:num]
    return out


def row_statistics(
    model: DSparkDraftModel,
    frozen: FrozenWeights,
    row: dict[str, jax.Array],
    anchors: jax.Array,
    valid: jax.Array,
    key: jax.Array,
    *,
    d2t: jax.Array | None = None,
    anchor_chunk: int = 64,
    vocab_chunk_tokens: int = 1024,
) -> dict[str, jax.Array]:
    """Run the drafter on one packed row at ``anchors`` [A] and return its statistics.

    Besides :func:`slot_statistics`' values: ``mask`` [A, B] (the training slot mask,
    ``anchors.slot_loss_mask``), ``context_pos`` [A] (the anchor's position in its
    document) and ``document`` [A] (its document id in the row).
    """
    cfg = model.config
    b = cfg.block_size
    num = anchors.shape[0]
    out = model(row, anchors, frozen)
    hidden = out.hidden.reshape(num, b, -1)
    tgt = target_hidden(row, anchors, frozen, cfg, model.dtype).reshape(num, b, -1)
    prev = anchor_ops.previous_tokens(row["input_ids"], anchors, b, cfg.sample_from_anchor)
    stats = slot_statistics(
        hidden,
        tgt,
        jax.lax.stop_gradient(frozen.lm_head.astype(model.dtype)),
        jax.lax.stop_gradient(frozen.verifier_lm_head.astype(model.dtype)),
        prev,
        key,
        markov_head=model.markov_head,
        conf_head=model.confidence_head,
        conf_with_markov=cfg.confidence_head_with_markov,
        markov_feature_tf=(
            None if out.markov_feature is None else out.markov_feature.reshape(num, b, -1)
        ),
        conf_tf=None if out.confidence_logits is None else out.confidence_logits.reshape(num, b),
        d2t=d2t,
        start_pos=0 if cfg.sample_from_anchor else 1,
        anchor_chunk=anchor_chunk,
        vocab_chunk_tokens=vocab_chunk_tokens,
        target_softcap=cfg.verifier_logit_softcapping,
    )
    mask = anchor_ops.slot_loss_mask(row["loss_mask"], anchors, valid, b, cfg.sample_from_anchor)
    stats["mask"] = mask.reshape(num, b)
    stats["context_pos"] = row["position_ids"][anchors]
    stats["document"] = row["document_ids"][anchors]
    return stats
