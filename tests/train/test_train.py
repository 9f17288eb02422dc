"""Training runs on the learnable tiny data: loss, metric records, checkpoints, the
8-device mesh, exact resume after SIGTERM.

One baseline run (1 device, Muon, 3 epochs of 5 steps) is shared by the tests; the
others reuse its compilations through the persistent cache.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import re
import shutil
import subprocess

import jax
import ml_dtypes
import numpy as np
import pytest
import yaml

from dspark_jax.train import flags as cli
from dspark_jax.train import trainer as train
from tests.converters.helpers import tree_digest
from tests.numerics import U
from tests.train.conftest import (
    LOSS_RTOL,
    NO_SAMPLES,
    PYTHON,
    ROOT,
    child_env,
    installed_trackers,
    make_learnable_data,
    offline_tracker_env,
    read_jsonl,
    read_mlflow,
    read_trackio,
    read_wandb,
    tiny_argv,
    write_verifier,
)

STEPS_PER_EPOCH = 5
EPOCHS = 3
RUN = {"epochs": EPOCHS, "lr": 3e-2, "optimizer": "muon"}
PROFILE = "1:3"
TRAIN_METRICS = {
    "loss",
    "ce_loss",
    "tv_loss",
    "confidence_loss",
    "confidence_abs_error",
    "confidence_pred_mean",
    "confidence_cumprod_bias",
    "accept_rate",
    "accept_len",
    "full_acc",
    "eal",
    "error_records",
    *(f"position_{k}_acc" for k in range(4)),
}


@pytest.fixture(scope="module")
def learn(tmp_path_factory):
    root = tmp_path_factory.mktemp("learn")
    verifier = write_verifier(root / "verifier")
    return verifier, make_learnable_data(root / "data", verifier)


@pytest.fixture(scope="module")
def baseline(learn, tmp_path_factory, trackio_dir):
    """The uninterrupted run: 15 steps on one device. It also logs to every installed
    tracker (offline) and profiles steps 1 and 2 (PROFILE)."""
    verifier, data = learn
    out = tmp_path_factory.mktemp("baseline")
    loggers = ",".join(["tensorboard", *installed_trackers()])
    args = cli.resolve(tiny_argv(verifier, data, out, **RUN, logger=loggers, profile_steps=PROFILE))
    with pytest.MonkeyPatch.context() as mp:
        for k, v in offline_tracker_env(out).items():
            mp.setenv(k, v)
        assert train.run(args, devices=jax.devices()[:1]) == 0
    return out, read_jsonl(out / "logs" / "run" / "metrics.jsonl"), args


def losses(records):
    return [r["train"]["loss"] for r in records if "train" in r]


def val_losses(records):
    return [r["val"]["loss_epoch"] for r in records if "val" in r]


def test_loss_is_finite_and_decreases(baseline):
    _, records, _ = baseline
    seq = losses(records)
    assert len(seq) == STEPS_PER_EPOCH * EPOCHS
    assert all(math.isfinite(x) for x in seq)
    # A progress margin (seeded run), ~250x the losses' round-off (LOSS_RTOL * 1.7).
    assert np.mean(seq[-3:]) < np.mean(seq[:3]) - 0.15, seq
    val = val_losses(records)
    assert len(val) == EPOCHS and val[-1] < val[0], val


def test_metric_records_have_the_expected_names(baseline):
    # TRAIN_METRICS is written out here; the per-row metric keys are compared with the
    # reference's compute_metrics in tests/reference/test_losses_parity.py.
    _, records, _ = baseline
    train_records = [r for r in records if "train" in r]
    first = train_records[0]
    assert set(first) == {"train", "profile", "epoch", "lr", "global_step", "step"}
    assert set(first["train"]) == TRAIN_METRICS
    # Step 0 of a linear decay: (15 - 0) / 15 = 1 exactly, so fp32(3e-2): within u.
    assert set(first["lr"]) == {"Muon", "AdamW"}
    assert first["lr"]["Muon"] == pytest.approx(3e-2, rel=U, abs=0)
    assert {"step_ms", "tokens_per_s", "fetch_ms", "fetch_frac"} <= set(first["profile"])
    assert [r["global_step"] for r in train_records] == list(range(STEPS_PER_EPOCH * EPOCHS))
    assert [r["epoch"] for r in train_records] == [
        e for e in range(EPOCHS) for _ in range(STEPS_PER_EPOCH)
    ]
    val = [r for r in records if "val" in r]
    assert set(val[0]["val"]) == {f"{k}_epoch" for k in TRAIN_METRICS - {"error_records"}}
    assert [r["step"] for r in val] == [STEPS_PER_EPOCH * (e + 1) for e in range(EPOCHS)]
    # The schedule: linear decay from step 0 (no warmup: 15 // 100 = 0 steps).
    # fp32: (15 - 14) / 15 rounded, fp32(3e-2), their product: <= 3u.
    assert train_records[-1]["lr"]["AdamW"] == pytest.approx(3e-2 * 1 / 15, rel=4 * U, abs=0)


def test_the_run_logs_to_every_tracker_and_profiles(baseline, monkeypatch):
    """Issue 20: one run, --logger tensorboard,wandb,trackio,mlflow --profile-steps 1:3.
    Each tracker holds the JSONL's train and val values under the reference's names,
    with the throughput figures; the trace of steps 1-2 is in the run's log dir."""
    out, records, _ = baseline
    trackers = installed_trackers()
    assert trackers == ["wandb", "trackio", "mlflow"] or not os.environ.get("CI")
    train_records = [r for r in records if "train" in r]
    profile = train_records[-1]["profile"]
    assert profile["tflops_per_device"] > 0 and profile["mfu"] is None  # CPU: no peak
    assert 0 <= profile["fetch_ms"] <= profile["step_ms"]
    expect = {r["step"]: r["train"]["loss"] for r in train_records}
    val = {r["step"]: r["val"]["loss_epoch"] for r in records if "val" in r}
    for k, v in offline_tracker_env(out).items():
        monkeypatch.setenv(k, v)
    got = {}
    if "wandb" in trackers:
        history, config = read_wandb(out / "logs", "run")
        got["wandb"] = history, config
        assert config["optimizer/lr"] == 3e-2 and config["logging/logger"].startswith("tens")
    if "trackio" in trackers:
        got["trackio"] = read_trackio("run")
    for name, (history, config) in got.items():
        step_key = "_step" if name == "wandb" else "step"
        assert {h[step_key]: h["train/loss"] for h in history if "train/loss" in h} == expect
        assert {h[step_key]: h["val/loss_epoch"] for h in history if "val/loss_epoch" in h} == val
        assert all(h["profile/tflops_per_device"] > 0 for h in history if "train/loss" in h)
        assert config["draft/num_layers"] == 1, name
    if "mlflow" in trackers:
        metrics = read_mlflow("run")
        assert metrics["train/loss"] == pytest.approx(expect, rel=1e-7)  # stored as float64
        assert metrics["val/loss_epoch"] == pytest.approx(val, rel=1e-7)
        assert set(metrics["profile/fetch_ms"]) == set(expect)
    traces = list((out / "logs" / "run" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1
    # Read back as TensorBoard's profile plugin / XProf would: the host plane holds the
    # profiled steps' dispatches of the jitted train step.
    events = [
        ev.name
        for plane in jax.profiler.ProfileData.from_file(str(traces[0])).planes
        for line in plane.lines
        for ev in line.events
    ]
    assert events.count("PjitFunction(train_step)") >= 2, len(events)


def test_an_input_bound_run_shows_its_data_wait(baseline, learn, tmp_path, monkeypatch):
    """The baseline's run with an input pipeline 0.25 s slower per batch: fetch_ms (the
    loop's wait for data) holds the delay. Stopped after 3 steps (same flags as the
    baseline: its compilation is reused)."""
    import time

    from dspark_jax.data.pipeline import PackedData

    delay, real = 0.25, PackedData.train_iterator

    class Slow:
        def __init__(self, inner):
            self.inner = inner

        def __next__(self):
            time.sleep(delay)
            return next(self.inner)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    class Stop(Exception):
        pass

    def stop(t):
        if t.global_step == 3:
            raise Stop

    monkeypatch.setattr(PackedData, "train_iterator", lambda self, **kw: Slow(real(self, **kw)))
    verifier, data = learn
    args = cli.resolve(tiny_argv(verifier, data, tmp_path, **RUN))
    with pytest.raises(Stop):
        train.run(args, devices=jax.devices()[:1], step_callback=stop)
    records = read_jsonl(tmp_path / "logs" / "run" / "metrics.jsonl")
    profiles = [r["profile"] for r in records if "train" in r]
    assert len(profiles) == 3
    for p in profiles:
        assert 1e3 * delay <= p["fetch_ms"] <= p["step_ms"], p
    assert profiles[-1]["fetch_frac"] >= 1e3 * delay / profiles[-1]["step_ms"] - 1e-9


def test_checkpoints_and_run_files(baseline, tmp_path):
    out, _, args = baseline
    ckpt = out / "ckpt"
    steps = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    assert steps == [5, 10, 15]  # --checkpoint-freq 1: every epoch end
    for name in ("run.yaml", "train_command.txt", "config.json"):
        assert (ckpt / name).is_file()
    meta = json.loads((ckpt / "15" / "meta" / "metadata").read_text())
    assert meta["format"] == train.CHECKPOINT_FORMAT and meta["global_step"] == 15
    assert meta["config"]["markov_rank"] == 4 and meta["metrics"]["loss"] > 0
    assert cli.resolve(["--config", str(ckpt / "run.yaml")]).values == args.values
    # The converters read a training checkpoint as is.
    from dspark_jax.convert.check import check_folder
    from dspark_jax.convert.export import export_checkpoint

    report, step = export_checkpoint(ckpt, tmp_path / "export", step="best")
    assert report.ok and step == meta["best_step"]
    assert check_folder(tmp_path / "export", target="vllm").ok


def test_resume_refuses_another_config(baseline, learn, tmp_path):
    verifier, data = learn
    out, _, _ = baseline
    shutil.copytree(out / "ckpt", tmp_path / "ckpt")
    args = cli.resolve(tiny_argv(verifier, data, tmp_path, **{**RUN, "markov_rank": 8}))
    with pytest.raises(cli.ConfigError, match="another drafter config .*markov_rank"):
        train.run(args, devices=jax.devices()[:1])


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_mesh_data2_fsdp2_tensor2_equals_one_device(baseline, learn, tmp_path):
    verifier, data = learn
    out, records, _ = baseline
    over = {
        **RUN,
        "max_steps": 3,
        "scheduler_total_steps": STEPS_PER_EPOCH * EPOCHS,
        "mesh": "data=2,fsdp=2,tensor=2",
    }
    args = cli.resolve(tiny_argv(verifier, data, tmp_path, **over))
    assert train.run(args) == 0
    sharded = losses(read_jsonl(tmp_path / "logs" / "run" / "metrics.jsonl"))
    np.testing.assert_allclose(sharded, losses(records)[:3], rtol=LOSS_RTOL)  # see conftest
    # The same from the trained drafter, which reads its inputs (a fresh one barely does:
    # rows whose aux hidden states were swapped on the mesh moved its loss by < 1e-4).
    trained = {**over, "max_steps": 2, "num_layers": None, "from_pretrained": out / "ckpt"}
    runs = {}
    for name, mesh, devices in (("one", None, jax.devices()[:1]), ("mesh", over["mesh"], None)):
        argv = tiny_argv(verifier, data, tmp_path / name, **{**trained, "mesh": mesh})
        assert train.run(cli.resolve(argv), devices=devices) == 0
        runs[name] = losses(read_jsonl(tmp_path / name / "logs" / "run" / "metrics.jsonl"))
    assert len(runs["one"]) == 2
    np.testing.assert_allclose(runs["mesh"], runs["one"], rtol=LOSS_RTOL)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_mesh_with_context_equals_one_device_and_resumes_exactly(baseline, learn, tmp_path):
    """--mesh data=2,fsdp=2,context=2: each row's 64 tokens over 2 devices. The losses are
    the one-device run's (the same sums in other orders: LOSS_RTOL), and a run resumed from
    step 5 on the same mesh continues bit for bit."""
    verifier, data = learn
    _, records, _ = baseline
    over = {
        **RUN,
        "max_steps": 10,
        "scheduler_total_steps": STEPS_PER_EPOCH * EPOCHS,
        "mesh": "data=2,fsdp=2,context=2",
    }
    assert train.run(cli.resolve(tiny_argv(verifier, data, tmp_path / "full", **over))) == 0
    full = read_jsonl(tmp_path / "full" / "logs" / "run" / "metrics.jsonl")
    np.testing.assert_allclose(losses(full)[:3], losses(records)[:3], rtol=LOSS_RTOL)
    shutil.copytree(tmp_path / "full" / "ckpt", tmp_path / "resumed" / "ckpt")
    shutil.rmtree(tmp_path / "resumed" / "ckpt" / "10")
    assert train.run(cli.resolve(tiny_argv(verifier, data, tmp_path / "resumed", **over))) == 0
    resumed = read_jsonl(tmp_path / "resumed" / "logs" / "run" / "metrics.jsonl")
    assert [r["global_step"] for r in resumed if "train" in r] == list(range(5, 10))
    assert losses(resumed) == losses(full)[5:]  # bit-exact: same batches, same anchors


def test_sigterm_then_restart_continues_exactly(baseline, learn, tmp_path, compilation_cache):
    """Kill mid-epoch (step 7 = epoch 1, step 2 of 5), restart with the same command."""
    verifier, data = learn
    _, records, _ = baseline
    argv = tiny_argv(verifier, data, tmp_path, **RUN)
    script = str(ROOT / "tests" / "train" / "sigterm_child.py")
    env = child_env(compilation_cache)
    first = subprocess.run(
        [PYTHON, script, "7", "1", *argv],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # Not done: 128 + SIGTERM, as a shell reports it, so `make` stops (issue 18.5).
    assert first.returncode == 143, first.stderr[-3000:]
    assert "interrupted (SIGTERM) at step 7" in first.stderr
    meta = json.loads((tmp_path / "ckpt" / "7" / "meta" / "metadata").read_text())
    assert (meta["reason"], meta["epoch"], meta["step_in_epoch"]) == ("interrupted", 1, 2)
    second = subprocess.run(
        [PYTHON, script, "-1", "1", *argv],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr
    resumed = read_jsonl(tmp_path / "logs" / "run" / "metrics.jsonl")
    steps = [r["global_step"] for r in resumed if "train" in r]
    assert steps == list(range(STEPS_PER_EPOCH * EPOCHS)), steps  # 0-6, then 7-14
    assert losses(resumed) == losses(records)  # bit-exact: same batches, same anchors
    assert val_losses(resumed) == val_losses(records)


def test_from_pretrained_sources(baseline, learn, tmp_path):
    """An Orbax checkpoint (a run's --save-path or `converters import`), a speculators
    folder and a config-only folder all start a run; shaping flags may not disagree."""
    from dspark_jax.checkpoint import orbax_io
    from dspark_jax.convert.export import export_checkpoint
    from dspark_jax.train import drafter_setup as draft_init

    verifier, data = learn
    out, records, _ = baseline
    trained = orbax_io.load_params(out / "ckpt", "latest")
    export_checkpoint(out / "ckpt", tmp_path / "folder", step="latest")
    (tmp_path / "config_only").mkdir()
    shutil.copy(tmp_path / "folder" / "config.json", tmp_path / "config_only" / "config.json")

    def setup(source, **over):
        argv = tiny_argv(
            verifier, data, tmp_path / "run", num_layers=None, from_pretrained=source, **over
        )
        return draft_init.build_draft(cli.resolve(argv))

    flat = dict(jax.tree_util.tree_leaves_with_path(trained.params))

    def bf16(x):  # the folder stores bf16 (round to nearest even), read back as fp32
        return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)

    def exact(x):
        return np.asarray(x)

    def stored(path):  # the folder keeps the confidence head in fp32 (vLLM holds it so)
        return exact if "confidence_head" in str(path) else bf16

    # The Orbax checkpoint holds the fp32 params: reloaded bit for bit. The folder holds
    # their bf16 rounding (the confidence head fp32): reloaded as exactly that.
    for source, expect in ((out / "ckpt", lambda path: exact), (tmp_path / "folder", stored)):
        s = setup(source)
        assert s.cfg == trained.cfg.replace(verifier_name_or_path=str(verifier))
        got = dict(jax.tree_util.tree_leaves_with_path(s.params))
        assert got.keys() == flat.keys()
        for path, value in got.items():
            assert value.dtype == np.float32, path
            np.testing.assert_array_equal(value, expect(path)(flat[path]), err_msg=str(path))
    fresh = setup(tmp_path / "config_only")
    assert fresh.params is None and fresh.cfg.markov_rank == trained.cfg.markov_rank
    with pytest.raises(cli.ConfigError, match="--markov-rank 8 conflicts"):
        setup(out / "ckpt", markov_rank=8)

    # Training from the trained weights starts where the baseline ended.
    argv = tiny_argv(
        verifier,
        data,
        tmp_path / "run",
        num_layers=None,
        from_pretrained=out / "ckpt",
        **{**RUN, "max_steps": 1},
    )
    assert train.run(cli.resolve(argv), devices=jax.devices()[:1]) == 0
    first = losses(read_jsonl(tmp_path / "run" / "logs" / "run" / "metrics.jsonl"))[0]
    assert first < np.mean(losses(records)[:3]) - 0.15


@contextlib.contextmanager
def trainer_log():
    """The trainer's log lines (its logger may not propagate: setup_logging ran)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("dspark_jax")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_resume_skips_a_truncated_checkpoint_and_logs_each_step_once(baseline, learn, tmp_path):
    """Issue 18.8 and 18.11: the newest step's arrays are truncated; the run names it,
    resumes from step 10 (moving 15 aside, bytes kept), retrains 10-14 exactly, and
    metrics.jsonl holds every step once."""
    verifier, data = learn
    out, records, _ = baseline
    shutil.copytree(out / "ckpt", tmp_path / "ckpt")
    shutil.copytree(out / "logs", tmp_path / "logs")
    for f in (tmp_path / "ckpt" / "15" / "state").rglob("d/*"):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    truncated, older = tree_digest(tmp_path / "ckpt" / "15"), tree_digest(tmp_path / "ckpt" / "10")
    args = cli.resolve(tiny_argv(verifier, data, tmp_path, **RUN))
    with trainer_log() as log:
        assert train.run(args, devices=jax.devices()[:1]) == 0
    lines = log.getvalue().splitlines()
    skipped = [line for line in lines if "is unreadable" in line]
    assert len(skipped) == 1, lines
    # One short line (issue 32): the step, the file relative to the checkpoint and the
    # cause in words, not TensorStore's spec.
    assert re.fullmatch(
        r"checkpoint step 15 is unreadable \(15/state/d/[0-9a-f]+: truncated: \d+ of \d+ "
        r"bytes\): skipped \(moved to 15\.unreadable\); resuming from step 10",
        skipped[0],
    ), skipped[0]
    assert len(skipped[0]) <= 200
    assert any(line.startswith(f"resumed from {tmp_path / 'ckpt'}/10:") for line in lines)
    assert tree_digest(tmp_path / "ckpt" / "15.unreadable") == truncated
    assert tree_digest(tmp_path / "ckpt" / "10") == older
    resumed = read_jsonl(tmp_path / "logs" / "run" / "metrics.jsonl")
    assert [r["global_step"] for r in resumed if "train" in r] == list(range(15))
    assert [r["step"] for r in resumed if "val" in r] == [5, 10, 15]
    assert losses(resumed) == losses(records) and val_losses(resumed) == val_losses(records)


def test_per_document_anchors_resume_exactly(baseline, learn, tmp_path):
    """--anchor-sampling per-document: other anchors than the default's (other losses),
    and a run resumed from step 5 redraws steps 5-14's anchors exactly (same losses)."""
    verifier, data = learn
    _, records, _ = baseline
    argv = tiny_argv(verifier, data, tmp_path / "full", **RUN, anchor_sampling="per-document")
    assert train.run(cli.resolve(argv), devices=jax.devices()[:1]) == 0
    full = read_jsonl(tmp_path / "full" / "logs" / "run" / "metrics.jsonl")
    assert len(losses(full)) == 15 and losses(full) != losses(records)
    shutil.copytree(tmp_path / "full" / "ckpt", tmp_path / "resumed" / "ckpt")
    for step in ("10", "15"):
        shutil.rmtree(tmp_path / "resumed" / "ckpt" / step)
    argv = tiny_argv(verifier, data, tmp_path / "resumed", **RUN, anchor_sampling="per-document")
    assert train.run(cli.resolve(argv), devices=jax.devices()[:1]) == 0
    resumed = read_jsonl(tmp_path / "resumed" / "logs" / "run" / "metrics.jsonl")
    assert [r["global_step"] for r in resumed if "train" in r] == list(range(5, 15))
    assert losses(resumed) == losses(full)[5:]  # bit-exact: same batches, same anchors
    assert val_losses(resumed) == val_losses(full)[1:]


DPARD = {"loss_fn": "renyi_half", "per_position_loss_weight": "dpard", "dpard_alpha": 0.4}


def test_dpard_trains_logs_its_metrics_and_resumes_exactly(baseline, learn, tmp_path):
    """--loss-fn renyi_half --per-position-loss-weight dpard through the trainer: the
    loss falls, the records have D-PARD's metrics (and no ce/tv terms), run.yaml keeps the
    flags, and a run resumed from step 5 continues bit-exactly."""
    verifier, data = learn
    _, records, _ = baseline
    argv = tiny_argv(verifier, data, tmp_path / "full", **RUN, **DPARD)
    assert train.run(cli.resolve(argv), devices=jax.devices()[:1]) == 0
    full = read_jsonl(tmp_path / "full" / "logs" / "run" / "metrics.jsonl")
    seq = losses(full)
    assert len(seq) == STEPS_PER_EPOCH * EPOCHS and all(math.isfinite(x) for x in seq)
    assert seq != losses(records)
    first = [r["train"] for r in full if "train" in r][0]
    dpard_metrics = {
        "dpard_loss",
        "dpard_credit",
        *(f"position_{k}_dpard_credit" for k in range(4)),
    }
    assert set(first) == TRAIN_METRICS - {"ce_loss", "tv_loss"} | dpard_metrics
    # loss = actor + confidence (alpha 1), each a mean over the step's 4 rows: the two
    # sums of 4 row values and the row's own addition, <= 8u of the magnitudes.
    for r in (r["train"] for r in full if "train" in r):
        parts = r["dpard_loss"] + r["confidence_loss"]
        assert abs(r["loss"] - parts) <= 8 * U * (abs(r["dpard_loss"]) + abs(r["confidence_loss"]))
        assert (
            r["dpard_credit"] > 0 and r["position_0_dpard_credit"] >= r["position_3_dpard_credit"]
        )
    # A progress margin (seeded run) far above the losses' round-off (LOSS_RTOL).
    assert np.mean(seq[-3:]) < np.mean(seq[:3]) - 0.05, seq
    run_yaml = yaml.safe_load((tmp_path / "full" / "ckpt" / "run.yaml").read_text())["train"]
    assert run_yaml["loss"]["loss_fn"] == "renyi_half"
    assert run_yaml["dflash"]["per_position_loss_weight"] == "dpard"
    assert run_yaml["dflash"]["dpard_alpha"] == 0.4
    shutil.copytree(tmp_path / "full" / "ckpt", tmp_path / "resumed" / "ckpt")
    for step in ("10", "15"):
        shutil.rmtree(tmp_path / "resumed" / "ckpt" / step)
    argv = tiny_argv(verifier, data, tmp_path / "resumed", **RUN, **DPARD)
    assert train.run(cli.resolve(argv), devices=jax.devices()[:1]) == 0
    resumed = read_jsonl(tmp_path / "resumed" / "logs" / "run" / "metrics.jsonl")
    assert [r["global_step"] for r in resumed if "train" in r] == list(range(5, 15))
    assert losses(resumed) == seq[5:]  # bit-exact: same batches, anchors and weights
    assert val_losses(resumed) == val_losses(full)[1:]


def test_a_validation_without_samples_is_no_loss(tmp_path):
    """Issue 18.4: every validation sample skipped: no val record, and the epoch-end
    checkpoint carries no metrics (so `--step best` never picks it). The loop's own
    pieces around validate() are stand-ins: no compilation needed."""
    from types import SimpleNamespace

    from dspark_jax.train.metrics_log import MetricsLog, Progress

    class Batches(list):
        def close(self):
            pass

    t = train.Trainer.__new__(train.Trainer)
    t.args = SimpleNamespace(num_workers=0, prefetch_factor=2, save_best=False, checkpoint_freq=1)
    t.data = SimpleNamespace(val_iterator=lambda **_: Batches([{"error_records": np.ones(4)}]))
    raw = {k: v for k, v in NO_SAMPLES.items() if not k.startswith("error_records")}
    t.eval_step = lambda *_: raw
    t._global = lambda batch: batch
    t.state, t.frozen, t.global_step = {"params": None}, None, 5
    t.best_val_loss, t.ckpt = math.inf, SimpleNamespace(best_step=None)
    t.metrics, out = MetricsLog(tmp_path, []), io.StringIO()
    t.progress = Progress(1, stream=out)
    saved = []
    t.save = lambda reason, metrics=None: saved.append((reason, metrics))
    t.end_of_epoch(0)
    t.metrics.close()
    assert saved == [("epoch_end", None)]
    assert (t.best_val_loss, t.ckpt.best_step) == (math.inf, None)
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    assert out.getvalue() == (
        "validation epoch 0: no supervised token (4 samples skipped); no validation loss recorded\n"
    )
