"""Confidence-head calibration: ECE, AUROC, Brier and sequential temperature scaling.

The confidence head gives slot k a logit ``c_k`` of P(slot k accepted | earlier slots
accepted). A serving stack (DSpark's prefix scheduler, TensorRT-LLM) uses the
**prefix survival** ``S_k = prod_{j <= k} sigmoid(c_j / T_j)``: the predicted
probability that draft positions 0..k are all accepted. Everything here scores
``S_k`` against the realised prefix acceptance ``Y_k = prod_{j <= k} y_j`` (y_j: 0/1,
slot j accepted given the earlier ones were), per draft position, like DeepSpec's
evaluator (``PerPositionConfidenceMetrics``: predictions are the cumulative
products, labels the accepted-prefix mask).

* ECE: ``sum_b (n_b / n) |mean(S in b) - mean(Y in b)|`` over ``bins`` equal-width
  bins of [0, 1] (a prediction of exactly 1 goes to the last bin).
* AUROC: the Mann-Whitney probability that a random accepted prefix has a higher
  ``S`` than a random rejected one (ties count one half); NaN when one class is empty.
* Brier: ``mean((S - Y)^2)``.

**Sequential temperature scaling (STS)**: one temperature per draft position,
fitted in order. With ``T_0..T_{k-1}`` fixed, ``T_k`` minimises the objective
(``nll``: binary cross entropy; or ``ece``) of ``S_k`` against ``Y_k`` on the
fitting split, by a log-spaced grid search over [``T_MIN``, ``T_MAX``] refined
around the best point. Position k is fitted on the survival the earlier positions'
calibrated temperatures produce, which is what makes it sequential (a per-position
fit on the conditional probabilities would ignore how errors compound along the
prefix).

**Global temperature**: one ``T`` for every position, fitted the same way on the
survival of all positions pooled. vLLM's adaptive verification multiplies the raw
per-slot sigmoids and reads no temperature, so this one is what ``converters export
--calibration`` folds into the confidence head (weight and bias divided by ``T``);
the per-position STS temperatures stay an evaluation report. It is saved as
``calibration.json`` in the eval output folder.

A block's position k is scored only when the slot mask covers positions 0..k.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "dspark-jax/confidence-temperatures-v1"
FORMULA = "p_k = sigmoid(logit_k / T_k); survival_k = prod_{j<=k} p_j (k = draft position)"
CALIBRATION_FORMAT = "dspark-jax/calibration-v1"
CALIBRATION_FILE = "calibration.json"
GLOBAL_FORMULA = "p_k = sigmoid(logit_k / T) at every draft position; survival_k = prod_{j<=k} p_j"
OBJECTIVES = ("nll", "ece")
T_MIN, T_MAX = 0.05, 20.0
_EPS = 1e-7


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -np.asarray(x, np.float64)))


def survival(logits: np.ndarray, temperatures: np.ndarray | None = None) -> np.ndarray:
    """``S[i, k] = prod_{j <= k} sigmoid(logits[i, j] / T_j)``; logits [n, N]."""
    logits = np.asarray(logits, np.float64)
    t = np.ones(logits.shape[1]) if temperatures is None else np.asarray(temperatures, np.float64)
    if t.shape != (logits.shape[1],):
        raise ValueError(f"temperatures must have {logits.shape[1]} values, got {t.shape}")
    if np.any(t <= 0):
        raise ValueError(f"temperatures must be positive, got {t.tolist()}")
    return np.cumprod(sigmoid(logits / t), axis=1)


def prefix_labels(accepted: np.ndarray) -> np.ndarray:
    """``Y[i, k] = prod_{j <= k} accepted[i, j]`` (0/1)."""
    return np.cumprod(np.asarray(accepted, np.float64) > 0, axis=1).astype(np.float64)


def scored(mask: np.ndarray) -> np.ndarray:
    """[n, N] bool: position k of block i is scored iff the mask covers positions 0..k."""
    return np.cumprod(np.asarray(mask) > 0, axis=1).astype(bool)


def ece(pred: np.ndarray, label: np.ndarray, bins: int = 20) -> float:
    pred, label = np.asarray(pred, np.float64), np.asarray(label, np.float64)
    if pred.size == 0:
        return float("nan")
    idx = np.clip((pred * bins).astype(np.int64), 0, bins - 1)
    count = np.bincount(idx, minlength=bins)
    gap = np.abs(np.bincount(idx, pred, bins) - np.bincount(idx, label, bins))
    return float(gap.sum() / pred.size) if count.sum() else float("nan")


def reliability(pred: np.ndarray, label: np.ndarray, bins: int = 20) -> list[dict[str, float]]:
    """Per non-empty bin: its range, mean prediction, mean label and count."""
    pred, label = np.asarray(pred, np.float64), np.asarray(label, np.float64)
    idx = np.clip((pred * bins).astype(np.int64), 0, bins - 1)
    count = np.bincount(idx, minlength=bins)
    sp, sl = np.bincount(idx, pred, bins), np.bincount(idx, label, bins)
    return [
        {
            "lo": b / bins,
            "hi": (b + 1) / bins,
            "pred": float(sp[b] / count[b]),
            "label": float(sl[b] / count[b]),
            "count": int(count[b]),
        }
        for b in range(bins)
        if count[b]
    ]


def auroc(pred: np.ndarray, label: np.ndarray) -> float:
    pred, label = np.asarray(pred, np.float64), np.asarray(label) > 0.5
    n_pos, n_neg = int(label.sum()), int((~label).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    # Average ranks (ties share their mean rank), then the Mann-Whitney U statistic.
    uniq, inverse, counts = np.unique(pred, return_inverse=True, return_counts=True)
    del uniq
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    avg_rank = first + (counts + 1) / 2.0
    ranks = avg_rank[inverse]
    u = ranks[label].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def brier(pred: np.ndarray, label: np.ndarray) -> float:
    pred, label = np.asarray(pred, np.float64), np.asarray(label, np.float64)
    return float(np.mean((pred - label) ** 2)) if pred.size else float("nan")


def nll(pred: np.ndarray, label: np.ndarray) -> float:
    p = np.clip(np.asarray(pred, np.float64), _EPS, 1.0 - _EPS)
    y = np.asarray(label, np.float64)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p))) if p.size else float("nan")


@dataclasses.dataclass(frozen=True)
class PositionMetrics:
    n: int
    ece: float
    auroc: float
    brier: float
    pred_mean: float
    label_mean: float
    reliability: list[dict[str, float]]

    def as_dict(self, with_bins: bool = True) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not with_bins:
            d.pop("reliability")
        return {k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in d.items()}


def position_metrics(
    logits: np.ndarray,
    accepted: np.ndarray,
    mask: np.ndarray,
    temperatures: np.ndarray | None = None,
    *,
    bins: int = 20,
) -> list[PositionMetrics]:
    """ECE/AUROC/Brier of the prefix survival per draft position ([n, N] inputs)."""
    pred = survival(logits, temperatures)
    label = prefix_labels(accepted)
    keep = scored(mask)
    out = []
    for k in range(pred.shape[1]):
        p, y = pred[keep[:, k], k], label[keep[:, k], k]
        out.append(
            PositionMetrics(
                n=int(p.size),
                ece=ece(p, y, bins),
                auroc=auroc(p, y),
                brier=brier(p, y),
                pred_mean=float(p.mean()) if p.size else float("nan"),
                label_mean=float(y.mean()) if y.size else float("nan"),
                reliability=reliability(p, y, bins),
            )
        )
    return out


def summary(metrics: list[PositionMetrics]) -> dict[str, float | None]:
    """Slot-count weighted means over positions (AUROC over positions where defined)."""
    w = np.array([m.n for m in metrics], np.float64)

    def mean(name: str) -> float | None:
        v = np.array([getattr(m, name) for m in metrics], np.float64)
        ok = ~np.isnan(v) & (w > 0)
        return float((v[ok] * w[ok]).sum() / w[ok].sum()) if ok.any() else None

    return {"ece": mean("ece"), "auroc": mean("auroc"), "brier": mean("brier")}


def fit_sequential_temperatures(
    logits: np.ndarray,
    accepted: np.ndarray,
    mask: np.ndarray,
    *,
    objective: str = "nll",
    bins: int = 20,
    grid: int = 161,
) -> np.ndarray:
    """STS (see the module docstring): [N] temperatures from fitting-split [n, N] arrays.

    A position with no scored blocks keeps T = 1.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    logits = np.asarray(logits, np.float64)
    label = prefix_labels(accepted)
    keep = scored(mask)
    n_pos = logits.shape[1]
    temps = np.ones(n_pos)
    prev = np.ones(logits.shape[0])  # calibrated survival through position k-1

    def loss(t: float, k: int) -> float:
        pred = prev[keep[:, k]] * sigmoid(logits[keep[:, k], k] / t)
        y = label[keep[:, k], k]
        return nll(pred, y) if objective == "nll" else ece(pred, y, bins)

    for k in range(n_pos):
        if keep[:, k].any():
            temps[k] = _minimise_on_log_grid(lambda t, k=k: loss(t, k), grid)
        prev = prev * sigmoid(logits[:, k] / temps[k])
    return temps


