"""dspark_jax.convert.check: a correct folder passes; each rule of vLLM 0.33.0 has a folder
that breaks it, and the message names the rule and the vLLM file (table-driven: one
mutation per row); what vLLM accepts passes; the speculators target keeps its own rules."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from dspark_jax.checkpoint.orbax_io import abstract_params
from dspark_jax.convert.check import check_folder, expected_tensors
from dspark_jax.convert.export import export_params
from dspark_jax.convert.vllm_rules import RULES, Verifier
from dspark_jax.model.params import speculators_key
from tests.converters.helpers import base_config, make_vocab, random_params, write_verifier

# The tiny drafters' verifier: 4 layers (aux ids 1, 3), vocabulary 64, hidden 32.
VERIFIER = Verifier(vocab_size=64, hidden_size=32, num_hidden_layers=4, source="org/v")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Good exports: full vocab and reduced vocab (vanilla head), verifier name set, and a
    DFlash-style one (sample_from_anchor=false)."""
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
    bonus = base_config(sample_from_anchor=False)
    export_params(bonus, random_params(bonus), root / "bonus", verifier_name_or_path="org/v")
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


def _method(**kv):
    return lambda d: d["speculators_config"]["proposal_methods"][0].update(kv)


def _name(name):
    return lambda d: d["speculators_config"]["verifier"].update(name_or_path=name)


def _bf16(*keys):
    def fn(t):
        for k in keys:
            t[k] = t[k].astype(ml_dtypes.bfloat16)

    return fn


def _copy(folders, tmp_path, base, cfg_edit=None, tensor_edit=None):
    folder = tmp_path / "f"
    shutil.copytree(folders / base, folder)
    if cfg_edit:
        edit_config(folder, cfg_edit)
    if tensor_edit:
        edit_tensors(folder, tensor_edit)
    return folder


def _move_t2d(t):
    """One verifier token of the draft vocabulary swapped for one outside it."""
    on, off = np.flatnonzero(t["t2d"]), np.flatnonzero(~t["t2d"])
    t["t2d"][on[1]], t["t2d"][off[-1]] = False, True


