"""gpt-oss's MXFP4 experts (the Hub's openai/gpt-oss-* checkpoints), dequantized while
reading (issue 43; docs/formats.md, "MXFP4 experts").

* The decoding is transformers 5.19's ``convert_moe_packed_tensors`` bit for bit: every
  code, scales from the smallest to large, bf16 and fp32, slices crossing block edges.
* A tiny gpt-oss whose experts are stored as MXFP4 gives, in the step, the hidden states of
  transformers' fp32 eager model loaded from the same folder (``Mxfp4Config(dequantize=
  True)``), within test_forward's bound.
* Sharded over a mesh whose tensor axis cuts a block of 32 in two, every shard is its slice.
* Corrupt tensors give one line naming the file and tensor.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from dspark_jax import parallel
from dspark_jax.verifier import load_params, load_verifier_config, mxfp4, weights
from dspark_jax.verifier.weights import VerifierCheckpointError
from tests.verifier.hf_models import build
from tests.verifier.test_forward import Case

# gpt-oss's own list (its config.json): what transformers leaves unquantized
NOT_CONVERTED = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]


def _to_mxfp4(fp_folder, out, seed=0):
    """``fp_folder``'s checkpoint with its experts replaced by random MXFP4 codes, with
    scales 2**-5 .. 2**-3 (O(1) activations at these widths)."""
    out.mkdir()
    rng = np.random.default_rng(seed)
    tensors = {}
    for key, value in load_file(str(fp_folder / "model.safetensors")).items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4.packed_shapes(value.shape)
            tensors[key + "_blocks"] = rng.integers(0, 256, blocks, dtype=np.uint8)
            tensors[key + "_scales"] = rng.integers(122, 125, scales, dtype=np.uint8)
        else:
            tensors[key] = value
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((fp_folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (out / "config.json").write_text(json.dumps(cfg))
    return tensors


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    build("gpt_oss", root / "fp", intermediate_size=32)  # MXFP4 blocks: widths of 32
    tensors = _to_mxfp4(root / "fp", root / "q")
    assert not any(k.endswith("experts.down_proj") for k in tensors)
    return root / "q"


def _transformers(folder):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager",
    )  # fmt: skip
    # it keeps the dequantized experts in bf16, which holds them exactly; fp32 everywhere
    return model.float().eval()


def test_decoding_is_transformers_bit_for_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 4, 16), dtype=np.uint8)
    blocks[0, 0, 0] = np.arange(256, dtype=np.uint8)[::16] | np.arange(16, dtype=np.uint8)
    scales = rng.integers(0, 251, (3, 5, 4), dtype=np.uint8)  # E8M0 down to 2**-127, finite
    scales[0, 0] = [0, 1, 127, 250]
    full = (slice(None),) * 3
    for dtype in (torch.float32, torch.bfloat16):
        ref = convert_moe_packed_tensors(
            torch.from_numpy(blocks), torch.from_numpy(scales), dtype=dtype
        ).float().numpy()  # fmt: skip
        ours = mxfp4.read_slice(blocks, scales, full)
        if dtype == torch.bfloat16:
            ours = ours.astype(jnp.bfloat16).astype(np.float32)
        assert ours.shape == ref.shape == (3, 128, 5)
        np.testing.assert_array_equal(ours, ref)
    ref = mxfp4.read_slice(blocks, scales, full)
    for index in [
        (slice(1, 3), slice(16, 80), slice(2, 4)),
        (slice(0, 1), slice(31, 33), slice(None)),
    ]:
        np.testing.assert_array_equal(mxfp4.read_slice(blocks, scales, index), ref[index])


@pytest.fixture(scope="module")
def case(folder):
    return Case("gpt_oss", folder, model=_transformers(folder))


def test_in_step_states_match_transformers(folder, case):
    ref = case.model.state_dict()
    cfg = load_verifier_config(folder)
    params = load_params(folder, cfg, dtype=jnp.float32)
    checked = 0
    for name, spec in weights.param_specs(cfg).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            for slot, layer in enumerate(spec.layers):
                want = ref["model." + weights.layer_key(name, layer)].numpy()
                np.testing.assert_array_equal(np.asarray(params[name][slot]), want)
                checked += 1
    assert checked == 2 * cfg.num_hidden_layers
    case.check(case.run())


def test_hf_extractor_equals_in_step(case):
    """launch.extract_hidden_states --backend hf at float32 on the MXFP4 checkpoint computes
    its experts in fp32 too (transformers keeps them bf16 whatever dtype is asked)."""
    from launch.hf_extract import HFExtractor

    ex = HFExtractor(str(case.folder), [1, 2], device="cpu", dtype="float32",
                     compute_dtype="float32", attn_implementation="eager")  # fmt: skip
    got = np.concatenate([t.float().numpy() for t in ex.extract([d.tolist() for d in case.docs])])
    ours = case.run()[:, 1:]  # layer ids 1, 2 and the last (3): the extractor's slots
    proj = np.einsum(
        "tjh,tjh->tj", case.c[:, 1:].astype(np.float64), (got - ours).astype(np.float64)
    )
    assert (np.abs(proj) <= case.bound[:, 1:]).all(), np.abs(proj / case.bound[:, 1:]).max()


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 8 (simulated) devices")
def test_sharded_read_is_the_slice(folder):
    """fsdp=2 x tensor=2: 2 experts a device; tensor halves the MLP width, I = 32, so
    down_proj's input rows (one block of 32) are cut inside a block."""
    cfg = load_verifier_config(folder)
    whole = load_params(folder, cfg, dtype=jnp.float32)
    mesh = parallel.make_mesh("fsdp=2,tensor=2", jax.devices()[:4])
    sharded = load_params(folder, cfg, mesh, jnp.float32)
    down = next(n for n in sharded if n.endswith("experts.down_proj"))
    assert sharded[down].sharding.spec[1:3] == ("fsdp", "tensor")
    for name in sharded:
        np.testing.assert_array_equal(np.asarray(sharded[name]), np.asarray(whole[name]))


