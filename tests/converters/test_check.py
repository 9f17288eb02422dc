"""dspark_jax.convert.check: a correct folder passes; each way vLLM would mis-load one fails
with a message naming the field or tensor (table-driven: one mutation per row)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from dspark_jax.convert.check import check_folder, expected_tensors
from dspark_jax.convert.export import export_params
from dspark_jax.model.params import speculators_key
from dspark_jax.train.checkpoint import abstract_params
from tests.converters.helpers import base_config, make_vocab, random_params, write_verifier


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Good exports: full vocab and reduced vocab (vanilla head), verifier name set."""
    root = tmp_path_factory.mktemp("check")
    full_cfg = base_config()
    red_cfg = base_config(draft_vocab_size=40)
    verifier = write_verifier(root / "verifier", red_cfg)
    export_params(full_cfg, random_params(full_cfg), root / "full", verifier_name_or_path="org/v")
    export_params(
        red_cfg,
        random_params(red_cfg),
        root / "reduced",
        vocab_maps=make_vocab(red_cfg),
        verifier_path=verifier,
        verifier_name_or_path="org/v",
    )
    return root


def edit_config(folder, fn):
    path = folder / "config.json"
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def edit_tensors(folder, fn, metadata=None):
    path = folder / "model.safetensors"
    with safe_open(path, "np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    fn(tensors)
    save_file(tensors, str(path), metadata=meta if metadata is None else metadata)


def _del(*keys):
    def fn(d):
        for k in keys:
            d.pop(k)

    return fn


def _set(**kv):
    return lambda d: d.update(kv)


def _tl(fn):
    return lambda d: fn(d["transformer_layer_config"])


def _rope(**kv):
    return _tl(lambda tl: tl["rope_parameters"].update(kv))


LONGROPE = dict(
    rope_type="longrope",
    short_factor=[1.0, 1.1, 1.2, 1.3],
    long_factor=[2.0, 3.0, 4.0, 5.0],
    original_max_position_embeddings=16,
)


def _t2d_shift(t):
    t["t2d"] = np.roll(t["t2d"], 1)


# name: (base folder, config edit, tensor edit, error regex)
MUTATIONS = {
    "missing-key": (
        "full",
        None,
        _del("layers.1.mlp.up_proj.weight"),
        (
            r"missing tensor 'layers\.1\.mlp\.up_proj\.weight' \[64, 32\]: vLLM would leave "
            r"it uninitialised"
        ),
    ),
    "extra-key": (
        "full",
        None,
        lambda t: t.update({"verifier_norm.weight": np.ones(32, np.float32)}),
        r"unexpected tensor 'verifier_norm\.weight' \[32\]: the verifier's final norm",
    ),
    "extra-bias": (
        "full",
        None,
        lambda t: t.update({"layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)}),
        r"unexpected tensor 'layers\.0\.self_attn\.q_proj\.bias'.*silently drops",
    ),
    "wrong-shape": (
        "reduced",
        None,
        lambda t: t.update({"markov_head.markov_w2.weight": np.zeros((40, 9), np.float32)}),
        r"tensor 'markov_head\.markov_w2\.weight' has shape \[40, 9\], expected \[40, 8\]",
    ),
    "top-level-model_type": (
        "full",
        _set(model_type="qwen3"),
        None,
        r"top-level 'model_type' \('qwen3'\) must be absent",
    ),
    "no-sample_from_anchor": (
        "full",
        _del("sample_from_anchor"),
        None,
        r"'sample_from_anchor' is missing \(vLLM reads a missing value as False",
    ),
    "speculative_tokens-vs-block": (
        "full",
        lambda d: d["speculators_config"]["proposal_methods"][0].update(speculative_tokens=3),
        None,
        r"speculative_tokens is 3, but block_size=4 with sample_from_anchor=True drafts 4",
    ),
    "dflash-slots-vs-block": (
        "full",
        _set(sample_from_anchor=False),
        None,
        r"speculative_tokens is 4, but block_size=4 with sample_from_anchor=False drafts 3",
    ),
    "no-markov_rank": ("full", _del("markov_rank"), None, r"'markov_rank' is missing"),
    "no-aux-layers": (
        "full",
        _del("aux_hidden_state_layer_ids"),
        None,
        r"'aux_hidden_state_layer_ids' is missing",
    ),
    "no-confidence_head_with_markov": (
        "full",
        _del("confidence_head_with_markov"),
        None,
        r"'confidence_head_with_markov' is missing \(vLLM reads a missing value as False",
    ),
    "no-mask_token_id": ("full", _set(mask_token_id=None), None, r"'mask_token_id' is missing"),
    "bool-as-int": (
        "full",
        _set(enable_confidence_head=1),
        None,
        r"'enable_confidence_head' must be bool",
    ),
    "null-speculators_config": (
        "full",
        _set(speculators_config=None),
        None,
        r"'speculators_config' is missing",
    ),
    "no-verifier-key": (
        "full",
        lambda d: d["speculators_config"]["verifier"].pop("name_or_path"),
        None,
        r"speculators_config\.verifier\.name_or_path is missing",
    ),
    "no-max_position_embeddings": (
        "full",
        _tl(_del("max_position_embeddings")),
        None,
        r"transformer_layer_config\.'max_position_embeddings' is missing",
    ),
    "no-rope_theta": (
        "full",
        _tl(_del("rope_parameters")),
        None,
        r"transformer_layer_config\.rope_parameters\.rope_theta is missing",
    ),
    "rope-legacy-type": (
        "full",
        _rope(type="default"),
        None,
        r"rope_parameters has the legacy 'type' key",
    ),
    "rope-untrained-type": (
        "full",
        _rope(rope_type="ntk", factor=2.0),
        None,
        r"rope_parameters\.rope_type 'ntk' is not one trained here",
    ),
    "yarn-without-factor": (
        "full",
        _rope(rope_type="yarn", original_max_position_embeddings=16),
        None,
        r"rope_type 'yarn' needs \['factor'\] \(vLLM's get_rope indexes them\)",
    ),
    "longrope-mscale-differs": (
        "full",
        _rope(**LONGROPE, short_mscale=1.0),
        None,
        r"vLLM scales cos/sin by short_mscale=1\.0, the drafter was trained with attention "
        r"scaling [0-9.]+",
    ),
    "mrope-section": (
        "full",
        _rope(mrope_section=[1, 1, 0]),
        None,
        r"mrope_section \[1, 1, 0\]: vLLM's MRotaryEmbedding needs 2 \* sum = the rotary dims \(8\)",
    ),
    "proportional-factor": (
        "full",
        _rope(rope_type="proportional", factor=2.0),
        None,
        r"vLLM's Gemma4RotaryEmbedding ignores factor",
    ),
    "gated-in-config": (
        "full",
        _set(markov_head_type="gated"),
        None,
        r"markov_head_type='gated' is not servable by vLLM",
    ),
    "non-causal-sliding": (
        "full",
        _set(sliding_window_non_causal=True),
        None,
        r"sliding_window_non_causal=true is not served by vLLM",
    ),
    "reduced-without-d2t": ("reduced", None, _del("d2t"), r"missing tensor 'd2t' \[40\]"),
    "reduced-without-lm_head": (
        "reduced",
        None,
        _del("lm_head.weight"),
        r"missing tensor 'lm_head\.weight' \[40, 32\]",
    ),
    "lm_head-with-full-vocab": (
        "full",
        None,
        lambda t: t.update({"lm_head.weight": np.zeros((64, 32), np.float32)}),
        r"unexpected tensor 'lm_head\.weight'.*only saved when draft_vocab_size < vocab_size",
    ),
    "d2t-t2d-disagree": ("reduced", None, _t2d_shift, r"'d2t' and 't2d' disagree"),
    "d2t-int32": (
        "reduced",
        None,
        lambda t: t.update(d2t=t["d2t"].astype(np.int32)),
        r"tensor 'd2t' has dtype I32, expected I64",
    ),
    "nan": (
        "full",
        None,
        lambda t: t["norm.weight"].__setitem__(0, np.nan),
        r"tensor 'norm\.weight' has non-finite values",
    ),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_fails_naming_the_problem(folders, tmp_path, name):
    base, cfg_edit, tensor_edit, pattern = MUTATIONS[name]
    folder = tmp_path / name
    shutil.copytree(folders / base, folder)
    if cfg_edit:
        edit_config(folder, cfg_edit)
    if tensor_edit:
        edit_tensors(folder, tensor_edit)
    report = check_folder(folder)
    assert not report.ok
    assert any(re.search(pattern, e) for e in report.errors), report.format()


@pytest.mark.parametrize("base", ["full", "reduced"])
@pytest.mark.parametrize("target", ["vllm", "speculators"])
def test_good_folders_pass(folders, base, target):
    report = check_folder(folders / base, target=target)
    assert report.ok, report.format()
    assert report.warnings == []
    assert report.config is not None


def test_rope_types_that_serve_differently_warn(folders, tmp_path):
    """Trained as transformers computes them, served by vLLM 0.33 otherwise: a warning."""
    for name, rope, pattern in (
        ("dynamic", {"rope_type": "dynamic", "factor": 2.0}, r"vLLM 0\.33 serves dynamic NTK"),
        ("longrope", LONGROPE, r"vLLM uses long_factor at every position"),
    ):
        folder = tmp_path / name
        shutil.copytree(folders / "full", folder)
        edit_config(folder, _rope(**rope))
        report = check_folder(folder)
        assert report.ok, report.format()
        assert any(re.search(pattern, w) for w in report.warnings), report.format()


def test_metadata_format_and_stray_weight_file(folders, tmp_path):
    folder = tmp_path / "f"
    shutil.copytree(folders / "full", folder)
    edit_tensors(folder, lambda t: None, metadata={"format": "np"})
    save_file({"step": np.zeros(1, np.int64)}, str(folder / "optimizer.safetensors"))
    errors = "\n".join(check_folder(folder).errors)
    assert "model.safetensors: safetensors metadata format must be 'pt'" in errors
    assert "unexpected tensor 'step'" in errors


def test_t2d_is_optional_for_vllm_only(folders, tmp_path):
    folder = tmp_path / "f"
    shutil.copytree(folders / "reduced", folder)
    edit_tensors(folder, _del("t2d"))
    assert check_folder(folder, target="vllm").ok
    assert "missing tensor 't2d' [64]" in check_folder(folder, target="speculators").errors


def test_speculators_target_allows_what_only_vllm_refuses(tmp_path):
    cfg = base_config(markov_head_type="gated", sliding_window_non_causal=True)
    export_params(
        cfg, random_params(cfg), tmp_path / "g", verifier_name_or_path="org/v", target="speculators"
    )
    assert check_folder(tmp_path / "g", target="speculators").ok
    errors = "\n".join(check_folder(tmp_path / "g", target="vllm").errors)
    assert "markov_head_type='gated' is not servable by vLLM" in errors
    assert "sliding_window_non_causal=true is not served by vLLM" in errors


def test_missing_verifier_name_is_a_warning(folders, tmp_path):
    folder = tmp_path / "f"
    shutil.copytree(folders / "full", folder)
    edit_config(folder, lambda d: d["speculators_config"]["verifier"].update(name_or_path=None))
    report = check_folder(folder)
    assert report.ok
    assert any("verifier.name_or_path is not set" in w for w in report.warnings)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(draft_vocab_size=40, markov_head_type="gated"),
        dict(markov_head_type="rnn", attention_bias=True, enable_confidence_head=False),
        dict(markov_rank=0, confidence_head_with_markov=False, target_hidden_size=48),
    ],
)
def test_key_table_matches_the_model(overrides):
    """check's table == the keys our model's params map to (+ vocab extras)."""
    cfg = base_config(**overrides)
    ours = {}
    for path, var in nnx.to_flat_state(abstract_params(cfg)):
        key, transpose = speculators_key(path)
        ours[key] = tuple(var.shape)[::-1] if transpose else tuple(var.shape)
    table = {k: s for k, (s, _) in expected_tensors(cfg, "speculators").items()}
    extras = {"lm_head.weight", "d2t", "t2d"} if cfg.uses_draft_vocab else set()
    assert set(table) - extras == set(ours)
    assert {k: table[k] for k in ours} == ours


def test_cli_check_json(folders, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "converters", "check", str(folders / "reduced"), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ok"] is True
    folder = tmp_path / "bad"
    shutil.copytree(folders / "full", folder)
    edit_config(folder, _set(model_type="qwen3"))
    out = subprocess.run(
        [sys.executable, "-m", "converters", "check", str(folder)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 1
    assert "FAILED" in out.stdout and "top-level 'model_type'" in out.stdout
