"""Experiment trackers of ``--logger``: Weights & Biases, Trackio and MLflow, as the
reference's handlers in ``speculators/train/logger.py`` drive them.

* ``wandb``: ``wandb.init(dir=<log-dir>, name=<run name>, config={})``; the run config
  gets each flattened hyperparameter (``run.config[k] = v``), a record is
  ``run.log(flat, step=step)``; at the end ``run.finish()`` and ``wandb.teardown()``.
  The project, entity, mode (``WANDB_PROJECT``,
  ``WANDB_ENTITY``, ``WANDB_MODE=offline``, ...) come from wandb's own environment
  variables.
* ``trackio``: the same calls on ``trackio.init(project="speculators", name=..., config={})``
  (Trackio has no ``dir``; ``TRACKIO_DIR`` moves its local store).
* ``mlflow``: experiment ``$MLFLOW_EXPERIMENT_NAME`` (default ``speculators``) on
  mlflow's tracking URI (``MLFLOW_TRACKING_URI``); an active run is reused, else a run
  of the same name is resumed, else one is started; ``MLFLOW_TAGS`` (JSON) are set as
  tags. Every record, the config included, is logged with ``log_metrics`` of its values
  that convert to float (as the reference does: strings and lists are dropped).

Names are flattened with ``/`` (``train/loss``, ``lr/Muon``). Only process 0 creates
trackers (MetricsLog). A tracker's package is imported when the run starts; a missing
one is named by :func:`missing_packages` when the flags are checked.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# --logger name -> the importable package it needs.
PACKAGES = {
    "tensorboard": "tensorboardX",
    "wandb": "wandb",
    "trackio": "trackio",
    "mlflow": "mlflow",
}
EXTRA = "loggers"  # the pyproject extra that installs them all
TRACKIO_PROJECT = "speculators"
MLFLOW_EXPERIMENT = "speculators"


def missing_packages(loggers: list[str]) -> str | None:
    """One line naming the packages ``loggers`` need and do not have, or None."""
    missing = [
        f"--logger {name} needs {PACKAGES[name]}"
        for name in loggers
        if name in PACKAGES and importlib.util.find_spec(PACKAGES[name]) is None
    ]
    if not missing:
        return None
    return "; ".join(missing) + f" (pip install 'dspark-jax[{EXTRA}]')"


def _flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in record.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = v
    return out


class WandbTracker:
    """The reference's WandbHandler (and, with ``package="trackio"``, TrackioHandler)."""

    package = "wandb"

    def __init__(self, run_name: str, log_dir: Path):
        self.module = importlib.import_module(self.package)
        self.run = self.module.init(**self._init_kwargs(run_name, Path(log_dir)))

    def _init_kwargs(self, run_name: str, log_dir: Path) -> dict[str, Any]:
        log_dir.mkdir(parents=True, exist_ok=True)
        return {"dir": log_dir, "name": run_name, "config": {}}

    def hparams(self, config: Mapping[str, Any]) -> None:
        for k, v in _flatten(config).items():
            self.run.config[k] = v

    def log(self, record: Mapping[str, Any], step: int) -> None:
        # The reference never logs a missing value; ours are None when no sample was seen.
        flat = {k: v for k, v in _flatten(record).items() if v is not None}
        self.run.log(flat, step=step)

    def close(self) -> None:
        self.run.finish()
        # Stop wandb's service threads now (the run is written out), not at exit: an idle
        # asyncio thread left behind can fail later in the process once its loop closes.
        self.module.teardown()


class TrackioTracker(WandbTracker):
    package = "trackio"

    def close(self) -> None:
        # trackio.finish() also forgets the run: after Run.finish() alone it stays current,
        # and trackio's exit hook finishes it again, printing after the process's last line.
        if self.module.context_vars.current_run.get() is self.run:
            self.module.finish()
        else:
            self.run.finish()

    def _init_kwargs(self, run_name: str, log_dir: Path) -> dict[str, Any]:
        del log_dir  # Trackio takes no directory (the reference ignores --log-dir too)
        return {"name": run_name, "config": {}, "project": TRACKIO_PROJECT}


class MLflowTracker:
    """The reference's MLFlowHandler."""

    def __init__(self, run_name: str, log_dir: Path):
        del log_dir  # mlflow's tracking URI decides where runs go
        import mlflow

        self.mlflow = mlflow
        self.auto_end = False
        active = mlflow.active_run()
        if active is not None:
            self.run = active
            return
        experiment = os.getenv("MLFLOW_EXPERIMENT_NAME", MLFLOW_EXPERIMENT)
        mlflow.set_experiment(experiment)
        run_id = None
        current = mlflow.get_experiment_by_name(experiment)
        if current is not None and run_name:
            past = mlflow.search_runs(
                experiment_ids=[current.experiment_id],
                filter_string="tags.mlflow.runName = '{}'".format(run_name.replace("'", r"\'")),
                max_results=1,
            )
            if not past.empty:
                run_id = past.run_id[0]
        self.run = (
            mlflow.start_run(run_id=run_id) if run_id else mlflow.start_run(run_name=run_name)
        )
        self.auto_end = True
        tags = os.getenv("MLFLOW_TAGS")
        if tags:
            mlflow.set_tags(json.loads(tags))

    def hparams(self, config: Mapping[str, Any]) -> None:
        self.log(config, None)  # the reference's handler logs the config record as metrics

    def log(self, record: Mapping[str, Any], step: int | None) -> None:
        metrics = {}
        for k, v in _flatten(record).items():
            with contextlib.suppress(ValueError, TypeError):
                metrics[k] = float(v)
        if metrics:
            self.mlflow.log_metrics(run_id=self.run.info.run_id, metrics=metrics, step=step)

    def close(self) -> None:
        if self.auto_end and self.mlflow.active_run() is not None:
            self.mlflow.end_run()


TRACKERS = {"wandb": WandbTracker, "trackio": TrackioTracker, "mlflow": MLflowTracker}
