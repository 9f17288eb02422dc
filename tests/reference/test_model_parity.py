"""The JAX drafter against speculators 0.9.0's DSparkDraftModel: same weights, same
row, same anchors -> same logits, targets, loss, metrics and parameter gradients.

Tolerances: both sides run fp32 with other summation orders (online-softmax attention
vs dense softmax, chunked vs full vocab reductions). The exact values come from the
reference run in float64; ours and the reference's fp32 run must both lie within the
fp32 round-off bound ``harness.fp32_roundoff`` (LAMBDA sqrt(n) U scale, n = the
longest accumulation chain: ``DRAFTER_DEPTH`` = 1024 forward, 2048 for gradients;
scale = the tensor's largest magnitude; for the loss and float metrics the largest
logit, which bounds every term of the log-sum-exps they are made of). That is
1.1e-5 of the largest logit and 1.6e-5 of each gradient tensor's largest entry.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("speculators")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.reference

from flax import nnx  # noqa: E402

from dspark_jax.config import DSparkConfig  # noqa: E402
from dspark_jax.model.draft import (  # noqa: E402
    DSparkDraftModel,
    FrozenWeights,
    LossSettings,
    row_loss,
    target_hidden,
)
from dspark_jax.model.params import to_speculators  # noqa: E402
from tests.numerics import DRAFTER_DEPTH  # noqa: E402
from tests.reference.harness import (  # noqa: E402
    assert_fp32_parity,
    build_reference_model,
    run_reference,
)
from tests.tiny_configs import VT, H, base_config  # noqa: E402

SEQ = 48
DOCS = (20, 17)  # two documents, then 11 padding positions


CASES = {
    # name: (config overrides, loss_fn, per_position_loss_weight, num_anchors)
    "vanilla-anchor-confmarkov": (dict(), '{"ce":0.1,"tv":0.9}', "fixed-exp-decay", 8),
    "gated-dflash-conf-plain-reduced-vocab": (
        dict(
            markov_head_type="gated",
            sample_from_anchor=False,
            confidence_head_with_markov=False,
            draft_vocab_size=40,
        ),
        "kl_div",
        "fixed-exp-decay",
        8,
    ),
    "rnn-noncausal-sliding-reduced-vocab": (
        dict(
            markov_head_type="rnn",
            draft_vocab_size=40,
            sliding_window_non_causal=True,
            enable_confidence_head=False,
        ),
        "ce",
        "dpace",
        6,
    ),
    "no-markov-full-attn-bias": (
        dict(
            markov_rank=0,
            confidence_head_with_markov=False,
            layer_types=None,
            sliding_window=None,
            attention_bias=True,
        ),
        '{"tv":1.0,"kl_div":0.5}',
        "fixed-exp-decay",
        8,
    ),
}


def make_row(rng: np.random.Generator, cfg: DSparkConfig) -> dict[str, np.ndarray]:
    pos, doc = [], []
    for d, n in enumerate(DOCS):
        pos += list(range(n))
        doc += [d] * n
    pad = SEQ - len(pos)
    pos += [0] * pad
    doc += [-1] * pad
    # Supervised spans inside each document (assistant turns), none on padding.
    loss_mask = np.zeros(SEQ, np.int64)
    loss_mask[5:18] = 1
    loss_mask[26:35] = 1
    n_aux = cfg.num_aux_layers
    return {
        "hidden_states": rng.standard_normal((SEQ, n_aux * H)).astype(np.float32),
        "verifier_last_hidden_states": rng.standard_normal((SEQ, H)).astype(np.float32) * 2,
        "input_ids": rng.integers(0, VT - 1, SEQ).astype(np.int64),
        "loss_mask": loss_mask,
        "position_ids": np.asarray(pos, np.int64),
        "document_ids": np.asarray(doc, np.int64),
    }


def make_frozen(rng: np.random.Generator, cfg: DSparkConfig):
    embed = rng.standard_normal((VT, H)).astype(np.float32)
    head_full = (rng.standard_normal((VT, H)) * 0.3).astype(np.float32)  # torch layout [Vt, H]
    t2d = None
    head = head_full
    if cfg.uses_draft_vocab:
        t2d = np.zeros(VT, bool)
        t2d[rng.choice(VT, cfg.draft_vocab_size, replace=False)] = True
        head = head_full[t2d]
    frozen = FrozenWeights(
        embed_tokens=embed,
        lm_head=head.T.copy(),
        verifier_lm_head=head.T.copy(),
        verifier_norm=(1.0 + 0.1 * rng.standard_normal(H)).astype(np.float32),
    )
    return frozen, t2d


def anchors_for(loss_mask: np.ndarray, num: int, block: int, rng: np.random.Generator):
    """Sorted valid anchors then invalid zeros, like select_anchors. Includes an
    anchor whose block straddles the end of document 0 (position 17)."""
    eligible = np.flatnonzero((loss_mask > 0) & (np.arange(SEQ) < SEQ - block))
    k = min(num - 2, len(eligible))  # always leave two padding anchors
    chosen = set(rng.choice(eligible, k - 1, replace=False).tolist()) | {17}
    chosen = sorted(chosen)[: num - 2]
    anchors = np.zeros(num, np.int64)
    valid = np.zeros(num, bool)
    anchors[: len(chosen)] = chosen
    valid[: len(chosen)] = True
    return anchors, valid


CASE_SEEDS = {case: 101 + i for i, case in enumerate(CASES)}  # fixed: reproducible failures


@pytest.mark.parametrize("case", list(CASES))
def test_drafter_matches_reference(case):
    overrides, loss_fn, weighting, num_anchors = CASES[case]
    cfg = base_config(**overrides)
    rng = np.random.default_rng(CASE_SEEDS[case])
    row = make_row(rng, cfg)
    frozen, t2d = make_frozen(rng, cfg)
    anchors, valid = anchors_for(row["loss_mask"], num_anchors, cfg.block_size, rng)

    model = DSparkDraftModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, remat=False)
    # Perturb norms and biases off their init so their gradients and roles are tested.
    params = nnx.state(model, nnx.Param)
    params = jax.tree.map(
        lambda p: p + 0.05 * jax.random.normal(jax.random.key(1), p.shape), params
    )
    nnx.update(model, params)

    ref_model = build_reference_model(cfg, nnx.state(model, nnx.Param), frozen, t2d)
    ref = run_reference(
        ref_model, row, anchors, valid, loss_fn=loss_fn, per_position_loss_weight=weighting
    )
    ref64 = run_reference(  # the exact values (harness.assert_fp32_parity)
        ref_model.double(),
        row,
        anchors,
        valid,
        loss_fn=loss_fn,
        per_position_loss_weight=weighting,
        dtype=torch.float64,
    )

    settings = LossSettings.from_loss_fn(
        loss_fn, num_anchors=num_anchors, per_position_loss_weight=weighting, vocab_chunk_tokens=12
    )
    jrow = {
        k: jnp.asarray(v.astype(np.int32) if v.dtype == np.int64 else v) for k, v in row.items()
    }
    jfrozen = FrozenWeights(*(jnp.asarray(x) for x in frozen))
    ja, jv = jnp.asarray(anchors, jnp.int32), jnp.asarray(valid)

    def loss_of(m):
        return row_loss(m, jfrozen, jrow, ja, jv, settings)

    # Compiled, as training runs them (op-by-op dispatch takes longer than the compiles).
    (loss, metrics), grads = nnx.jit(nnx.value_and_grad(loss_of, has_aux=True))(model)

    # Logits (Markov-corrected) and targets, densely: fine at this vocab size.
    out = nnx.jit(lambda m: m(jrow, ja, jfrozen))(model)
    logits = out.hidden @ jfrozen.lm_head
    if out.markov_feature is not None:
        logits = logits + out.markov_feature @ model.markov_w2()
    targets = target_hidden(jrow, ja, jfrozen, cfg, jnp.float32) @ jfrozen.verifier_lm_head
    fwd, bwd = DRAFTER_DEPTH, 2 * DRAFTER_DEPTH
    assert_fp32_parity(logits, ref.logits, ref64.logits, fwd, "logits")
    assert_fp32_parity(targets, ref.targets, ref64.targets, fwd, "targets")
    if ref.confidence_logits is not None:
        assert_fp32_parity(
            out.confidence_logits, ref.confidence_logits, ref64.confidence_logits, fwd, "conf"
        )
    else:
        assert out.confidence_logits is None

    logit_scale = float(np.abs(ref64.logits).max())
    assert_fp32_parity(float(loss), float(ref.loss), float(ref64.loss), fwd, "loss", logit_scale)
    assert set(metrics) == set(ref.metrics), set(metrics) ^ set(ref.metrics)
    for k, v in ref64.metrics.items():  # counts are exact integers: the bound (< 1) keeps them
        scale = max(abs(v), logit_scale)
        assert_fp32_parity(float(metrics[k]), ref.metrics[k], v, fwd, k, scale)

    ours = to_speculators(grads)
    assert set(ours) == set(ref.grads) == set(ref64.grads), set(ours) ^ set(ref.grads)
    for k, g in ref64.grads.items():
        assert float(np.abs(g).max()) > 0, k  # every gradient is exercised
        assert_fp32_parity(ours[k], ref.grads[k], g, bwd, k)
