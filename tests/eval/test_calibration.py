"""Confidence calibration: metrics on known cases, STS on an over-confident head, JSON round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_jax.eval import calibration
from tests.numerics import assert_within

F64 = 16 * 2.0**-53  # float64 sums / means of a few terms, in other orders: a few ulps


def test_metrics_on_known_cases():
    pred = np.array([0.1, 0.4, 0.35, 0.8])
    label = np.array([0, 0, 1, 1])
    assert calibration.auroc(pred, label) == 0.75  # 3 of 4 pairs ordered: exact ranks
    assert calibration.auroc(np.full(4, 0.5), label) == 0.5  # ties count half
    assert np.isnan(calibration.auroc(pred, np.ones(4)))
    brier = np.mean((pred - label) ** 2)
    assert calibration.brier(pred, label) == pytest.approx(brier, rel=F64, abs=0)
    # 2 bins: [0, .5) holds 0.1, 0.4, 0.35 (mean .2833, labels 1/3); [.5, 1] holds 0.8 (label 1).
    want = (3 * abs(0.85 / 3 - 1 / 3) + abs(0.8 - 1.0)) / 4
    assert calibration.ece(pred, label, bins=2) == pytest.approx(want, rel=F64, abs=0)
    assert calibration.ece(np.array([0.0, 1.0]), np.array([0, 1]), bins=10) == 0.0
    # Survival and prefix labels are cumulative products; a masked position ends scoring.
    logits = np.array([[0.0, 0.0, 0.0]])
    np.testing.assert_array_equal(calibration.survival(logits), [[0.5, 0.25, 0.125]])  # 2^-k
    np.testing.assert_array_equal(calibration.prefix_labels([[1, 0, 1]]), [[1, 0, 0]])
    np.testing.assert_array_equal(calibration.scored([[1, 0, 1]]), [[True, False, False]])


def _synthetic(n, rng, sharpen=(3.0, 3.0, 3.0, 3.0)):
    """True conditional acceptance sigmoid(z); the head reports sharpen * z (over-confident)."""
    z = rng.normal(0.8, 1.5, (n, len(sharpen)))
    accepted = rng.random(z.shape) < 1.0 / (1.0 + np.exp(-z))
    logits = z * np.asarray(sharpen)
    mask = np.ones_like(z)
    mask[: n // 10, 2:] = 0  # some blocks end early
    return logits, accepted, mask


def _temperature_se(logits, accepted, mask, sharpen):
    """Standard error of each fitted temperature (MLE, Fisher information at the truth).

    STS fits position k's pi = prev * sigmoid(beta l), prev the calibrated survival through
    k - 1, to the prefix label. At the truth beta = 1 / T, beta l = z, and the information
    is I = sum_i (dpi / dbeta)^2 / (pi (1 - pi)) over the scored blocks; SE(T) = T^2 /
    sqrt(I). The data are fixed (seeded), so the check below is deterministic.
    """
    z = logits / np.asarray(sharpen)
    keep = calibration.scored(mask)
    s = 1.0 / (1.0 + np.exp(-z))
    prev, out = np.ones(len(z)), []
    for k, t in enumerate(sharpen):
        pi = prev * s[:, k]
        dpi = prev * s[:, k] * (1 - s[:, k]) * logits[:, k]
        info = (dpi**2 / (pi * (1 - pi)))[keep[:, k]].sum()
        out.append(t * t / np.sqrt(info))
        prev = pi
    return np.asarray(out)


def _paired_auroc_se(a: np.ndarray, b: np.ndarray, label: np.ndarray) -> float:
    """Standard error of AUROC(a) - AUROC(b) on the same blocks (DeLong et al. 1988): the
    variance of each score's placements (a positive's share of negatives below it, ties
    half; a negative's share of positives above it), differenced per block."""

    def placements(pred):
        pos, neg = np.sort(pred[label]), np.sort(pred[~label])

        def share(x, ref):
            lo, hi = np.searchsorted(ref, x, "left"), np.searchsorted(ref, x, "right")
            return (lo + 0.5 * (hi - lo)) / len(ref)

        return share(pred[label], neg), 1 - share(pred[~label], pos)

    (pa, na), (pb, nb) = placements(a), placements(b)
    d_pos, d_neg = pa - pb, na - nb
    return float(np.sqrt(d_pos.var(ddof=1) / d_pos.size + d_neg.var(ddof=1) / d_neg.size))


