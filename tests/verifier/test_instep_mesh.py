"""``--hidden-states-backend jax`` executed on 8 simulated CPU devices (issue 41): the
in-step runs of tests/verifier/instep_fixtures.py (a random HF Qwen3 verifier, fp32) on
meshes that shard the verifier and the drafter (fsdp, data x fsdp x tensor), split
rows over ``context`` (4 devices: the verifier's context split, verifier/
attention.py), and Qwen3-MoE and Kimi-Linear (KDA, MLA) verifiers with their experts sharded. Each run's
training losses, accept_len and validation losses equal the one-device run's on the same
batches (tests/train/conftest.py's LOSS_RTOL: the same fp32 sums in other orders)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dspark_jax.train import flags as cli
from dspark_jax.train import trainer as train
from dspark_jax.verifier import attention as vatt
from tests.train.conftest import LOSS_RTOL, read_jsonl
from tests.verifier.instep_fixtures import SHAPE, instep_argv

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

RUN = dict(rows_per_step=8, epochs=2)  # 8 rows: every mesh below takes the same batches
# Training with the rows split runs at context=4; the verifier's states are checked at 2,
# 4 and 8 (test_context_split.py) and the file backend trains at data=2,fsdp=2,context=2
# (tests/train/test_train.py). Each run here compiles two steps (~27 s on 2 cores).
MESHES = [
    "fsdp=8",
    "data=2,fsdp=2,tensor=2",
    "fsdp=2,context=4",
]


def _run(setup, out, mesh=None):
    argv = instep_argv(setup, out, **RUN, mesh=mesh)
    devices = jax.devices()[:1] if mesh is None else None
    assert train.run(cli.resolve(argv), devices=devices) == 0
    records = read_jsonl(out / "logs" / "run" / "metrics.jsonl")
    train_rows = [r["train"] for r in records if "train" in r]
    return {
        "loss": [r["loss"] for r in train_rows],
        "accept_len": [r["accept_len"] for r in train_rows],
        "val": [r["val"]["loss_epoch"] for r in records if "val" in r],
    }


def _assert_equal_runs(got, want):
    assert len(got["loss"]) == len(want["loss"]) >= 2 and len(got["val"]) == 2
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=LOSS_RTOL, err_msg=name)


@pytest.fixture(scope="module")
def one_device(instep_setup, tmp_path_factory):
    return _run(instep_setup, tmp_path_factory.mktemp("one"))


@pytest.mark.parametrize("mesh", MESHES)
def test_instep_run_on_a_mesh_equals_one_device(
    instep_setup, one_device, tmp_path, mesh, monkeypatch
):
    split = []  # the verifier's attention traced with the row's tokens split
    real = vatt._split_attention
    monkeypatch.setattr(vatt, "_split_attention", lambda *a, **k: split.append(1) or real(*a, **k))
    _assert_equal_runs(_run(instep_setup, tmp_path, mesh), one_device)
    assert bool(split) == ("context" in mesh)


# The MoE verifiers' shapes: the tiny trainer's, MLA's heads all key-value heads.
# Kimi-Linear has DeepSeek-V3's MLA (unrotated) and routing, and KDA layers (3 of the 4,
# their heads over tensor); DeepSeek-V3's own forward is test_forward's.
MOE = {
    "qwen3_moe": SHAPE,  # 4 experts, top 2
    "kimi_linear": {  # 8 experts in 4 groups, top 2
        **SHAPE,
        "num_key_value_heads": 2,
        "linear_attn_config": dict(
            head_dim=4,
            num_heads=2,
            short_conv_kernel_size=4,
            kda_layers=[1, 2, 4],
            full_attn_layers=[3],
        ),
    },
}


@pytest.mark.parametrize("family", list(MOE))
def test_moe_verifier_with_sharded_experts_equals_one_device(instep_setup, tmp_path, family):
    """The same data with an MoE verifier of the trainer's shape. Expert tensors [E, 2I, H]
    and [E, H, I]: whole experts over fsdp=4, their width I over tensor=2."""
    from tests.verifier.hf_models import build

    _, _, data = instep_setup
    model = build(family, tmp_path / "verifier", **MOE[family])
    setup = (tmp_path, model, data)
    one = _run(setup, tmp_path / "one")
    _assert_equal_runs(_run(setup, tmp_path / "mesh", "fsdp=4,tensor=2"), one)
