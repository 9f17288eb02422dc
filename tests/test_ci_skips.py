"""tests/conftest.py: under CI=true a skip that means a broken machine or install fails
the run (the 8 simulated devices, srun on PATH, the loggers extra's trackers); outside
CI it stays a skip, and an optional feature's skip stays one in CI."""

from __future__ import annotations

import pytest

from tests import conftest


class _Item:
    def get_closest_marker(self, name):
        return None


@pytest.mark.parametrize(
    "reason",
    [
        "needs 8 (simulated) devices",
        "this machine has srun",
        "could not import 'wandb': No module named 'wandb'",
        "could not import 'trackio': No module named 'trackio'",
        "could not import 'mlflow': No module named 'mlflow'",
    ],
)
def test_a_broken_machine_skip_fails_only_under_ci(monkeypatch, reason):
    monkeypatch.setattr(conftest, "CI", True)
    why = conftest._item_skip_is_failure(_Item(), reason)
    assert why is not None and "CI_NEVER_SKIPS" in why
    monkeypatch.setattr(conftest, "CI", False)
    assert conftest._item_skip_is_failure(_Item(), reason) is None


def test_an_optional_skip_stays_a_skip_under_ci(monkeypatch):
    monkeypatch.setattr(conftest, "CI", True)
    assert conftest._item_skip_is_failure(_Item(), "needs a CUDA GPU") is None


class _Marked(_Item):
    def __init__(self, marker: str):
        self.marker = marker

    def get_closest_marker(self, name):
        return object() if name == self.marker else None


@pytest.mark.parametrize("marker", ["vllm", "served", "sglang_jax", "tpu", "cuda_compile"])
def test_an_engine_test_skip_fails_only_under_ci(monkeypatch, marker):
    """The engines' tests (their venvs and servers built by .ci/run) may not skip in CI."""
    monkeypatch.setattr(conftest, "CI", True)
    why = conftest._item_skip_is_failure(_Marked(marker), "DSPARK_X_PYTHON is not set")
    assert why is not None and f"'{marker}'" in why
    monkeypatch.setattr(conftest, "CI", False)
    assert conftest._item_skip_is_failure(_Marked(marker), "DSPARK_X_PYTHON is not set") is None
