"""Converters against speculators 0.9.0: our export loads in its
``DSparkDraftModel.from_pretrained`` and computes what our model computes; its
``save_pretrained`` output imports into JAX with the same outputs and re-exports
bit for bit; our check accepts its folders.

Tolerances: both sides run fp32 on the same (bf16-representable) weights; as in
test_model_parity.py the exact values are the reference model run in float64, and ours
and the reference's fp32 run must both lie within the fp32 round-off bound
``harness.fp32_roundoff(DRAFTER_DEPTH, scale)`` (6 sqrt(1024) U = 1.1e-5 of the largest
logit). Tensors round-tripped through import/export are compared as bytes.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("speculators")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.reference

from flax import nnx
from safetensors import safe_open

from dspark_jax.checkpoint import orbax_io
from dspark_jax.convert.check import check_folder
from dspark_jax.convert.export import export_checkpoint
from dspark_jax.convert.importer import WarmStart, import_folder
from dspark_jax.model.draft import (
    DSparkDraftModel,
    FrozenWeights,
    LossSettings,
    row_loss,
)
from dspark_jax.model.params import to_speculators
from dspark_jax.verifier.frozen import load_verifier_tensors
from tests.converters.helpers import (
    base_config,
    flat_params,
    make_vocab,
    random_params,
    write_verifier,
)
from tests.numerics import DRAFTER_DEPTH
from tests.reference.harness import assert_fp32_parity, reference_config, run_reference
from tests.reference.test_model_parity import anchors_for, make_row

LOSS_FN = '{"ce":0.1,"tv":0.9}'
NUM_ANCHORS = 8


def load_reference(folder, dtype=torch.float32):
    """speculators' own loader, eager attention (flex attention needs a GPU), fp32 (or
    float64: the exact values)."""
    from speculators.models.dspark import DSparkDraftModel as Ref
    from speculators.models.dspark import DSparkSpeculatorConfig

    config = DSparkSpeculatorConfig.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = "eager"
    return Ref.from_pretrained(str(folder), config=config).to(dtype)


def run_reference_both(folder, row, anchors, valid):
    """The reference on ``folder`` in fp32 and in float64 (the exact values)."""
    return tuple(
        run_reference(
            load_reference(folder, dtype), row, anchors, valid, loss_fn=LOSS_FN, dtype=dtype
        )
        for dtype in (torch.float32, torch.float64)
    )


def frozen_from(verifier, t2d):
    vt = load_verifier_tensors(verifier, t2d)

    def f32(x):
        return jnp.asarray(np.asarray(x, np.float32))

    head = f32(vt.lm_head).T
    return FrozenWeights(f32(vt.embed_tokens), head, head, f32(vt.norm))


def ours(cfg, params, frozen, row, anchors, valid):
    """Loss, Markov-corrected logits and confidence logits of our model (fp32, jit)."""
    abstract = nnx.eval_shape(
        lambda: DSparkDraftModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, remat=False)
    )
    model = nnx.merge(nnx.split(abstract)[0], params)
    settings = LossSettings.from_loss_fn(LOSS_FN, num_anchors=NUM_ANCHORS, vocab_chunk_tokens=12)
    jrow = {
        k: jnp.asarray(v.astype(np.int32) if v.dtype == np.int64 else v) for k, v in row.items()
    }

    @nnx.jit
    def run(m, fr, r, a, v):
        loss, _ = row_loss(m, fr, r, a, v, settings)
        out = m(r, a, fr)
        logits = out.hidden @ fr.lm_head
        if out.markov_feature is not None:
            logits = logits + out.markov_feature @ m.markov_w2()
        return loss, logits, out.confidence_logits

    return run(model, frozen, jrow, jnp.asarray(anchors, jnp.int32), jnp.asarray(valid))


def assert_same_outputs(refs, loss, logits, conf):
    """Ours vs the reference's (fp32, float64) runs, within the fp32 round-off bound
    (harness.assert_fp32_parity; the loss is made of log-sum-exps of the logits, so
    its terms are bounded by the largest logit)."""
    ref, ref64 = refs
    assert_fp32_parity(logits, ref.logits, ref64.logits, DRAFTER_DEPTH, "logits")
    if ref.confidence_logits is None:
        assert conf is None
    else:
        assert_fp32_parity(
            conf, ref.confidence_logits, ref64.confidence_logits, DRAFTER_DEPTH, "conf"
        )
    scale = float(np.abs(ref64.logits).max())
    assert_fp32_parity(
        float(loss), float(ref.loss), float(ref64.loss), DRAFTER_DEPTH, "loss", scale
    )


def batch(cfg, seed):
    rng = np.random.default_rng(seed)
    row = make_row(rng, cfg)
    anchors, valid = anchors_for(row["loss_mask"], NUM_ANCHORS, cfg.block_size, rng)
    return row, anchors, valid


EXPORT_CASES = {
    # name: (config overrides, export target). Reduced vocab: the gated case here,
    # the vanilla one in the import test below.
    "vanilla": (dict(), "vllm"),
    "gated-reduced-dflash-slots": (
        dict(
            markov_head_type="gated",
            draft_vocab_size=40,
            sample_from_anchor=False,
            confidence_head_with_markov=False,
        ),
        "speculators",
    ),
    "rnn-noncausal-sliding": (
        dict(markov_head_type="rnn", sliding_window_non_causal=True),
        "speculators",
    ),
}


@pytest.mark.parametrize("case", list(EXPORT_CASES))
def test_export_loads_in_speculators_with_equal_outputs(tmp_path, case):
    overrides, target = EXPORT_CASES[case]
    cfg = base_config(**overrides)
    verifier = write_verifier(tmp_path / "verifier", cfg)
    params = random_params(cfg, seed=11)
    orbax_io.save_params_checkpoint(tmp_path / "ck", 50, cfg, params)
    t2d = None
    if cfg.uses_draft_vocab:
        d2t, t2d = make_vocab(cfg, seed=11)
        orbax_io.save_checkpoint_vocab_maps(tmp_path / "ck", cfg, d2t, t2d)
    export_checkpoint(
        tmp_path / "ck",
        tmp_path / "out",
        verifier_path=verifier,
        verifier_name_or_path=str(verifier),
        target=target,
    )

    row, anchors, valid = batch(cfg, seed=3)
    refs = run_reference_both(tmp_path / "out", row, anchors, valid)
    # Our model on the weights as exported (bf16-rounded) and the verifier's tensors. The
    # confidence head is exported fp32 (vLLM holds it so), but speculators builds the model
    # in config.json's dtype (bf16) and rounds it on load.
    rounded = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32), params)
    assert_same_outputs(refs, *ours(cfg, rounded, frozen_from(verifier, t2d), row, anchors, valid))


def reference_save(folder, cfg, verifier, t2d=None, d2t=None, seed=0):
    """A randomly initialised speculators model (verifier weights loaded, norms and
    biases moved off their init), saved by speculators in bf16."""
    from speculators.models.dspark import DSparkDraftModel as Ref

    config = reference_config(cfg)
    config.speculators_config.verifier.name_or_path = str(verifier)
    torch.manual_seed(seed)
    model = Ref(config)
    model.load_vocab_mappings(
        None if t2d is None else torch.from_numpy(t2d),
        None if d2t is None else torch.from_numpy(d2t),
    )
    model.load_verifier_weights()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(str(folder))
    return folder


def tensors_of(folder):
    with safe_open(folder / "model.safetensors", "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


SAVED_CASES = {
    # name: (config overrides, check target, run both models). The rnn case only
    # round-trips tensors: its forward is covered by the export test (same key table).
    "vanilla-reduced-vocab": (dict(draft_vocab_size=40), "vllm", True),
    "rnn": (dict(markov_head_type="rnn"), "speculators", False),
}


@pytest.mark.parametrize("case", list(SAVED_CASES))
def test_speculators_checkpoint_imports_runs_and_reexports_bit_exact(tmp_path, case):
    overrides, target, run_models = SAVED_CASES[case]
    cfg = base_config(**overrides)
    verifier = write_verifier(tmp_path / "verifier", cfg)
    d2t = t2d = None
    if cfg.uses_draft_vocab:
        d2t, t2d = make_vocab(cfg, seed=5)
    saved = reference_save(tmp_path / "saved", cfg, verifier, t2d, d2t, seed=5)
    assert json.loads((saved / "config.json").read_text())["dtype"] == "bfloat16"
    report = check_folder(saved, target=target)
    assert report.ok, report.format()

    result = import_folder(saved, tmp_path / "ck", verifier_path=verifier)
    assert result.cfg == cfg.replace(verifier_name_or_path=str(verifier))
    if run_models:
        row, anchors, valid = batch(cfg, seed=4)
        refs = run_reference_both(saved, row, anchors, valid)
        loaded = orbax_io.load_params(tmp_path / "ck")
        assert_same_outputs(
            refs, *ours(loaded.cfg, loaded.params, frozen_from(verifier, t2d), row, anchors, valid)
        )

    export_checkpoint(tmp_path / "ck", tmp_path / "out", verifier_path=verifier, target=target)
    theirs, mine = tensors_of(saved), tensors_of(tmp_path / "out")
    assert set(mine) == set(theirs)
    for k in theirs:
        if k.startswith("confidence_head."):  # exported fp32 (vLLM holds it so): same values
            assert mine[k].dtype == np.float32, k
            np.testing.assert_array_equal(mine[k], theirs[k].astype(np.float32), err_msg=k)
            continue
        assert mine[k].dtype == theirs[k].dtype, k
        assert mine[k].tobytes() == theirs[k].tobytes(), k
    # Same config, field by field (speculators adds auto_map/transformers_version and
    # HF defaults inside transformer_layer_config; ours adds its verifier_norm_style
    # record, which readers ignore; ours must agree on the rest).
    a = json.loads((saved / "config.json").read_text())
    b = json.loads((tmp_path / "out" / "config.json").read_text())
    assert b["verifier_norm_style"] == "plain"
    for key in set(b) - {"transformer_layer_config", "architectures", "verifier_norm_style"}:
        assert a[key] == b[key], key
    tl_a, tl_b = a["transformer_layer_config"], b["transformer_layer_config"]
    for key in set(tl_b) - {"architectures"}:
        assert tl_a[key] == tl_b[key], key


def test_speculators_dflash_checkpoint_warm_starts(tmp_path):
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    cfg = base_config(sample_from_anchor=False)
    verifier = write_verifier(tmp_path / "verifier", cfg)
    rc = reference_config(cfg)
    config = DFlashSpeculatorConfig(
        transformer_layer_config=rc.transformer_layer_config,
        draft_vocab_size=cfg.draft_vocab_size,
        block_size=cfg.block_size,
        aux_hidden_state_layer_ids=list(cfg.aux_hidden_state_layer_ids),
        mask_token_id=cfg.mask_token_id,
        sample_from_anchor=False,
        speculators_config=rc.speculators_config,
    )
    config.speculators_config.algorithm = "dflash"
    config.speculators_config.proposal_methods[0].speculative_tokens = cfg.block_size - 1
    config.speculators_config.verifier.name_or_path = str(verifier)
    torch.manual_seed(0)
    model = DFlashDraftModel(config)
    model.load_verifier_weights()
    model.to(torch.bfloat16).save_pretrained(str(tmp_path / "dflash"))

    result = import_folder(
        tmp_path / "dflash", tmp_path / "ck", warm_start=WarmStart(markov_rank=8)
    )
    assert result.kind == "dflash"
    assert result.cfg == cfg.replace(verifier_name_or_path=str(verifier))  # DSpark defaults
    ours_t = to_speculators(result.params)
    theirs = tensors_of(tmp_path / "dflash")
    assert set(theirs) == {k for k in ours_t if not k.startswith(("markov_", "confidence_"))}
    for k, v in theirs.items():
        np.testing.assert_array_equal(ours_t[k], v.astype(np.float32), err_msg=k)
    assert {"markov_head/markov_w1/embedding", "confidence_head/proj/kernel"} <= set(
        flat_params(result.params)
    )
