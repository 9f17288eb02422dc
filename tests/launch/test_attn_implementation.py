"""Issue 31: the hf backends compute every attention feature of the verifier's config
that vLLM computes (docs/formats.md, "Attention features of the hf backends").

Per feature, a tiny random verifier whose feature changes the result: the stored hidden
states equal the forward that honours it (eager, fp32) within one bf16 rounding, and
differ from the forward that drops it (sdpa) by more, so the test fails if the
extractor ran the wrong one.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from launch import attn_implementation as attn_impl
from launch.hf_extract import HFExtractor
from tests.numerics import BF16_U, assert_within

LAYERS = [1, 2, 3]  # + 4, the last
VOCAB = 4096  # the demo tokenizer's, so small_prepared's rows fit


def _save(tmp_path_factory, name: str, model_type: str, scale_qk: float, **fields) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=8,  # alternating sliding / full layers, window shorter than the rows
        **fields,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger attention logits, so that a cap of 2.0 bites
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(scale_qk)
            layer.self_attn.k_proj.weight.mul_(scale_qk)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def gemma2_path(tmp_path_factory) -> str:
    return _save(
        tmp_path_factory,
        "gemma2",
        "gemma2",
        scale_qk=8.0,
        intermediate_size=128,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=16,
    )


@pytest.fixture(scope="module")
def gpt_oss_path(tmp_path_factory) -> str:
    return _save(
        tmp_path_factory,
        "gpt_oss",
        "gpt_oss",
        scale_qk=1.0,
        intermediate_size=32,
        num_local_experts=2,
        num_experts_per_tok=1,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )


def _forwards(path: str, ids: list[int], dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Slots LAYERS of direct ``dtype`` forwards with eager and with sdpa: [T, 3, H] each
    (the residual stream after k layers is ``hidden_states[k]`` for k < 4)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    out = {}
    for impl in ("eager", "sdpa"):
        model.config._attn_implementation = impl  # sdpa also where transformers refuses it
        with torch.inference_mode():
            hs = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        out[impl] = torch.stack([hs[k][0] for k in LAYERS], dim=1).double()
    return out


def _rows() -> list[list[int]]:
    g = np.random.default_rng(0)
    return [g.integers(0, VOCAB, n).tolist() for n in (5, 24)]


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("fixture", "feature"),
    [("gemma2_path", "attention logit soft-capping"), ("gpt_oss_path", "attention sinks")],
)
def test_stored_hidden_states_are_the_forward_that_honours_the_feature(
    fixture, feature, compute, request
):
    path = request.getfixturevalue(fixture)
    ex = HFExtractor(path, LAYERS, device="cpu", compute_dtype=compute, dtype="bfloat16")
    assert ex.attn_implementation == "eager"
    assert [f.name.startswith(feature) for f in attn_impl.features(ex.model.config)] == [True]
    dtype = getattr(torch, compute)
    for ids in _rows():
        stored = ex.extract([ids])[0][:, :3].double()  # slots 1 2 3; 4 is pre-norm
        forwards = _forwards(path, ids, dtype)
        honours, drops = forwards["eager"], forwards["sdpa"]
        # stored = bf16(x), x the eager forward in `compute` (the same kernels on the same
        # row): one round to nearest, |error| <= BF16_U |x| (bf16 keeps 8 significant
        # bits, half an ulp = 2^-8 relative); 0 when x is bf16 already
        bound = BF16_U * honours.abs()
        assert_within(stored, honours, bound, f"{fixture} vs eager, T={len(ids)}")
        if compute == "bfloat16":
            assert torch.equal(stored, honours)
        # the feature is live: dropping it moves most hidden states far beyond that
        over = ((drops - honours).abs() > 4 * bound).double().mean()
        assert over > 0.5, (fixture, len(ids), float(over))


def test_cli_records_the_implementation(tmp_path, gemma2_path, small_prepared):
    from launch.extract_hidden_states import main

    out = tmp_path / "hs"
    argv = ["--backend", "hf", "--model", gemma2_path, "--preprocessed-data", str(small_prepared),
            "--output", str(out), "--target-layer-ids", *map(str, LAYERS), "--batch-size", "1",
            "--max-samples", "1", "--device", "cpu", "--compute-dtype", "float32"]  # fmt: skip
    assert main(argv) == 0
    record = json.loads((out / "extraction_config.json").read_text())
    assert record["attn_implementation"] == "eager" and record["compute_dtype"] == "float32"
    f = load_file(out / "hs_0.safetensors")
    ids = f["token_ids"].tolist()
    want = _forwards(gemma2_path, ids)["eager"]
    assert_within(f["hidden_states"][:, :3].double(), want, BF16_U * want.abs(), "cli")


def test_cli_refuses_an_implementation_that_drops_a_feature(
    tmp_path, gemma2_path, small_prepared, capsys
):
    from launch.extract_hidden_states import main

    out = tmp_path / "hs"
    argv = ["--backend", "hf", "--model", gemma2_path, "--preprocessed-data", str(small_prepared),
            "--output", str(out), "--max-samples", "1", "--device", "cpu",
            "--target-layer-ids", "1", "--attn-implementation", "sdpa"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "error: --attn-implementation sdpa: does not compute the verifier's attention logit "
        "soft-capping (attn_logit_softcapping), which vLLM computes; use eager"
    )
    assert not out.exists()


def test_choose():
    from transformers import AutoConfig

    gemma2 = AutoConfig.for_model("gemma2", attn_logit_softcapping=2.0)
    assert attn_impl.choose(gemma2, None, "cpu") == "eager"
    assert attn_impl.choose(gemma2, "flex_attention", "cpu") == "flex_attention"
    with pytest.raises(ValueError, match=r"flash_attention_2: does not compute .* soft-capping"):
        attn_impl.choose(gemma2, "flash_attention_2", "cuda")
    # a null cap is no feature: transformers' default (sdpa) computes the model
    assert (
        attn_impl.choose(AutoConfig.for_model("gemma2", attn_logit_softcapping=None), None, "cpu")
        is None
    )
    # Gemma 3 keeps the field but neither transformers nor vLLM applies it
    assert attn_impl.features(AutoConfig.for_model("gemma3_text", attn_logit_softcapping=2.0)) == []
    assert attn_impl.choose(AutoConfig.for_model("llama"), None, "cpu") is None
    assert attn_impl.choose(AutoConfig.for_model("llama"), "sdpa", "cpu") == "sdpa"
    gpt_oss = AutoConfig.for_model("gpt_oss")
    assert attn_impl.choose(gpt_oss, None, "cuda") == "eager"
    assert attn_impl.choose(gpt_oss, "flex_attention", "cuda") == "flex_attention"
    with pytest.raises(ValueError, match=r"flex_attention: does not compute .* sinks .* on cpu,"):
        attn_impl.choose(gpt_oss, "flex_attention", "cpu")
    with pytest.raises(ValueError, match=r"^--attn-implementation spda: expected one of eager, "):
        attn_impl.choose(AutoConfig.for_model("llama"), "spda", "cpu")


def test_regenerate_hf_runs_the_verifier_with_eager(tmp_path, gemma2_path, verifier_path, caplog):
    """launch.regenerate --backend hf loads the verifier as the extractor does."""
    from pathlib import Path

    from launch import regenerate as rg

    folder = tmp_path / "gemma2"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (folder / name).symlink_to(Path(gemma2_path) / name)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the demo's: the vocab fits
        (folder / name).symlink_to(Path(verifier_path) / name)
    argv = ["--data", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
            "--model", str(folder), "--backend", "hf", "--device", "cpu"]  # fmt: skip
    with caplog.at_level("INFO", logger="launch.regenerate"):
        rg.hf_backend(rg.parse_args(argv))
    assert "hf backend: attention eager" in caplog.text
    with pytest.raises(ValueError, match=r"^--attn-implementation sdpa: does not compute the ver"):
        rg.hf_backend(rg.parse_args([*argv, "--attn-implementation", "sdpa"]))
