"""Issue 4, test 1: hf extraction of the demo verifier equals a direct forward."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from launch.hf_extract import HFExtractor
from launch.hs_files import resolve_layer_ids
from tests.converters.helpers import tree_digest
from tests.numerics import U, assert_within

from .conftest import DEMO_TARGET_LAYERS
from .test_launch_vllm import speculators_launcher_ids


def _ids(tok, text="def add(a, b):\n    return a + b\n"):
    conv = [{"role": "user", "content": "Write add."}, {"role": "assistant", "content": text}]
    return tok(tok.apply_chat_template(conv, tokenize=False), add_special_tokens=False)["input_ids"]


def test_slots_are_residual_stream_and_last_is_prenorm(verifier_path, demo_tokenizer):
    ex = HFExtractor(verifier_path, [0, 1, 2, 3], device="cpu")
    n = ex.num_hidden_layers
    assert ex.layer_ids == [0, 1, 2, 3, n]
    ids = _ids(demo_tokenizer)
    hs = ex.extract([ids])[0]
    assert hs.shape == (len(ids), 5, ex.hidden_size) and hs.dtype == ex.dtype == torch.bfloat16

    with torch.inference_mode():
        out = ex.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        ref = [h[0] for h in out.hidden_states]  # N + 1 entries; ref[N] is post-norm
        assert len(ref) == n + 1
        # slot k == residual stream after k layers (HF's hidden_states[k] for k < N)
        for slot, k in enumerate(ex.layer_ids[:-1]):
            assert torch.equal(hs[:, slot], ref[k]), k
        emb = ex.model.get_input_embeddings()(torch.tensor(ids))
        assert torch.equal(hs[:, 0], emb)
        last = hs[:, -1]
        # the last slot differs from output_hidden_states[-1] by exactly the final norm
        assert not torch.equal(last, ref[n])
        assert torch.equal(ex.model.model.norm(last), ref[n])
        # and feeds the verifier's lm_head to give its logits
        torch.testing.assert_close(
            ex.model.lm_head(ex.model.model.norm(last)).float(),
            out.logits[0].float(),
            rtol=0,
            atol=0,
        )


def _bf16_spacing(x: torch.Tensor) -> torch.Tensor:
    """The gap between adjacent bf16 numbers in |x|'s binade (8 significant bits)."""
    e = torch.floor(torch.log2(x.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)))
    return torch.exp2(e - 7)


def _residual_abs_evaluation(ex: HFExtractor, ids) -> torch.Tensor:
    """[T, len(layer_ids), H] float64: per slot k, |embedding| + the sum over layers < k of
    |W_o| @ |a_o| + |W_down| @ |a_down| (a: those projections' fp32 inputs), the absolute
    evaluation of the residual stream's last step in each sublayer."""
    stores: list[tuple[torch.nn.Linear, list]] = []
    handles = []
    for layer in ex.layers:
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            store: list = []
            stores.append((proj, store))
            handles.append(proj.register_forward_pre_hook(lambda _m, a, s=store: s.append(a[0])))
    try:
        with torch.inference_mode():
            ex.decoder(input_ids=torch.tensor([ids]), use_cache=False)
            steps = [ex.model.get_input_embeddings()(torch.tensor(ids)).double().abs()]
            for i in range(0, len(stores), 2):  # one decoder layer: attention out, MLP out
                pairs = stores[i : i + 2]
                steps.append(
                    steps[-1]
                    + sum(s[0][0].double().abs() @ p.weight.double().abs().T for p, s in pairs)
                )
    finally:
        for h in handles:
            h.remove()
    return torch.stack([steps[k] for k in ex.layer_ids], dim=1)


