"""dspark_jax.convert.llamacpp_rules (``converters check --target llama.cpp``): a good folder
passes with the llama-server command; each rule has a folder (or verifier) that breaks
it, and the message names the rule and its llama.cpp file:line (table-driven)."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from dspark_jax.convert.check import check_folder
from dspark_jax.convert.export import export_params
from dspark_jax.convert.llamacpp_rules import RULES
from tests.converters.helpers import make_vocab, random_params, write_verifier
from tests.converters.test_check import _del, _set, _tl, edit_config
from tests.tiny_configs import base_config


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A reduced-vocab export (sliding layer non-causal: nothing to warn about) and its
    verifier (Qwen3, 4 layers, hidden 32)."""
    root = tmp_path_factory.mktemp("llamacpp")
    cfg = base_config(draft_vocab_size=40, sliding_window_non_causal=True)
    verifier = write_verifier(root / "verifier", cfg)
    export_params(cfg, random_params(cfg), root / "good", vocab_maps=make_vocab(cfg),
                  verifier_path=verifier, verifier_name_or_path="org/v", target="speculators")  # fmt: skip
    return root


def _verifier(**kv):
    def fn(root):
        path = root / "verifier" / "config.json"
        d = json.loads(path.read_text())
        d.update(kv)
        path.write_text(json.dumps(d))

    return fn


# rule -> (config edit, verifier edit, what the message says)
BREAKS = {
    "architecture": (_set(speculators_model_type="eagle3"), None, "not a speculators DSpark"),
    "sample-from-anchor": (_del("sample_from_anchor"), None, "reads a speculators folder without"),
    "block-size": (_del("block_size"), None, "defaults to 16"),
    "markov-head": (_set(markov_head_type="gated"), None, "refuses all but 'vanilla'"),
    "confidence-head": (_set(confidence_head_with_markov=False), None, "H + rank"),
    "attention-bias": (_tl(_set(attention_bias=True)), None, "has none"),
    "rope": (
        _tl(_set(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0})),
        None,
        "carries only default, linear, yarn",
    ),  # fmt: skip
    "draft-vocab": (None, None, "without a d2t"),  # tensor removed below
    "aux-capture": (
        None,
        _verifier(architectures=["Qwen2ForCausalLM"]),
        "layer input tensor is null",
    ),
    "final-layer": (_set(aux_hidden_state_layer_ids=[1, 4]), None, "captures layer inputs 0..3"),
    "hidden-size": (None, _verifier(hidden_size=64), "!= the verifier's 64"),
}


@pytest.mark.parametrize("rule", list(BREAKS))
def test_each_rule_has_a_folder_that_breaks_it(folders, tmp_path, rule):
    cfg_edit, verifier_edit, says = BREAKS[rule]
    root = tmp_path / "r"
    shutil.copytree(folders, root)
    if cfg_edit:
        edit_config(root / "good", cfg_edit)
    if verifier_edit:
        verifier_edit(root)
    if rule == "draft-vocab":
        from tests.converters.test_check import edit_tensors

        edit_tensors(root / "good", lambda t: t.pop("d2t"))
    report = check_folder(root / "good", target="llama.cpp", verifier=root / "verifier")
    mine = [e for e in report.errors if f"[{rule}: {RULES[rule]}]" in e]
    assert mine, report.errors
    assert any(says in e for e in mine), mine
    assert not report.commands


def test_every_error_rule_is_exercised():
    """Every rule but the warning-only ones has a row above."""
    assert set(RULES) - set(BREAKS) == {"sliding-window", "softcap", "draft-n-max"}


def test_good_folder_passes_with_the_server_command(folders):
    report = check_folder(folders / "good", target="llama.cpp", verifier=folders / "verifier")
    assert report.ok and not report.warnings, report.format()
    (cmd,) = report.commands
    # --spec-draft-n-max: the drafter's speculative tokens (block 4, sample_from_anchor).
    assert re.search(r"--spec-type draft-dspark --spec-draft-n-max 4 ", cmd), cmd
    assert "--metrics" in cmd and "--temp 0" in cmd and "draft.gguf" in cmd


def test_a_causal_sliding_layer_is_a_warning(folders, tmp_path):
    root = tmp_path / "r"
    shutil.copytree(folders, root)
    edit_config(root / "good", _set(sliding_window_non_causal=False))
    report = check_folder(root / "good", target="llama.cpp", verifier=root / "verifier")
    assert report.ok
    assert any(f"[sliding-window: {RULES['sliding-window']}]" in w for w in report.warnings)


def test_without_a_verifier_its_rules_are_a_note(folders):
    report = check_folder(folders / "good", target="llama.cpp")
    assert report.ok and any("unchecked" in n for n in report.notes)
