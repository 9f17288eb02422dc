"""Build speculators 0.9.0's DSparkDraftModel with our weights, and run it on our
batch with our anchors (the test oracle). Imports torch: tests/reference only.

fp32 parity bound (``assert_fp32_parity``). Both sides run fp32; the exact value is
the reference run in float64 (``model.double()``, ``dtype=torch.float64``). An fp32
evaluation is a chain of roundings, each a relative error <= U = 2^-24 of a term; with
terms bounded by the tensor's largest magnitude ``scale`` and independent zero-mean
rounding errors, n chained roundings stay within LAMBDA sqrt(n) U scale of the exact
value with probability >= 1 - 2 exp(-LAMBDA^2 / 2) (probabilistic rounding-error
analysis, Higham & Mary 2019); LAMBDA = 6 gives 3e-8 per entry. n is the longest
accumulation chain (``tests.numerics.DRAFTER_DEPTH`` = 1024 for a drafter row's
forward, twice that for a gradient). The reference's own fp32 run is held to the same
bound, so the bound is a property of fp32 arithmetic, not of our code.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from dspark_jax.config import DSparkConfig
from dspark_jax.model.draft import FrozenWeights
from dspark_jax.model.params import to_speculators
from launch.speculators_config import reference_config
from tests.numerics import U, assert_within

LAMBDA = 6.0  # probabilistic bound, see the module docstring


def fp32_roundoff(depth: int, scale: float) -> float:
    """LAMBDA sqrt(depth) U scale: fp32 error bound of a ``depth``-rounding chain."""
    return LAMBDA * math.sqrt(depth) * U * float(scale)


def assert_fp32_parity(ours, ref32, ref64, depth: int, err_msg: str, scale=None) -> None:
    """ours (fp32) and the reference's fp32 run both within ``fp32_roundoff(depth,
    scale)`` of the reference's float64 run; scale defaults to max |ref64|."""
    ref64 = np.asarray(ref64, np.float64)
    scale = float(np.abs(ref64).max()) if scale is None else float(scale)
    bound = fp32_roundoff(depth, scale)
    assert_within(ref32, ref64, bound, f"{err_msg} (reference fp32 vs float64)")
    assert_within(ours, ref64, bound, f"{err_msg} (ours vs reference float64)")


def build_reference_model(
    cfg: DSparkConfig,
    params,
    frozen: FrozenWeights,
    t2d: np.ndarray | None = None,
    ref_config=None,
):
    """A float32 reference model holding our trainable params and frozen tensors
    (``ref_config``: the reference's own config object; default: ours translated)."""
    from speculators.models.dspark import DSparkDraftModel as RefModel

    model = RefModel(ref_config if ref_config is not None else reference_config(cfg)).float()
    sd = {k: torch.from_numpy(np.array(v)) for k, v in to_speculators(params).items()}
    sd["embed_tokens.weight"] = torch.from_numpy(np.asarray(frozen.embed_tokens))
    sd["lm_head.weight"] = torch.from_numpy(np.asarray(frozen.lm_head).T.copy())
    sd["verifier_lm_head.weight"] = torch.from_numpy(np.asarray(frozen.verifier_lm_head).T.copy())
    sd["verifier_norm.weight"] = torch.from_numpy(np.asarray(frozen.verifier_norm))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    allowed_missing = {"t2d", "d2t"}
    assert not unexpected, unexpected
    assert set(missing) <= allowed_missing, missing
    if t2d is not None:
        model.t2d.copy_(torch.from_numpy(t2d))
    return model


@dataclass
class ReferenceRun:
    loss: torch.Tensor
    metrics: dict
    logits: np.ndarray  # [Q, Vd] Markov-corrected draft logits
    targets: np.ndarray  # [Q, Vd]
    confidence_logits: np.ndarray | None
    loss_mask: np.ndarray  # [Q]
    grads: dict[str, np.ndarray]  # speculators key -> grad (torch layout)


@contextlib.contextmanager
def _injected(anchors: np.ndarray, valid: np.ndarray, captured: dict):
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core

    original_select, original_metrics = dflash_core.select_anchors, dspark_core.compute_metrics

    def select(loss_mask, num_anchors, block_size):
        assert num_anchors == len(anchors)
        return torch.from_numpy(anchors.astype(np.int64)), torch.from_numpy(valid)

    def metrics(logits, targets, confidence_logits, loss_mask, *a, **kw):
        logits.retain_grad()
        captured.update(logits=logits, targets=targets, conf=confidence_logits, mask=loss_mask)
        return original_metrics(logits, targets, confidence_logits, loss_mask, *a, **kw)

    dflash_core.select_anchors, dspark_core.compute_metrics = select, metrics
    try:
        yield
    finally:
        dflash_core.select_anchors, dspark_core.compute_metrics = original_select, original_metrics


def run_reference(
    model,
    row: dict[str, np.ndarray],
    anchors: np.ndarray,
    valid: np.ndarray,
    *,
    loss_fn: str,
    gamma: float = 4.0,
    confidence_head_alpha: float = 1.0,
    per_position_loss_weight: str = "fixed-exp-decay",
    dtype: torch.dtype = torch.float32,
) -> ReferenceRun:
    """Forward + backward of the reference on one row with the given anchors.

    ``dtype=torch.float64`` (with ``model.double()``) gives the exact-arithmetic
    oracle the fp32 tolerances are measured against."""
    from speculators.losses import eager, resolve_loss_config

    def t(name, dtype=None):
        x = torch.from_numpy(np.asarray(row[name]))[None]
        return x.to(dtype) if dtype is not None else x

    captured: dict = {}
    model.zero_grad(set_to_none=True)
    with _injected(anchors, valid, captured):
        _, loss, metrics = model(
            hidden_states=t("hidden_states", dtype),
            input_ids=t("input_ids", torch.long),
            loss_mask=t("loss_mask", torch.long),
            verifier_last_hidden_states=t("verifier_last_hidden_states", dtype),
            document_ids=t("document_ids", torch.long),
            position_ids=t("position_ids", torch.long),
            loss_config=resolve_loss_config(loss_fn, "eager"),
            tv_loss_fn=eager.tv_loss,
            gamma=gamma,
            max_anchors=len(anchors),
            confidence_head_alpha=confidence_head_alpha,
            per_position_loss_weight=per_position_loss_weight,
        )
    loss.backward()
    grads = {
        k: p.grad.detach().numpy().copy()
        for k, p in model.named_parameters()
        if p.requires_grad and p.grad is not None
    }
    conf = captured["conf"]
    return ReferenceRun(
        loss=loss.detach(),
        metrics={k: float(v) for k, v in metrics.items()},
        logits=captured["logits"].detach()[0].numpy(),
        targets=captured["targets"].detach()[0].numpy(),
        confidence_logits=None if conf is None else conf.detach()[0].numpy(),
        loss_mask=captured["mask"].detach()[0].numpy(),
        grads=grads,
    )
