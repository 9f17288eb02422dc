"""Metric records: normalisation, JSONL, TensorBoard names, console line.

The normalisation is compared with the reference's own function in
tests/reference/test_train_flags.py::test_normalize_counted_metrics_is_the_references.
"""

from __future__ import annotations

import io
import json
import sys
import types

import pytest

from dspark_jax.train.metrics_log import (
    MetricsLog,
    Progress,
    flatten,
    has_samples,
    normalize_counted_metrics,
    step_metrics,
)
from tests.train.conftest import NO_SAMPLES


def test_normalize_counted_metrics():
    metrics = {"loss_sum": 3.0, "loss_total": 2.0, "accept_len_sum": 1.0, "accept_len_total": 0.0,
               "orphan_total": 4.0, "other": 6.0}  # fmt: skip
    assert normalize_counted_metrics(metrics) == {"loss": 1.5, "accept_len": 0.0, "other": 6.0}
    assert normalize_counted_metrics(metrics, 3)["other"] == 2.0  # unpaired: mean over ranks


def test_jsonl_and_tensorboard_names(tmp_path, monkeypatch):
    calls = []

    class Writer:
        def __init__(self, logdir):
            calls.append(("init", logdir))

        def add_scalar(self, k, v, global_step):
            calls.append(("scalar", k, v, global_step))

        def add_text(self, k, v, global_step):
            calls.append(("text", k, v, global_step))

        def add_hparams(self, h, m, name, global_step):
            calls.append(("hparams", h["lr"], global_step))

        def flush(self):
            pass

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(sys.modules, "tensorboardX", types.SimpleNamespace(SummaryWriter=Writer))
    log = MetricsLog(tmp_path / "run", ["tensorboard"])
    log.hparams({"lr": 0.1, "target_layer_ids": [1, 2], "run_name": None}, 0)
    record = {"train": {"loss": 1.5}, "lr": {"Muon": 0.1, "AdamW": 0.01}, "epoch": 0,
              "global_step": 4, "note": "x"}  # fmt: skip
    log.log(record, 4)
    log.close()
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text()) == {**record, "step": 4}
    scalars = {c[1]: c[2] for c in calls if c[0] == "scalar"}
    assert scalars == {"train/loss": 1.5, "lr/Muon": 0.1, "lr/AdamW": 0.01, "epoch": 0,
                       "global_step": 4}  # fmt: skip
    assert ("text", "note", "x", 4) in calls and ("hparams", 0.1, 0) in calls
    assert flatten({"a": {"b": {"c": 1}}}) == {"a/b/c": 1}


def test_tensorboard_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(RuntimeError, match="needs the tensorboardX package"):
        MetricsLog(tmp_path, ["tensorboard"])


def test_progress_line():
    out = io.StringIO()
    p = Progress(100, stream=out, interval=0.0)
    p.start(0)
    p.update(10, 0, 10, 50, {"loss": 1.25, "accept_len": 2.5}, 1e-3, 1234.0)
    line = out.getvalue().strip()
    assert line.startswith("epoch 0 | step 10/50 | [10/100] | loss 1.2500 | accept_len 2.500")
    assert "lr 1.00e-03" in line and "1,234 tok/s" in line and "ETA" in line


def test_a_step_without_samples_logs_no_loss(tmp_path):
    """Issue 18.4: null (not 0) in the record, n/a on the console; counts stay."""
    assert normalize_counted_metrics(NO_SAMPLES)["loss"] == 0.0  # the reference's value
    assert not has_samples(NO_SAMPLES) and has_samples({**NO_SAMPLES, "eal_total": 2.0})
    train = step_metrics(NO_SAMPLES)
    assert train == {"loss": None, "accept_len": None, "eal": None, "error_records": 4.0}
    log = MetricsLog(tmp_path, [])
    log.log({"train": train, "global_step": 3}, 3)
    log.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["train"]["loss"] is None
    out = io.StringIO()
    Progress(10, stream=out, interval=0.0).update(4, 0, 4, 5, train, 1e-3, None)
    assert "loss nan | accept_len nan" in out.getvalue()


def test_resume_drops_the_records_a_resume_repeats(tmp_path):
    """Issue 18.11: resuming from checkpoint 10 (saved after epoch 1's validation) keeps
    train steps 0-9 and the validations up to step 10; later lines go (logged again)."""
    log = MetricsLog(tmp_path, [])
    for step in range(15):
        log.log({"train": {"loss": 1.0}, "global_step": step}, step)
        if step + 1 in (5, 10, 15):
            log.log({"val": {"loss_epoch": 1.0}, "epoch": step // 5}, step + 1)
    log.resume_at(10)
    log.log({"train": {"loss": 2.0}, "global_step": 10}, 10)
    log.close()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in records if "train" in r] == list(range(11))
    assert [r["step"] for r in records if "val" in r] == [5, 10]
    assert records[-1]["train"]["loss"] == 2.0
