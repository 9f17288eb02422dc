"""The drafter's batch path: jit, rows mapped with their own anchors, memory shape
contract of the compiled step, bf16 compute, and that training reduces the loss."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dspark_jax import anchors as anchor_ops
from dspark_jax.config import DSparkConfig
from dspark_jax.model.draft import (
    DSparkDraftModel,
    FrozenWeights,
    LossSettings,
    batch_loss,
    row_loss,
)
from tests.numerics import BF16_U, DRAFTER_DEPTH, U, assert_within, model_roundoff


def tiny_config(**kw) -> DSparkConfig:
    fields = dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=2,
        vocab_size=96,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=16,
        block_size=4,
        mask_token_id=95,
        aux_hidden_state_layer_ids=(1, 2),
        markov_rank=8,
    )
    fields.update(kw)
    return DSparkConfig(**fields)


def random_batch(rng, cfg: DSparkConfig, rows: int, seq: int) -> dict[str, jax.Array]:
    h = cfg.hidden_size
    docs = [seq // 2, seq // 3]
    pos = np.concatenate([np.arange(n) for n in docs] + [np.zeros(seq - sum(docs), int)])
    doc = np.concatenate(
        [np.full(n, i) for i, n in enumerate(docs)] + [np.full(seq - sum(docs), -1)]
    )
    loss_mask = (rng.random((rows, seq)) < 0.7).astype(np.int32) * (doc >= 0)
    return {
        "hidden_states": jnp.asarray(
            rng.standard_normal((rows, seq, cfg.num_aux_layers * h)), jnp.float32
        ),
        "verifier_last_hidden_states": jnp.asarray(
            rng.standard_normal((rows, seq, h)), jnp.float32
        ),
        "input_ids": jnp.asarray(rng.integers(0, cfg.vocab_size - 1, (rows, seq)), jnp.int32),
        "loss_mask": jnp.asarray(loss_mask, jnp.int32),
        "position_ids": jnp.asarray(np.tile(pos, (rows, 1)), jnp.int32),
        "document_ids": jnp.asarray(np.tile(doc, (rows, 1)), jnp.int32),
    }


def random_frozen(rng, cfg: DSparkConfig) -> FrozenWeights:
    h, vt, vd = cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size
    head = jnp.asarray(rng.standard_normal((h, vd)) * 0.3, jnp.float32)
    return FrozenWeights(
        embed_tokens=jnp.asarray(rng.standard_normal((vt, h)), jnp.float32),
        lm_head=head,
        verifier_lm_head=head,
        verifier_norm=jnp.ones((h,), jnp.float32),
    )


def test_batch_loss_is_the_mean_of_row_losses_with_per_row_anchors():
    cfg = tiny_config()
    rng = np.random.default_rng(0)
    batch = random_batch(rng, cfg, rows=2, seq=40)
    frozen = random_frozen(rng, cfg)
    model = DSparkDraftModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
    settings = LossSettings.from_loss_fn('{"ce":0.1,"tv":0.9}', num_anchors=6, vocab_chunk_tokens=8)
    key = jax.random.key(3)

    loss, metrics = nnx.jit(batch_loss, static_argnums=4)(model, frozen, batch, key, settings)

    keys = jax.random.split(key, 2)
    per_row = []
    one_row = nnx.jit(row_loss, static_argnums=5)  # one compile, not op-by-op dispatch
    for r in range(2):
        row = {k: v[r] for k, v in batch.items()}
        anchors, valid = anchor_ops.select_anchors(keys[r], row["loss_mask"], 6, cfg.block_size)
        per_row.append(one_row(model, frozen, row, anchors, valid, settings))
    # Batched (vmap, jit) vs per row: the same fp32 sums in other orders. The loss bound
    # comes from its sensitivity to all weights and inputs (tests.numerics.model_roundoff).
    graphdef, params = nnx.split(model)
    floats = {k: v for k, v in batch.items() if v.dtype == jnp.float32}

    def as_fn(p, fr, fl):
        return batch_loss(nnx.merge(graphdef, p), fr, dict(batch, **fl), key, settings)[0]

    grads = jax.jit(jax.grad(as_fn, argnums=(0, 1, 2)))(params, frozen, floats)
    bound = model_roundoff(grads, (params, frozen, floats))  # ~5e-5 here, loss ~1.5
    assert_within(loss, (per_row[0][0] + per_row[1][0]) / 2, bound, "loss")
    # accept_rate sums per-slot overlaps in [0, 1]; with probabilities within depth * u
    # relative on each side, one overlap moves by <= 2 depth u: 2 depth u per valid slot.
    n_slots = float(metrics["accept_rate_total"])
    assert_within(
        metrics["accept_rate_sum"],
        per_row[0][1]["accept_rate_sum"] + per_row[1][1]["accept_rate_sum"],
        2 * DRAFTER_DEPTH * U * n_slots,
        "accept_rate_sum",
    )
    # Counts (valid blocks, argmax matches): integers, equal unless a top-2 logit gap is
    # within round-off.
    for k in ("accept_rate_total", "accept_len_total", "full_acc_sum", "full_acc_total", "eal_sum"):
        np.testing.assert_array_equal(metrics[k], per_row[0][1][k] + per_row[1][1][k], err_msg=k)
    assert per_row[0][0] != per_row[1][0]  # rows differ, so the mean is a real check


def _shapes_in(hlo: str) -> set[tuple[int, ...]]:
    return {
        tuple(int(d) for d in dims.split(",") if d)
        for dims in re.findall(r"(?:f32|bf16|f16|s32|pred)\[([0-9,]*)\]", hlo)
    }


def test_compiled_step_never_holds_row_sized_scores_or_logits():
    # Distinct sizes so a [Q, S(+Q)] score matrix or a [Q, V] logit matrix would show
    # up in the compiled HLO: Q = 32*4 = 128 slots, S = 1024, Vd = 640.
    seq, num_anchors, vocab = 1024, 32, 640
    cfg = tiny_config(vocab_size=vocab, mask_token_id=vocab - 1, sliding_window=64)
    rng = np.random.default_rng(1)
    batch = random_batch(rng, cfg, rows=1, seq=seq)
    frozen = random_frozen(rng, cfg)
    model = DSparkDraftModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
    settings = LossSettings.from_loss_fn("kl_div", num_anchors=num_anchors, vocab_chunk_tokens=32)
    graphdef, params = nnx.split(model)

    def step(params, batch, key):
        def f(p):
            return batch_loss(nnx.merge(graphdef, p), frozen, batch, key, settings)[0]

        return jax.value_and_grad(f)(params)

    hlo = jax.jit(step).lower(params, batch, jax.random.key(0)).compile().as_text()
    q = num_anchors * cfg.block_size
    for shape in _shapes_in(hlo):
        dims = set(shape)
        assert not (q in dims and (dims & {seq, seq + q})), f"row-sized attention array {shape}"
        assert not (q in dims and vocab in dims), f"row-sized logits {shape}"


def test_bf16_compute_tracks_fp32():
    cfg = tiny_config()
    rng = np.random.default_rng(2)
    batch = random_batch(rng, cfg, rows=1, seq=40)
    frozen = random_frozen(rng, cfg)
    settings = LossSettings.from_loss_fn("kl_div", num_anchors=6, vocab_chunk_tokens=8)
    key = jax.random.key(0)
    m32 = DSparkDraftModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
    m16 = DSparkDraftModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    loss = nnx.jit(batch_loss, static_argnums=4)  # compiled as training runs it
    l32, _ = loss(m32, frozen, batch, key, settings)
    frozen16 = FrozenWeights(*(x.astype(jnp.bfloat16) for x in frozen))
    l16, _ = loss(m16, frozen16, batch, key, settings)
    assert nnx.state(m16, nnx.Param)["fc"]["kernel"][...].dtype == jnp.float32  # fp32 master
    # bf16 rounds the matmul operands and sublayer outputs: ~40 roundings on a path (per
    # layer the norm, q/k/v, q/k norms, RoPE, P, attention out, o_proj, norm, gate/up, act,
    # down; then fc, two norms, both heads' operands), each <= 2^-8 relative. Worst case
    # they add up (40 * 2^-8 * sum|dL/dx||x| = 24% here); as independent round-to-nearest
    # errors (uniform, sd 2^-8 / sqrt(3) relative) a stage whose values x move L by
    # dL/dx . dx has sd 2^-8 / sqrt(3) ||dL/dx * x||_2: 6 sd over 40 stages, each bounded
    # by the inputs' ||dL/dx * x||_2 (computed here, weights and inputs): ~4e-2 on 2.35.
    # (6 sd of a normal: false alarm ~2e-9.) No tighter a-priori bound: the round-off is a
    # sum of ~40 stages whose own sensitivities are not computed here, so the worst case is
    # 6x larger still. Planted: the final norm skipped in bf16 only moves the loss by 0.35 and
    # fails; bf16-only slips below the round-off spread (the context's hidden_norm skipped:
    # 3e-3, vs 1.6e-3 of plain round-off here) cannot be told from round-off by one loss.
    graphdef, params = nnx.split(m32)
    floats = {k: v for k, v in batch.items() if v.dtype == jnp.float32}

    def as_fn(p, fr, fl):
        return batch_loss(nnx.merge(graphdef, p), fr, dict(batch, **fl), key, settings)[0]

    grads = jax.jit(jax.grad(as_fn, argnums=(0, 1, 2)))(params, frozen, floats)
    l2 = np.sqrt(sum(
        np.sum((np.asarray(g, np.float64) * np.asarray(x, np.float64)) ** 2)
        for g, x in zip(jax.tree.leaves(grads), jax.tree.leaves((params, frozen, floats)),
                        strict=True)
    ))  # fmt: skip
    assert_within(l16, l32, 6 * BF16_U / np.sqrt(3) * np.sqrt(40) * l2, "bf16 loss")


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_a_few_steps_reduce_the_loss(head):
    cfg = tiny_config(markov_head_type=head)
    rng = np.random.default_rng(4)
    batch = random_batch(rng, cfg, rows=2, seq=40)
    frozen = random_frozen(rng, cfg)
    model = DSparkDraftModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
    opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    settings = LossSettings.from_loss_fn('{"ce":0.1,"tv":0.9}', num_anchors=6, vocab_chunk_tokens=8)

    @nnx.jit
    def step(model, opt, batch):
        def f(m):
            return batch_loss(m, frozen, batch, jax.random.key(0), settings)

        (loss, _), grads = nnx.value_and_grad(f, has_aux=True)(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, batch)) for _ in range(6)]
    # A progress margin, not a round-off tolerance: seeded data and init, and the loss's
    # round-off (model_roundoff: ~1e-4) is 500x below it.
    assert losses[-1] < losses[0] - 0.05, losses


def test_config_mismatch_raises_with_field_and_shapes():
    cfg = tiny_config()
    rng = np.random.default_rng(0)
    row = {k: v[0] for k, v in random_batch(rng, cfg, rows=1, seq=48).items()}
    frozen = random_frozen(rng, cfg)
    model = DSparkDraftModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, remat=False)
    bad = dict(row, hidden_states=row["hidden_states"][:, : cfg.hidden_size])
    anchors = jnp.zeros(4, jnp.int32)
    with pytest.raises(
        ValueError, match=r"row\['hidden_states'\]: expected shape \(48, 64\).*got \(48, 32\)"
    ):
        model(bad, anchors, frozen)
    with pytest.raises(
        ValueError, match=r"row\['input_ids'\]: expected an integer dtype, got float32"
    ):
        model(dict(row, input_ids=row["input_ids"].astype(jnp.float32)), anchors, frozen)
    wrong = dataclasses.replace(cfg, draft_vocab_size=40)
    with pytest.raises(
        ValueError, match=r"FrozenWeights.lm_head: expected shape \(32, 40\), got \(32, 96\)"
    ):
        frozen.check(wrong)


def test_the_configured_target_softcap_reaches_training_and_evaluation(monkeypatch):
    """DSparkConfig.verifier_logit_softcapping (--verifier-logit-softcapping served) caps
    the target logits of the loss and of every evaluation path; the numbers of the cap
    itself (and that it changes the values): tests/test_losses.py::
    test_target_softcap_matches_a_direct_computation."""
    from dspark_jax import losses
    from dspark_jax.eval.slot_statistics import row_statistics

    rng = np.random.default_rng(0)
    cfg = tiny_config(verifier_logit_softcapping=0.5)
    row = {k: v[0] for k, v in random_batch(rng, cfg, rows=1, seq=40).items()}
    frozen = random_frozen(rng, cfg)
    anchors, valid = anchor_ops.select_anchors(jax.random.key(3), row["loss_mask"], 6, 4)
    settings = LossSettings.from_loss_fn('{"kl_div":1.0}', num_anchors=6, vocab_chunk_tokens=8)
    seen = []
    real = losses.soft_cap

    def spy(x, cap):
        seen.append(cap)
        return real(x, cap)

    monkeypatch.setattr(losses, "soft_cap", spy)
    model = DSparkDraftModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
    # tracing is enough to see which cap each computation takes
    jax.eval_shape(lambda *a: row_loss(*a, settings), model, frozen, row, anchors, valid)
    assert seen == [0.5]
    seen.clear()
    jax.eval_shape(
        lambda *a: row_statistics(*a, vocab_chunk_tokens=8),
        model, frozen, row, anchors, valid, jax.random.key(0),
    )  # fmt: skip
    assert seen == [0.5, 0.5]  # teacher forced (chunked values) and free running
