"""Fixtures for the PyTorch-side tests (launch/). Nothing here imports JAX."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo"
VERIFIER = Path(os.environ.get("DSPARK_DEMO_VERIFIER", DEMO / "verifier"))
# the demo verifier has 4 decoder layers; the demo drafter uses aux layers 1 2 3 (+4)
DEMO_TARGET_LAYERS = [1, 2, 3]

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    import torch

    torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def verifier_path() -> str:
    assert (VERIFIER / "model.safetensors").exists(), (
        f"{VERIFIER} missing: run python -m launch.train_demo_verifier"
    )
    return str(VERIFIER)


@pytest.fixture(scope="session")
def demo_tokenizer(verifier_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(verifier_path)


@pytest.fixture(scope="session")
def extractor(verifier_path):
    from launch.hf_extract import HFExtractor

    return HFExtractor(verifier_path, DEMO_TARGET_LAYERS, device="cpu")


def demo_conversations(n: int, start: int = 0) -> list[dict]:
    with open(DEMO / "conversations.jsonl", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    return rows[start : start + n]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return path


@pytest.fixture(scope="session")
def small_prepared(tmp_path_factory, verifier_path):
    """A prepared dataset of demo rows (24 conversations, seq_length 256)."""
    from launch.prepare_data import prepare

    root = tmp_path_factory.mktemp("prepared")
    data = write_jsonl(root / "convs.jsonl", demo_conversations(24))
    out = root / "data"
    prepare(
        model=verifier_path,
        data=[str(data)],
        output=str(out),
        seq_length=256,
        num_workers=1,
        minimum_valid_tokens=4,
    )
    return out
