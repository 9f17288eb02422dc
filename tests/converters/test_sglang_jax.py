"""--target sglang-jax: the export writes sglang-jax's flat qwen3 layout, a correct folder
passes with the launch command, and each rule of sglang-jax's DSpark path has a folder
that breaks it, the message naming the rule and the sglang-jax file@commit (one planted
violation per row)."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from converters.__main__ import main
from dspark_jax.checkpoint import orbax_io
from dspark_jax.convert.check import check_folder
from dspark_jax.convert.export import export_params
from dspark_jax.convert.sglang_jax_export import ReducedVocabError, sglang_jax_config
from dspark_jax.convert.sglang_jax_rules import RULES
from dspark_jax.convert.vllm_rules import Verifier
from tests.converters.helpers import base_config, random_params
from tests.converters.test_check import edit_config, edit_tensors

# The tiny drafter's verifier: 4 layers (dspark-jax aux ids 1, 3 -> sglang-jax 0, 2).
VERIFIER = Verifier(vocab_size=64, hidden_size=32, num_hidden_layers=4, source="org/v")


def _cfg(**kw):
    return base_config(layer_types=None, verifier_name_or_path="org/v", **kw)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """'spec': a vLLM export; 'good': the same rewritten in sglang-jax's layout."""
    root = tmp_path_factory.mktemp("sgl")
    cfg = _cfg()
    export_params(cfg, random_params(cfg), root / "spec")
    shutil.copytree(root / "spec", root / "good")
    d = json.loads((root / "spec" / "config.json").read_text())
    (root / "good" / "config.json").write_text(json.dumps(sglang_jax_config(d)))
    return root


def _copy(folders, tmp_path, base, cfg_edit=None, tensor_edit=None):
    folder = tmp_path / "f"
    shutil.copytree(folders / base, folder)
    if cfg_edit:
        edit_config(folder, cfg_edit)
    if tensor_edit:
        edit_tensors(folder, tensor_edit)
    return folder


def _set(**kv):
    return lambda d: d.update(kv)


def _del(*keys):
    def fn(d):
        for k in keys:
            d.pop(k)

    return fn


def _sub(**kv):
    return lambda d: d["dflash_config"].update(kv)


def _pop_t(key):
    return lambda t: t.pop(key)


def _w2_rows(n):
    def fn(t):
        t["markov_head.markov_w2.weight"] = t["markov_head.markov_w2.weight"][:n]

    return fn


def test_layout_of_the_rewritten_config(folders):
    d = json.loads((folders / "good" / "config.json").read_text())
    assert d["model_type"] == "qwen3" and d["architectures"] == ["Qwen3DSparkModel"]
    # dspark-jax layer id k (stream after k layers) -> sglang-jax t (before layer t + 1).
    assert d["dflash_config"] == {"block_size": 4, "target_layer_ids": [0, 2], "mask_token_id": 63}
    assert d["target_layer_ids"] == [0, 2] and d["block_size"] == 4
    cfg = _cfg()
    for name, want in (
        ("head_dim", cfg.head_dim),
        ("rope_theta", cfg.rope_theta),
        ("rms_norm_eps", cfg.rms_norm_eps),
        ("attention_bias", False),
        ("target_hidden_size", cfg.verifier_hidden_size),
        ("markov_rank", cfg.markov_rank),
        ("markov_head_type", "vanilla"),
        ("sample_from_anchor", True),
    ):
        assert d[name] == want, name


def test_good_folder_passes_with_the_launch_command(folders):
    report = check_folder(folders / "good", target="sglang-jax", verifier=VERIFIER)
    assert report.ok and report.warnings == [], report.format()
    cmd = (
        f"python -m sgl_jax.launch_server --model-path org/v --speculative-algorithm DSPARK "
        f"--speculative-draft-model-path {folders / 'good'} --speculative-num-steps 1 "
        "--speculative-eagle-topk 1 --speculative-num-draft-tokens 5 --grammar-backend none"
    )
    assert report.commands == [cmd]
    assert report.format().endswith(
        "serve with sglang-jax (add --device cpu for the JAX CPU backend):\n  " + cmd
    )
    # The confidence head: ignored, a note (and its tensors a note, not a warning).
    assert any(n.endswith(f"[confidence-head: {RULES['confidence-head']}]") for n in report.notes)


