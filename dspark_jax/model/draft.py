"""The DSpark drafter: DFlash block-parallel backbone + Markov bias + confidence head.

``DSparkDraftModel`` holds the trainable parameters only (paths mirror the
speculators keys). The verifier-owned tensors (embedding, draft lm_head rows,
verifier head and final norm) travel separately as ``FrozenWeights``: they are
never differentiated, never in the optimiser state and never saved with the draft.

One packed row at a time: ``row_loss`` runs the drafter on a row and reduces it to
the DSpark loss and metrics; ``batch_loss`` maps it over the rows of a batch.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax import anchors as anchor_ops
from dspark_jax import losses, parallel
from dspark_jax.config import DSparkConfig
from dspark_jax.model.heads import ConfidenceHead, MarkovHead
from dspark_jax.model.layers import (
    DecoderLayer,
    RMSNorm,
    RopeTables,
    gemma_rms_norm,
    linear,
    rms_norm,
    rope_cos_sin,
    rope_frequencies,
    rope_tables,
)

ROW_KEYS = (
    "hidden_states",  # [S, n_aux * Ht] aux verifier layers, layer-major
    "verifier_last_hidden_states",  # [S, Ht] last verifier layer, before its final norm
    "input_ids",  # [S] int
    "loss_mask",  # [S] 0/1
    "position_ids",  # [S] int, restarting at 0 per document
    "document_ids",  # [S] int, -1 on padding
)


class FrozenWeights(NamedTuple):
    """Verifier-owned tensors, kernel layout ([in, out]) for the heads."""

    embed_tokens: jax.Array  # [Vt, H]
    lm_head: jax.Array  # [H, Vd] draft head (verifier head rows of the draft vocab)
    verifier_lm_head: jax.Array  # [H, Vd] the targets' head (same rows)
    verifier_norm: jax.Array  # [H] verifier final norm weight, as stored (config's style)

    def check(self, cfg: DSparkConfig) -> None:
        """Raise with the field name and both shapes on any mismatch with the config."""
        h, vt, vd = cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size
        expected = {
            "embed_tokens": (vt, h),
            "lm_head": (h, vd),
            "verifier_lm_head": (h, vd),
            "verifier_norm": (cfg.verifier_hidden_size,),
        }
        for name, shape in expected.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"FrozenWeights.{name}: expected shape {shape}, got {got}")

    @classmethod
    def from_verifier(cls, embed_tokens, lm_head_rows, norm, cfg: DSparkConfig) -> FrozenWeights:
        """The frozen tensors from the verifier's (host) arrays, checked against ``cfg``.

        ``lm_head_rows``: [Vd, H], the verifier head's rows of the draft vocabulary (torch
        layout); it serves as both the draft head and the targets' head (kernel layout).
        """
        head = lm_head_rows.T  # [H, Vd]
        frozen = cls(embed_tokens, head, head, norm)
        frozen.check(cfg)
        return frozen


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """The reference trainer's loss flags (speculators names), hashable for jit."""

    loss_weights: tuple[tuple[str, float], ...] = (("kl_div", 1.0),)  # --loss-fn
    num_anchors: int = 3072  # --max-anchors
    gamma: float = 4.0  # --dflash-decay-gamma
    confidence_head_alpha: float = 1.0
    per_position_loss_weight: str = "fixed-exp-decay"
    dpace_alpha: float = 0.5
    dpard_alpha: float = 0.5  # --dpard-alpha (D-PARD, docs/math.md §7)
    vocab_chunk_tokens: int = 1024  # slots per vocab-sized chunk of the loss
    anchor_sampling: str = "per-row"  # --anchor-sampling (dspark_jax/anchors.py)
    training_stage: str = "sft"  # --training-stage; opd: Draft-OPD (dspark_jax/train/opd.py)
    gamma_opd: float = 0.8  # --gamma-opd
    lambda_acc: float = 1.0  # --lambda-acc
    lambda_rej: float = 1.0  # --lambda-rej
    opd_drafting: str = "greedy"  # --opd-drafting: greedy, or sampled (seeded by the step)

    @classmethod
    def from_loss_fn(cls, loss_fn: str, **kw) -> LossSettings:
        return cls(loss_weights=tuple(losses.parse_loss_fn(loss_fn).items()), **kw)


