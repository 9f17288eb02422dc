"""DSparkConfig: validation messages and the speculators config.json format."""

import json
import math

import pytest

from dspark_jax.config import (
    DSparkConfig,
    decoder_fields_from_qwen3,
    rope_scaling_from_dict,
    verifier_norm_style,
)

BASE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_hidden_layers=2,
    vocab_size=64,
    layer_types=["sliding_attention", "full_attention"],
    sliding_window=6,
    block_size=4,
    mask_token_id=63,
    aux_hidden_state_layer_ids=[1, 3],
    markov_rank=8,
    verifier_name_or_path="demo/verifier",
)


def test_json_round_trip(tmp_path):
    cfg = DSparkConfig(**BASE, draft_vocab_size=40, markov_head_type="gated")
    cfg.save_json(tmp_path / "config.json")
    d = json.loads((tmp_path / "config.json").read_text())
    assert "model_type" not in d  # vLLM would not recognise the folder otherwise
    assert d["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert d["transformer_layer_config"]["model_type"] == "qwen3"
    assert DSparkConfig.load_json(tmp_path) == cfg


def test_speculative_tokens_follow_sample_from_anchor():
    assert DSparkConfig(**BASE).speculative_tokens == 4
    assert DSparkConfig(**BASE, sample_from_anchor=False).speculative_tokens == 3


def test_missing_sample_from_anchor_reads_as_false_like_vllm():
    d = DSparkConfig(**BASE).to_speculators_dict()
    del d["sample_from_anchor"]
    assert DSparkConfig.from_speculators_dict(d).sample_from_anchor is False


def test_per_layer_semantics():
    cfg = DSparkConfig(**BASE)
    assert cfg.layer_sliding_window(0) == 6 and cfg.layer_causal_in_block(0)
    assert cfg.layer_sliding_window(1) is None and not cfg.layer_causal_in_block(1)
    nc = DSparkConfig(**BASE, sliding_window_non_causal=True)
    assert not nc.layer_causal_in_block(0)


@pytest.mark.parametrize(
    "override, message",
    [
        (dict(markov_rank=0), r"confidence_head_with_markov=True requires markov_rank > 0"),
        (dict(markov_head_type="lstm"), r"markov_head_type: unknown head type 'lstm'"),
        (
            dict(num_key_value_heads=3),
            r"num_attention_heads must be a multiple of num_key_value_heads",
        ),
        (
            dict(layer_types=["full_attention"]),
            r"layer_types has 1 entries, expected num_hidden_layers=2",
        ),
        (dict(layer_types=["sliding_attention", "x"]), r"unknown layer type 'x'"),
        (dict(sliding_window=None), r"sliding_window must be a positive int"),
        (dict(draft_vocab_size=65), r"draft_vocab_size \(65\) must not exceed vocab_size \(64\)"),
        (dict(mask_token_id=64), r"mask_token_id must be in \[0, vocab_size=64\)"),
        (dict(hidden_size=0), r"hidden_size must be a positive int"),
        (dict(aux_hidden_state_layer_ids=[]), r"aux_hidden_state_layer_ids must not be empty"),
        (dict(aux_hidden_state_layer_ids=[2, 2]), r"aux_hidden_state_layer_ids must be distinct"),
        (dict(aux_hidden_state_layer_ids=[3, 1]), r"aux_hidden_state_layer_ids must be ascending"),
    ],
)
def test_validation_names_the_field(override, message):
    with pytest.raises(ValueError, match=message):
        DSparkConfig(**{**BASE, **override})


def test_bad_json_files_name_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"{path}: not valid JSON"):
        DSparkConfig.load_json(path)
    d = DSparkConfig(**BASE).to_speculators_dict()
    d["speculators_model_type"] = "eagle3"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="speculators_model_type must be 'dspark'"):
        DSparkConfig.load_json(path)
    d = DSparkConfig(**BASE).to_speculators_dict()
    d["transformer_layer_config"]["rope_parameters"] = {"rope_type": "ntk", "factor": 4.0}
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=f"{path}: transformer_layer_config: rope_parameters: "
                       r"DSparkConfig.rope_scaling.rope_type: unknown rope type 'ntk'"):  # fmt: skip
        DSparkConfig.load_json(path)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


def test_rope_and_norm_round_trip(tmp_path):
    longrope = {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.5, 2.0, 3.0],
        "long_factor": [2.0, 3.0, 4.0, 5.0],
        "original_max_position_embeddings": 16,
    }
    for rope in (YARN, longrope, {"rope_type": "default", "mrope_section": [2, 2, 0]}):
        cfg = DSparkConfig(**BASE, rope_scaling=rope, max_position_embeddings=64,
                           verifier_norm_style="gemma")  # fmt: skip
        cfg.save_json(tmp_path / "config.json")
        d = json.loads((tmp_path / "config.json").read_text())
        assert d["verifier_norm_style"] == "gemma"
        assert d["transformer_layer_config"]["rope_parameters"] == {**rope, "rope_theta": 1e6}
        assert DSparkConfig.load_json(tmp_path) == cfg


