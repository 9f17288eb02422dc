"""``--training-stage opd``: Draft-OPD inside the step (docs/math.md, "Draft-OPD").

Per row, after the in-step verifier has computed the row's hidden states:

1. the drafter's forward at the anchors, with gradient (the SFT stage's);
2. its free-running tokens, drafted left to right in each block as vLLM drafts them
   (greedy, or drawn from the drafter's distribution with the step's key), no gradient;
3. the verifier's forward on those drafted blocks after the row's own context
   (:func:`dspark_jax.verifier.forward.drafted_hidden`): the targets of a drafted prefix,
   on the same devices, in the same step (the PyTorch trainers replay rejected blocks
   through a vLLM server);
4. the drafter's distributions conditioned on its own tokens (Markov and confidence heads
   fed the drafted tokens) against those targets: :func:`dspark_jax.losses.draft_opd_loss`.

Anchors are drawn as in the SFT stage (same key per row), so a resumed run repeats the
uninterrupted one: drafting is deterministic given the parameters and the step's key.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax import anchors as anchor_ops
from dspark_jax import losses
from dspark_jax.config import DSparkConfig
from dspark_jax.model.draft import (
    DSparkDraftModel,
    FrozenWeights,
    LossSettings,
    batch_loss,
    verifier_normed,
)
from dspark_jax.model.heads import MarkovHead
from dspark_jax.verifier.forward import drafted_hidden
from dspark_jax.verifier.instep import InStepVerifier

DRAFTING = ("greedy", "sampled")


def _logits(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [C, K] @ w [K, V] -> fp32, w cast to x's dtype (the loss's logits matmul)."""
    prec = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32, precision=prec)


