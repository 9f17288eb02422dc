"""Verifier tensors: exact key, suffix, aliases, sharded index, tied heads, errors."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from dspark_jax.verifier.frozen import VerifierWeightsError, load_verifier_tensors, resolve_key
from tests.data.conftest import write_safetensors

BF16 = np.dtype(ml_dtypes.bfloat16)
V, H = 16, 8


def _t(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(BF16)


def make_folder(path, tensors, *, shards=1, config=None):
    path.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    if shards == 1:
        write_safetensors(path / "model.safetensors", tensors, {"format": "pt"})
    else:
        wmap = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: tensors[k] for k in names[s::shards]}
            write_safetensors(path / fname, part, {"format": "pt"})
            wmap.update(dict.fromkeys(part, fname))
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def llama_like():
    return {
        "model.embed_tokens.weight": _t(0, V, H),
        "lm_head.weight": _t(1, V, H),
        "model.norm.weight": _t(2, H),
        "model.layers.0.input_layernorm.weight": _t(3, H),
        "model.layers.0.mlp.down_proj.weight": _t(4, H, 2 * H),
    }


@pytest.mark.parametrize("shards", [1, 3])
def test_reads_the_three_tensors(tmp_path, shards):
    t = llama_like()
    vt = load_verifier_tensors(make_folder(tmp_path / "m", t, shards=shards))
    assert vt.keys == {
        "embed_tokens.weight": "model.embed_tokens.weight",
        "lm_head.weight": "lm_head.weight",
        "model.norm.weight": "model.norm.weight",
    }
    assert not vt.tied and vt.embed_tokens.dtype == BF16
    for got, key in (
        (vt.embed_tokens, "model.embed_tokens.weight"),
        (vt.lm_head, "lm_head.weight"),
        (vt.norm, "model.norm.weight"),
    ):
        np.testing.assert_array_equal(got.view(np.uint16), t[key].view(np.uint16))


def test_draft_vocab_rows_and_tied_head(tmp_path):
    t = llama_like()
    del t["lm_head.weight"]
    t2d = np.zeros(V, bool)
    t2d[[1, 4, 9]] = True
    vt = load_verifier_tensors(
        make_folder(tmp_path / "m", t, config={"tie_word_embeddings": True}), t2d
    )
    assert vt.tied and vt.lm_head.shape == (3, H)
    np.testing.assert_array_equal(
        vt.lm_head.view(np.uint16), t["model.embed_tokens.weight"][[1, 4, 9]].view(np.uint16)
    )
    with pytest.raises(VerifierWeightsError, match="tie_word_embeddings=false"):
        load_verifier_tensors(make_folder(tmp_path / "u", t, config={"tie_word_embeddings": False}))
    with pytest.raises(VerifierWeightsError, match=r"t2d has shape \(5,\)"):
        load_verifier_tensors(tmp_path / "m", np.ones(5, bool))


def test_suffix_matches_whole_components_and_prefers_shortest():
    keys = [
        "model.layers.0.input_layernorm.weight",
        "model.layers.61.embed_tokens.weight",
        "model.embed_tokens.weight",
        "language_model.model.norm.weight",
    ]
    assert resolve_key("embed_tokens.weight", keys) == "model.embed_tokens.weight"
    assert resolve_key("model.norm.weight", keys) == "language_model.model.norm.weight"
    # The bare norm.weight alias must not pick a per-layer norm.
    assert resolve_key("model.norm.weight", keys[:2]) is None
    assert resolve_key("model.norm.weight", ["backbone.norm_f.weight"]) == "backbone.norm_f.weight"
    assert resolve_key("lm_head.weight", ["output.weight"]) == "output.weight"


def test_missing_tensor_lists_the_names_tried(tmp_path):
    t = llama_like()
    del t["model.norm.weight"]
    with pytest.raises(
        VerifierWeightsError,
        match="no tensor for model.norm.weight; tried "
        "'model.norm.weight' .*'llm.norm.weight'.*'backbone.norm_f.weight'"
        ".*'norm.weight'",
    ):
        load_verifier_tensors(make_folder(tmp_path / "m", t))
    t = llama_like()
    del t["model.embed_tokens.weight"]
    with pytest.raises(VerifierWeightsError, match="no tensor for embed_tokens.weight"):
        load_verifier_tensors(make_folder(tmp_path / "e", t))
    (tmp_path / "no_weights").mkdir()
    with pytest.raises(VerifierWeightsError, match="neither model.safetensors.index.json"):
        load_verifier_tensors(tmp_path / "no_weights")
    with pytest.raises(VerifierWeightsError, match="not a local model folder"):
        load_verifier_tensors(tmp_path / "org/model")


def test_only_needed_shards_are_opened(tmp_path, monkeypatch):
    from dspark_jax.verifier import frozen as verifier

    t = llama_like()
    folder = make_folder(tmp_path / "m", t, shards=5)  # one tensor per shard
    opened = []
    real = verifier.SafetensorsFile

    class Spy(real):
        def __init__(self, path):
            opened.append(path.name)
            super().__init__(path)

    monkeypatch.setattr(verifier, "SafetensorsFile", Spy)
    load_verifier_tensors(folder)
    assert sorted(opened) == [
        "model-00001-of-00005.safetensors",
        "model-00002-of-00005.safetensors",
        "model-00003-of-00005.safetensors",
    ]
