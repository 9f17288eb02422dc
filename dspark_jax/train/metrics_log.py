"""Training logs: the reference's metric records, as JSONL, TensorBoard and a console line.

A record is what ``speculators.train`` hands its ``speculators.metrics`` logger
(trainer.py): ``{"train": {...}, "profile": {...}, "epoch": e, "lr": ..., "global_step":
s}`` every ``--log-freq`` steps and ``{"val": {"loss_epoch": ..., ...}, "epoch": e}``
after each validation, with the same metric names (``normalize_counted_metrics``
turns the ``*_sum``/``*_total`` pairs into ``loss``, ``accept_len``, ...). Each JSONL
line is the record plus ``"step"`` (the reference's ``extra={"step": ...}``);
TensorBoard gets the record flattened with ``/`` (``train/loss``, ``lr/Muon``), as the
reference's TensorBoardHandler does; ``wandb``, ``trackio`` and ``mlflow`` get it as the
reference's handlers do (:mod:`dspark_jax.train.trackers`). Only process 0 writes.

The ``profile`` part of a train record holds the reference's ``fetch_ms`` (the time the
loop waited for the input pipeline), ``step_ms``, ``tokens_per_s`` and ``fetch_frac``,
and our throughput figures: ``tflops_per_device`` and ``mfu`` (docs/math.md, "Step
FLOPs"; no MFU where the device's peak is unknown, e.g. CPU) and ``memory_mb``
(``in_use``/``peak``, the largest over this process's devices, where the backend reports
it).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO


def normalize_counted_metrics(metrics: dict[str, float], world_size: int = 1) -> dict[str, float]:
    """speculators/train/utils.py::normalize_counted_metrics (same order of keys)."""
    metrics = dict(metrics)
    normalized: set[str] = set()
    for tk in [k for k in metrics if k.endswith("_total")]:
        prefix = tk.removesuffix("_total")
        sk = f"{prefix}_sum"
        if sk in metrics:
            total = metrics[tk]
            metrics[prefix] = metrics[sk] / total if total > 0 else 0.0
            del metrics[sk]
            normalized.add(prefix)
        del metrics[tk]
    if world_size > 1:
        for k in metrics:
            if k not in normalized:
                metrics[k] /= world_size
    return metrics


def has_samples(metrics: Mapping[str, float]) -> bool:
    """Whether raw counted metrics saw a supervised draft slot (``eal_total``: blocks with
    one). Without one every ratio is 0/0, which the reference logs as 0.0: a perfect
    loss that ``--step best`` would then pick."""
    return metrics.get("eal_total", 1.0) > 0


def step_metrics(raw: Mapping[str, float]) -> dict[str, float | None]:
    """:func:`normalize_counted_metrics`, with null ratios (not 0) when no sample was seen."""
    out = normalize_counted_metrics(dict(raw))
    if has_samples(raw):
        return out
    return {k: (v if k == "error_records" else None) for k, v in out.items()}


def flatten(record: Mapping[str, Any], sep: str = "/", prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in record.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, sep, f"{prefix}{k}{sep}"))
        else:
            out[prefix + k] = v
    return out


def _tensorboard_writer(log_dir: Path):
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise RuntimeError(
            "--logger tensorboard needs the tensorboardX package (pip install "
            "'dspark-jax[loggers]'); metrics are in the JSONL file regardless"
        ) from None
    log_dir.mkdir(parents=True, exist_ok=True)
    return SummaryWriter(logdir=str(log_dir))


class MetricsLog:
    """JSONL (always) + the ``--logger`` trackers on process 0.

    ``run_dir`` is ``<log-dir>/<run name>``: the JSONL file and TensorBoard events go
    there, wandb gets ``<log-dir>`` as its ``dir`` and the run name as its name.
    """

    def __init__(self, run_dir: Path, loggers: list[str], enabled: bool = True):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file: TextIO | None = None
        self._tb = None
        self._trackers: list = []
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        try:
            if "tensorboard" in loggers:
                self._tb = _tensorboard_writer(Path(run_dir))
            from dspark_jax.train.trackers import TRACKERS

            for name in loggers:
                if name in TRACKERS:
                    run_dir = Path(run_dir)
                    self._trackers.append(TRACKERS[name](run_dir.name, run_dir.parent))
        except BaseException:
            self.close()
            raise

    def resume_at(self, step: int) -> None:
        """Drop the records of the work a resume from checkpoint ``step`` repeats, so that
        no step appears twice: train records of steps >= ``step`` (they are logged again)
        and validations after it (a validation precedes its epoch-end checkpoint)."""
        if not self.enabled or not self.path.exists():
            return
        lines = self.path.read_text().splitlines(keepends=True)
        keep = [line for line in lines if _logged_before(line, step)]
        if len(keep) == len(lines):
            return
        self._file.close()
        tmp = self.path.with_name(f".{self.path.name}.partial")
        tmp.write_text("".join(keep))
        os.replace(tmp, self.path)
        self._file = self.path.open("a")

    def hparams(self, config: dict[str, Any], step: int) -> None:
        if self._tb is not None:
            flat = {
                k: v if isinstance(v, (int, float, str, bool)) or v is None else json.dumps(v)
                for k, v in flatten(config).items()
            }
            self._tb.add_hparams(
                {k: ("None" if v is None else v) for k, v in flat.items()},
                {},
                name=".",
                global_step=step,
            )
        for tracker in self._trackers:
            tracker.hparams(config)

    def log(self, record: dict[str, Any], step: int) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps({**record, "step": step}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in flatten(record).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, global_step=step)
                elif isinstance(v, str):
                    self._tb.add_text(k, v, global_step=step)
        for tracker in self._trackers:
            tracker.log(record, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.close()


def _logged_before(line: str, step: int) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return True  # not ours to judge: kept
    if not isinstance(record, dict):
        return True
    if "train" in record:
        return record.get("global_step", -1) < step
    return record.get("step", -1) <= step


def _num(value: float | None) -> float:
    return float("nan") if value is None else value


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(seconds)
    h, m, s = s // 3600, s // 60 % 60, s % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _throughput_parts(profile: Mapping[str, Any]) -> list[str]:
    """Step time, TFLOP/s per device, MFU, data wait and memory of a profile record."""
    parts = []
    if "step_ms" in profile:
        parts.append(f"step {profile['step_ms']:,.0f} ms")
    if profile.get("tflops_per_device") is not None:
        parts.append(f"{profile['tflops_per_device']:.3g} TFLOP/s/device")
    mfu = profile.get("mfu")
    parts.append("MFU n/a" if mfu is None else f"MFU {100 * mfu:.1f}%")
    if "fetch_ms" in profile:
        frac = profile.get("fetch_frac", 0.0)
        parts.append(f"data wait {profile['fetch_ms']:,.1f} ms ({100 * frac:.0f}%)")
    mem = profile.get("memory_mb")
    if mem:
        parts.append(f"mem {mem['in_use'] / 1024:.2f} GiB (peak {mem['peak'] / 1024:.2f})")
    return parts


class Progress:
    """One console line: epoch, step, loss, accept_len, lr, tokens/s, ETA.

    On a terminal the line is rewritten in place; otherwise a line is printed at most
    every ``interval`` seconds (and at epoch ends).
    """

    def __init__(
        self,
        total_steps: int,
        stream: TextIO | None = None,
        interval: float = 2.0,
        enabled: bool = True,
    ):
        self.total = total_steps
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.interval = interval
        self.enabled = enabled
        self._last_print = 0.0
        self._t0: float | None = None
        self._s0 = 0
        self._tokens = 0.0
        self._rate: float | None = None

    def start(self, step: int) -> None:
        self._t0, self._s0 = time.perf_counter(), step

    def update(
        self,
        step: int,
        epoch: int,
        step_in_epoch: int,
        steps_in_epoch: int,
        metrics: dict[str, float],
        lr: float,
        tokens_per_s: float | None,
        force: bool = False,
        profile: Mapping[str, Any] | None = None,
    ) -> None:
        """``step``: optimizer steps done so far (the record's global_step + 1);
        ``profile``: the record's ``profile`` (step time, MFU, data wait, memory)."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._t0 is None:
            self.start(step - 1)
        done = step - self._s0
        per_step = (now - self._t0) / done if done > 0 else float("nan")
        eta = per_step * (self.total - step)
        parts = [
            f"epoch {epoch}",
            f"step {step_in_epoch}/{steps_in_epoch}",
            f"[{step}/{self.total}]",
            f"loss {_num(metrics.get('loss')):.4f}",
            f"accept_len {_num(metrics.get('accept_len')):.3f}",
            f"lr {lr:.2e}",
        ]
        if tokens_per_s is not None:
            parts.append(f"{tokens_per_s:,.0f} tok/s")
        if profile:
            parts += _throughput_parts(profile)
        parts.append(f"ETA {_duration(eta)}")
        line = " | ".join(parts)
        if self.tty:
            self.stream.write("\r\033[K" + line)
            if force:
                self.stream.write("\n")
        elif force or now - self._last_print >= self.interval:
            self.stream.write(line + "\n")
            self._last_print = now
        self.stream.flush()

    def message(self, text: str) -> None:
        if self.enabled:
            self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
            self.stream.flush()
