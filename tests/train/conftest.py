"""Fixtures for the trainer tests: a tiny verifier folder, tiny prepared data, flags.

JAX compilations are cached on disk for the session (and handed to subprocesses), so
runs with the same shapes compile once.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

from tests.data.conftest import make_tiny_data, write_safetensors

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    path = os.environ.get("DSPARK_TEST_JAX_CACHE") or str(tmp_path_factory.mktemp("jax_cache"))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def write_verifier(
    folder,
    *,
    vocab=1024,
    hidden=8,
    layers=4,
    heads=2,
    kv=1,
    head_dim=4,
    intermediate=16,
    seed=0,
    tokenizer=False,
    **config,
) -> Path:
    """A Qwen3-shaped verifier: config.json + the three tensors the drafter reads."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    cfg.update(config)
    (folder / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(seed)
    bf16 = ml_dtypes.bfloat16
    # The first 32 rows (the learnable data's alphabet) dominate the head: peaked targets.
    head = rng.standard_normal((vocab, hidden)) * 0.1
    head[:32] *= 10.0
    write_safetensors(
        folder / "model.safetensors",
        {
            "model.embed_tokens.weight": rng.standard_normal((vocab, hidden)).astype(bf16),
            "lm_head.weight": head.astype(bf16),
            "model.norm.weight": np.full(hidden, 2.0, bf16),
        },
        {"format": "pt"},
    )
    if tokenizer:
        vocab_map = {f"t{i}": i for i in range(vocab - 4)}
        (folder / "tokenizer.json").write_text(
            json.dumps(
                {
                    "model": {"vocab": vocab_map},
                    "added_tokens": [{"id": vocab - 4, "content": "<|eos|>"}],
                }
            )
        )
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    return folder


@pytest.fixture(scope="session")
def verifier(tmp_path_factory) -> Path:
    return write_verifier(tmp_path_factory.mktemp("verifier"))


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    return make_tiny_data(tmp_path_factory.mktemp("train_data"), n_docs=40, max_len=30)


def tiny_argv(verifier: Path, data, save: Path, **over) -> list[str]:
    """A 1-layer drafter on the tiny data (hidden 8, 2 aux layers, S=64)."""
    flags = {
        "verifier-name-or-path": str(verifier),
        "data-path": str(data.data_path),
        "save-path": str(save / "ckpt"),
        "log-dir": str(save / "logs"),
        "run-name": "run",
        "target-layer-ids": ["1", "2"],
        "mask-token-id": "1023",
        "total-seq-len": "64",
        "max-anchors": "6",
        "block-size": "4",
        "num-layers": "1",
        "markov-rank": "4",
        "epochs": "2",
        "optimizer": "adamw",
        "lr": "1e-2",
        "train-data-ratio": "0.75",
        "num-workers": "0",
        "prefetch-factor": "2",
        "loss-fn": '{"ce": 0.1, "tv": 0.9}',
        "hidden-states-dtype": "float32",
        "on-missing": "raise",
        "loss-chunk-tokens": "8",
        "rows-per-step": "4",
    }
    flags.update({k.replace("_", "-"): v for k, v in over.items()})
    argv = []
    for k, v in flags.items():
        if v is None:
            continue
        if v is True:
            argv.append(f"--{k}")
        elif isinstance(v, list):
            argv += [f"--{k}", *v]
        else:
            argv += [f"--{k}", str(v)]
    return argv


# Round-off of one logged loss of the tiny_argv drafter (hidden 8, 1 layer, 2 x 4 heads,
# intermediate 16, vocab 1024, S = 64, 6 anchors x 4): longest fp32 accumulation chain per
# layer the norm 8, q/k/v 8, scores 4, softmax sum and P V over <= 88 keys, o_proj 8,
# norm 8, gate/up 8, down 16 (236); then fc 16, norms 16, lm_head 8, the vocab sums 1024,
# Markov 4, slots 24, rows 4: 1332 -> depth 1536. Two evaluations in other orders (another
# mesh, two processes) each equal the exact loss of inputs and weights perturbed by
# <= depth u relatively, so differ by <= 2 depth u kappa |L|, kappa = sum|dL/dx||x| / |L|
# (the drafter's is 0.6-1.5 in tests/model/test_draft.py; taken <= 2). Later steps start
# from parameters that differ by the previous update's round-off; Muon's bf16 Newton-Schulz
# can turn an fp32 difference into a flipped bf16 rounding (one ulp of one update entry,
# lr * ratio * 2^-7 ~ 2e-4 on one weight): a few flips move the loss by far less than this.
LOSS_RTOL = 2 * 1536 * 2.0**-24 * 2


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def child_env(cache: str) -> dict[str, str]:
    """The parent's environment (same XLA flags: compilations are found in the cache)."""
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_COMPILATION_CACHE_DIR"] = cache
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


PYTHON = sys.executable

# batch_loss's counts for rows without one supervised token (every sample skipped): its
# clamped totals make the reference's loss 0/1 = 0 and accept_len 1 -- no value at all.
NO_SAMPLES = {"loss_sum": 0.0, "loss_total": 1.0, "accept_len_sum": 0.0, "accept_len_total": 1.0,
              "eal_sum": 0.0, "eal_total": 0.0, "error_records_sum": 4.0,
              "error_records_total": 1.0}  # fmt: skip


def make_learnable_data(root, verifier: Path, *, n_docs=80, n_aux=2, hidden=8, alphabet=32, seed=0):
    """Prepared data + hidden states a drafter can learn: each document follows
    ``next = (5 t + 3) % alphabet``, the aux layers hold the token's verifier embedding
    and the last layer points the verifier head at the next token."""
    from safetensors.numpy import load_file

    from tests.data.conftest import TinyData, write_hs, write_prepared_dataset

    rng = np.random.default_rng(seed)
    tensors = load_file(str(Path(verifier) / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"].astype(np.float32)
    head = tensors["lm_head.weight"].astype(np.float32)
    root = Path(root)
    data_path, hs = root / "prepared", root / "prepared" / "hidden_states"
    ids, masks, hidden_states = [], [], []
    for n in rng.integers(6, 31, n_docs):
        toks = [int(rng.integers(alphabet))]
        for _ in range(n - 1):
            toks.append((5 * toks[-1] + 3) % alphabet)
        toks = np.asarray(toks, np.int64)
        nxt = (5 * toks + 3) % alphabet
        aux = [embed[toks], embed[nxt] * 0.5][:n_aux]
        last = head[nxt] * 4.0
        h = np.stack([*aux, last], axis=1) + 0.05 * rng.standard_normal((n, n_aux + 1, hidden))
        ids.append(toks)
        m = np.ones(n, np.int64)
        m[0] = 0
        masks.append(m)
        hidden_states.append(h.astype(ml_dtypes.bfloat16))
    write_prepared_dataset(data_path, ids, masks)
    hs.mkdir(parents=True)
    for i in range(n_docs):
        write_hs(hs, i, ids[i], hidden_states[i])
    return TinyData(data_path, hs, ids, masks, hidden_states, n_aux, hidden, 64)


# ---------------------------------------------------------------- offline trackers
# --logger wandb/trackio/mlflow without a network: wandb offline run files, Trackio's
# local SQLite store, an MLflow file store; readers of what each stored.

TRACKERS = ("wandb", "trackio", "mlflow")


def installed_trackers() -> list[str]:
    import importlib.util

    return [t for t in TRACKERS if importlib.util.find_spec(t) is not None]


@pytest.fixture(scope="session")
def trackio_dir(tmp_path_factory) -> Path | None:
    """Trackio reads TRACKIO_DIR once, at import: set it before the first import (None:
    trackio is not installed)."""
    if "trackio" not in sys.modules:
        os.environ["TRACKIO_DIR"] = str(tmp_path_factory.mktemp("trackio"))
    try:
        import trackio.utils
    except ImportError:
        return None
    return Path(trackio.utils.TRACKIO_DIR)


def offline_tracker_env(root: Path) -> dict[str, str]:
    root = Path(root)
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_CONFIG_DIR": str(root / "wandb_config"),
        "WANDB_CACHE_DIR": str(root / "wandb_cache"),
        "WANDB_DATA_DIR": str(root / "wandb_data"),
        "HF_HUB_OFFLINE": "1",
        "MLFLOW_TRACKING_URI": (root / "mlruns").as_uri(),
        "MLFLOW_ALLOW_FILE_STORE": "true",  # mlflow 3 wants opting in to file stores
    }


def read_wandb(log_dir: Path, run_name: str, timeout: float = 30.0) -> tuple[list[dict], dict]:
    """(history rows, config) of the offline run named ``run_name`` under
    ``<log_dir>/wandb``. The run file is a LevelDB-style log of wandb Record protos (32 KiB
    blocks, 7-byte record headers: crc32, length, type full/first/middle/last), written by
    wandb's service process: ``finish()`` can return before it is whole, so it is read
    again until its ``exit`` record is there."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        runs = [
            run
            for run in map(_read_wandb_file, Path(log_dir).glob("wandb/offline-run-*/run-*.wandb"))
            if run[0] == run_name
        ]
        if len(runs) == 1 and runs[0][3]:
            return runs[0][1], runs[0][2]
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{len(runs)} complete wandb runs named {run_name!r} under {log_dir}"
            )
        time.sleep(0.2)


def _read_wandb_file(path: Path) -> tuple[str | None, list[dict], dict, bool]:
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    raw, pos, buf, records = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if n == 0 and kind == 0:
            break
        data, pos = raw[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            records.append(buf + data)
            buf = b""
        else:
            buf += data
    history, config, name, done = [], {}, None, False
    for data in records:
        record = pb.Record()
        record.ParseFromString(data)
        which = record.WhichOneof("record_type")
        if which == "run":
            name = record.run.display_name or name
        elif which == "history":
            history.append({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif which == "config":
            config.update({_key(u): json.loads(u.value_json) for u in record.config.update})
        elif which == "exit":
            done = True
    return name, history, config, done


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_trackio(run_name: str, project: str = "speculators") -> tuple[list[dict], dict]:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_logs(project, run_name), SQLiteStorage.get_run_config(
        project, run_name
    )


def read_mlflow(run_name: str, experiment: str = "speculators") -> dict[str, dict[int, float]]:
    """metric -> {step: value} of the run named ``run_name``."""
    import mlflow

    client = mlflow.tracking.MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.mlflow.runName = '{run_name}'"
    )
    assert len(runs) == 1, [r.info.run_name for r in runs]
    run = runs[0]
    return {
        key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        for key in run.data.metrics
    }
