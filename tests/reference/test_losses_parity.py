"""dspark_jax.losses against speculators 0.9.0 ``compute_metrics`` (eager losses), fp32.

Both sides see the same arrays: draft logits ``h @ W + f @ W2`` and target logits
``th @ Wv``. Compared: the loss, every metric key and value, and
the gradients w.r.t. draft hidden, lm_head, Markov feature, Markov W2 and confidence
logits.

Tolerances: the exact values are the reference's, run in float64; ours and the
reference's fp32 run must both lie within ``harness.fp32_roundoff(n, scale)`` =
6 sqrt(n) U scale (see tests/reference/harness.py). n = the longest accumulation
chain: the logit sums (H 16 + R 8), the vocab sums of the softmaxes (V 40), the
masked sums over positions (Q 24) and ~10 elementwise roundings = 98 -> LOSS_DEPTH =
128 forward, 256 for gradients; scale = the largest |logit| for the loss, float
metrics and per-position values (every log-sum-exp term is bounded by it), the
tensor's largest entry for gradients. Counts (``*_total``, accuracy sums, ``eal_*``)
are compared exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.reference

torch = pytest.importorskip("torch")
pytest.importorskip("speculators")

from speculators.losses import eager, resolve_loss_config
from speculators.models.dspark.metrics import compute_metrics

from dspark_jax.losses import PER_POSITION_TERMS, dspark_loss, parse_loss_fn, per_position_values
from tests.reference.harness import assert_fp32_parity

B, A, H, V, R = 4, 6, 16, 40, 8
Q = A * B
CHUNK = 10  # does not divide Q: the padded last chunk is exercised
MIXED = '{"ce":0.1,"tv":0.9}'
GRAD_NAMES = ("draft_hidden", "lm_head", "markov_feature", "markov_w2", "confidence_logits")
LOSS_DEPTH = 128  # see the module docstring


def _case(seed: int, anchor_masked: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    f32 = np.float32
    mask = (rng.random(Q) < 0.8).astype(np.int64)
    mask[1 * B : 2 * B] = 0  # an all-zero block
    mask[3 * B : 4 * B] = [1, 0, 0, 0]  # only the anchor slot valid
    if anchor_masked:  # what the data pipeline produces for sample_from_anchor=False
        mask[::B] = 0
    return {
        "draft_hidden": rng.standard_normal((Q, H)).astype(f32),
        "lm_head": (0.7 * rng.standard_normal((H, V))).astype(f32),
        "target_hidden": rng.standard_normal((Q, H)).astype(f32),
        "verifier_head": (0.7 * rng.standard_normal((H, V))).astype(f32),
        "markov_feature": rng.standard_normal((Q, R)).astype(f32),
        "markov_w2": (0.5 * rng.standard_normal((R, V))).astype(f32),
        "confidence_logits": (1.5 * rng.standard_normal(Q)).astype(f32),
        "loss_mask": mask,
    }


def _tensors(case, dtype=torch.float32, grad=False):
    """The case as torch tensors, float arrays in ``dtype`` (float64: the exact values)."""
    return {
        k: torch.tensor(
            v.astype(np.float64) if dtype == torch.float64 and v.dtype == np.float32 else v,
            requires_grad=grad and k in GRAD_NAMES,
        )
        for k, v in case.items()
    }


def _reference(case, spec, with_conf, kw, dtype=torch.float32):
    t = _tensors(case, dtype, grad=True)
    logits = (t["draft_hidden"] @ t["lm_head"] + t["markov_feature"] @ t["markov_w2"])[None]
    targets = (t["target_hidden"] @ t["verifier_head"])[None]
    conf = t["confidence_logits"][None] if with_conf else None
    loss, metrics = compute_metrics(
        logits,
        targets,
        conf,
        t["loss_mask"][None],
        B,
        loss_config=resolve_loss_config(spec, "eager"),
        tv_loss_fn=eager.tv_loss,
        **kw,
    )
    loss.backward()
    grads = {k: t[k].grad.numpy() for k in GRAD_NAMES if with_conf or k != "confidence_logits"}
    return loss.item(), {k: v.item() for k, v in metrics.items()}, grads


def _ours(case, spec, with_conf, kw):
    weights = parse_loss_fn(spec)
    j = {k: jnp.asarray(v) for k, v in case.items()}

    def f(h, w, feat, w2, conf):
        vals = per_position_values(
            h,
            w,
            j["target_hidden"],
            j["verifier_head"],
            feat,
            w2,
            terms=tuple(weights),
            chunk_size=CHUNK,
        )
        return dspark_loss(
            vals,
            conf if with_conf else None,
            j["loss_mask"],
            block_size=B,
            loss_weights=weights,
            **kw,
        )

    (loss, metrics), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True))(
        *(j[k] for k in GRAD_NAMES)
    )
    grads = dict(zip(GRAD_NAMES, map(np.asarray, grads)))
    if not with_conf:
        grads.pop("confidence_logits")
    return float(loss), {k: float(v) for k, v in metrics.items()}, grads


CASES = [
    # (spec, sample_from_anchor, confidence head, per-position weighting)
    *[(s, True, True, "fixed-exp-decay") for s in ("kl_div", "ce", "tv", MIXED, "rkl", "jsd")],
    *[(s, True, True, "fixed-exp-decay") for s in ("nla", "lk_hybrid")],
    ("kl_div", False, True, "fixed-exp-decay"),
    (MIXED, False, True, "fixed-exp-decay"),
    ("ce", True, False, "fixed-exp-decay"),
    (MIXED, False, False, "fixed-exp-decay"),
    ("ce", True, True, "dpace"),
    ("ce", False, False, "dpace"),
    ('{"ce":0.5,"kl_div":0.5}', True, True, "dpace"),  # each term's own dpace weights
]


@pytest.mark.parametrize(("spec", "sample_from_anchor", "with_conf", "weighting"), CASES)
def test_loss_metrics_and_grads_match_reference(spec, sample_from_anchor, with_conf, weighting):
    case = _case(seed=len(spec) + 7 * sample_from_anchor, anchor_masked=not sample_from_anchor)
    kw = {
        "gamma": 3.0,
        "confidence_head_alpha": 0.7,
        "per_position_loss_weight": weighting,
        "dpace_alpha": 0.3,
        "sample_from_anchor": sample_from_anchor,
    }
    ref_loss, ref_m, ref_g = _reference(case, spec, with_conf, kw)
    ex_loss, ex_m, ex_g = _reference(case, spec, with_conf, kw, torch.float64)
    loss, m, g = _ours(case, spec, with_conf, kw)

    scale = float(_logits(case, torch.float64)[0].abs().max())
    assert_fp32_parity(loss, ref_loss, ex_loss, LOSS_DEPTH, "loss", scale)
    assert sorted(m) == sorted(ref_m) == sorted(ex_m)  # jit returns dicts in sorted key order
    for k, want in ex_m.items():
        if k.endswith("_total") or "_acc_" in k or k.startswith("eal_"):
            assert m[k] == ref_m[k] == want, k
        else:
            assert_fp32_parity(m[k], ref_m[k], want, LOSS_DEPTH, k, max(scale, abs(want)))
    assert set(g) == set(ref_g) == set(ex_g)
    for k, want in ex_g.items():
        assert float(np.abs(want).max()) > 0, k
        assert_fp32_parity(g[k], ref_g[k], want, 2 * LOSS_DEPTH, k)


def _logits(case, dtype):
    """(draft logits, target logits) [1, Q, V], computed by torch in ``dtype``."""
    t = _tensors(case, dtype)
    logits = (t["draft_hidden"] @ t["lm_head"] + t["markov_feature"] @ t["markov_w2"])[None]
    return logits, (t["target_hidden"] @ t["verifier_head"])[None]


def test_per_position_values_match_reference_eager_losses():
    case = _case(seed=3, anchor_masked=False)
    j = {k: jnp.asarray(v) for k, v in case.items()}
    vals = jax.jit(
        lambda: per_position_values(
            j["draft_hidden"],
            j["lm_head"],
            j["target_hidden"],
            j["verifier_head"],
            j["markov_feature"],
            j["markov_w2"],
            terms=PER_POSITION_TERMS,
            chunk_size=CHUNK,
        )
    )()
    logits32, targets32 = _logits(case, torch.float32)
    logits64, targets64 = _logits(case, torch.float64)
    reference = {
        "ce": eager.ce_loss,
        "tv": eager.tv_loss,
        "kl_div": eager.kl_div_loss,
        "rkl": eager.reverse_kl_div_loss,
        "jsd": eager.js_div_loss,
        "nla": eager.neg_log_acceptance_loss,
        "lk_hybrid": eager.lk_hybrid_loss,
    }
    # renyi_half (D-PARD's actor) is not in 0.9.0: tests/test_losses.py checks it.
    assert set(reference) == set(PER_POSITION_TERMS) - {"renyi_half"}
    scale = float(logits64.abs().max())
    for name, fn in reference.items():
        assert_fp32_parity(
            vals[name],
            fn(logits32, targets32)[0].numpy(),
            fn(logits64, targets64)[0].numpy(),
            LOSS_DEPTH,
            name,
            scale,
        )
    assert_fp32_parity(
        vals["accept"],
        1.0 - eager.tv_loss(logits32, targets32)[0].numpy(),
        1.0 - eager.tv_loss(logits64, targets64)[0].numpy(),
        LOSS_DEPTH,
        "accept",
        scale,
    )
    np.testing.assert_array_equal(vals["pred_ids"], torch.argmax(logits32[0], -1).numpy())
    np.testing.assert_array_equal(vals["target_ids"], torch.argmax(targets32[0], -1).numpy())


@pytest.mark.parametrize(
    "spec", ["ce", "nla", "kl_div", MIXED, "{}", "[1]", '{"x": 1}', '{"ce": "a"}']
)
def test_parse_loss_fn_agrees_with_resolve_loss_config(spec):
    try:
        ref = {k: w for k, (_, w) in resolve_loss_config(spec, "eager").items()}
    except ValueError as err:
        with pytest.raises(ValueError) as ours:
            parse_loss_fn(spec)
        # Same message; the list of known names also has renyi_half (D-PARD, not in 0.9.0).
        names = sorted(PER_POSITION_TERMS)
        ref_names = sorted(set(names) - {"renyi_half"})
        assert str(ours.value) == str(err).replace(str(ref_names), str(names))
    else:
        got = parse_loss_fn(spec)
        assert got == ref and list(got) == list(ref)