class DraftOutputs(NamedTuple):
    hidden: jax.Array  # [Q, H] final-normed draft hidden states (compute dtype)
    markov_feature: jax.Array | None  # [Q, r]: Markov bias = feature @ W2
    confidence_logits: jax.Array | None  # [Q] fp32


class DSparkDraftModel(nnx.Module):
    def __init__(
        self,
        cfg: DSparkConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.bfloat16,
        remat: bool = True,
    ):
        """dtype: the compute dtype (parameters are fp32). remat: recompute each
        decoder layer in the backward pass instead of keeping its activations."""
        self.config = cfg
        self.dtype = dtype
        self.remat = remat
        h = cfg.hidden_size
        # Created without eager sharding: parallel.py shards by annotation at jit time.
        with nnx.use_eager_sharding(False):
            self.fc = linear(
                cfg.num_aux_layers * cfg.verifier_hidden_size,
                h,
                ("aux_embed", "embed"),
                use_bias=False,
                dtype=dtype,
                rngs=rngs,
            )
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
            self.layers = nnx.List(
                [DecoderLayer(cfg, i, dtype, rngs) for i in range(cfg.num_hidden_layers)]
            )
            self.norm = RMSNorm(h, cfg.rms_norm_eps)
            # Optional heads are data attributes even when absent (None).
            self.markov_head = nnx.data(
                MarkovHead(cfg, dtype, rngs) if cfg.markov_rank > 0 else None
            )
            extra = cfg.markov_rank if cfg.confidence_head_with_markov else 0
            self.confidence_head = nnx.data(
                ConfidenceHead(h + extra, dtype, rngs) if cfg.enable_confidence_head else None
            )

    def __call__(
        self,
        row: dict[str, jax.Array],
        anchors: jax.Array,  # [A] int32
        frozen: FrozenWeights,
        rope: RopeTables | None = None,
    ) -> DraftOutputs:
        """Run the drafter on one packed row (see ROW_KEYS) for the given anchors.

        rope: ``rope_tables(config)``, by default embedded as constants; pass them as
        an argument of a jitted caller to reuse one compilation across rope configs.
        """
        cfg = self.config
        b = cfg.block_size
        check_row(row, cfg)
        frozen.check(cfg)
        if cfg.mask_token_id is None:
            raise ValueError("DSparkConfig.mask_token_id is not set (pass --mask-token-id)")
        num_blocks = anchors.shape[0]
        input_ids, positions = row["input_ids"], row["position_ids"]

        # Block tokens: the anchor token, then B-1 mask tokens.
        slot = jnp.arange(num_blocks * b) % b
        # Per-token arrays may be split over the mesh's context axis: gathers at the anchors
        # move A rows, never the row (parallel.sequence_take).
        anchor_tokens = jnp.repeat(parallel.sequence_take(input_ids, anchors), b)
        block_tokens = jnp.where(slot == 0, anchor_tokens, cfg.mask_token_id)
        x = frozen.embed_tokens[block_tokens].astype(jnp.float32)  # [Q, H] residual stream

        hidden_states = parallel.constrain_tokens(row["hidden_states"])
        ctx = parallel.constrain_tokens(self.hidden_norm(self.fc(hidden_states)))  # [S, H]
        block_pos = anchor_ops.block_indices(
            parallel.sequence_take(positions, anchors), b
        )  # anchor position + k
        tables = rope_tables(cfg) if rope is None else rope
        # Length-dependent rope types (dynamic, longrope) see the row's largest position,
        # context and blocks together, like the reference's one rotary call per row.
        seq_len = jnp.maximum(positions.max(), block_pos.max()) + 1
        inv_freq = rope_frequencies(tables, seq_len)
        rope_blk = rope_cos_sin(block_pos, inv_freq, tables.attention_scaling)
        rope_ctx = rope_cos_sin(positions, inv_freq, tables.attention_scaling)

        for layer in self.layers:
            # Pure split/merge + jax.checkpoint (not nnx.remat) so the model can be
            # called under plain jax.vmap/jax.jit transforms of the caller.
            graphdef, state = nnx.split(layer)

            def run_layer(state, x, graphdef=graphdef):
                return nnx.merge(graphdef, state)(
                    x, ctx, rope_blk, rope_ctx, anchors, row["document_ids"]
                )

            if self.remat:
                run_layer = jax.checkpoint(run_layer)
            x = run_layer(state, x)
        hidden = self.norm(x).astype(self.dtype)  # [Q, H]

        hidden_blocks = hidden.reshape(num_blocks, b, -1)
        markov_feature = prev_emb = None
        if self.markov_head is not None:
            prev = anchor_ops.previous_tokens(input_ids, anchors, b, cfg.sample_from_anchor)
            prev_emb = self.markov_head.prev_embeddings(prev)  # [A, B, r]
            markov_feature = self.markov_head.features(prev_emb, hidden_blocks)
            markov_feature = markov_feature.reshape(num_blocks * b, -1)
        confidence_logits = None
        if self.confidence_head is not None:
            feats = hidden_blocks
            if cfg.confidence_head_with_markov:
                feats = jnp.concatenate([hidden_blocks, prev_emb.astype(hidden.dtype)], axis=-1)
            confidence_logits = self.confidence_head(feats).reshape(-1)
        return DraftOutputs(hidden, markov_feature, confidence_logits)

    def markov_w2(self) -> jax.Array | None:
        return None if self.markov_head is None else self.markov_head.w2_kernel()