def test_batched_extraction_matches_single_rows(fp32_extractor, demo_tokenizer):
    """A padded batch stores what one-row forwards store, up to one bf16 rounding step.

    The forward runs in fp32 (the CPU default; in a bf16 forward a one-ulp flip in layer 1
    propagates, which has no tight a-priori bound). The batched and the one-row fp32 forwards
    differ only in accumulation order (kernel shapes, the padding mask; right padding is
    never seen by a real position): per entry by <= delta = 2 depth U S (tests/numerics.py's
    backward-error model), S the absolute evaluation of the residual stream
    (_residual_abs_evaluation), depth the longest fp32 chain (per layer: input norm, q/k/v
    and post norm H each, q/k norms and scores head_dim each, softmax and P V T each, o_proj
    heads * head_dim, down intermediate, + 16 elementwise). Each is then rounded once to bf16,
    a monotone rounding, so the stored values differ by <= delta + one bf16 spacing of the
    larger. A batched path off by 1% at one position (which rtol=atol=0.02 let through)
    fails it."""
    ex = fp32_extractor
    assert ex.compute_dtype == torch.float32 and ex.dtype == torch.bfloat16
    c = ex.model.config
    rows = [_ids(demo_tokenizer, "x = 1\n" * k) for k in (1, 5, 12)]
    T = max(len(r) for r in rows)
    per_layer = 3 * c.hidden_size + 2 * c.head_dim + 2 * T
    per_layer += c.num_attention_heads * c.head_dim + c.intermediate_size + 16
    depth = c.num_hidden_layers * per_layer
    single = [ex.extract([r])[0] for r in rows]
    batched = ex.extract(rows)
    for s, b, r in zip(single, batched, rows):
        assert b.shape == (len(r), len(DEMO_TARGET_LAYERS) + 1, ex.hidden_size)
        S = _residual_abs_evaluation(ex, r)
        spacing = _bf16_spacing(torch.maximum(b.double().abs(), s.double().abs()))
        assert_within(b.double(), s.double(), spacing + 2 * depth * U * S, f"row of {len(r)}")


def test_layer_id_resolution():
    assert resolve_layer_ids([1, 2, 3], 4) == [1, 2, 3, 4]
    assert resolve_layer_ids([1, 4], 4) == [1, 4]  # final layer already present
    assert resolve_layer_ids([1, 2], 4, include_last_layer=False) == [1, 2]
    # ascending, as vLLM captures them; the final layer is then always last
    assert resolve_layer_ids([3, 1, 2], 4) == [1, 2, 3, 4]
    assert resolve_layer_ids([4, 2, 1], 4, include_last_layer=False) == [1, 2, 4]
    for last in (True, False):  # speculators' launcher: the same default either way
        want = speculators_launcher_ids(36, None, last)
        assert resolve_layer_ids(None, 36, include_last_layer=last) == want == [2, 18, 33, 36]
    with pytest.raises(ValueError, match="default target layer ids"):
        resolve_layer_ids(None, 4)  # [2, 2, 1]: duplicates
    with pytest.raises(ValueError, match="within"):
        resolve_layer_ids([1, 5], 4)
    assert resolve_layer_ids([3, 1], 4) == [1, 3, 4]  # sorted, as vLLM sorts them


def test_cli_writes_spec_files(tmp_path, small_prepared, verifier_path, fp32_extractor):
    from datasets import load_from_disk

    from launch.extract_hidden_states import main

    out = tmp_path / "hs"
    rc = main(
        [
            "--backend",
            "hf",
            "--model",
            verifier_path,
            "--preprocessed-data",
            str(small_prepared),
            "--output",
            str(out),
            "--target-layer-ids",  # out of order: stored ascending, as vLLM would
            "3",
            "1",
            "2",
            "--batch-size",
            "1",
            "--max-samples",
            "4",
            "--device",
            "cpu",
        ]
    )
    assert rc == 0
    ds = load_from_disk(str(small_prepared)).with_format(None)
    assert sorted(p.name for p in out.glob("hs_*")) == [f"hs_{i}.safetensors" for i in range(4)]
    for i in range(4):
        f = load_file(out / f"hs_{i}.safetensors")
        assert set(f) == {"hidden_states", "token_ids"}
        assert f["token_ids"].dtype == torch.int64
        assert f["token_ids"].tolist() == ds[i]["input_ids"]
        assert torch.equal(f["hidden_states"], fp32_extractor.extract([ds[i]["input_ids"]])[0])
    record = json.loads((out / "extraction_config.json").read_text())
    assert record["layer_ids"] == [1, 2, 3, 4] and record["dtype"] == "bfloat16"
    # on a CPU the forward runs in float32 (the default --compute-dtype auto)
    assert record["compute_dtype"] == "float32"


@pytest.fixture(scope="module")
def fp32_extractor(verifier_path):
    return HFExtractor(verifier_path, DEMO_TARGET_LAYERS, device="cpu", compute_dtype="auto")


