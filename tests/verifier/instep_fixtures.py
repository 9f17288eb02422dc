"""The in-step verifier's tiny setup, shared by tests/verifier/test_instep.py and
tests/train/test_opd.py (registered in tests/conftest.py): a random HF Qwen3 verifier of
the tiny trainer shapes (hidden 8, 4 layers, vocab 1024) saved locally, the tiny prepared
data without hidden-state files, and one 2-epoch in-step run, trained once per session."""

from __future__ import annotations

import shutil

import jax
import pytest

from tests.data.conftest import make_tiny_data
from tests.train.conftest import tiny_argv

AUX = (1, 2)  # the drafter requires ascending aux layers (vLLM's capture order)
SHAPE = dict(
    vocab_size=1024,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="session")
def instep_setup(tmp_path_factory):
    """(folder holding verifier/, the HF model, the tiny data)."""
    from tests.verifier.hf_models import build  # torch: only where these tests run

    root = tmp_path_factory.mktemp("instep")
    model = build("qwen3", root / "verifier", **SHAPE)
    data = make_tiny_data(root / "data", n_docs=40, max_len=30)
    shutil.rmtree(data.hs_path)  # the in-step backend needs the prepared dataset only
    return root, model, data


def instep_argv(setup, out, **over):
    root, _, data = setup
    flags = dict(
        hidden_states_backend="jax",
        verifier_dtype="float32",
        target_layer_ids=[str(i) for i in AUX],
        epochs=2,
    )
    flags.update(over)
    return tiny_argv(root / "verifier", data, out, **flags)


@pytest.fixture(scope="session")
def instep_trained(instep_setup, tmp_path_factory):
    """The folder of a 2-epoch run (ckpt/ with a checkpoint per epoch, logs/run/)."""
    from dspark_jax.train import flags as cli
    from dspark_jax.train import trainer as train

    full = tmp_path_factory.mktemp("full")
    assert train.run(cli.resolve(instep_argv(instep_setup, full)), devices=jax.devices()[:1]) == 0
    return full
