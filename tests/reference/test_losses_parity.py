"""dspark_jax.losses against speculators 0.9.0 ``compute_metrics`` (eager losses), fp32.

Both sides see the same arrays: draft logits ``h @ W + f @ W2`` and target logits
``th @ Wv``. Compared: the loss, every metric key and value, and
the gradients w.r.t. draft hidden, lm_head, Markov feature, Markov W2 and confidence
logits.

Tolerances (fp32 on both sides; measured: loss 1.6e-7 relative, metrics 2.4e-7):
* counts (``*_total``, accuracy sums, ``eal_*``): exact;
* loss and float metrics: ``rtol=2e-6, atol=1e-6``;
* gradients: ``atol=5e-6 * max|grad_ref| + 1e-8``, ``rtol=1e-5`` (measured: 7e-7 * max).
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

B, A, H, V, R = 4, 6, 16, 40, 8
Q = A * B
CHUNK = 10  # does not divide Q: the padded last chunk is exercised
MIXED = '{"ce":0.1,"tv":0.9}'
GRAD_NAMES = ("draft_hidden", "lm_head", "markov_feature", "markov_w2", "confidence_logits")


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


def _reference(case, spec, with_conf, kw):
    t = {k: torch.tensor(v, requires_grad=k in GRAD_NAMES) for k, v in case.items()}
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
    loss, m, g = _ours(case, spec, with_conf, kw)

    np.testing.assert_allclose(loss, ref_loss, rtol=2e-6, atol=1e-6)
    assert sorted(m) == sorted(ref_m)  # jit returns dicts in sorted key order
    for k, want in ref_m.items():
        if k.endswith("_total") or "_acc_" in k or k.startswith("eal_"):
            assert m[k] == want, k
        else:
            np.testing.assert_allclose(m[k], want, rtol=2e-6, atol=1e-6, err_msg=k)
    assert set(g) == set(ref_g)
    for k, want in ref_g.items():
        scale = float(np.abs(want).max())
        assert scale > 0, k
        np.testing.assert_allclose(g[k], want, rtol=1e-5, atol=5e-6 * scale + 1e-8, err_msg=k)


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
    t = {k: torch.tensor(v) for k, v in case.items()}
    logits = (t["draft_hidden"] @ t["lm_head"] + t["markov_feature"] @ t["markov_w2"])[None]
    targets = (t["target_hidden"] @ t["verifier_head"])[None]
    reference = {
        "ce": eager.ce_loss,
        "tv": eager.tv_loss,
        "kl_div": eager.kl_div_loss,
        "rkl": eager.reverse_kl_div_loss,
        "jsd": eager.js_div_loss,
        "nla": eager.neg_log_acceptance_loss,
        "lk_hybrid": eager.lk_hybrid_loss,
    }
    assert set(reference) == set(PER_POSITION_TERMS)
    for name, fn in reference.items():
        np.testing.assert_allclose(
            vals[name], fn(logits, targets)[0].numpy(), rtol=2e-6, atol=1e-6, err_msg=name
        )
    np.testing.assert_allclose(
        vals["accept"], 1.0 - eager.tv_loss(logits, targets)[0].numpy(), rtol=2e-6, atol=1e-6
    )
    np.testing.assert_array_equal(vals["pred_ids"], torch.argmax(logits[0], -1).numpy())
    np.testing.assert_array_equal(vals["target_ids"], torch.argmax(targets[0], -1).numpy())


@pytest.mark.parametrize(
    "spec", ["ce", "nla", "kl_div", MIXED, "{}", "[1]", '{"x": 1}', '{"ce": "a"}']
)
def test_parse_loss_fn_agrees_with_resolve_loss_config(spec):
    try:
        ref = {k: w for k, (_, w) in resolve_loss_config(spec, "eager").items()}
    except ValueError as err:
        with pytest.raises(ValueError) as ours:
            parse_loss_fn(spec)
        assert str(ours.value) == str(err)
    else:
        got = parse_loss_fn(spec)
        assert got == ref and list(got) == list(ref)
