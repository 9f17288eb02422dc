"""dspark_jax.convert.export: Orbax checkpoint -> speculators/vLLM folder."""

from __future__ import annotations

import json
import os
import stat

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from converters.__main__ import main
from dspark_jax.checkpoint import orbax_io
from dspark_jax.convert.check import check_folder
from dspark_jax.convert.export import ExportError, export_checkpoint, export_params
from dspark_jax.model.params import to_speculators
from dspark_jax.verifier.frozen import load_verifier_tensors
from tests.converters.helpers import (
    base_config,
    make_vocab,
    random_params,
    tree_digest,
    write_verifier,
)


def read(folder):
    with safe_open(folder / "model.safetensors", "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_config_and_tensors(tmp_path):
    cfg = base_config(verifier_name_or_path="old/name")
    params = random_params(cfg, seed=3)
    orbax_io.save_params_checkpoint(tmp_path / "ck", 100, cfg, params)
    report, step = export_checkpoint(
        tmp_path / "ck",
        tmp_path / "out",
        verifier_name_or_path="moonshotai/Kimi-K3",
        verifier_architectures=["KimiK3ForCausalLM"],
    )
    assert step == 100 and report.ok and report.warnings == []
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    want = cfg.replace(
        verifier_name_or_path="moonshotai/Kimi-K3", verifier_architectures=("KimiK3ForCausalLM",)
    ).to_speculators_dict()
    assert config == want
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert config["transformer_layer_config"]["max_position_embeddings"] == 32768
    tensors = read(tmp_path / "out")
    ref = to_speculators(params)
    assert set(tensors) == set(ref)
    for k, v in ref.items():
        # vLLM holds the confidence head in fp32: exported fp32 whatever --dtype says.
        want = np.float32 if k.startswith("confidence_head.") else ml_dtypes.bfloat16
        assert tensors[k].dtype == want, k
        np.testing.assert_array_equal(tensors[k], v.astype(want), err_msg=k)
    # Torch layout: Linear kernels [in, out] are written [out, in].
    kernel = np.asarray(params["layers"][1]["self_attn"]["o_proj"]["kernel"][...])
    np.testing.assert_array_equal(
        tensors["layers.1.self_attn.o_proj.weight"], kernel.T.astype(ml_dtypes.bfloat16)
    )
    card = (tmp_path / "out" / "README.md").read_text()
    assert card.startswith("---\nbase_model: moonshotai/Kimi-K3\n")
    assert "vllm serve moonshotai/Kimi-K3 --spec-method dspark --spec-model" in card
    assert "Not recorded (the checkpoint has no run.yaml)" in card


def test_confidence_head_fp32_and_a_folded_temperature(tmp_path):
    cfg = base_config()
    params = random_params(cfg, seed=1)
    ref = to_speculators(params)
    export_params(cfg, params, tmp_path / "out", verifier_name_or_path="org/v",
                  confidence_temperature=2.5, calibration_record={"rule": "sampled"})  # fmt: skip
    with safe_open(tmp_path / "out" / "model.safetensors", "np") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes["confidence_head.proj.weight"] == dtypes["confidence_head.proj.bias"] == "F32"
    assert dtypes["markov_head.markov_w2.weight"] == "BF16"
    tensors = read(tmp_path / "out")
    for key in ("confidence_head.proj.weight", "confidence_head.proj.bias"):
        want = (ref[key].astype(np.float64) / 2.5).astype(np.float32)
        np.testing.assert_array_equal(tensors[key], want, err_msg=key)
    record = json.loads((tmp_path / "out" / "calibration.json").read_text())
    assert record == {"rule": "sampled", "temperature": 2.5, "folded_into_head": True}
    assert (
        "calibrated (temperature 2.5000 folded in)" in (tmp_path / "out" / "README.md").read_text()
    )
    report = check_folder(tmp_path / "out")
    assert report.ok and not any("[calibration:" in n for n in report.notes)
    nohead = base_config(enable_confidence_head=False)
    with pytest.raises(ExportError, match="needs a confidence head"):
        export_params(nohead, random_params(nohead), tmp_path / "x", confidence_temperature=2.0)


def test_float32_export_is_exact(tmp_path):
    cfg = base_config()
    params = random_params(cfg)
    export_params(cfg, params, tmp_path / "out", dtype="float32", verifier_name_or_path="v")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"
    tensors = read(tmp_path / "out")
    for k, v in to_speculators(params).items():
        np.testing.assert_array_equal(tensors[k], v, err_msg=k)


def test_reduced_vocab_writes_verifier_head_rows_and_maps(tmp_path):
    cfg = base_config(draft_vocab_size=40)
    verifier = write_verifier(tmp_path / "verifier", cfg)
    d2t, t2d = make_vocab(cfg)
    orbax_io.save_params_checkpoint(tmp_path / "ck", 1, cfg, random_params(cfg))
    with pytest.raises(orbax_io.CheckpointError, match=r"not found: .*d2t-40\.npy"):
        export_checkpoint(tmp_path / "ck", tmp_path / "out", verifier_path=verifier)
    orbax_io.save_checkpoint_vocab_maps(tmp_path / "ck", cfg, d2t, t2d)
    with pytest.raises(ExportError, match=r"needs lm_head\.weight, the verifier head's rows t2d"):
        export_checkpoint(tmp_path / "ck", tmp_path / "out")
    export_checkpoint(
        tmp_path / "ck", tmp_path / "out", verifier_path=verifier, verifier_name_or_path="org/v"
    )
    tensors = read(tmp_path / "out")
    head = load_verifier_tensors(verifier).lm_head
    assert tensors["lm_head.weight"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(tensors["lm_head.weight"], head[t2d])
    np.testing.assert_array_equal(tensors["d2t"], d2t)
    np.testing.assert_array_equal(tensors["t2d"], t2d)
    # Maps given explicitly (e.g. from the data folder) win over the checkpoint's: other
    # maps here, so the folder shows which were used.
    d2t_b, t2d_b = make_vocab(cfg, seed=1)
    assert not np.array_equal(t2d_b, t2d)
    np.save(tmp_path / "d2t.npy", d2t_b)
    np.save(tmp_path / "t2d.npy", t2d_b)
    export_checkpoint(
        tmp_path / "ck",
        tmp_path / "out",
        verifier_path=verifier,
        overwrite=True,
        d2t_path=tmp_path / "d2t.npy",
        t2d_path=tmp_path / "t2d.npy",
    )
    tensors = read(tmp_path / "out")
    np.testing.assert_array_equal(tensors["d2t"], d2t_b)
    np.testing.assert_array_equal(tensors["t2d"], t2d_b)
    np.testing.assert_array_equal(tensors["lm_head.weight"], head[t2d_b])


def test_existing_output_and_step_choice(tmp_path):
    cfg = base_config()
    for step, loss in ((5, 0.9), (6, 1.1)):
        orbax_io.save_params_checkpoint(
            tmp_path / "ck",
            step,
            cfg,
            random_params(cfg, seed=step),
            meta={"metrics": {"loss": loss}},
        )
    _, step = export_checkpoint(tmp_path / "ck", tmp_path / "out", step="best")
    assert step == 5
    np.testing.assert_array_equal(
        read(tmp_path / "out")["norm.weight"],
        to_speculators(random_params(cfg, seed=5))["norm.weight"].astype(ml_dtypes.bfloat16),
    )
    with pytest.raises(ExportError, match="exists"):
        export_checkpoint(tmp_path / "ck", tmp_path / "out")
    _, step = export_checkpoint(tmp_path / "ck", tmp_path / "out", overwrite=True)
    assert step == 6


def test_cli_export(tmp_path, capsys):
    cfg = base_config(markov_head_type="rnn")
    orbax_io.save_params_checkpoint(tmp_path / "ck", 2, cfg, random_params(cfg))
    argv = ["export", str(tmp_path / "ck"), str(tmp_path / "out"), "--verifier-name", "org/v"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "export refused: the folder fails the vllm check" in err
    assert "markov_head_type='rnn' is not served by vLLM" in err
    assert not (tmp_path / "out").exists()
    assert main([*argv, "--target", "speculators", "--step", "2"]) == 0
    assert "exported step 2" in capsys.readouterr().out
    assert main(["check", str(tmp_path / "out"), "--target", "speculators"]) == 0
    assert "vLLM 0.33 does not serve it" in (tmp_path / "out" / "README.md").read_text()


def test_overwrite_replaces_only_an_export(tmp_path, capsys):
    """Issue 18.2: --overwrite never removes the checkpoint, a folder above it or a folder
    that is not an export; everything stays byte-identical."""
    cfg = base_config()
    run = tmp_path / "runs" / "demo"
    ckpt = run / "checkpoints"
    orbax_io.save_params_checkpoint(ckpt, 2, cfg, random_params(cfg))
    (run / "notes").mkdir()
    (run / "notes" / "todo.txt").write_text("mine")
    before = tree_digest(tmp_path)
    refused = {
        ckpt: "is {} or a folder above it (the checkpoint being exported)".format(ckpt.resolve()),
        run: "is {} or a folder above it (the checkpoint being exported)".format(ckpt.resolve()),
        run / "notes": "has no config.json with speculators_model_type",
        tmp_path: "is {} or a folder above it (the checkpoint being exported)".format(
            ckpt.resolve()
        ),
    }
    for out, why in refused.items():
        assert main(["export", str(ckpt), str(out), "--overwrite"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"export failed: --overwrite refused: {out} {why}; only an earlier export folder "
            "is replaced"
        ], err
    # A checkpoint directory elsewhere (not the one exported) is no export either.
    other = tmp_path / "other"
    orbax_io.save_params_checkpoint(other, 1, cfg, random_params(cfg))
    before_other = tree_digest(other)
    assert main(["export", str(ckpt), str(other), "--overwrite"]) == 1
    assert "holds folders (1); an export holds files only" in capsys.readouterr().err
    assert tree_digest(other) == before_other
    assert tree_digest(tmp_path / "runs") == {
        k.removeprefix("runs/"): v for k, v in before.items() if k.startswith("runs/")
    }
    # An earlier export is replaced.
    out = tmp_path / "export"
    assert main(["export", str(ckpt), str(out), "--target", "speculators"]) == 0
    assert main(["export", str(ckpt), str(out), "--target", "speculators"]) == 1
    assert "exists (pass --overwrite to replace an earlier export)" in capsys.readouterr().err
    assert main(["export", str(ckpt), str(out), "--target", "speculators", "--overwrite"]) == 0


def test_export_is_readable_by_others(tmp_path):
    """Issue 18.11: the folder and its files get the umask's modes (mkdtemp gave 0700,
    safetensors 0600)."""
    cfg = base_config()
    old = os.umask(0o022)
    try:
        export_params(cfg, random_params(cfg), tmp_path / "out", verifier_name_or_path="v")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755
    for name in ("config.json", "model.safetensors"):
        assert stat.S_IMODE((tmp_path / "out" / name).stat().st_mode) == 0o644, name


def test_card_command_is_the_run_yaml_as_the_trainer_spells_it(tmp_path):
    # The card reads run.yaml through its owner (dspark_jax.run_file, below the trainer);
    # its command must parse back to the run's values, a false store_true flag included.
    from dspark_jax import run_file
    from dspark_jax.train import flags as cli

    argv = ["--config", "configs/demo/train.yaml", "--data-path", str(tmp_path / "data")]
    argv += ["--save-path", str(tmp_path / "ck"), "--target-layer-ids", "1", "2", "3"]
    argv += ["--lr", "0.001", "--gradient-checkpointing", "--no-sample-from-anchor"]
    argv += ["--no-enable-confidence-head"]
    cli.resolve(argv).save(tmp_path)
    with open(tmp_path / "run.yaml", "a") as f:  # as a hand-written config may say it
        f.write("  deterministic_cuda: false\n")
    values = run_file.load(tmp_path / "run.yaml")
    assert values["total_seq_len"] == 1024 and values["target_layer_ids"] == [1, 2, 3]
    command = run_file.command(values)
    assert "--no-sample-from-anchor" in command and "--gradient-checkpointing" in command
    resolved = cli.resolve(["--config", str(tmp_path / "run.yaml")]).values
    assert cli.resolve(command[3:]).values == resolved


def test_an_unreadable_run_yaml_names_the_file(tmp_path):
    cfg = base_config()
    orbax_io.save_params_checkpoint(tmp_path / "ck", 1, cfg, random_params(cfg, seed=1))
    (tmp_path / "ck" / "run.yaml").write_text("train: [unclosed\n")
    with pytest.raises(ExportError, match=r"ck/run.yaml: not valid YAML"):
        export_checkpoint(tmp_path / "ck", tmp_path / "out", dtype="float32")
    assert not (tmp_path / "out").exists()


def test_the_card_takes_a_default_sequence_length_from_the_checkpoint(tmp_path):
    # run.yaml holds the flags given; a run on the default --total-seq-len records the
    # resolved value in each step's meta, and the card shows it.
    cfg = base_config()
    ck = tmp_path / "ck"
    orbax_io.save_params_checkpoint(ck, 1, cfg, random_params(cfg), meta={"total_seq_len": 8192})
    (ck / "run.yaml").write_text("train:\n  lr: 0.001\n")
    export_checkpoint(ck, tmp_path / "out", dtype="float32", verifier_name_or_path="v")
    assert "| Sequence length | 8192 |" in (tmp_path / "out" / "README.md").read_text()
