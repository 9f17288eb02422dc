"""--logger wandb, trackio, mlflow: each offline (wandb offline run files, Trackio's local
store, an MLflow file store), read back; the flag's errors. The record shapes are the
reference's (speculators/train/logger.py); one training run logs to all of them in
tests/train/test_train.py::test_the_run_logs_to_every_tracker_and_profiles.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_jax.train import flags as cli
from dspark_jax.train.flags import ConfigError
from dspark_jax.train.metrics_log import MetricsLog
from tests.train.conftest import (
    installed_trackers,
    offline_tracker_env,
    read_mlflow,
    read_trackio,
    read_wandb,
)

CONFIG = {"seed": 42, "optimizer": {"lr": 0.01, "optimizer": "muon"},
          "draft": {"target_layer_ids": [1, 2]}, "logging": {"run_name": None}}  # fmt: skip
RECORDS = [
    ({"train": {"loss": 1.5, "accept_len": 2.0}, "profile": {"step_ms": 10.0, "mfu": None},
      "epoch": 0, "lr": {"Muon": 0.02, "AdamW": 0.01}, "global_step": 0}, 0),
    ({"train": {"loss": 1.25, "accept_len": 2.5}, "profile": {"step_ms": 8.0, "mfu": 0.25},
      "epoch": 0, "lr": {"Muon": 0.01, "AdamW": 0.005}, "global_step": 2}, 2),
    ({"val": {"loss_epoch": 1.125}, "epoch": 0, "global_step": 3}, 3),
]  # fmt: skip


@pytest.fixture
def env(tmp_path, monkeypatch):
    for k, v in offline_tracker_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("MLFLOW_TAGS", raising=False)
    return tmp_path


def _log(run_dir, loggers):
    log = MetricsLog(run_dir, loggers)
    log.hparams(CONFIG, 0)
    for record, step in RECORDS:
        log.log(record, step)
    log.close()


def test_wandb_offline_run_has_the_reference_names(env):
    pytest.importorskip("wandb")
    _log(env / "logs" / "run-w", ["wandb"])
    history, config = read_wandb(env / "logs", "run-w")
    rows = {row["_step"]: row for row in history}
    assert sorted(rows) == [0, 2, 3]
    assert rows[0]["train/loss"] == 1.5 and rows[0]["lr/Muon"] == 0.02
    assert "profile/mfu" not in rows[0] and rows[2]["profile/mfu"] == 0.25  # None: not logged
    assert rows[3]["val/loss_epoch"] == 1.125 and rows[3]["global_step"] == 3
    assert config["optimizer/lr"] == 0.01 and config["draft/target_layer_ids"] == [1, 2]
    assert config["seed"] == 42 and config["logging/run_name"] is None


def test_trackio_local_store_has_the_reference_names(env, trackio_dir):
    pytest.importorskip("trackio")
    _log(env / "logs" / "run-t", ["trackio"])
    logs, config = read_trackio("run-t")
    assert trackio_dir.is_dir() and any(trackio_dir.glob("speculators*"))
    by_step = {row["step"]: row for row in logs}
    assert sorted(by_step) == [0, 2, 3]
    assert by_step[2]["train/loss"] == 1.25 and by_step[2]["lr/AdamW"] == 0.005
    assert by_step[3]["val/loss_epoch"] == 1.125
    assert config["optimizer/lr"] == 0.01 and config["draft/target_layer_ids"] == [1, 2]


def test_mlflow_file_store_has_the_reference_names(env, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "dspark-test")
    monkeypatch.setenv("MLFLOW_TAGS", '{"team": "spec"}')
    _log(env / "logs" / "run-m", ["mlflow"])
    metrics = read_mlflow("run-m", "dspark-test")
    assert metrics["train/loss"] == {0: 1.5, 2: 1.25}
    assert metrics["lr/Muon"] == {0: 0.02, 2: 0.01} and metrics["val/loss_epoch"] == {3: 1.125}
    assert metrics["profile/mfu"] == {2: 0.25}  # None is no float: dropped, as the reference
    # The reference's handler logs the config record as metrics too (its float values).
    assert metrics["optimizer/lr"] == {0: 0.01} and metrics["seed"] == {0: 42.0}
    import mlflow

    run = mlflow.tracking.MlflowClient().search_runs(
        [mlflow.get_experiment_by_name("dspark-test").experiment_id]
    )[0]
    assert run.data.tags["team"] == "spec"
    # A second run of the same name resumes it (the reference's lookup by run name).
    log = MetricsLog(env / "logs" / "run-m", ["mlflow"])
    log.log({"train": {"loss": 1.0}}, 4)
    log.close()
    assert read_mlflow("run-m", "dspark-test")["train/loss"] == {0: 1.5, 2: 1.25, 4: 1.0}


def test_logger_flag_takes_a_comma_separated_mix():
    base = ["--verifier-name-or-path", "/v"]
    args = cli.resolve([*base, "--logger", "tensorboard, wandb,mlflow"])
    assert cli.loggers(args.values) == ["tensorboard", "wandb", "mlflow"]
    with pytest.raises(ConfigError, match=r"--logger comet is not supported \(supported: "):
        cli.resolve([*base, "--logger", "wandb,comet"])
    for bad in ("3", "2:2", "a:b", "-1:2"):
        with pytest.raises(ConfigError, match="--profile-steps must be A:B"):
            cli.resolve([*base, f"--profile-steps={bad}"])
    assert cli.parse_profile_steps("1:3") == (1, 3)


@pytest.mark.parametrize("name", ["wandb", "trackio", "mlflow", "tensorboard"])
def test_a_missing_package_is_a_one_line_install_hint(name, monkeypatch, capsys, tmp_path):
    import importlib.util

    package = {"tensorboard": "tensorboardX"}.get(name, name)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == package else real(n, *a)
    )
    monkeypatch.setitem(sys.modules, package, None)
    from dspark_jax.train.trainer import main

    assert main(["--verifier-name-or-path", str(tmp_path), "--logger", name]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --logger {name} needs {package} (pip install 'dspark-jax[loggers]')"


def test_closed_trackers_print_nothing_at_exit(tmp_path):
    """Issue 32: a process that closed its trackers ends on its own last line (Trackio
    used to finish its run again at exit, printing "* Run finished ..." after it)."""
    trackers = installed_trackers()
    if not trackers:
        pytest.skip("no tracker installed")
    script = (
        "import sys\n"
        "from dspark_jax.train.metrics_log import MetricsLog\n"
        "log = MetricsLog(sys.argv[1], sys.argv[2].split(','))\n"
        "log.log({'train': {'loss': 1.0}}, 0)\n"
        "log.close()\n"
        "print('LAST LINE', flush=True)\n"
    )
    env = {**offline_tracker_env(tmp_path), "TRACKIO_DIR": str(tmp_path / "trackio")}
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "logs" / "run"), ",".join(trackers)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "LAST LINE", out.stdout
    assert "Run finished" not in out.stderr, out.stderr