def _minimise_on_log_grid(loss, grid: int) -> float:
    """argmin of ``loss(T)`` over a log-spaced grid of [T_MIN, T_MAX], refined around the best."""
    log_grid = np.linspace(np.log(T_MIN), np.log(T_MAX), grid)
    step = log_grid[1] - log_grid[0]
    best = log_grid[int(np.argmin([loss(float(np.exp(g))) for g in log_grid]))]
    fine = np.linspace(best - step, best + step, 41)
    fine = fine[(fine >= log_grid[0]) & (fine <= log_grid[-1])]
    return float(np.exp(fine[int(np.argmin([loss(float(np.exp(g))) for g in fine]))]))


def fit_global_temperature(
    logits: np.ndarray,
    accepted: np.ndarray,
    mask: np.ndarray,
    *,
    objective: str = "nll",
    bins: int = 20,
    grid: int = 161,
) -> float:
    """One temperature for all positions (the module docstring): the objective of the
    survival ``S_k`` against ``Y_k`` pooled over every scored position. T = 1 when
    nothing is scored."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    logits = np.asarray(logits, np.float64)
    keep = scored(mask)
    if not keep.any():
        return 1.0
    label = prefix_labels(accepted)[keep]

    def loss(t: float) -> float:
        pred = survival(logits, np.full(logits.shape[1], t))[keep]
        return nll(pred, label) if objective == "nll" else ece(pred, label, bins)

    return _minimise_on_log_grid(loss, grid)


# ------------------------------------------------------------------ temperatures file
def temperatures_record(by_rule: dict[str, np.ndarray], rule: str, **info: Any) -> dict[str, Any]:
    if rule not in by_rule:
        raise ValueError(f"rule {rule!r} not among the fitted rules {sorted(by_rule)}")
    return {
        "format": FORMAT,
        "formula": FORMULA,
        "rule": rule,
        "temperatures": [float(t) for t in by_rule[rule]],
        "by_rule": {r: [float(t) for t in v] for r, v in by_rule.items()},
        **info,
    }


def save_temperatures(path: str | os.PathLike, record: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)
    return path


def load_temperatures(path: str | os.PathLike, rule: str | None = None) -> np.ndarray:
    """The temperatures of ``rule`` (default: the file's ``rule``) from a saved file."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a temperatures file ({e})") from None
    if record.get("format") != FORMAT:
        raise ValueError(f"{path}: format {record.get('format')!r}, expected {FORMAT!r}")
    if rule is None or rule == record.get("rule"):
        temps = record["temperatures"]
    else:
        by_rule = record.get("by_rule") or {}
        if rule not in by_rule:
            raise ValueError(f"{path}: no temperatures for rule {rule!r} (has {sorted(by_rule)})")
        temps = by_rule[rule]
    temps = np.asarray(temps, np.float64)
    if temps.ndim != 1 or np.any(~np.isfinite(temps)) or np.any(temps <= 0):
        raise ValueError(f"{path}: temperatures must be positive finite numbers, got {temps}")
    return temps


# ------------------------------------------------------------------ calibration.json
def calibration_record(temperature: float, rule: str, **info: Any) -> dict[str, Any]:
    """What ``converters export --calibration`` reads: the global temperature of ``rule``."""
    return {
        "format": CALIBRATION_FORMAT,
        "formula": GLOBAL_FORMULA,
        "rule": rule,
        "temperature": float(temperature),
        **info,
    }


def load_calibration(path: str | os.PathLike) -> dict[str, Any]:
    """A ``calibration.json`` record; its ``temperature`` is a positive finite float."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a calibration file ({e})") from None
    if not isinstance(record, dict) or record.get("format") != CALIBRATION_FORMAT:
        got = record.get("format") if isinstance(record, dict) else record
        raise ValueError(f"{path}: format {got!r}, expected {CALIBRATION_FORMAT!r}")
    t = record.get("temperature")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not np.isfinite(t) or t <= 0:
        raise ValueError(f"{path}: 'temperature' must be a positive finite number, got {t!r}")
    return record