def test_fp32_compute_stores_the_float32_forward_rounded_once(
    fp32_extractor, extractor, demo_tokenizer
):
    """Issue 20: --compute-dtype float32 runs the forward in fp32 (fast on a CPU) and
    stores each slot of the fp32 residual stream rounded once to the files' bf16."""
    assert fp32_extractor.compute_dtype == torch.float32
    assert fp32_extractor.dtype == torch.bfloat16 and fp32_extractor.dtype_name == "bfloat16"
    ids = _ids(demo_tokenizer)
    hs = fp32_extractor.extract([ids])[0]
    assert hs.dtype == torch.bfloat16
    with torch.inference_mode():
        out = fp32_extractor.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    for slot, k in enumerate(fp32_extractor.layer_ids[:-1]):
        assert torch.equal(hs[:, slot], out.hidden_states[k][0].to(torch.bfloat16)), k
    # not the bf16 forward: its roundings compound layer after layer
    assert not torch.equal(hs, extractor.extract([ids])[0])
    # and closer to the exact (float64) forward than the bf16 forward is
    exact = HFExtractor(fp32_extractor.model_name, DEMO_TARGET_LAYERS, device="cpu",
                        compute_dtype="float64", dtype="bfloat16")  # fmt: skip
    assert exact.dtype == torch.bfloat16 and exact.compute_dtype == torch.float64
    with torch.inference_mode():
        ref = exact.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    ref_last = torch.stack([ref.hidden_states[k][0] for k in exact.layer_ids[:-1]], dim=1)
    err32 = (hs[:, :-1].double() - ref_last).abs().max()
    err16 = (extractor.extract([ids])[0][:, :-1].double() - ref_last).abs().max()
    assert err32 < err16


def test_compute_dtype_must_name_a_torch_dtype(verifier_path):
    with pytest.raises(ValueError, match="--compute-dtype fp33: not a torch dtype name"):
        HFExtractor(verifier_path, DEMO_TARGET_LAYERS, device="cpu", compute_dtype="fp33")


def test_dtype_auto_is_what_vllm_serves(tmp_path, verifier_path, extractor, demo_tokenizer):
    """A float32 config is served in bf16 by vLLM on compute capability >= 8.0: so are
    the hf backend's files (here equal to those of the bf16 demo verifier)."""
    config = json.loads((Path(verifier_path) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    (tmp_path / "model.safetensors").symlink_to(Path(verifier_path) / "model.safetensors")
    ex = HFExtractor(str(tmp_path), [1, 2, 3], device="cpu", compute_capability="9.0")
    assert ex.dtype == torch.bfloat16
    ids = _ids(demo_tokenizer)
    assert torch.equal(ex.extract([ids])[0], extractor.extract([ids])[0])


def _cli(model, data, out, *extra):
    return [
        "--backend",
        "hf",
        "--model",
        str(model),
        "--preprocessed-data",
        str(data),
        "--output",
        str(out),
        "--target-layer-ids",
        "1",
        "2",
        "3",
        "--batch-size",
        "1",
        "--device",
        "cpu",
        *extra,
    ]


def test_a_verifier_missing_a_tensor_is_refused(tmp_path, small_prepared, verifier_path, capsys):
    """Issue 18.3: transformers would initialise the embedding at random (a warning
    only); the command names the folder and the tensor and writes nothing."""
    from launch.extract_hidden_states import main

    bad = tmp_path / "verifier"
    shutil.copytree(verifier_path, bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.embed_tokens.weight"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    data = tree_digest(small_prepared)
    assert main(_cli(bad, small_prepared, tmp_path / "hs", "--max-samples", "2")) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"error: {bad}: the verifier's weights do not match its config.json (missing keys "
        "model.embed_tokens.weight); transformers would initialise them at random"
    )
    assert not (tmp_path / "hs").exists() and tree_digest(small_prepared) == data


def test_rerun_revalidates_files_and_files_are_readable_by_others(
    tmp_path, small_prepared, verifier_path, extractor
):
    """Issue 18.11: a NaN planted in a finished file (header, shape and token ids fine)
    is regenerated by the rerun, the valid one kept; files are 0644 under umask 022."""
    from launch.extract_hidden_states import main, parse_args, run
    from launch.hs_files import load_and_check

    out = tmp_path / "hs"
    argv = _cli(verifier_path, small_prepared, out, "--max-samples", "2")
    old = os.umask(0o022)
    try:
        assert main(argv) == 0
        tensors = load_file(out / "hs_1.safetensors")
        tensors["hidden_states"][0, 0, 0] = float("nan")
        save_file(tensors, str(out / "hs_1.safetensors"))
        kept = tree_digest(out)["hs_0.safetensors"]
        summary = run(parse_args(argv))
    finally:
        os.umask(old)
    assert (summary.skipped_valid, summary.invalid_existing, summary.written) == (1, 1, 1)
    assert tree_digest(out)["hs_0.safetensors"] == kept
    ids = load_file(out / "hs_1.safetensors")["token_ids"].tolist()
    load_and_check(out / "hs_1.safetensors", ids, num_slots=4)  # finite again
    for p in out.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p.name