def test_sts_calibrates_an_overconfident_head_on_held_out_data(tmp_path):
    rng = np.random.default_rng(0)
    fit = _synthetic(6000, rng)
    held = _synthetic(6000, rng)

    raw = calibration.position_metrics(*held)
    assert min(m.ece for m in raw) > 0.05  # over-confident: badly calibrated
    temps = calibration.fit_sequential_temperatures(*fit)
    # The sharpening undone: within 4 standard errors of the MLE (0.08 .. 0.27 here, the
    # later positions scored on fewer surviving blocks); the grid's step is 0.2% of T.
    se = _temperature_se(*fit, (3.0, 3.0, 3.0, 3.0))
    assert_within(temps, np.full(4, 3.0), 4 * se, "temperatures")
    cal = calibration.position_metrics(*held, temps)
    for before, after in zip(raw, cal, strict=True):
        # A calibrated predictor's ECE is sampling noise: per bin |mean(pred) - mean(label)|
        # has E <= sqrt(2 / pi) sqrt(p (1 - p) / n_b), so E[ECE] <= sqrt(2 / pi) sqrt(bins /
        # (4 n)) = 0.023 (20 bins, n >= 5400 blocks per position); the raw head's is > 0.05.
        assert after.ece < 0.5 * before.ece and after.ece < 0.03
        assert after.brier < before.brier
    # Position 0 is a single monotone map of the same scores: its ranking is identical.
    assert cal[0].auroc == raw[0].auroc
    # Later survivals are products of per-position maps, which reorder blocks. Ranked by
    # the true survival probability (the sharpening undone exactly), the AUROC is the best
    # one expects; the calibrated survival ranks like it: within 4 paired (DeLong) standard
    # errors, a 6e-5 false alarm per position (a head scaled only at position 0 sits 4-6 SE
    # off, one without the product 15). The raw head's products rank worse (~3 SE here).
    logits, accepted, mask = held
    truth = calibration.survival(logits, np.full(4, 3.0))
    mine = calibration.survival(logits, temps)
    labels, keep = calibration.prefix_labels(accepted) > 0.5, calibration.scored(mask)
    for k in range(1, 4):
        y, a, b = labels[keep[:, k], k], mine[keep[:, k], k], truth[keep[:, k], k]
        assert cal[k].auroc == calibration.auroc(a, y)
        gap = cal[k].auroc - calibration.auroc(b, y)
        assert abs(gap) <= 4 * _paired_auroc_se(a, b, y), (k, gap)
    by_ece = calibration.fit_sequential_temperatures(*fit, objective="ece")
    for before, after in zip(raw, calibration.position_metrics(*held, by_ece), strict=True):
        assert after.ece < 0.5 * before.ece

    # Round trip through the JSON file.
    record = calibration.temperatures_record(
        {"sampled": temps, "greedy": temps * 0.5}, "sampled", draft_positions=4
    )
    path = calibration.save_temperatures(tmp_path / "t.json", record)
    loaded = calibration.load_temperatures(path)
    np.testing.assert_array_equal(loaded, temps)
    np.testing.assert_array_equal(calibration.load_temperatures(path, "greedy"), temps * 0.5)
    again = calibration.position_metrics(*held, loaded)
    assert [m.ece for m in again] == [m.ece for m in cal]
    saved = json.loads(path.read_text())
    assert saved["format"] == calibration.FORMAT and saved["draft_positions"] == 4
    with pytest.raises(ValueError, match="no temperatures for rule 'other'"):
        calibration.load_temperatures(path, "other")
    (tmp_path / "bad.json").write_text('{"format": "x"}')
    with pytest.raises(ValueError, match="bad.json"):
        calibration.load_temperatures(tmp_path / "bad.json")


def test_sts_fits_each_position_given_the_earlier_calibrated_ones():
    # Position 0 over-confident (x3), position 1 calibrated: fitted in order, T = (3, 1).
    # Scoring position 1's survival with an uncalibrated position 0 would need T_1 != 1.
    rng = np.random.default_rng(1)
    logits, accepted, mask = _synthetic(8000, rng, sharpen=(3.0, 1.0))
    temps = calibration.fit_sequential_temperatures(logits, accepted, mask)
    se = _temperature_se(logits, accepted, mask, (3.0, 1.0))  # 0.07, 0.04
    assert_within(temps, [3.0, 1.0], 4 * se, "temperatures")
