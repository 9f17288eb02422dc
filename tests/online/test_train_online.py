"""Online training end to end: ``python -m dspark_jax.train --on-missing generate``
against ``python -m launch.serve_hidden_states`` (a real HF verifier on CPU) on
127.0.0.1 gives the same losses as offline training on the same samples extracted
to files first, through the file transport (worker processes) and through Mooncake
(the in-process store fake)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from dspark_jax.train import flags as cli
from dspark_jax.train import trainer as train
from tests.data.conftest import write_prepared_dataset
from tests.online.store_fake import FakeMooncakeStore
from tests.train.conftest import ROOT, read_jsonl, tiny_argv

pytestmark = pytest.mark.slow
LAYERS = [1, 2]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny real Qwen3 verifier (bf16), prepared rows, and their offline files."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from launch.hf_extract import HFExtractor
    from launch.hs_files import save_hidden_states

    root = tmp_path_factory.mktemp("online_train")
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=1024, hidden_size=8, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=4, intermediate_size=16, max_position_embeddings=4096,
        tie_word_embeddings=False, rms_norm_eps=1e-6,
    )  # fmt: skip
    verifier = root / "verifier"
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(verifier)
    rng = np.random.default_rng(0)
    ids, masks = [], []
    for n in rng.integers(6, 31, 48):
        toks = [int(rng.integers(32))]
        for _ in range(n - 1):
            toks.append((5 * toks[-1] + 3) % 32)
        ids.append(np.asarray(toks, np.int64))
        m = np.ones(n, np.int64)
        m[0] = 0
        masks.append(m)
    data_path = root / "prepared"
    write_prepared_dataset(data_path, ids, masks)
    offline = root / "offline_hs"
    offline.mkdir()
    extractor = HFExtractor(str(verifier), LAYERS, device="cpu", dtype="bfloat16")
    for i, row in enumerate(ids):
        save_hidden_states(offline / f"hs_{i}.safetensors", extractor.extract([row])[0], row)
    return SimpleNamespace(root=root, verifier=verifier, data_path=data_path, offline=offline,
                           extractor=extractor)  # fmt: skip


def run_losses(world, name, store_factory=None, **flags):
    out = world.root / name
    args = cli.resolve(tiny_argv(world.verifier, world, out, epochs=1, **flags))
    assert train.run(args, devices=jax.devices()[:1], store_factory=store_factory) == 0
    records = read_jsonl(out / "logs" / "run" / "metrics.jsonl")
    train_losses = [r["train"]["loss"] for r in records if "train" in r]
    val = [r["val"]["loss_epoch"] for r in records if "val" in r]
    errors = sum(r["train"].get("error_records", 0) for r in records if "train" in r)
    return train_losses, val, errors


@pytest.fixture(scope="module")
def offline(world):
    return run_losses(world, "offline", hidden_states_path=str(world.offline))


def test_online_file_transport_against_the_cli_server(world, offline):
    staging = world.root / "staging"
    cmd = [
        sys.executable, "-m", "launch.serve_hidden_states", str(world.verifier),
        "--target-layer-ids", *map(str, LAYERS), "--port", "0", "--device", "cpu",
        "--hidden-states-backend", "file", "--hidden-states-path", str(staging),
        "--compute-dtype", "bfloat16",  # as the offline files' extractor computes
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if m := re.search(r"serving .* on (http://127\.0\.0\.1:\d+/v1)", line):
                endpoint = m.group(1)
                break
        else:
            pytest.fail("server did not start:\n" + "".join(lines))
        got = run_losses(world, "online_file", on_missing="generate", vllm_endpoint=endpoint,
                         hidden_states_path=str(world.root / "empty"), num_workers=1)  # fmt: skip
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert got == offline and len(got[0]) > 0 and got[2] == 0
    assert list(staging.iterdir()) == []  # every generated file deleted after use


def test_online_mooncake_transport(world, offline):
    from dspark_jax.data.online.mooncake import MooncakeHiddenStates
    from launch.serve_hidden_states import HiddenStatesServer, MooncakePublisher

    store = FakeMooncakeStore()
    srv = HiddenStatesServer(
        world.extractor, str(world.verifier), MooncakePublisher(MooncakeHiddenStates(store))
    ).start()
    try:
        got = run_losses(world, "online_mooncake", store_factory=lambda: store,
                         on_missing="generate", vllm_endpoint=srv.base_url + "/v1",
                         hidden_states_backend="mooncake", hidden_states_path=None)  # fmt: skip
    finally:
        srv.stop()
    assert got == offline
    assert store.objects == {}
