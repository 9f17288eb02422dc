"""Two processes on localhost (jax.distributed over gloo) train exactly like one process:
with the same 8 rows per step (4 CPU devices each), and with each row's tokens split over
both (``--mesh context=4``, 2 devices each: each process reads and holds the hidden states
of half of every row). Both compare against one one-process run of the same flags (the
module's fixture), which runs beside the first two-process run (a one-process run keeps
one of 2 cores busy). Slow: ~2.5 min in all on 2 busy cores."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pytest

from tests.multiprocess import Launched, launch, start
from tests.train.conftest import (
    LOSS_RTOL,
    make_learnable_data,
    read_jsonl,
    tiny_argv,
    write_verifier,
)

pytestmark = pytest.mark.slow

# Every run of this module: 8 rows per step, Muon, stopped at step 3 after epoch 0's end.
FLAGS = {"epochs": 2, "max_steps": 3, "rows_per_step": 8, "optimizer": "muon"}


@dataclass
class OneProcess:
    verifier: Path
    data: object  # tests.data.conftest.TinyData
    run: Path
    launched: Launched

    @cached_property
    def records(self) -> list[dict]:
        """The one-process run's metrics.jsonl, once it has exited 0."""
        self.launched.wait()
        return read_jsonl(self.run / "logs" / "run" / "metrics.jsonl")


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> Iterator[OneProcess]:
    """The verifier, the learnable data, and one run of FLAGS in one process, one device
    (started: its records wait for it)."""
    root = tmp_path_factory.mktemp("multiprocess")
    verifier = write_verifier(root / "verifier")
    data = make_learnable_data(root / "data", verifier)
    argv = tiny_argv(verifier, data, root / "one", **FLAGS)
    one = OneProcess(
        verifier, data, root / "one", start("dspark_jax.train", argv, devices=1, processes=1)
    )
    yield one
    one.launched.kill()


def _train(records: list[dict]) -> list[dict]:
    return [r["train"] for r in records if "train" in r]


def _val_losses(records: list[dict]) -> list[float]:
    return [r["val"]["loss_epoch"] for r in records if "val" in r]


def _steps(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "ckpt").iterdir() if p.name.isdigit())


def test_two_processes_give_the_same_losses_as_one(one, tmp_path):
    launch(
        "dspark_jax.train",
        tiny_argv(one.verifier, one.data, tmp_path, **FLAGS),
        devices=4,
        processes=2,
    )
    two = read_jsonl(tmp_path / "logs" / "run" / "metrics.jsonl")
    train_one = [r["loss"] for r in _train(one.records)]
    assert len(train_one) == 3 and len(_val_losses(one.records)) == 2  # epoch 0 end, step 3
    # Same rows per step, other reduction orders: the round-off bound of conftest.LOSS_RTOL.
    np.testing.assert_allclose([r["loss"] for r in _train(two)], train_one, rtol=LOSS_RTOL)
    np.testing.assert_allclose(_val_losses(two), _val_losses(one.records), rtol=LOSS_RTOL)
    assert _steps(tmp_path) == ["2", "3"]


def test_a_row_split_over_two_processes_trains_like_one_process(one, tmp_path):
    """--mesh context=4 over 2 processes x 2 devices, 8 64-token rows per step: process 0
    builds the hidden states of tokens 0:32 of each row only, process 1 those of 32:64
    (asserted in tests/train/context_child.py, which also sees an interleaved device order
    refused). The losses and metrics are the one-device run's: the same sums in other
    orders."""
    argv = tiny_argv(one.verifier, one.data, tmp_path, mesh="context=4", **FLAGS)
    outs = launch("tests.train.context_child", argv, devices=2, processes=2)
    assert [o.strip().splitlines()[-1] for o in outs] == ["held 0:32 of 64", "held 32:64 of 64"]
    two = read_jsonl(tmp_path / "logs" / "run" / "metrics.jsonl")
    ones, twos = _train(one.records), _train(two)
    assert len(ones) == len(twos) == 3
    for a, b in zip(ones, twos, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], (int, float)) and not k.endswith("_per_s"):
                # conftest.LOSS_RTOL bounds a loss-like sum over the same rows in another
                # order; the other metrics are sums of the same form.
                np.testing.assert_allclose(b[k], a[k], rtol=LOSS_RTOL, err_msg=k)
    np.testing.assert_allclose(_val_losses(two), _val_losses(one.records), rtol=LOSS_RTOL)