def free_running_tokens(
    markov_head: MarkovHead | None,
    hidden: jax.Array,
    teacher_prev: jax.Array,
    lm_head: jax.Array,
    *,
    d2t: jax.Array | None,
    start_pos: int,
    key: jax.Array,
    sampled: bool = False,
    anchor_chunk: int = 64,
) -> jax.Array:
    """The token each slot conditions on when the drafter drafts its blocks itself: [A, B]
    verifier ids.

    hidden [A, B, H]: the drafter's final normed hidden states (detached); teacher_prev
    [A, B]: the dataset's tokens (``anchors.previous_tokens``), used for slots <= start_pos
    (the real context, as in serving); slot k > start_pos conditions on the drafter's token
    for slot k - 1: the argmax of its logits (lm_head + Markov bias on its own previous
    token), or with ``sampled`` a draw from their softmax (Gumbel-max with ``key``).
    d2t [Vd]: draft -> verifier id offsets (None: one vocabulary). Logits exist for
    ``anchor_chunk`` blocks at a time ([anchor_chunk, Vd] fp32).
    """
    num, block = teacher_prev.shape
    chunk = max(1, min(anchor_chunk, num))
    n_chunks = -(-num // chunk)
    pad = n_chunks * chunk - num

    def chunks(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x
        return x.reshape(n_chunks, chunk, *x.shape[1:])

    w2 = None if markov_head is None else markov_head.w2_kernel()

    def one_chunk(args):
        h, tp, key = args  # [C, B, H], [C, B]

        def step(carry, xs):
            prev, state, key = carry
            k, h_k, tp_k = xs
            prev = jnp.where(k <= start_pos, tp_k, prev)
            z = _logits(h_k, lm_head)  # [C, Vd]
            if markov_head is not None:
                state, feat = markov_head.step(state, markov_head.prev_embeddings(prev), h_k)
                z = z + _logits(feat, w2)
            key, sub = jax.random.split(key)
            if sampled:
                z = z + jax.random.gumbel(sub, z.shape)
            drafted = jnp.argmax(z, axis=-1)
            if d2t is not None:
                drafted = drafted + d2t[drafted]
            return (drafted.astype(tp.dtype), state, key), prev

        state0 = (
            jnp.zeros((), jnp.float32)
            if markov_head is None
            else markov_head.initial_state(chunk, markov_head.dtype)
        )
        xs = (jnp.arange(block), h.swapaxes(0, 1), tp.swapaxes(0, 1))
        _, prevs = jax.lax.scan(step, (tp[:, 0], state0, key), xs)
        return prevs.swapaxes(0, 1)

    keys = jax.random.split(key, n_chunks)
    out = jax.lax.map(one_chunk, (chunks(hidden), chunks(teacher_prev), keys))
    return out.reshape(n_chunks * chunk, block)[:num]


class OpdRow(NamedTuple):
    values: dict[str, jax.Array]  # per_position_values(terms=("kl_div", "rkl")), [Q] each
    confidence_logits: jax.Array | None  # [Q], the head fed the drafted tokens
    mask: jax.Array  # [Q] the slot mask (anchors.slot_loss_mask)
    prev: jax.Array  # [A, B] verifier ids each slot conditions on (free_running_tokens)
    target_hidden: jax.Array  # [Q, Ht] the verifier's layer-N states of the slots' targets


def opd_row_values(
    model: DSparkDraftModel,
    frozen: FrozenWeights,
    verifier: InStepVerifier,
    vparams: dict[str, jax.Array],
    row: dict[str, jax.Array],
    anchors: jax.Array,
    valid: jax.Array,
    settings: LossSettings,
    key: jax.Array,
    d2t: jax.Array | None,
) -> OpdRow:
    """Steps 1-4 of the module docstring for one row, up to the per-slot values."""
    cfg = model.config
    b, sfa = cfg.block_size, cfg.sample_from_anchor
    num = anchors.shape[0]
    out = model(row, anchors, frozen)
    hidden = out.hidden.reshape(num, b, -1)
    lm_head = jax.lax.stop_gradient(frozen.lm_head.astype(model.dtype))
    teacher_prev = anchor_ops.previous_tokens(row["input_ids"], anchors, b, sfa)
    prev = free_running_tokens(
        model.markov_head, jax.lax.stop_gradient(hidden), teacher_prev, lm_head,
        d2t=d2t, start_pos=0 if sfa else 1, key=key,
        sampled=settings.opd_drafting == "sampled",
    )  # fmt: skip
    prev = jax.lax.stop_gradient(prev)
    # Block slot j of the verifier's pass sits at anchor + j and holds the token slot j
    # (sample_from_anchor) or slot j + 1 conditions on; its output is that slot's target.
    tokens = prev if sfa else jnp.concatenate([prev[:, 1:], prev[:, -1:]], axis=1)
    h_last = drafted_hidden(
        vparams,
        verifier.cfg,
        row["input_ids"],
        row["position_ids"],
        row["document_ids"],
        anchors,
        tokens,
    ).astype(verifier.out_dtype)  # rounded like the row's own states (InStepVerifier.fill)
    if not sfa:
        h_last = jnp.concatenate([h_last[:, :1], h_last[:, :-1]], axis=1)  # slot 0: masked
    h_last = h_last.reshape(num * b, -1)

    feature = w2 = emb = None
    if model.markov_head is not None:
        emb = model.markov_head.prev_embeddings(prev)
        feature = model.markov_head.features(emb, hidden).reshape(num * b, -1)
        w2 = model.markov_w2()
    conf = None
    if model.confidence_head is not None:
        feats = hidden
        if cfg.confidence_head_with_markov:
            feats = jnp.concatenate([hidden, emb.astype(hidden.dtype)], axis=-1)
        conf = model.confidence_head(feats).reshape(-1)
    values = losses.per_position_values(
        out.hidden,
        lm_head,
        verifier_normed(h_last, frozen, cfg, model.dtype),
        jax.lax.stop_gradient(frozen.verifier_lm_head.astype(model.dtype)),
        feature,
        w2,
        terms=("kl_div", "rkl"),
        chunk_size=settings.vocab_chunk_tokens,
        target_softcap=cfg.verifier_logit_softcapping,
    )
    mask = anchor_ops.slot_loss_mask(row["loss_mask"], anchors, valid, b, sfa)
    return OpdRow(values, conf, mask, prev, h_last)


def opd_row_loss(
    r: OpdRow, cfg: DSparkConfig, settings: LossSettings
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Draft-OPD loss and metrics of one row from its :func:`opd_row_values`."""
    return losses.draft_opd_loss(
        r.values,
        r.confidence_logits,
        r.mask,
        block_size=cfg.block_size,
        sample_from_anchor=cfg.sample_from_anchor,
        gamma_opd=settings.gamma_opd,
        lambda_acc=settings.lambda_acc,
        lambda_rej=settings.lambda_rej,
        gamma=settings.gamma,
        confidence_head_alpha=settings.confidence_head_alpha,
    )


def opd_batch_loss(
    model: DSparkDraftModel,
    frozen: FrozenWeights,
    verifier: InStepVerifier,
    vparams: dict[str, jax.Array],
    batch: dict[str, jax.Array],
    key: jax.Array,
    settings: LossSettings,
    d2t: jax.Array | None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """:func:`dspark_jax.model.draft.batch_loss` with the Draft-OPD row loss: the same
    anchors per row (same key folds), the mean row loss, metrics summed."""

    def row_fn(row, anchors, valid, row_key):
        r = opd_row_values(
            model, frozen, verifier, vparams, row, anchors, valid, settings,
            jax.random.fold_in(row_key, 1), d2t,
        )  # fmt: skip
        return opd_row_loss(r, model.config, settings)

    return batch_loss(model, frozen, batch, key, settings, row_fn=row_fn)
