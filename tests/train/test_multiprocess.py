"""Two processes on localhost (jax.distributed over gloo, 4 CPU devices each) train
exactly like one process with the same 8 rows per step (slow: ~2 min on 2 cores)."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import portpicker
import pytest

from tests.train.conftest import (
    LOSS_RTOL,
    PYTHON,
    ROOT,
    make_learnable_data,
    read_jsonl,
    tiny_argv,
    write_verifier,
)

pytestmark = pytest.mark.slow


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def test_two_processes_give_the_same_losses_as_one(tmp_path):
    verifier = write_verifier(tmp_path / "verifier")
    data = make_learnable_data(tmp_path / "data", verifier)
    common = {"epochs": 2, "max_steps": 3, "rows_per_step": 8, "optimizer": "muon"}

    single = tiny_argv(verifier, data, tmp_path / "one", **common)
    one = subprocess.run(
        [PYTHON, "-m", "dspark_jax.train", *single],
        check=False,
        env=_env(1),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert one.returncode == 0, one.stderr[-3000:]

    port = portpicker.pick_unused_port()
    argv = tiny_argv(verifier, data, tmp_path / "two", **common)
    procs = [
        subprocess.Popen(
            [
                PYTHON,
                "-m",
                "dspark_jax.train",
                *argv,
                "--coordinator-address",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(pid),
            ],
            env=_env(4),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]

    def losses(run):
        records = read_jsonl(tmp_path / run / "logs" / "run" / "metrics.jsonl")
        return [r["train"]["loss"] for r in records if "train" in r], [
            r["val"]["loss_epoch"] for r in records if "val" in r
        ]

    (train_one, val_one), (train_two, val_two) = losses("one"), losses("two")
    assert len(train_one) == 3 and len(val_one) == 2  # epoch 0 end, stop at step 3
    # Same rows per step, other reduction orders: the round-off bound of conftest.LOSS_RTOL.
    np.testing.assert_allclose(train_two, train_one, rtol=LOSS_RTOL)
    np.testing.assert_allclose(val_two, val_one, rtol=LOSS_RTOL)
    assert sorted(p.name for p in (tmp_path / "two" / "ckpt").iterdir() if p.name.isdigit()) == [
        "2",
        "3",
    ]