def check_row(row: dict[str, jax.Array], cfg: DSparkConfig) -> None:
    """Shape checks of one row against the config (static, at trace time)."""
    missing = [k for k in ROW_KEYS if k not in row]
    if missing:
        raise ValueError(f"row is missing {missing}; expected keys {list(ROW_KEYS)}")
    (seq_len,) = row["input_ids"].shape
    expected = {
        "hidden_states": (seq_len, cfg.num_aux_layers * cfg.verifier_hidden_size),
        "verifier_last_hidden_states": (seq_len, cfg.verifier_hidden_size),
        "loss_mask": (seq_len,),
        "position_ids": (seq_len,),
        "document_ids": (seq_len,),
    }
    for name, shape in expected.items():
        got = tuple(row[name].shape)
        if got != shape:
            raise ValueError(
                f"row[{name!r}]: expected shape {shape} (from input_ids length {seq_len} and "
                f"the config's aux layers/hidden size), got {got}"
            )
    for name in ROW_KEYS:
        dtype = jnp.dtype(row[name].dtype)
        floating = name in ("hidden_states", "verifier_last_hidden_states")
        ok = (
            jnp.issubdtype(dtype, jnp.floating)
            if floating
            else (jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_)
        )
        if not ok:
            kind = "a floating" if floating else "an integer"
            raise ValueError(f"row[{name!r}]: expected {kind} dtype, got {dtype}")


def target_hidden(
    row: dict[str, jax.Array], anchors: jax.Array, frozen: FrozenWeights, cfg: DSparkConfig, dtype
) -> jax.Array:
    """verifier_norm(h_last) at each slot's target position: [Q, Ht] (no gradient).

    The verifier norm uses the draft config's rms_norm_eps, like the reference, and the
    verifier's own convention (``cfg.verifier_norm_style``): Qwen3's ``w * x`` or
    Gemma's ``(1 + w) * x``, each with its numerics.
    """
    (seq_len,) = row["input_ids"].shape
    idx = anchor_ops.target_indices(anchors, cfg.block_size, seq_len, cfg.sample_from_anchor)
    h_last = parallel.sequence_take(row["verifier_last_hidden_states"], idx)
    return verifier_normed(h_last, frozen, cfg, dtype)


