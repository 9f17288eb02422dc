"""The exported folder's keys and shapes are exactly those of docs/formats.md, "Tensor
keys and shapes" (what vLLM 0.33's Qwen3DSpark loader builds), written out here from the doc's
formulas independently of dspark_jax.convert.check's own table."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from dspark_jax.convert.check import CheckError
from dspark_jax.convert.export import export_params
from tests.converters.helpers import base_config, make_vocab, random_params, write_verifier


def spec_table(*, H, n_aux, Ht, L, nh, nkv, hd, I, Vt, Vd, r, conf, conf_markov, bias):
    """docs/formats.md, "Tensor keys and shapes", row by row (torch layout [out, in])."""
    rows = {
        "fc.weight": [H, n_aux * Ht],
        "hidden_norm.weight": [H],
        "norm.weight": [H],
    }
    for i in range(L):
        rows |= {
            f"layers.{i}.input_layernorm.weight": [H],
            f"layers.{i}.post_attention_layernorm.weight": [H],
            f"layers.{i}.self_attn.q_proj.weight": [nh * hd, H],
            f"layers.{i}.self_attn.k_proj.weight": [nkv * hd, H],
            f"layers.{i}.self_attn.v_proj.weight": [nkv * hd, H],
            f"layers.{i}.self_attn.o_proj.weight": [H, nh * hd],
            f"layers.{i}.self_attn.q_norm.weight": [hd],
            f"layers.{i}.self_attn.k_norm.weight": [hd],
            f"layers.{i}.mlp.gate_proj.weight": [I, H],
            f"layers.{i}.mlp.up_proj.weight": [I, H],
            f"layers.{i}.mlp.down_proj.weight": [H, I],
        }
        if bias:  # attention_bias: Qwen3 q/k/v/o biases (vLLM's qkv_proj / o_proj bias)
            rows |= {
                f"layers.{i}.self_attn.q_proj.bias": [nh * hd],
                f"layers.{i}.self_attn.k_proj.bias": [nkv * hd],
                f"layers.{i}.self_attn.v_proj.bias": [nkv * hd],
                f"layers.{i}.self_attn.o_proj.bias": [H],
            }
    rows |= {"markov_head.markov_w1.weight": [Vt, r], "markov_head.markov_w2.weight": [Vd, r]}
    if conf:
        rows |= {
            "confidence_head.proj.weight": [1, H + (r if conf_markov else 0)],
            "confidence_head.proj.bias": [1],
        }
    if Vd != Vt:
        rows |= {"lm_head.weight": [Vd, H], "d2t": [Vd], "t2d": [Vt]}
    return rows


GEOMETRY = dict(H=32, n_aux=2, Ht=32, L=2, nh=4, nkv=2, hd=8, I=64, Vt=64, r=8)
CASES = {
    # name: (config overrides, spec-table overrides)
    "vanilla-full-vocab": ({}, dict(Vd=64, conf=True, conf_markov=True, bias=False)),
    "reduced-vocab": (
        dict(draft_vocab_size=40),
        dict(Vd=40, conf=True, conf_markov=True, bias=False),
    ),
    "confidence-without-markov": (
        dict(confidence_head_with_markov=False),
        dict(Vd=64, conf=True, conf_markov=False, bias=False),
    ),
    "no-confidence-head": (
        dict(enable_confidence_head=False),
        dict(Vd=64, conf=False, conf_markov=False, bias=False),
    ),
    "attention-bias-rank16": (
        dict(attention_bias=True, markov_rank=16),
        dict(Vd=64, conf=True, conf_markov=True, bias=True, r=16),
    ),
    "wider-verifier": (
        dict(target_hidden_size=48),
        dict(Vd=64, conf=True, conf_markov=True, bias=False, Ht=48),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_exported_keys_and_shapes_are_spec_section_5(tmp_path, case):
    overrides, spec = CASES[case]
    cfg = base_config(**overrides)
    kw = {}
    if cfg.uses_draft_vocab:
        kw = dict(vocab_maps=make_vocab(cfg), verifier_path=write_verifier(tmp_path / "v", cfg))
    export_params(cfg, random_params(cfg), tmp_path / "out", verifier_name_or_path="org/v", **kw)
    with safe_open(tmp_path / "out" / "model.safetensors", "np") as f:
        got = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
        assert f.metadata() == {"format": "pt"}
    assert got == spec_table(**(GEOMETRY | spec))
    floats = {k: dtypes[k] for k in got if k not in ("d2t", "t2d")}
    # vLLM holds the confidence head in fp32 (DSparkConfidenceHead): it stays fp32.
    assert {d for k, d in floats.items() if not k.startswith("confidence_head.")} == {"BF16"}
    assert {d for k, d in floats.items() if k.startswith("confidence_head.")} <= {"F32"}
    if cfg.uses_draft_vocab:
        assert (dtypes["d2t"], dtypes["t2d"]) == ("I64", "BOOL")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "model_type" not in config and config["dtype"] == "bfloat16"
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/v"


@pytest.mark.parametrize("head", ["gated", "rnn"])
def test_gated_and_rnn_heads_are_refused_for_vllm(tmp_path, head):
    cfg = base_config(markov_head_type=head)
    with pytest.raises(CheckError) as e:
        export_params(cfg, random_params(cfg), tmp_path / "out", verifier_name_or_path="org/v")
    assert f"markov_head_type='{head}' is not served by vLLM" in str(e.value)
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []  # no partial folder left behind
    # Same model for speculators only: the extra head tensors are written.
    export_params(
        cfg,
        random_params(cfg),
        tmp_path / "out",
        verifier_name_or_path="org/v",
        target="speculators",
    )
    with safe_open(tmp_path / "out" / "model.safetensors", "np") as f:
        extra = sorted(k for k in f.keys() if k.startswith("markov_head.") and "markov_w" not in k)
    r = 8
    want = {
        "gated": {"markov_head.gate_proj.weight": [r, 32 + r], "markov_head.gate_proj.bias": [r]},
        "rnn": {
            "markov_head.joint_proj.weight": [3 * r, 2 * r + 32],
            "markov_head.joint_proj.bias": [3 * r],
        },
    }[head]
    assert extra == sorted(want)
    with safe_open(tmp_path / "out" / "model.safetensors", "np") as f:
        assert {k: list(f.get_slice(k).get_shape()) for k in extra} == want
        # bf16 values are the fp32 params rounded to nearest even.
        np.testing.assert_array_equal(
            f.get_tensor("norm.weight"),
            np.asarray(random_params(cfg).norm.weight[...]).astype(ml_dtypes.bfloat16),
        )
