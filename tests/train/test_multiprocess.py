"""Two processes on localhost (jax.distributed over gloo) train exactly like one process:
with the same 8 rows per step (4 CPU devices each), and with each row's tokens split over
both (``--mesh context=4``, 2 devices each: each process reads and holds the hidden states
of half of every row). Slow: ~2 min each on 2 cores."""

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


def _run_two(tmp_path, argv: list[str], devices: int, module: str) -> list[str]:
    port = portpicker.pick_unused_port()
    procs = [
        subprocess.Popen(
            [
                PYTHON,
                "-m",
                module,
                *argv,
                "--coordinator-address",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(pid),
            ],
            env=_env(devices),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for pid in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [out for out, _ in outs]


def test_a_row_split_over_two_processes_trains_like_one_process(tmp_path):
    """--mesh context=4 over 2 processes x 2 devices, one 64-token row per step: process 0
    builds the hidden states of tokens 0:32 only, process 1 those of 32:64 (asserted in
    tests/train/context_child.py, which also sees an interleaved device order refused).
    The losses and metrics are the one-device run's: the same sums in other orders."""
    verifier = write_verifier(tmp_path / "verifier")
    data = make_learnable_data(tmp_path / "data", verifier)
    common = {"epochs": 1, "max_steps": 3, "rows_per_step": 1, "optimizer": "adamw"}
    one = subprocess.run(
        [PYTHON, "-m", "dspark_jax.train", *tiny_argv(verifier, data, tmp_path / "one", **common)],
        check=False, env=_env(1), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    argv = tiny_argv(verifier, data, tmp_path / "two", mesh="context=4", **common)
    outs = _run_two(tmp_path, argv, 2, "tests.train.context_child")
    assert [o.strip().splitlines()[-1] for o in outs] == ["held 0:32 of 64", "held 32:64 of 64"]

    def train_metrics(run):
        records = read_jsonl(tmp_path / run / "logs" / "run" / "metrics.jsonl")
        return [r["train"] for r in records if "train" in r]

    ones, twos = train_metrics("one"), train_metrics("two")
    assert len(ones) == len(twos) == 3
    for a, b in zip(ones, twos, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], (int, float)) and not k.endswith("_per_s"):
                # conftest.LOSS_RTOL bounds a loss-like sum over the same row in another
                # order; the other metrics are sums of the same form.
                np.testing.assert_allclose(b[k], a[k], rtol=LOSS_RTOL, err_msg=k)