def verifier_normed(
    h_last: jax.Array, frozen: FrozenWeights, cfg: DSparkConfig, dtype
) -> jax.Array:
    """verifier_norm(h_last) [..., Ht] in ``dtype``, detached (see :func:`target_hidden`)."""
    if cfg.verifier_norm_style == "gemma":
        normed = gemma_rms_norm(h_last, frozen.verifier_norm, cfg.rms_norm_eps)
    else:
        normed = rms_norm(h_last, frozen.verifier_norm.astype(h_last.dtype), cfg.rms_norm_eps)
    return jax.lax.stop_gradient(normed.astype(dtype))


def row_loss(
    model: DSparkDraftModel,
    frozen: FrozenWeights,
    row: dict[str, jax.Array],
    anchors: jax.Array,
    valid: jax.Array,
    settings: LossSettings,
    rope: RopeTables | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DSpark loss and speculators metrics (``*_sum``/``*_total``) of one row
    (``rope``: see :meth:`DSparkDraftModel.__call__`)."""
    cfg = model.config
    out = model(row, anchors, frozen, rope)
    values = losses.per_position_values(
        out.hidden,
        jax.lax.stop_gradient(frozen.lm_head.astype(model.dtype)),
        target_hidden(row, anchors, frozen, cfg, model.dtype),
        jax.lax.stop_gradient(frozen.verifier_lm_head.astype(model.dtype)),
        out.markov_feature,
        model.markov_w2(),
        terms=tuple(name for name, _ in settings.loss_weights),
        chunk_size=settings.vocab_chunk_tokens,
        target_softcap=cfg.verifier_logit_softcapping,
    )
    mask = anchor_ops.slot_loss_mask(
        row["loss_mask"], anchors, valid, cfg.block_size, cfg.sample_from_anchor
    )
    return losses.dspark_loss(
        values,
        out.confidence_logits,
        mask,
        block_size=cfg.block_size,
        loss_weights=dict(settings.loss_weights),
        gamma=settings.gamma,
        confidence_head_alpha=settings.confidence_head_alpha,
        per_position_loss_weight=settings.per_position_loss_weight,
        dpace_alpha=settings.dpace_alpha,
        sample_from_anchor=cfg.sample_from_anchor,
        dpard_alpha=settings.dpard_alpha,
    )


def batch_loss(
    model: DSparkDraftModel,
    frozen: FrozenWeights,
    batch: dict[str, jax.Array],
    key: jax.Array,
    settings: LossSettings,
    row_fn=None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean row loss over a batch of rows ([R, S, ...] arrays); metrics summed.

    Each row draws its own anchors from ``key`` (one fold per row), so a resumed
    run with the same key and step draws the same anchors. ``row_fn(row, anchors, valid,
    row_key) -> (loss, metrics)``: another row objective (default :func:`row_loss`).
    """
    num_rows = batch["input_ids"].shape[0]
    keys = jax.random.split(key, num_rows)
    b = model.config.block_size
    if row_fn is None:

        def row_fn(row, anchors, valid, _):
            return row_loss(model, frozen, row, anchors, valid, settings)

    def one(row, k):
        anchors, valid = anchor_ops.sample_anchors(
            k, row["loss_mask"], row["document_ids"], settings.num_anchors, b,
            settings.anchor_sampling,
        )  # fmt: skip
        return row_fn(row, anchors, valid, k)

    # Split over context, the rows' axes are named: the shard_maps inside then take each
    # device's own rows (parallel.context_shard_map).
    row_losses, metrics = jax.vmap(one, spmd_axis_name=parallel.row_vmap_axes())(
        {k: batch[k] for k in ROW_KEYS}, keys
    )
    # The reference averages per-row losses across data-parallel ranks (DDP mean).
    return row_losses.mean(), jax.tree.map(lambda m: m.sum(0), metrics)
