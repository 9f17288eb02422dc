"""Confidence calibration: metrics on known cases, STS on an over-confident head, JSON round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_jax.eval import calibration


def test_metrics_on_known_cases():
    pred = np.array([0.1, 0.4, 0.35, 0.8])
    label = np.array([0, 0, 1, 1])
    assert calibration.auroc(pred, label) == pytest.approx(0.75)  # 3 of 4 pairs ordered
    assert calibration.auroc(np.full(4, 0.5), label) == pytest.approx(0.5)  # ties count half
    assert np.isnan(calibration.auroc(pred, np.ones(4)))
    assert calibration.brier(pred, label) == pytest.approx(np.mean((pred - label) ** 2))
    # 2 bins: [0, .5) holds 0.1, 0.4, 0.35 (mean .2833, labels 1/3); [.5, 1] holds 0.8 (label 1).
    want = (3 * abs(0.85 / 3 - 1 / 3) + abs(0.8 - 1.0)) / 4
    assert calibration.ece(pred, label, bins=2) == pytest.approx(want)
    assert calibration.ece(np.array([0.0, 1.0]), np.array([0, 1]), bins=10) == 0.0
    # Survival and prefix labels are cumulative products; a masked position ends scoring.
    logits = np.array([[0.0, 0.0, 0.0]])
    np.testing.assert_allclose(calibration.survival(logits), [[0.5, 0.25, 0.125]])
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


def test_sts_calibrates_an_overconfident_head_on_held_out_data(tmp_path):
    rng = np.random.default_rng(0)
    fit = _synthetic(6000, rng)
    held = _synthetic(6000, rng)

    raw = calibration.position_metrics(*held)
    assert min(m.ece for m in raw) > 0.05  # over-confident: badly calibrated
    temps = calibration.fit_sequential_temperatures(*fit)
    np.testing.assert_allclose(temps, 3.0, rtol=0.15)  # the sharpening undone
    cal = calibration.position_metrics(*held, temps)
    for before, after in zip(raw, cal, strict=True):
        assert after.ece < 0.5 * before.ece and after.ece < 0.03
        assert after.brier < before.brier
        assert after.auroc == pytest.approx(before.auroc, abs=0.02)  # ranking ~unchanged
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
    np.testing.assert_allclose(temps, [3.0, 1.0], rtol=0.15)