def _corrupt(folder, tmp_path, key_suffix, change):
    out = tmp_path / "bad"
    shutil.copytree(folder, out)
    tensors = load_file(str(out / "model.safetensors"))
    key = next(k for k in sorted(tensors) if k.endswith(key_suffix))
    change(tensors, key)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out, key


@pytest.mark.parametrize(
    "suffix, change, message",
    [
        ("down_proj_scales", lambda t, k: t.pop(k), r"no tensor model\.layers\.0\.mlp\.experts\.down_proj_scales"),
        ("down_proj_blocks", lambda t, k: t.update({k: t[k][:, :, :, :8]}), r"model\.layers\.0\.mlp\.experts\.down_proj_blocks is U8 \(4, 32, 1, 8\), MXFP4 of .* is U8 \(4, 32, 1, 16\)"),
        ("gate_up_proj_scales", lambda t, k: t.update({k: t[k].astype(np.float32)}), r"gate_up_proj_scales is F32"),
    ],
)  # fmt: skip
def test_corrupt_tensors_are_named(folder, tmp_path, suffix, change, message):
    bad, _ = _corrupt(folder, tmp_path, suffix, change)
    with pytest.raises(VerifierCheckpointError, match=message):
        load_params(bad, load_verifier_config(bad), dtype=jnp.float32)


def test_nan_scale_is_refused(folder, tmp_path):
    def nan(t, k):
        t[k][1, 0, 0] = mxfp4.NAN_SCALE

    bad, key = _corrupt(folder, tmp_path, "gate_up_proj_scales", nan)
    with pytest.raises(
        VerifierCheckpointError, match=rf"{bad}/model.safetensors: {key} holds E8M0's NaN"
    ):
        jax.block_until_ready(load_params(bad, load_verifier_config(bad), dtype=jnp.float32))


def test_packed_decoding_is_compressed_tensors_bit_for_bit():
    """compressed-tensors' mxfp4-pack-quantized layout (Kimi-K3's experts: weight_packed
    [R, C/2], weight_scale [R, C/32]) decodes as compressed-tensors 0.20.1 unpacks it
    (``unpack_fp4_from_uint8`` times ``decompress_mx_scale``): every code in both nibbles,
    scales 2**-127 .. 2**125 (above, 6 * 2**s overflows fp32), slices crossing block edges."""
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    rng = np.random.default_rng(4)
    R, C = 6, 96
    packed = rng.integers(0, 256, (R, C // 2), dtype=np.uint8)
    packed.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)  # every byte: both nibbles
    scale = rng.integers(0, 253, (R, C // mxfp4.BLOCK), dtype=np.uint8)
    scale[1] = [0, 127, 252]  # the extremes fp32 holds (6 * 2**126 would overflow)
    want = unpack_fp4_from_uint8(torch.from_numpy(packed), R, C, torch.float32)
    want = want * decompress_mx_scale(torch.from_numpy(scale)).float().repeat_interleave(
        mxfp4.BLOCK, dim=1
    )
    for rows, cols in [(slice(None), slice(None)), (slice(1, 4), slice(17, 70)),
                       (slice(5, 6), slice(31, 33))]:  # fmt: skip
        got = mxfp4.read_packed(packed, scale, rows, cols)
        np.testing.assert_array_equal(got, want.numpy()[rows, cols])
    scale[2, 1] = mxfp4.NAN_SCALE
    with pytest.raises(ValueError, match="NaN"):
        mxfp4.read_packed(packed, scale, slice(2, 3), slice(40, 41))