# name: (base, config edit, tensor edit, verifier, rule, message regex)
BREAKS = {
    "speculators-format": (
        "spec",
        None,
        None,
        None,
        "hf-config",
        r"config\.json is in the speculators format",
    ),
    "model_type-llama": (
        "good",
        _set(model_type="llama"),
        None,
        None,
        "hf-config",
        r"'model_type' must be 'qwen3'",
    ),
    "gated-head": (
        "good",
        _set(markov_head_type="gated"),
        None,
        None,
        "markov-head",
        r"'markov_head_type' must be 'vanilla'",
    ),
    "no-markov_head_type": (
        "good",
        _del("markov_head_type"),
        None,
        None,
        "markov-head",
        r"'markov_head_type' must be 'vanilla' .*got None",
    ),
    "rank-0": (
        "good",
        _set(markov_rank=0),
        None,
        None,
        "markov-head",
        r"'markov_rank' must be a positive int, got 0",
    ),
    "no-markov_rank": (
        "good",
        _del("markov_rank"),
        None,
        None,
        "markov-head",
        r"'markov_rank' is missing \(sglang-jax then uses 0",
    ),
    "anchor-false": (
        "good",
        _set(sample_from_anchor=False),
        None,
        None,
        "sample-from-anchor",
        r"'sample_from_anchor' must be true: --speculative-algorithm DSPARK forces",
    ),
    "no-sample_from_anchor": (
        "good",
        _del("sample_from_anchor"),
        None,
        None,
        "sample-from-anchor",
        r"'sample_from_anchor' must be true.*got None",
    ),
    "reduced-vocab": (
        "good",
        _set(draft_vocab_size=40),
        None,
        None,
        "full-vocab",
        r"draft_vocab_size=40 != vocab_size=64",
    ),
    "verifier-vocab": (
        "good",
        None,
        None,
        Verifier(128, 32, 4, "org/big"),
        "full-vocab",
        r"vocab_size=64 but the verifier \(org/big\) has 128",
    ),
    "no-block_size": (
        "good",
        _del("block_size"),
        None,
        None,
        "verify-width",
        r"'block_size' is missing \(sglang-jax then uses 16",
    ),
    "block-1": (
        "good",
        _set(block_size=1),
        None,
        None,
        "verify-width",
        r"'block_size' must be > 1",
    ),
    "sub-block-differs": (
        "good",
        _sub(block_size=7),
        None,
        None,
        "draft-config",
        r"dflash_config\.block_size=7 != block_size=4",
    ),
    "no-dflash_config": (
        "good",
        _del("dflash_config"),
        None,
        None,
        "draft-config",
        r"'dflash_config' must be an object",
    ),
    "mask-out-of-range": (
        "good",
        lambda d: (d["dflash_config"].update(mask_token_id=64), d.update(mask_token_id=64)),
        None,
        None,
        "mask-token",
        r"mask_token_id must be an int in \[0, vocab_size=64\)",
    ),
    "no-target_layer_ids": (
        "good",
        lambda d: (d["dflash_config"].pop("target_layer_ids"), d.pop("target_layer_ids")),
        None,
        None,
        "aux-layers",
        r"target_layer_ids must be a non-empty list",
    ),
    "layers-descending": (
        "good",
        _sub(target_layer_ids=[2, 0]),
        None,
        None,
        "aux-layers",
        r"target_layer_ids \[2, 0\] must be distinct and ascending",
    ),
    "last-layer-captured": (
        "good",
        None,
        None,
        Verifier(64, 32, 3, "org/short"),
        "aux-layers",
        r"include \[2\]: sglang-jax captures the residual stream before decoder layer t \+ 1",
    ),
    "no-head_dim": (
        "good",
        _del("head_dim"),
        None,
        None,
        "layer-config",
        r"'head_dim' is missing \(sglang-jax then uses hidden_size // num_attention_heads",
    ),
    "no-rms_norm_eps": (
        "good",
        _del("rms_norm_eps"),
        None,
        None,
        "layer-config",
        r"'rms_norm_eps' is missing",
    ),
    "no-attention_bias": (
        "good",
        _del("attention_bias"),
        None,
        None,
        "layer-config",
        r"'attention_bias' is missing",
    ),
    "gelu": (
        "good",
        _set(hidden_act="gelu"),
        None,
        None,
        "layer-config",
        r"'hidden_act' must be 'silu'",
    ),
    "no-rope_theta": (
        "good",
        _del("rope_theta"),
        None,
        None,
        "rope",
        r"'rope_theta' is missing \(sglang-jax then uses 10000",
    ),
    "yarn": (
        "good",
        _set(rope_scaling={"rope_type": "yarn", "factor": 2.0}),
        None,
        None,
        "rope",
        r"rope_scaling\.rope_type 'yarn' is not served",
    ),
    "sliding-layer": (
        "good",
        _set(layer_types=["sliding_attention", "full_attention"]),
        None,
        None,
        "sliding-window",
        r"'layer_types' has sliding_attention layers",
    ),
    "no-target_hidden_size": (
        "good",
        _del("target_hidden_size"),
        None,
        None,
        "target-hidden",
        r"'target_hidden_size' is missing \(sglang-jax then uses hidden_size\)",
    ),
    "verifier-hidden": (
        "good",
        None,
        None,
        Verifier(64, 48, 4, "org/wide"),
        "target-hidden",
        r"verifier \(org/wide\) has hidden size 48",
    ),
    "missing-w1": (
        "good",
        None,
        _pop_t("markov_head.markov_w1.weight"),
        None,
        "weights",
        r"missing tensors \['markov_head\.markov_w1\.weight'\]",
    ),
    "w2-draft-rows": (
        "good",
        None,
        _w2_rows(40),
        None,
        "weight-shapes",
        r"'markov_head\.markov_w2\.weight' has shape \[40, 8\], sglang-jax's parameter is "
        r"\[64, 8\]",
    ),
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_each_rule_has_a_folder_that_breaks_it(folders, tmp_path, name):
    base, cfg_edit, tensor_edit, verifier, rule, pattern = BREAKS[name]
    folder = _copy(folders, tmp_path, base, cfg_edit, tensor_edit)
    report = check_folder(folder, target="sglang-jax", verifier=verifier)
    assert not report.ok and report.commands == []
    hits = [e for e in report.errors if re.search(pattern, e)]
    assert hits, report.format()
    assert all(e.endswith(f"[{rule}: {RULES[rule]}]") for e in hits), hits


def test_every_error_rule_is_exercised():
    soft = {"architecture", "confidence-head", "serve-form"}  # warning/note/command: below
    assert set(RULES) - soft == {b[4] for b in BREAKS.values()}


def test_soft_rules(folders, tmp_path):
    folder = _copy(folders, tmp_path, "good", _set(architectures=["DSparkDraftModel"]))
    report = check_folder(folder, target="sglang-jax")
    assert report.ok
    assert [w for w in report.warnings if "[architecture: " in w], report.format()
    assert any("no --verifier" in n for n in report.notes)
    rules = re.findall(r"\[([a-z-]+): [^\]]+@[0-9a-f]{8}\]", report.format())
    assert rules and all(r in RULES for r in rules)


def test_reduced_vocab_export_is_refused_in_one_line():
    d = base_config(draft_vocab_size=40, layer_types=None).to_speculators_dict()
    with pytest.raises(ReducedVocabError) as e:
        sglang_jax_config(d)
    msg = str(e.value)
    assert "\n" not in msg and "draft_vocab_size=40" in msg and "full target vocabulary" in msg


def test_cli_export_and_check(tmp_path, capsys):
    cfg = _cfg()
    orbax_io.save_params_checkpoint(tmp_path / "ck", 3, cfg, random_params(cfg))
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "ck"), str(out), "--target", "sglang-jax"]) == 0
    assert "--speculative-algorithm DSPARK" in capsys.readouterr().out
    card = (out / "README.md").read_text()
    # The card names the folder relatively (its name: it was given absolute), never the staging one.
    assert "--speculative-draft-model-path out " in card and "vllm serve" not in card
    assert str(tmp_path) not in card
    assert not list(tmp_path.glob(".out.*"))  # no staging folder left
    assert main(["check", str(out), "--target", "sglang-jax"]) == 0
    assert "--speculative-num-draft-tokens 5" in capsys.readouterr().out
    # A drafter with sliding layers exports for vLLM but is refused here; nothing written.
    bad = base_config(verifier_name_or_path="org/v")
    orbax_io.save_params_checkpoint(tmp_path / "ck2", 1, bad, random_params(bad))
    assert main(["export", str(tmp_path / "ck2"), str(tmp_path / "o2"), "--target", "sglang-jax"])
    err = capsys.readouterr().err
    assert "fails the sglang-jax check" in err and "sliding_attention" in err
    assert not (tmp_path / "o2").exists() and not list(tmp_path.glob(".o2.*"))
