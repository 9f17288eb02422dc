"""launch.from_gguf: a GGUF written here by llama.cpp's own converter (gguf-py, the pinned
sdist) from a tiny random Llama with tied embeddings and the demo tokenizer, turned back
into an HF folder: the same weights (exactly from f32; within Q8_0's rounding from a
quantized file), the same tokenizer and chat template, tied embeddings kept tied.
Marked ``served``: CI runs it once the llama.cpp tree is unpacked (the served run)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from tests.served.fixtures import VERIFIER

pytestmark = pytest.mark.served


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random tied-embedding Llama (2 layers, hidden 64) with the demo tokenizer."""
    if not os.environ.get("DSPARK_LLAMA_SERVER"):
        pytest.skip("the llama.cpp tree comes with the served run (DSPARK_LLAMA_SERVER)")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gguf")
    cfg = AutoConfig.for_model(
        "llama", vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(root / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(VERIFIER / name, root / "hf" / name)
    return root, {k: v.numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_gguf_round_trip(tiny_llama, tmp_path, outtype):
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    from launch import from_gguf, llamacpp_gguf

    root, weights = tiny_llama
    gguf = tmp_path / f"tiny-{outtype}.gguf"
    llamacpp_gguf.convert(root / "hf", gguf, outtype=outtype, pre_tokenizer="gpt-2")
    out = from_gguf.convert(gguf, tmp_path / "hf", dtype="float32")

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] and "quantization_config" not in cfg
    got = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in got  # tied: saved once, as the embedding
    assert set(got) == set(weights) - {"lm_head.weight"}
    for name, w in weights.items():
        if name == "lm_head.weight":
            continue
        g = got[name]
        if outtype == "f32" or w.ndim == 1:  # norms stay f32 in a Q8_0 file
            np.testing.assert_array_equal(g, w, err_msg=name)
        else:  # Q8_0: blocks of 32 along the row, scale = max|w| / 127 (f16), round to nearest
            blocks = w.reshape(w.shape[0], -1, 32)
            scale = np.abs(blocks).max(-1, keepdims=True) / 127
            # half a step of rounding, plus the scale's own f16 rounding (2**-11) times 127
            bound = scale * (0.5 + 127 * 2.0**-11) + 1e-12
            assert (np.abs(g.reshape(blocks.shape) - blocks) <= bound).all(), name

    mine, theirs = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(VERIFIER)
    text = "def add(a, b):\n    return a + b  # ünïcode, 123"
    assert mine(text)["input_ids"] == theirs(text)["input_ids"]
    turns = [{"role": "user", "content": "hi"}]
    assert mine.apply_chat_template(turns, tokenize=False, add_generation_prompt=True) == (
        theirs.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    )


def test_refuses_a_missing_file_and_a_full_folder(tmp_path):
    from launch.from_gguf import GGUFImportError, convert

    with pytest.raises(GGUFImportError, match="no such file"):
        convert(tmp_path / "none.gguf", tmp_path / "out")
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("mine")
    with pytest.raises(GGUFImportError, match="not empty"):
        convert(tmp_path / "x.gguf", tmp_path / "out")
    assert (tmp_path / "out" / "keep").read_text() == "mine"
