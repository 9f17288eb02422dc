"""The evaluation's teacher-forced numbers are the training metrics on the same anchors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax import anchors as anchor_ops
from dspark_jax.eval import acceptance
from dspark_jax.eval.slot_statistics import row_statistics
from dspark_jax.model.draft import LossSettings, row_loss, target_hidden
from tests.converters.helpers import make_vocab
from tests.eval.conftest import eval_config, numpy_drafter
from tests.model.test_draft import random_batch, random_frozen
from tests.numerics import U, assert_within, overlap_bound


@pytest.mark.parametrize(
    "variant",
    [
        {},  # vanilla Markov head, sample_from_anchor (DSpark)
        {"markov_head_type": "rnn", "sample_from_anchor": False, "draft_vocab_size": 24},
    ],
    ids=["vanilla", "rnn-dflash-slots-draft-vocab"],
)
def test_teacher_forced_acceptance_equals_the_training_metrics(variant):
    cfg = eval_config(**variant)
    rng = np.random.default_rng(0)
    model = numpy_drafter(cfg, seed=1, scale=0.3)
    frozen = random_frozen(rng, cfg)
    row = {k: v[0] for k, v in random_batch(rng, cfg, rows=1, seq=48).items()}
    anchors, valid = anchor_ops.select_anchors(
        jax.random.key(5), row["loss_mask"], 32, cfg.block_size
    )
    assert 0 < int(valid.sum()) < 32  # some padding anchors too
    settings = LossSettings.from_loss_fn(
        '{"ce":0.1,"tv":0.9}', num_anchors=32, vocab_chunk_tokens=16
    )
    d2t = jnp.asarray(make_vocab(cfg)[0]) if cfg.uses_draft_vocab else None
    graphdef, params = nnx.split(model)

    @jax.jit
    def both(params, row, anchors, valid):
        m = nnx.merge(graphdef, params)
        _, metrics = row_loss(m, frozen, row, anchors, valid, settings)
        stats = row_statistics(m, frozen, row, anchors, valid, jax.random.key(0), d2t=d2t,
                               anchor_chunk=5, vocab_chunk_tokens=7)  # fmt: skip
        out = m(row, anchors, frozen)  # the operands both sides form their logits from
        tgt = target_hidden(row, anchors, frozen, cfg, m.dtype)
        return metrics, stats, (out.hidden, out.markov_feature, tgt, m.markov_head.w2_kernel())

    metrics, stats, (hidden, feature, tgt, w2) = jax.device_get(both(params, row, anchors, valid))
    # Both sides read one drafter forward and form logits / overlaps in other chunkings:
    # per slot an accept value within tests.numerics.overlap_bound; r its largest relative.
    bound, accept = overlap_bound(hidden, frozen.lm_head, tgt, frozen.verifier_lm_head, feature, w2)
    r = float((bound / accept).max())
    start = 0 if cfg.sample_from_anchor else 1
    m = {k: float(v) for k, v in metrics.items()}
    mask = np.asarray(stats["mask"])

    analytic = acceptance.curve(stats["accept_tf"], mask, start=start)
    greedy = acceptance.curve(stats["greedy_tf"], mask, start=start)
    n = cfg.block_size - start
    # A block's accepted length is 1 + sum_k P_k, P_k a product of k <= n accept values:
    # relative error <= k r (+ k u), so the mean over blocks moves <= n (r + u) (length - 1);
    # the fp32 sums of the training metric (<= 32 blocks x n terms) add 32 n u of the total.
    length = m["accept_len_sum"] / m["accept_len_total"]
    assert_within(
        analytic.acceptance_length,
        length,
        n * (r + U) * (length - 1) + 32 * n * U * length,
        "analytic acceptance length",
    )
    # Greedy: counts of argmax matches, exact integers on both sides (no top-2 logit gap
    # within round-off here); the ratios are float64 (<= 2^-52 relative) of the same
    # integers over the same count.
    exact_ratio = 2.0**-50
    assert greedy.acceptance_length == pytest.approx(m["eal_sum"] / m["eal_total"], rel=exact_ratio)
    # accept_rate: the masked mean over all slots = the slot-weighted per-position means;
    # each slot within r relative, the fp32 sum of <= 128 positive values within 128 u.
    pooled = np.nansum(analytic.slot_mean * analytic.slots) / analytic.slots.sum()
    rate = m["accept_rate_sum"] / m["accept_rate_total"]
    assert_within(pooled, rate, (r + 128 * U) * rate, "accept rate")
    for j in range(n):
        k = j + start
        acc = m[f"position_{k}_acc_sum"] / m[f"position_{k}_acc_total"]
        assert greedy.slot_mean[j] == pytest.approx(acc, rel=exact_ratio), k
        assert analytic.slots[j] == m[f"position_{k}_acc_total"]
    assert analytic.blocks == m["accept_len_total"]
    # Per-row extras: context length = the anchor's position in its document.
    np.testing.assert_array_equal(stats["context_pos"], np.asarray(row["position_ids"])[anchors])
    # Free running conditions slot k on the drafter's own earlier tokens, teacher forcing on
    # the verifier's: the same at slots <= start (both read the teacher tokens there; the
    # vanilla head's feature is a W1 row, so the same logits up to round-off), and with
    # random weights the drafts differ from the teacher tokens, so later slots move.
    fr, tf = np.asarray(stats["accept_fr"]), np.asarray(stats["accept_tf"])
    assert np.isfinite(fr).all()
    if cfg.markov_head_type == "vanilla":
        bounds = bound.reshape(fr.shape)
        assert_within(
            fr[:, : start + 1], tf[:, : start + 1], bounds[:, : start + 1], "slot <= start"
        )
    later = np.abs(fr[:, start + 1 :] - tf[:, start + 1 :])
    assert later.max() > 100 * bound.max(), (later.max(), bound.max())
