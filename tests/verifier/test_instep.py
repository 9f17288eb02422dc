"""``--hidden-states-backend jax``: the trainer computes the rows' hidden states in the step.

A random Qwen3 verifier (transformers, saved locally) of the tiny trainer shapes (hidden 8,
4 layers, vocab 1024) and the tiny prepared data. Checks: the step's batch holds, slot by
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
import numpy as np
import pytest
import torch

from dspark_jax.train import flags as cli
from dspark_jax.train import trainer as train
from dspark_jax.verifier import UnsupportedVerifierError, VerifierCheckpointError, instep
from tests.data.conftest import make_tiny_data, write_prepared_dataset
from tests.multiprocess import launch
from tests.numerics import U
from tests.train.conftest import read_jsonl, tiny_argv
from tests.verifier.bounds import chain_depth, projection_sensitivity
from tests.verifier.hf_models import hf_hidden_states

AUX = (1, 2)  # the drafter requires ascending aux layers (vLLM's capture order)
SHAPE = dict(
    vocab_size=1024,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def hf_qwen3(folder, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", **SHAPE)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(r / p.shape[-1] ** 0.5 if p.ndim >= 2 and "embed" not in name else r)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * r)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("instep")
    model = hf_qwen3(root / "verifier")
    data = make_tiny_data(root / "data", n_docs=40, max_len=30)
    shutil.rmtree(data.hs_path)  # the in-step backend needs the prepared dataset only
    return root, model, data


def argv(setup, out, **over):
    root, _, data = setup
    flags = dict(
        hidden_states_backend="jax",
        verifier_dtype="float32",
        target_layer_ids=[str(i) for i in AUX],
        epochs=2,
    )
    flags.update(over)
    return tiny_argv(root / "verifier", data, out, **flags)


def test_step_batch_equals_hf_per_document(setup, tmp_path):
    root, model, data = setup
    args = cli.resolve(argv(setup, tmp_path))
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


@pytest.fixture(scope="module")
def trained(setup, tmp_path_factory):
    full = tmp_path_factory.mktemp("full")
    assert train.run(cli.resolve(argv(setup, full)), devices=jax.devices()[:1]) == 0
    return full


def test_trains_and_resumes_exactly(setup, trained, tmp_path):
    full = trained
    records = read_jsonl(full / "logs" / "run" / "metrics.jsonl")
    losses = [r["train"]["loss"] for r in records if "train" in r]
    assert losses and all(np.isfinite(losses))
    steps = sorted(int(p.name) for p in (full / "ckpt").iterdir() if p.name.isdigit())
    assert len(steps) >= 2
    shutil.copytree(full / "ckpt", tmp_path / "resumed" / "ckpt")
    shutil.rmtree(tmp_path / "resumed" / "ckpt" / str(steps[-1]))
    resumed_args = cli.resolve(argv(setup, tmp_path / "resumed"))
    assert train.run(resumed_args, devices=jax.devices()[:1]) == 0
    resumed = read_jsonl(tmp_path / "resumed" / "logs" / "run" / "metrics.jsonl")
    again = [r["train"]["loss"] for r in resumed if "train" in r]
    assert again == losses[len(losses) - len(again) :] and len(again) < len(losses)


def test_eval_backend_matches_files(setup, trained, tmp_path):
    """python -m dspark_jax.eval --hidden-states-backend jax on the prepared dataset alone,
    against the same evaluation from fp32 files of HF's per-document hidden states. The
    hidden states agree to fp32 round-off (test_step_batch_equals_hf_per_document); the
    analytic acceptance is a smooth function of them, so it agrees far inside 1e-4."""
    from dspark_jax.eval import runner as dspark_eval
    from tests.data.conftest import write_hs

    root, model, data = setup
    hs = tmp_path / "hs"
    hs.mkdir()
    for i, ids in enumerate(data.input_ids):
        write_hs(hs, i, ids, hf_hidden_states(model, ids, (*AUX, 4)))
    common = ["--checkpoint", str(trained / "ckpt"), "--verifier", str(root / "verifier"),
              "--dataset", f"d={data.data_path}", "--total-seq-len", "64", "--no-plots",
              "--anchors-per-call", "16"]  # fmt: skip
    jax_run = dspark_eval.run(
        [
            *common,
            "--output-dir",
            str(tmp_path / "a"),
            "--hidden-states-backend",
            "jax",
            "--verifier-dtype",
            "float32",
            "--hidden-states-dtype",
            "float32",
        ]  # fmt: skip
    )
    file_run = dspark_eval.run(
        [
            *common,
            "--output-dir",
            str(tmp_path / "b"),
            "--hidden-states",
            f"d={hs}",
            "--hidden-states-dtype",
            "float32",
        ]  # fmt: skip
    )
    a = json.loads((tmp_path / "a" / "summary.json").read_text())["datasets"]["d"]
    b = json.loads((tmp_path / "b" / "summary.json").read_text())["datasets"]["d"]
    assert a["documents"] == b["documents"] == len(data.input_ids)
    got = np.array(a["acceptance"]["analytic/free_running"]["cumulative"])
    want = np.array(b["acceptance"]["analytic/free_running"]["cumulative"])
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert jax_run is not None and file_run is not None


# ------------------------------------------------------------------------------ bad input


def _build(folder, setup, tmp_path, **over):
    args = cli.resolve(argv(setup, tmp_path, verifier_name_or_path=str(folder), **over))
    return train.Trainer(args, devices=jax.devices()[:1])


def _copy(setup, tmp_path):
    dst = tmp_path / "v"
    shutil.copytree(setup[0] / "verifier", dst)
    return dst


def test_unsupported_family_is_refused_before_reading(setup, tmp_path):
    v = _copy(setup, tmp_path)
    cfg = json.loads((v / "config.json").read_text())
    cfg["model_type"] = "deepseek_v3"
    (v / "config.json").write_text(json.dumps(cfg))
    (v / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(
        UnsupportedVerifierError, match=r"model_type 'deepseek_v3'.*supported: llama"
    ):
        instep.build(str(v), None, "bfloat16", None)


def test_missing_and_misshaped_tensors(setup, tmp_path):
    from safetensors.numpy import load_file, save_file

    v = _copy(setup, tmp_path)
    tensors = load_file(v / "model.safetensors")
    del tensors["model.layers.3.mlp.down_proj.weight"]
    save_file(tensors, v / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        VerifierCheckpointError, match=r"missing tensor model\.layers\.3\.mlp\.down_proj"
    ):
        _build(v, setup, tmp_path)
    tensors["model.layers.3.mlp.down_proj.weight"] = np.zeros((8, 15), np.float32)
    save_file(tensors, v / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        VerifierCheckpointError, match=r"down_proj\.weight has shape \(8, 15\), config"
    ):
        _build(v, setup, tmp_path)


def test_layer_ids_beyond_the_verifier(setup, tmp_path):
    with pytest.raises(ValueError, match=r"target_layer_ids must be distinct and within \[0, 4\]"):
        _build(setup[0] / "verifier", setup, tmp_path, target_layer_ids=["2", "5"])
    vcfg = instep.load_verifier_config(setup[0] / "verifier")  # the verifier's own check
    with pytest.raises(ValueError, match=r"aux: layer ids \[2, 5\] must lie in \[0, 4\]"):
        vcfg.check_layer_ids([2, 5], "aux")


def test_vocab_mismatch_with_the_data(setup, tmp_path):
    root, _, data = setup
    bad = tmp_path / "bad"
    write_prepared_dataset(bad, [np.array([1, 2, 1024 + 7])] * 8, [np.array([0, 1, 1])] * 8)
    args = cli.resolve(argv(setup, tmp_path, data_path=str(bad)))
    t = train.Trainer(args, devices=jax.devices()[:1])
    with pytest.raises(
        instep.InStepError, match=r"token id 1031 >= the verifier's vocab_size 1024"
    ):
        t.open_data()


def test_compile_for_includes_the_verifier(setup, tmp_path, capsys):
    """--dry-run --compile-for with the in-step backend from config.json alone (no
    weights, no data): the step compiles over fsdp x tensor and reports the verifier."""
    cfg_only = tmp_path / "config_only"
    cfg_only.mkdir()
    shutil.copy(setup[0] / "verifier" / "config.json", cfg_only / "config.json")
    from tests.train.test_compile_for import tiny_compile_argv

    argv = tiny_compile_argv(
        cfg_only, tmp_path, "--compile-for", "local", "--mesh", "fsdp=2,tensor=2",
        "--hidden-states-backend", "jax", "--rows-per-step", "2",
    )  # fmt: skip
    assert train.run(cli.resolve(argv), devices=jax.devices()[:4]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "in-step verifier (qwen3, 4 layers" in ln)
    assert "bfloat16 weights" in line and "TFLOP per step" in line
    assert out.splitlines()[-1].startswith("[compile] fits: local")


@pytest.mark.slow
def test_two_processes_read_only_their_shards(setup, tmp_path):
    """Each of 2 processes (2 CPU devices each, mesh fsdp=2 x tensor=2) reads exactly the
    slices its devices hold, and they equal the file's."""
    outs = launch(
        "tests.verifier.load_child",
        [str(setup[0] / "verifier")],
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
def test_flag_errors(setup, tmp_path, over, message):
    with pytest.raises(cli.ConfigError, match=message):
        cli.resolve(argv(setup, tmp_path, **over))
