"""The served tests' shared setup (registered in tests/conftest.py): the demo verifier
(configs/demo/verifier, a real 3.3M-parameter Qwen3) and a small DSpark drafter trained
for it once per session with the verifier in the step (no hidden-state files), on the
first 300 demo conversations: enough that it accepts several tokens per draft, so a
served walk that drafts at the wrong anchors cannot agree by chance."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[2]
VERIFIER = ROOT / "configs/demo/verifier"
CONVERSATIONS = 300


@pytest.fixture(scope="session")
def served_drafter(tmp_path_factory) -> Path:
    """The checkpoint folder of a 1-epoch in-step demo run (2,048-token draft vocab).
    ``DSPARK_TEST_SERVED_RUN``: a folder holding such a run (ckpt/, data/) to reuse."""
    from dspark_jax.train import flags as cli
    from dspark_jax.train import trainer as train

    if os.environ.get("DSPARK_TEST_SERVED_RUN"):
        return Path(os.environ["DSPARK_TEST_SERVED_RUN"]) / "ckpt"
    root = tmp_path_factory.mktemp("served")
    subprocess.run(
        [sys.executable, "-m", "launch.prepare_data", "--model", str(VERIFIER),
         "--data", str(ROOT / "configs/demo/conversations.jsonl"), "--output", str(root / "data"),
         "--seq-length", "1024", "--minimum-valid-tokens", "16", "--draft-vocab-size", "2048",
         "--max-samples", str(CONVERSATIONS)],
        check=True, cwd=ROOT, capture_output=True,
    )  # fmt: skip
    argv = [
        "--config", str(ROOT / "configs/demo/train.yaml"),
        "--verifier-name-or-path", str(VERIFIER),
        "--hidden-states-backend", "jax", "--verifier-dtype", "float32",
        "--data-path", str(root / "data"), "--save-path", str(root / "ckpt"),
        "--log-dir", str(root / "logs"), "--run-name", "served", "--epochs", "1",
    ]  # fmt: skip
    assert train.run(cli.resolve(argv), devices=jax.devices()[:1]) == 0
    return root / "ckpt"


def heldout_prompts(n: int) -> list[list[int]]:
    """The first ``n`` held-out demo prompts as token ids (chat template applied), as
    bench/served_acceptance.py sends them."""
    from transformers import AutoTokenizer

    from bench.served_acceptance import prompts

    tok = AutoTokenizer.from_pretrained(VERIFIER)
    return prompts(ROOT / "configs/demo/conversations_heldout.jsonl", tok, n)
