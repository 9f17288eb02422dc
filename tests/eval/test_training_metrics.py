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
from dspark_jax.model.draft import LossSettings, row_loss
from tests.converters.helpers import make_vocab
from tests.eval.conftest import eval_config, numpy_drafter
from tests.model.test_draft import random_batch, random_frozen


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
        return metrics, stats

    metrics, stats = jax.device_get(both(params, row, anchors, valid))
    start = 0 if cfg.sample_from_anchor else 1
    m = {k: float(v) for k, v in metrics.items()}
    mask = np.asarray(stats["mask"])

    analytic = acceptance.curve(stats["accept_tf"], mask, start=start)
    greedy = acceptance.curve(stats["greedy_tf"], mask, start=start)
    assert analytic.acceptance_length == pytest.approx(
        m["accept_len_sum"] / m["accept_len_total"], rel=1e-6
    )
    assert greedy.acceptance_length == pytest.approx(m["eal_sum"] / m["eal_total"], rel=1e-6)
    # accept_rate: the masked mean over all slots = the slot-weighted per-position means.
    pooled = np.nansum(analytic.slot_mean * analytic.slots) / analytic.slots.sum()
    assert pooled == pytest.approx(m["accept_rate_sum"] / m["accept_rate_total"], rel=1e-6)
    for j in range(cfg.block_size - start):
        k = j + start
        acc = m[f"position_{k}_acc_sum"] / m[f"position_{k}_acc_total"]
        assert greedy.slot_mean[j] == pytest.approx(acc, rel=1e-6), k
        assert analytic.slots[j] == m[f"position_{k}_acc_total"]
    assert analytic.blocks == m["accept_len_total"]
    # Per-row extras: context length = the anchor's position in its document.
    np.testing.assert_array_equal(stats["context_pos"], np.asarray(row["position_ids"])[anchors])
    # Random weights: the free-running columns are close to, not equal to, the teacher-forced ones.
    assert np.isfinite(stats["accept_fr"]).all()