# name: (base folder, config edit, tensor edit, check kwargs, rule, message regex)
BREAKS = {
    "model_type-present": (
        "full", _set(model_type="qwen3"), None, {}, "speculators-format",
        r"top-level 'model_type' \('qwen3'\) must be absent",
    ),
    "speculators_config-null": (
        "full", _set(speculators_config=None), None, {}, "speculators-format",
        r"'speculators_config' must be an object",
    ),
    "no-speculative_tokens": (
        "full", lambda d: d["speculators_config"]["proposal_methods"][0].pop("speculative_tokens"),
        None, {}, "speculators-config", r"proposal_methods\[0\]\.speculative_tokens is missing",
    ),
    "no-verifier-key": (
        "full", lambda d: d["speculators_config"]["verifier"].pop("name_or_path"), None, {},
        "speculators-config", r"speculators_config\.verifier\.name_or_path is missing",
    ),
    "no-layer-config": (
        "full", _del("transformer_layer_config"), None, {}, "speculators-config",
        r"'transformer_layer_config' must be an object",
    ),
    "dflash-type": (
        "full", _set(speculators_model_type="dflash"), None, {}, "algorithm",
        r"'speculators_model_type' must be 'dspark', got 'dflash'",
    ),
    "more-tokens-than-trained": (
        "full", _method(speculative_tokens=5), None, {}, "spec-tokens",
        r"speculative_tokens is 5, but block_size=4 with sample_from_anchor=true trains 4 draft "
        r"positions: vLLM would draft untrained positions",
    ),
    "bonus-anchor-block-tokens": (  # what --spec-model drafts without --spec-tokens
        "bonus", _method(speculative_tokens=4), None, {}, "spec-tokens",
        r"speculative_tokens is 4, but block_size=4 with sample_from_anchor=false trains 3",
    ),
    "no-max_position_embeddings": (
        "full", _tl(_del("max_position_embeddings")), None, {}, "layer-config",
        r"transformer_layer_config\.'max_position_embeddings' is missing",
    ),
    "gelu": (
        "full", _tl(_set(hidden_act="gelu")), None, {}, "layer-config",
        r"hidden_act must be 'silu' \(Qwen2MLP\), got 'gelu'",
    ),
    "no-rope_theta": (
        "full", _tl(_del("rope_parameters")), None, {}, "rope",
        r"rope_parameters\.rope_theta is missing: vLLM defaults it to 1e6",
    ),
    "non-causal-sliding": (
        "full", _set(sliding_window_non_causal=True), None, {}, "sliding-window",
        r"sliding_window_non_causal=true is not served: vLLM runs sliding_attention layers causal",
    ),
    "no-sliding_window": (
        "full", _tl(_set(sliding_window=None)), None, {}, "sliding-window",
        r"sliding_window must be a positive int for sliding_attention layers",
    ),
    "no-aux-layers": (
        "full", _del("aux_hidden_state_layer_ids"), None, {}, "aux-layers",
        r"'aux_hidden_state_layer_ids' is missing \(vLLM indexes it\)",
    ),
    "aux-descending": (
        "full", _set(aux_hidden_state_layer_ids=[3, 1]), None, {}, "aux-order",
        r"\[3, 1\] must be distinct and ascending: vLLM .* concatenates them in ascending order",
    ),
    "aux-beyond-verifier": (
        "full", _set(aux_hidden_state_layer_ids=[1, 5]), None, {"verifier": VERIFIER}, "aux-range",
        r"include \[5\], beyond the verifier's 4 layers .*: vLLM captures layers 0\.\.4 only",
    ),
    "no-sample_from_anchor": (
        "full", _del("sample_from_anchor"), None, {}, "sample-from-anchor",
        r"'sample_from_anchor' must be true or false, got None \(vLLM reads a missing value as "
        r"false",
    ),
    "no-mask_token_id": (
        "full", _set(mask_token_id=None), None, {}, "mask-token",
        r"'mask_token_id' must be an int in \[0, vocab_size=64\)",
    ),
    "no-markov_rank": (
        "full", _del("markov_rank"), None, {}, "markov-head",
        r"'markov_rank' must be a positive int",
    ),
    "gated-head": (
        "full", _set(markov_head_type="gated"), None, {}, "markov-head",
        r"markov_head_type='gated' is not served by vLLM",
    ),
    "no-confidence_head_with_markov": (
        "full", _del("confidence_head_with_markov"), None, {}, "weight-shapes",
        r"'confidence_head\.proj\.weight' has shape \[1, 40\], vLLM's parameter is \[1, 32\] "
        r"\(confidence_head_with_markov=false; vLLM reads a missing value as false\)",
    ),
    "reduced-without-d2t": (
        "reduced", None, _del("d2t"), {}, "verifier-vocab", r"missing tensor 'd2t'",
    ),
    "reduced-without-lm_head": (
        "reduced", None, _del("lm_head.weight"), {}, "verifier-vocab",
        r"missing tensor 'lm_head\.weight': the drafter's vocabulary \(draft 40, input 64\)",
    ),
    "verifier-vocab-larger": (  # vLLM compares with the verifier, not with vocab_size
        "full", None, None, {"verifier": Verifier(128, 32, 4, "big")}, "verifier-vocab",
        r"missing tensor 'lm_head\.weight': .*differs from the verifier's \(128\)",
    ),
    "verifier-vocab-smaller": (
        "full", None, None, {"verifier": Verifier(48, 32, 4, "small")}, "verifier-vocab",
        r"missing tensor 'embed_tokens\.weight'",
    ),
    "d2t-two-draft-ids-one-token": (
        "reduced", None, lambda t: t["d2t"].__setitem__(1, t["d2t"][0] - 1), {}, "vocab-roundtrip",
        r"draft_id \+ d2t must be strictly increasing",
    ),
    "t2d-moved-entry": (
        "reduced", None, _move_t2d, {}, "vocab-roundtrip",
        r"'d2t' and 't2d' disagree: vLLM sends draft id \d+ to verifier token \d+, which t2d "
        r"does not map back",
    ),
    "d2t-without-reduced-vocab": (
        "full", None, lambda t: t.update(d2t=np.zeros(64, np.int64)), {}, "verifier-vocab",
        r"unexpected tensor 'd2t'.*no draft_id_to_target_id to load it into",
    ),
    "verifier-hidden": (
        "full", None, None, {"verifier": Verifier(64, 48, 4, "wide")}, "verifier-hidden",
        r"fc takes 2 x 32 features .*but the verifier \(wide\) has hidden size 48",
    ),
    "tensor-parallel-3": (
        "full", None, None, {"tensor_parallel_size": 3}, "tensor-parallel",
        r"num_attention_heads=4, num_key_value_heads=2, intermediate_size=64 not divisible by "
        r"--tensor-parallel-size 3",
    ),
    "missing-key": (
        "full", None, _del("layers.1.mlp.up_proj.weight"), {}, "weights",
        r"missing tensor 'layers\.1\.mlp\.up_proj\.weight' \[64, 32\]: vLLM never reports it",
    ),
    "extra-key": (
        "full", None, lambda t: t.update({"verifier_norm.weight": np.ones(32, np.float32)}), {},
        "weights", r"unexpected tensor 'verifier_norm\.weight' \[32\]: .*\(a load error\)",
    ),
    "extra-bias": (
        "full", None,
        lambda t: t.update({"layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)}), {},
        "weights", r"unexpected tensor 'layers\.0\.self_attn\.q_proj\.bias'.*silently drops",
    ),
    "wrong-shape": (
        "reduced", None,
        lambda t: t.update({"markov_head.markov_w2.weight": np.zeros((40, 9), np.float32)}), {},
        "weight-shapes",
        r"tensor 'markov_head\.markov_w2\.weight' has shape \[40, 9\], vLLM's parameter is "
        r"\[40, 8\]",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BREAKS))
def test_each_rule_has_a_folder_that_breaks_it(folders, tmp_path, name):
    base, cfg_edit, tensor_edit, kwargs, rule, pattern = BREAKS[name]
    folder = _copy(folders, tmp_path, base, cfg_edit, tensor_edit)
    report = check_folder(folder, **kwargs)
    assert not report.ok and report.commands == []
    hits = [e for e in report.errors if re.search(pattern, e)]
    assert hits, report.format()
    assert all(e.endswith(f"[{rule}: {RULES[rule]}]") for e in hits), hits


def test_every_error_rule_is_exercised():
    # notes/warnings-only rules have tests of their own below
    soft = {
        "verifier-name",
        "serve-form",
        "confidence-head",
        "confidence-fp32",
        "calibration",
        "explicit-defaults",
        "architecture",
    }
    assert set(RULES) - soft == {rule for *_, rule, _ in BREAKS.values()}


# What vLLM 0.33 accepts (issue: check refused these): name: (base, config edit, tensor edit)
ACCEPTED = {
    "no-markov_head_type": ("full", _del("markov_head_type"), None),
    "no-draft_vocab_size": ("full", _del("draft_vocab_size"), None),
    "no-block_size": ("full", _del("block_size"), None),
    "no-dtype": ("full", _del("dtype"), None),
    "layer-model_type": ("full", _tl(_set(model_type="llama")), None),
    "legacy-rope_theta": (
        "full",
        _tl(lambda tl: tl.update(rope_theta=10000.0) or tl.pop("rope_parameters")),
        None,
    ),
    "yarn-rope": (
        "full",
        _tl(
            _set(
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 1e4,
                    "factor": 2.0,
                    "original_max_position_embeddings": 16,
                }
            )
        ),
        None,
    ),
    "tie_word_embeddings": (
        "full",
        lambda d: (
            d.update(tie_word_embeddings=True)
            or d["transformer_layer_config"].update(tie_word_embeddings=True)
        ),
        None,
    ),
    "other-metadata": (
        "full",
        lambda d: (
            d.update(speculators_version="9.9", architectures=["Whatever"])
            or d["speculators_config"].update(algorithm="other", default_proposal_method="x")
        ),
        None,
    ),
    "d2t-int32": ("reduced", None, lambda t: t.update(d2t=t["d2t"].astype(np.int32))),
    "full-vocab-lm_head": (
        "full",
        None,
        lambda t: t.update({"lm_head.weight": np.zeros((64, 32), np.float32)}),
    ),
    "embed_tokens": (
        "full",
        None,
        lambda t: t.update({"embed_tokens.weight": np.zeros((64, 32), np.float32)}),
    ),
    "no-t2d": ("reduced", None, _del("t2d")),
    "metadata-format-np": ("full", None, None),
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_what_vllm_accepts_passes(folders, tmp_path, name):
    base, cfg_edit, tensor_edit = ACCEPTED[name]
    folder = _copy(folders, tmp_path, base, cfg_edit, tensor_edit)
    if name == "metadata-format-np":
        edit_tensors(folder, lambda t: None, metadata={"format": "np"})
    report = check_folder(folder, verifier=VERIFIER)
    assert report.ok, report.format()
    assert len(report.commands) == 2, report.format()
    if name == "yarn-rope":  # served as configured, and trained the same way here
        assert any("[rope: " in n for n in report.notes)
        assert not any("dspark-jax cannot import" in n for n in report.notes)


@pytest.mark.parametrize("base", ["full", "reduced", "bonus"])
def test_good_folders_pass_with_the_serve_commands(folders, base):
    report = check_folder(folders / base, verifier=VERIFIER)
    assert report.ok and report.warnings == [], report.format()
    n = 3 if base == "bonus" else 4  # sample_from_anchor=false: block_size - 1
    assert report.commands == [
        f"vllm serve {folders / base}",
        f"vllm serve org/v --spec-method dspark --spec-model {folders / base} --spec-tokens {n}",
    ]
    # [serve-form: arg_utils.py]: the folder form never takes --spec-method / --spec-tokens
    assert not any(c.startswith(f"vllm serve {folders / base} --spec") for c in report.commands)
    text = report.format()
    assert text.endswith("\n".join(["serve with vLLM 0.33:", *(f"  {c}" for c in report.commands)]))
    assert report.config is not None


def test_verifier_name_decides_the_folder_form(folders, tmp_path, monkeypatch):
    rule = f"[verifier-name: {RULES['verifier-name']}]"
    for name in ("configs/demo/verifier", None, "bad--name"):
        folder = _copy(folders, tmp_path / str(hash(name)), "full", _name(name))
        report = check_folder(folder)
        assert report.ok and len(report.warnings) == 1 and report.warnings[0].endswith(rule)
        assert "`vllm serve <folder>` fails" in report.warnings[0]
        assert [c.split(" --")[0] for c in report.commands] == [
            "vllm serve " + (name or "<verifier>")
        ]
    # A valid repo id that is also a local path is refused by vLLM too.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "v").mkdir(parents=True)
    report = check_folder(folders / "full")
    assert "is an existing local path" in report.warnings[0] and len(report.commands) == 1


def test_confidence_head_rules(folders, tmp_path):
    # The head is fp32 in vLLM: a bf16 export rounds it.
    keys = ("confidence_head.proj.weight", "confidence_head.proj.bias")
    folder = _copy(folders, tmp_path / "a", "full", None, _bf16(*keys))
    report = check_folder(folder)
    assert report.ok
    fp32 = [
        w for w in report.warnings if w.endswith(f"[confidence-fp32: {RULES['confidence-fp32']}]")
    ]
    assert len(fp32) == 2 and "'confidence_head.proj.weight' is BF16" in fp32[1]
    # Tensors without the flag (vLLM's default: false) are dropped, and the reverse.
    for edit, tensors, message in (
        (_del("enable_confidence_head"), None, "are dropped: enable_confidence_head is false"),
        (None, _del(*keys), "enable_confidence_head=true but no confidence_head tensors"),
    ):
        folder = _copy(folders, tmp_path / message[:8], "full", edit, tensors)
        report = check_folder(folder)
        assert report.ok and any(
            message in w and w.endswith(f"[confidence-head: {RULES['confidence-head']}]")
            for w in report.warnings
        ), report.format()
    # Calibration: a note unless export folded a temperature in (calibration.json).
    note = f"[calibration: {RULES['calibration']}]"
    assert any(n.endswith(note) for n in check_folder(folders / "full").notes)
    folder = _copy(folders, tmp_path / "cal", "full")
    (folder / "calibration.json").write_text("{}")
    assert not any(n.endswith(note) for n in check_folder(folder).notes)


def test_tensor_parallel_sizes_vllm_accepts(folders):
    # 4 heads, 2 KV heads, MLP 64: TP 2 and 4 split them (KV heads replicated at 4).
    for tp in (2, 4):
        report = check_folder(folders / "full", tensor_parallel_size=tp)
        assert report.ok, report.format()
        assert all(c.endswith(f"--tensor-parallel-size {tp}") for c in report.commands)


def test_verifier_argument(folders, tmp_path):
    verifier = write_verifier(tmp_path / "v", base_config())
    report = check_folder(folders / "full", verifier=verifier)
    assert report.ok and not any("no --verifier" in n for n in report.notes)
    assert report.commands[1].startswith(f"vllm serve {verifier} --spec-method dspark")
    assert check_folder(folders / "full", verifier=verifier / "config.json").ok
    with pytest.raises(ValueError, match=r"--verifier .*nope: expected a folder with config\.json"):
        check_folder(folders / "full", verifier=tmp_path / "nope")


# ---------------------------------------------------------------- target speculators
def test_metadata_format_and_stray_weight_file(folders, tmp_path):
    folder = _copy(folders, tmp_path, "full")
    edit_tensors(folder, lambda t: None, metadata={"format": "np"})
    save_file({"step": np.zeros(1, np.int64)}, str(folder / "optimizer.safetensors"))
    errors = "\n".join(check_folder(folder, target="speculators").errors)
    assert "model.safetensors: safetensors metadata format must be 'pt'" in errors
    assert "unexpected tensor 'step'" in errors
    assert "unexpected tensor 'step'" in "\n".join(check_folder(folder).errors)


def test_t2d_is_optional_for_vllm_only(folders, tmp_path):
    folder = _copy(folders, tmp_path, "reduced", None, _del("t2d"))
    assert check_folder(folder, target="vllm").ok
    assert "missing tensor 't2d' [64]" in check_folder(folder, target="speculators").errors


def test_speculators_target_allows_what_only_vllm_refuses(tmp_path):
    cfg = base_config(markov_head_type="gated", sliding_window_non_causal=True)
    export_params(
        cfg, random_params(cfg), tmp_path / "g", verifier_name_or_path="org/v", target="speculators"
    )
    assert check_folder(tmp_path / "g", target="speculators").ok
    errors = "\n".join(check_folder(tmp_path / "g", target="vllm").errors)
    assert "markov_head_type='gated' is not served by vLLM" in errors
    assert "sliding_window_non_causal=true is not served" in errors


def test_speculators_target_mutations(folders, tmp_path):
    for base, cfg_edit, tensor_edit, pattern in (
        ("full", _del("sample_from_anchor"), None, r"'sample_from_anchor' is missing"),
        ("reduced", None, lambda t: t.update(d2t=t["d2t"].astype(np.int32)), r"expected I64"),
        (
            "reduced",
            None,
            lambda t: t.update(t2d=np.roll(t["t2d"], 1)),
            r"'d2t' and 't2d' disagree",
        ),
        ("full", None, lambda t: t["norm.weight"].__setitem__(0, np.nan), r"non-finite"),
    ):
        folder = _copy(folders, tmp_path / pattern[:6], base, cfg_edit, tensor_edit)
        report = check_folder(folder, target="speculators")
        assert any(re.search(pattern, e) for e in report.errors), report.format()
    folder = _copy(
        folders, tmp_path / "nan", "full", None, lambda t: t["norm.weight"].__setitem__(0, np.nan)
    )
    assert "tensor 'norm.weight' has non-finite values (NaN/inf)" in check_folder(folder).errors


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
    table = {k: s for k, (s, _) in expected_tensors(cfg).items()}
    extras = {"lm_head.weight", "d2t", "t2d"} if cfg.uses_draft_vocab else set()
    assert set(table) - extras == set(ours)
    assert {k: table[k] for k in ours} == ours


def test_cli_check_json(folders, tmp_path):
    argv = [sys.executable, "-m", "converters", "check", str(folders / "reduced"), "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["ok"] is True and len(got["commands"]) == 2 and got["notes"]
    folder = _copy(folders, tmp_path, "full", _set(model_type="qwen3"))
    out = subprocess.run(
        [sys.executable, "-m", "converters", "check", str(folder), "--tensor-parallel-size", "3"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 1
    assert "FAILED" in out.stdout and "top-level 'model_type'" in out.stdout
    assert "serve with" not in out.stdout


def _rope(**kv):
    return _tl(lambda tl: tl["rope_parameters"].update(kv))


LONGROPE = dict(
    rope_type="longrope",
    short_factor=[1.0, 1.1, 1.2, 1.3],
    long_factor=[2.0, 3.0, 4.0, 5.0],
    original_max_position_embeddings=16,
)

# rope_parameters as vLLM 0.33's get_rope reads them, against what was trained
ROPE_BREAKS = {
    "rope-legacy-type": (_rope(type="default"), r"rope_parameters has the legacy 'type' key"),
    "rope-untrained-type": (
        _rope(rope_type="ntk", factor=2.0),
        r"rope_parameters\.rope_type 'ntk' is not one trained here",
    ),
    "yarn-without-factor": (
        _rope(rope_type="yarn", original_max_position_embeddings=16),
        r"rope_type 'yarn' needs \['factor'\] \(vLLM's get_rope indexes them\)",
    ),
    "longrope-mscale-differs": (
        _rope(**LONGROPE, short_mscale=1.0),
        r"vLLM scales cos/sin by short_mscale=1\.0, the drafter was trained with attention "
        r"scaling [0-9.]+",
    ),
    "mrope-section": (
        _rope(mrope_section=[1, 1, 0]),
        r"mrope_section \[1, 1, 0\]: vLLM's MRotaryEmbedding needs 2 \* sum = the rotary "
        r"dims \(8\)",
    ),
    "proportional-factor": (
        _rope(rope_type="proportional", factor=2.0),
        r"vLLM's Gemma4RotaryEmbedding ignores factor",
    ),
}


@pytest.mark.parametrize("name", list(ROPE_BREAKS))
def test_rope_parameters_vllm_cannot_serve_as_trained(folders, tmp_path, name):
    edit, pattern = ROPE_BREAKS[name]
    folder = _copy(folders, tmp_path, "full", edit, None)
    report = check_folder(folder, verifier=VERIFIER)
    assert not report.ok and report.commands == []
    assert any(re.search(pattern, e) for e in report.errors), report.format()


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


def test_fields_read_with_a_default_are_written_explicitly(folders, tmp_path):
    rule = f"[explicit-defaults: {RULES['explicit-defaults']}]"
    assert not any(rule in w for w in check_folder(folders / "full").warnings)
    for name in ("markov_head_type", "block_size", "draft_vocab_size", "enable_confidence_head"):
        folder = _copy(folders, tmp_path / name, "full", _del(name))
        report = check_folder(folder)
        hits = [w for w in report.warnings if w.endswith(rule)]
        assert len(hits) == 1 and f"{name!r} (vLLM uses " in hits[0], report.format()


def test_architecture_vllm_resolves(folders, tmp_path):
    rule = f"[architecture: {RULES['architecture']}]"
    # speculators writes DSparkDraftModel, which update_dspark drops: served as Qwen3DSparkModel.
    notes = [n for n in check_folder(folders / "full").notes if n.endswith(rule)]
    assert len(notes) == 1 and notes[0].startswith("vLLM 0.33 serves it as Qwen3DSparkModel")
    assert "['DSparkDraftModel'] dropped" in notes[0]
    folder = _copy(folders, tmp_path, "full", _set(architectures=["Qwen3OmniDSparkModel"]))
    notes = [n for n in check_folder(folder).notes if n.endswith(rule)]
    assert (
        notes[0].startswith("vLLM 0.33 serves it as Qwen3OmniDSparkModel")
        and "dropped" not in notes[0]
    )