def test_rope_parameters_are_standardized_for_both_readers():
    tl = DSparkConfig(**BASE).transformer_layer_dict()
    # transformers 4 spelling; original_max_position_embeddings defaults to the maximum.
    legacy = {**tl, "rope_theta": 5e5, "max_position_embeddings": 64}
    legacy["rope_parameters"] = None
    legacy["rope_scaling"] = {"type": "yarn", "factor": None}
    fields = decoder_fields_from_qwen3(legacy)
    assert fields["rope_theta"] == 5e5
    # vLLM indexes factor: transformers' implied max / original (here 64 / 64) is written.
    assert fields["rope_scaling"].to_dict() == {
        "rope_type": "yarn",
        "factor": 1.0,
        "original_max_position_embeddings": 64,
    }
    # longrope with a factor: vLLM would scale by sqrt(1 + ln(64/16) / ln 16) instead.
    rope = {"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0] * 4,
            "long_factor": [2.0] * 4, "original_max_position_embeddings": 16}  # fmt: skip
    scaling = rope_scaling_from_dict(rope, 64)
    assert (
        scaling.get("short_mscale")
        == scaling.get("long_mscale")
        == pytest.approx((1 + math.log(2) / math.log(16)) ** 0.5)
    )


@pytest.mark.parametrize(
    "rope, message",
    [
        ({"rope_type": "linear"}, r"rope_type 'linear' needs \['factor'\]"),
        ({**YARN, "extra": {"a": 1}}, r"rope_scaling.extra: unsupported value \{'a': 1\}"),
        ({**YARN, "factor": -1.0}, r"rope_scaling.factor: invalid value -1.0"),
        ({"rope_type": "default", "partial_rotary_factor": 0.5},
         r"partial_rotary_factor=0.5 < 1 with rope_type 'default'"),
        ({"rope_type": "default", "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 0]},
         r"MRoPE with partial_rotary_factor=0.5 < 1.*what --draft-mrope-full-head-hack does"),
        ({"rope_type": "default", "mrope_section": [1, 1, 0]},
         r"mrope_section \[1, 1, 0\]: 2 \* sum must equal head_dim=8"),
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0],
          "original_max_position_embeddings": 16},
         r"short_factor has 1 entries, expected head_dim // 2 = 4"),
    ],
)  # fmt: skip
def test_rope_validation_names_the_field(rope, message):
    with pytest.raises(ValueError, match=message):
        DSparkConfig(**BASE, rope_scaling=rope)


def test_verifier_norm_style():
    with pytest.raises(ValueError, match=r"verifier_norm_style: unknown style 'rms'"):
        DSparkConfig(**BASE, verifier_norm_style="rms")
    assert verifier_norm_style("Gemma3_Text") == "gemma"
    assert verifier_norm_style("qwen3_5_text") == "gemma"
    # speculators 0.9.0 matches exactly: gemma3n, gemma4 and qwen3_5_moe are not listed.
    for model_type in ("gemma3n", "gemma4", "qwen3_5_moe_text", "llama", None):
        assert verifier_norm_style(model_type) == "plain"
    d = DSparkConfig(**BASE).to_speculators_dict()
    del d["verifier_norm_style"]  # a folder speculators wrote
    assert DSparkConfig.from_speculators_dict(d).verifier_norm_style == "plain"


def test_verifier_logit_softcapping_field():
    assert "verifier_logit_softcapping" not in DSparkConfig(**BASE).to_speculators_dict()
    d = DSparkConfig(**BASE, verifier_logit_softcapping=30.0).to_speculators_dict()
    assert d["verifier_logit_softcapping"] == 30.0
    assert DSparkConfig.from_speculators_dict(d).verifier_logit_softcapping == 30.0
    for bad in (0.0, -1.0, float("inf"), "30"):
        with pytest.raises(ValueError, match=r"verifier_logit_softcapping must be null or a pos"):
            DSparkConfig(**BASE, verifier_logit_softcapping=bad)
    with pytest.raises(ValueError, match=r"verifier_logit_softcapping must be a number or null"):
        DSparkConfig.from_speculators_dict({**d, "verifier_logit_softcapping": "30"})


@pytest.mark.reference
def test_reads_config_saved_by_speculators(tmp_path):
    from tests.reference.harness import reference_config

    cfg = DSparkConfig(**BASE, draft_vocab_size=40, sample_from_anchor=False)
    reference_config(cfg).save_pretrained(tmp_path)
    back = DSparkConfig.load_json(tmp_path / "config.json")
    # The reference config records no verifier path here (None).
    assert back == cfg.replace(verifier_name_or_path=None)
