"""``--hidden-states-backend jax``: the trainer computes the rows' hidden states in the step.

A random Qwen3 verifier (transformers, saved locally) of the tiny trainer shapes (hidden 8,
4 layers, vocab 1024) and the tiny prepared data (tests/verifier/instep_fixtures.py). Checks: the step's batch holds, slot by
slot, the hidden states HF's forward gives each packed document (aux layers in the
drafter's order, then layer N pre-norm), within tests/verifier/bounds.py's bound; a run
trains with no hidden-state file; a resumed run repeats the uninterrupted one bit for bit;
bad verifier folders and data stop before the first step with one line.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dspark_jax.train import flags as cli
from dspark_jax.train import trainer as train
from dspark_jax.verifier import UnsupportedVerifierError, VerifierCheckpointError, instep
from dspark_jax.verifier.config import load_verifier_config
from tests.data.conftest import write_prepared_dataset
from tests.multiprocess import launch
from tests.numerics import U
from tests.train.conftest import read_jsonl
from tests.verifier.bounds import chain_depth, projection_sensitivity
from tests.verifier.hf_models import hf_hidden_states
from tests.verifier.instep_fixtures import AUX, instep_argv


def test_step_batch_equals_hf_per_document(instep_setup, tmp_path):
    root, model, data = instep_setup
    args = cli.resolve(instep_argv(instep_setup, tmp_path))
    t = train.Trainer(args, devices=jax.devices()[:1])
    assert t.instep is not None and tuple(t.cfg.aux_hidden_state_layer_ids) == AUX
    pd = t.open_data()
    batch = pd.step_loader("train", 0)(0)
    assert batch["hidden_states"].shape[-1] == 0  # nothing was read
    vparams = t.instep.load(t.mesh)
    filled = jax.jit(t.instep.fill)(vparams, {k: jnp.asarray(v) for k, v in batch.items()})
    ids = (*AUX, 4)
    vparams_norm = model.model.norm.weight.detach().numpy()
    for r in range(batch["input_ids"].shape[0]):
        doc, pos = batch["document_ids"][r], batch["position_ids"][r]
        n = int((doc >= 0).sum())
        got = np.concatenate(
            [
                np.asarray(filled["hidden_states"][r]).reshape(len(doc), len(AUX), 8),
                np.asarray(filled["verifier_last_hidden_states"][r])[:, None],
            ],
            axis=1,
        )[:n]
        want = np.concatenate(
            [
                hf_hidden_states(model, batch["input_ids"][r][doc == d], ids)
                for d in range(int(doc.max()) + 1)
            ]
        )
        c = np.random.default_rng(r).standard_normal((len(doc), len(ids), 8)).astype(np.float32)
        c[n:] = 0
        sens = projection_sensitivity(
            vparams, t.instep.cfg, batch["input_ids"][r], pos, doc, ids, c
        )[:n]
        depth = np.array([chain_depth(t.instep.cfg, k, 30) for k in ids])
        bound = 2 * depth[None] * U * sens

        def within(x):
            return (np.abs(np.einsum("tjh,tjh->tj", c[:n], x - want)) <= bound).all()

        assert within(got), r
        # Planted layout bugs fail: aux slots in the wrong order; the last slot post-norm.
        assert not within(got[:, [1, 0, 2]])
        w = vparams_norm
        normed = got[:, 2] / np.sqrt(np.mean(got[:, 2] ** 2, -1, keepdims=True) + 1e-6) * w
        assert not within(np.concatenate([got[:, :2], normed[:, None]], axis=1))


def test_trains_and_resumes_exactly(instep_setup, instep_trained, tmp_path):
    full = instep_trained
    records = read_jsonl(full / "logs" / "run" / "metrics.jsonl")
    losses = [r["train"]["loss"] for r in records if "train" in r]
    assert losses and all(np.isfinite(losses))
    steps = sorted(int(p.name) for p in (full / "ckpt").iterdir() if p.name.isdigit())
    assert len(steps) >= 2
    shutil.copytree(full / "ckpt", tmp_path / "resumed" / "ckpt")
    shutil.rmtree(tmp_path / "resumed" / "ckpt" / str(steps[-1]))
    resumed_args = cli.resolve(instep_argv(instep_setup, tmp_path / "resumed"))
    assert train.run(resumed_args, devices=jax.devices()[:1]) == 0
    resumed = read_jsonl(tmp_path / "resumed" / "logs" / "run" / "metrics.jsonl")
    again = [r["train"]["loss"] for r in resumed if "train" in r]
    assert again == losses[len(losses) - len(again) :] and len(again) < len(losses)


def test_eval_backend_matches_files(instep_setup, instep_trained, tmp_path):
    """python -m dspark_jax.eval --hidden-states-backend jax on the prepared dataset alone,
    against the same evaluation from fp32 files of HF's per-document hidden states.

    The two see hidden states that differ by fp32 round-off: each value within
    ``2 depth u |h|`` (depth: tests/verifier/bounds.chain_depth of the deepest captured
    layer; test_step_batch_equals_hf_per_document bounds it per slot). Rather than bound
    the drafter's Lipschitz constant, the figure's response to a perturbation of that size
    is measured: the file evaluation again with every value moved by ``2 depth u |h|``,
    random signs. Round-off is no larger and no more aligned, so in-step sits within that
    response (x4 for its spread across sign draws) plus the figure's own 8 u. Measured:
    in-step 1e-8 off, the response 5e-7. Files rounded to bf16 (a wrong
    --hidden-states-dtype) fall outside (4e-6, 1.7x the bound at its closest)."""
    from dspark_jax.eval import runner as dspark_eval
    from tests.data.conftest import write_hs

    root, model, data = instep_setup
    ids = (*AUX, 4)
    vcfg = load_verifier_config(str(root / "verifier"))
    rel = 2 * max(chain_depth(vcfg, k, 64) for k in ids) * U
    rng = np.random.default_rng(0)
    hs = {"exact": tmp_path / "hs", "moved": tmp_path / "hs_moved", "bf16": tmp_path / "hs_bf16"}
    for folder in hs.values():
        folder.mkdir()
    for i, row in enumerate(data.input_ids):
        h = hf_hidden_states(model, row, ids)
        write_hs(hs["exact"], i, row, h)
        moved = h * (1 + rel * rng.choice([-1.0, 1.0], h.shape))
        write_hs(hs["moved"], i, row, moved.astype(np.float32))
        write_hs(hs["bf16"], i, row, h.astype(ml_dtypes.bfloat16).astype(np.float32))
    common = ["--checkpoint", str(instep_trained / "ckpt"), "--verifier", str(root / "verifier"),
              "--dataset", f"d={data.data_path}", "--total-seq-len", "64", "--no-plots",
              "--anchors-per-call", "16", "--hidden-states-dtype", "float32"]  # fmt: skip

    def figure(name, *source):
        out = tmp_path / name
        assert dspark_eval.run([*common, "--output-dir", str(out), *source]) is not None
        got = json.loads((out / "summary.json").read_text())["datasets"]["d"]
        assert got["documents"] == len(data.input_ids)
        return np.array(got["acceptance"]["analytic/free_running"]["cumulative"])

    instep = ("--hidden-states-backend", "jax", "--verifier-dtype", "float32")
    instep_fig = figure("jax", *instep)
    files = {name: figure(name, "--hidden-states", f"d={folder}") for name, folder in hs.items()}
    bound = 4 * np.abs(files["moved"] - files["exact"]) + 8 * U * np.abs(files["exact"])
    assert (np.abs(instep_fig - files["exact"]) <= bound).all(), (instep_fig, files, bound)
    # The verifier sharded over 8 devices (--mesh, as in training: its weights over fsdp and
    # tensor, each row's tokens over context) is the same forward in other orders.
    if jax.device_count() >= 8:
        mesh_fig = figure("mesh", *instep, "--mesh", "fsdp=2,context=2,tensor=2")
        assert (np.abs(mesh_fig - files["exact"]) <= bound).all(), (mesh_fig, files, bound)
    assert (np.abs(files["bf16"] - files["exact"]) > bound).all(), (files, bound)


# ------------------------------------------------------------------------------ bad input


def _build(folder, instep_setup, tmp_path, **over):
    args = cli.resolve(
        instep_argv(instep_setup, tmp_path, verifier_name_or_path=str(folder), **over)
    )
    return train.Trainer(args, devices=jax.devices()[:1])


def _copy(instep_setup, tmp_path):
    dst = tmp_path / "v"
    shutil.copytree(instep_setup[0] / "verifier", dst)
    return dst


def test_unsupported_family_is_refused_before_reading(instep_setup, tmp_path):
    v = _copy(instep_setup, tmp_path)
    cfg = json.loads((v / "config.json").read_text())
    cfg["model_type"] = "deepseek_v32"
    (v / "config.json").write_text(json.dumps(cfg))
    (v / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(
        UnsupportedVerifierError,
        match=r"model_type 'deepseek_v32' .*\(nearest supported: deepseek_v3\); supported: llama",
    ):
        instep.build(str(v), None, "bfloat16", None)


def test_quantized_checkpoint_is_refused(instep_setup, tmp_path):
    v = _copy(instep_setup, tmp_path)
    cfg = json.loads((v / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (v / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        UnsupportedVerifierError, match=r"config.json: quantization_config \(mxfp4\)"
    ):
        instep.build(str(v), None, "bfloat16", None)


def test_missing_and_misshaped_tensors(instep_setup, tmp_path):
    from safetensors.numpy import load_file, save_file

    v = _copy(instep_setup, tmp_path)
    tensors = load_file(v / "model.safetensors")
    del tensors["model.layers.3.mlp.down_proj.weight"]
    save_file(tensors, v / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        VerifierCheckpointError, match=r"missing tensor model\.layers\.3\.mlp\.down_proj"
    ):
        _build(v, instep_setup, tmp_path)
    tensors["model.layers.3.mlp.down_proj.weight"] = np.zeros((8, 15), np.float32)
    save_file(tensors, v / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        VerifierCheckpointError, match=r"down_proj\.weight has shape \(8, 15\), config"
    ):
        _build(v, instep_setup, tmp_path)


def test_layer_ids_beyond_the_verifier(instep_setup, tmp_path):
    with pytest.raises(ValueError, match=r"target_layer_ids must be distinct and within \[0, 4\]"):
        _build(instep_setup[0] / "verifier", instep_setup, tmp_path, target_layer_ids=["2", "5"])
    vcfg = instep.load_verifier_config(instep_setup[0] / "verifier")  # the verifier's own check
    with pytest.raises(ValueError, match=r"aux: layer ids \[2, 5\] must lie in \[0, 4\]"):
        vcfg.check_layer_ids([2, 5], "aux")


def test_vocab_mismatch_with_the_data(instep_setup, tmp_path):
    root, _, data = instep_setup
    bad = tmp_path / "bad"
    write_prepared_dataset(bad, [np.array([1, 2, 1024 + 7])] * 8, [np.array([0, 1, 1])] * 8)
    args = cli.resolve(instep_argv(instep_setup, tmp_path, data_path=str(bad)))
    t = train.Trainer(args, devices=jax.devices()[:1])
    with pytest.raises(
        instep.InStepError, match=r"token id 1031 >= the verifier's vocab_size 1024"
    ):
        t.open_data()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dense", "moe_fused", "moe_per_expert"])
def test_two_processes_read_only_their_shards(instep_setup, tmp_path, layout):
    """Each of 2 processes (2 CPU devices each, mesh fsdp=2 x tensor=2) reads exactly the
    slices its devices hold, and they equal the file's: the Qwen3 verifier, and a
    Qwen3-MoE one (4 experts, 2 per process) saved fused by transformers or per expert
    as on the Hub."""
    folder = instep_setup[0] / "verifier"
    if layout != "dense":
        from tests.verifier.hf_models import build
        from tests.verifier.instep_fixtures import SHAPE
        from tests.verifier.test_hub_layouts import _per_expert

        folder = tmp_path / "moe"
        build("qwen3_moe", folder, **SHAPE)
        if layout == "moe_per_expert":
            _per_expert(folder, tmp_path / "per_expert")
            folder = tmp_path / "per_expert"
    outs = launch(
        "tests.verifier.load_child",
        [str(folder)],
        devices=2,
        processes=2,
        timeout=300,
    )
    for out in outs:
        assert out.startswith("ok "), out


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(hidden_states_backend="file", verifier_dtype="float32"),
         "--verifier-dtype applies to --hidden-states-backend jax only"),
        (dict(hidden_states_path="/x"), "--hidden-states-path: --hidden-states-backend jax reads no files"),
        (dict(on_missing="generate"), "--on-missing generate: --hidden-states-backend jax computes"),
    ],
)  # fmt: skip
def test_flag_errors(instep_setup, tmp_path, over, message):
    with pytest.raises(cli.ConfigError, match=message):
        cli.resolve(instep_argv(instep_setup, tmp_path, **over))


def test_tied_embeddings_in_step(instep_setup, tmp_path):
    """A Llama that ties its head to its embedding (SmolLM2, Gemma): the drafter's frozen
    embedding and head rows both come from ``embed_tokens`` (the checkpoint has no
    ``lm_head``), the embedding is on the devices once (the verifier's), and the in-step
    run trains on it, its rows read by a Grain worker
    process (tokens only: an empty hidden-state array, no shared memory for it)."""
    from tests.verifier.hf_models import build
    from tests.verifier.instep_fixtures import SHAPE

    root, _, data = instep_setup
    tied = build("llama", tmp_path / "verifier", **{**SHAPE, "tie_word_embeddings": True})
    embed = tied.model.embed_tokens.weight.detach().numpy()
    args = cli.resolve(
        instep_argv((tmp_path, tied, data), tmp_path / "run", max_steps=2, num_workers=1)
    )
    t = train.Trainer(args, devices=jax.devices()[:1])
    frozen = t.load_frozen()
    maps = t.setup.vocab_maps
    rows = embed if maps is None else embed[np.asarray(maps[1]).astype(bool)]
    np.testing.assert_array_equal(np.asarray(frozen.embed_tokens), embed)
    np.testing.assert_array_equal(np.asarray(frozen.lm_head), rows.T)
    # The embedding on the devices once: the drafter's is the verifier's own array (fp32
    # holds the fp32 checkpoint exactly)...
    vparams = t.instep.load(t.mesh)
    shared = t.load_frozen(vparams["embed_tokens.weight"])
    assert shared.embed_tokens is vparams["embed_tokens.weight"]
    np.testing.assert_array_equal(np.asarray(shared.lm_head), rows.T)
    # ... but not a bf16 verifier's, which would round the drafter's fp32 embedding.
    bf16 = t.load_frozen(vparams["embed_tokens.weight"].astype(jnp.bfloat16))
    assert bf16.embed_tokens.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(bf16.embed_tokens), embed)
    assert train.run(args, devices=jax.devices()[:1]) == 0
    losses = [r["train"]["loss"] for r in read_jsonl(tmp_path / "run" / "logs" / "run" /
                                                       "metrics.jsonl") if "train" in r]  # fmt: skip
    assert losses and np.isfinite(losses).all()
