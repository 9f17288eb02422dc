"""The command line: the seed's flags, unsupported features, --config, derived defaults,
the draft decoder from the verifier, and the no-argument demo."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from dspark_jax import cli, draft_init, train
from tests.data.conftest import make_tiny_data
from tests.train.conftest import write_verifier

# ../shared/SEED_COMMAND.md section 4, with `python -m dspark_jax.train` in place of
# `torchrun --standalone --nproc-per-node 4 scripts/train.py`; {paths} are filled in.
SEED_FLAGS = """
  --verifier-name-or-path {verifier} --trust-remote-code
  --draft-config {draft_config}
  --data-path {data} --save-path {save}
  --draft-vocab-size 163840 --mask-token-id 163837
  --epochs 1 --checkpoint-freq 0.1 --total-seq-len 8192 --train-data-ratio 0.999
  --speculator-type dspark --target-layer-ids 24 48 72 88 92
  --block-size 8 --max-anchors 1024 --dflash-decay-gamma 4.0
  --markov-rank 256 --markov-head-type vanilla
  --enable-confidence-head --confidence-head-with-markov --confidence-head-alpha 1.0
  --loss-fn '{{"ce":0.1,"tv":0.9}}' --optimizer muon --lr 1e-4
  --scheduler-type cosine --scheduler-warmup-ratio 0.03
  --hidden-states-backend mooncake --mooncake-master 10.0.0.1:50051
  --mooncake-metadata-server P2PHANDSHAKE --mooncake-protocol tcp
  --mooncake-global-segment-gib 0 --mooncake-local-buffer-gib 4 --mooncake-writer-threads 4
  --vllm-endpoint http://10.0.0.2:8000/v1 --on-missing generate --on-generate delete
  --request-timeout 900 --max-retries 5 --generation-validation-retries 2
  --max-consecutive-generation-failures 20 --num-workers 2 --prefetch-factor 2 --log-freq 20
"""


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """A stand-in for Kimi-K3 (its vocabulary and layer count, hidden size 32) and the
    model card's draft config scaled down to that hidden size."""
    root = tmp_path_factory.mktemp("k3")
    write_verifier(
        root / "Kimi-K3",
        vocab=163840,
        hidden=32,
        layers=93,
        heads=8,
        kv=8,
        head_dim=4,
        intermediate=None,
        model_type="kimi_k3",
        architectures=["KimiK3ForCausalLM"],
    )
    draft = {
        "model_type": "qwen3",
        "num_hidden_layers": 5,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 6,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "layer_types": ["sliding_attention"] * 5,
        "sliding_window": 2048,
        "use_sliding_window": True,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": 163840,
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
    }
    (root / "k3_draft_layer_config.json").write_text(json.dumps(draft))
    return root


def seed_argv(k3: Path, save: Path) -> list[str]:
    return shlex.split(
        SEED_FLAGS.format(
            verifier=k3 / "Kimi-K3",
            draft_config=k3 / "k3_draft_layer_config.json",
            data=k3 / "data",
            save=save,
        )
    )


@pytest.mark.filterwarnings("ignore:--on-generate is deprecated")
def test_seed_command_parses_and_dry_runs(k3, tmp_path, capsys):
    save = tmp_path / "checkpoints"
    assert train.main([*seed_argv(k3, save), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "needs the online transport" in out
    for needed in (
        "--hidden-states-backend mooncake",
        "--mooncake-master 10.0.0.1:50051",
        "--mooncake-writer-threads 4",
        "--on-missing generate",
        "--vllm-endpoint http://10.0.0.2:8000/v1",
        "--request-timeout 900.0",
    ):
        assert needed in out, needed
    config = json.loads((save / "config.json").read_text())
    assert config["aux_hidden_state_layer_ids"] == [24, 48, 72, 88, 92]
    assert (config["block_size"], config["mask_token_id"], config["draft_vocab_size"]) == (
        8,
        163837,
        163840,
    )
    assert (config["markov_rank"], config["markov_head_type"]) == (256, "vanilla")
    layer = config["transformer_layer_config"]
    assert layer["layer_types"] == ["sliding_attention"] * 5 and layer["sliding_window"] == 2048
    assert (layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]) == (
        6,
        1,
        8,
    )
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 8
    assert (save / "model.safetensors").is_file() and (save / "run.yaml").is_file()
    assert "vLLM check: ok" in out


@pytest.mark.filterwarnings("ignore:--on-generate is deprecated")
def test_seed_command_without_dry_run_names_the_online_transport(k3, tmp_path, capsys):
    assert train.main(seed_argv(k3, tmp_path / "checkpoints")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --hidden-states-backend mooncake needs the online transport")


def test_on_missing_generate_stops_only_when_a_file_is_missing(tmp_path, capsys):
    data = make_tiny_data(tmp_path / "d", n_docs=12, max_len=20)
    (data.hs_path / "hs_3.safetensors").unlink()
    verifier = write_verifier(tmp_path / "v")
    argv = [
        "--verifier-name-or-path",
        str(verifier),
        "--data-path",
        str(data.data_path),
        "--target-layer-ids",
        "1",
        "2",
        "--mask-token-id",
        "5",
        "--save-path",
        str(tmp_path / "s"),
        "--num-layers",
        "1",
        "--total-seq-len",
        "64",
    ]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert "1 of 12 rows have no hidden-state file" in err and "hs_3.safetensors" in err
    assert "--on-missing generate needs the online transport" in err


BASE = ["--verifier-name-or-path", "/nonexistent/verifier"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--speculator-type", "eagle3"], "trains --speculator-type dspark only"),
        (["--ttt-steps", "2"], "--ttt-steps is an option of eagle3"),
        (["--fc-norm"], "--fc-norm is an option of eagle3"),
        (["--no-norm-before-residual"], "--norm-before-residual is an option of eagle3"),
        (["--conv-kernel-size", "3"], "--conv-kernel-size is an option of dflash2"),
        (["--xpress-rank", "8"], "--xpress-rank is an option of xpress"),
        (["--num-depths", "4"], "--num-depths is an option of peagle"),
        (["--num-speculative-steps", "2"], "--num-speculative-steps is an option of mtp"),
        (["--logger", "wandb"], "--logger wandb is not supported"),
        (["--draft-arch", "llama"], "qwen3 draft layers only"),
        (["--draft-hidden-act", "gelu"], "SiLU only"),
        (["--hidden-states-dtype", "float16"], "float16 is not supported"),
        (["--mooncake-master", "h:1"], "only apply with --hidden-states-backend mooncake"),
        (
            ["--on-missing", "raise", "--vllm-endpoint", "http://h/v1"],
            "only apply with --on-missing generate",
        ),
        (
            ["--draft-config", "x.json", "--num-layers", "2"],
            "--draft-config defines the draft decoder",
        ),
        (
            ["--from-pretrained", "p", "--draft-config", "x.json"],
            "--from-pretrained loads a complete",
        ),
        (["--per-position-loss-weight", "dpace"], "dpace requires --loss-fn=ce"),
        (["--checkpoint-freq", "1.5"], "is not an integer"),
        (["--loss-fn", "mse"], "Unknown loss function 'mse'"),
        (
            ["--num-processes", "2"],
            "--coordinator-address, --num-processes and --process-id go together",
        ),
    ],
)
def test_unsupported_or_conflicting_flags_fail_with_one_line(flags, message, capsys):
    assert train.main([*BASE, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_missing_verifier_is_required():
    with pytest.raises(cli.ConfigError, match="set --verifier-name-or-path"):
        cli.resolve(["--lr", "1e-3"])


def test_derived_defaults_follow_the_reference_for_dspark():
    args = cli.resolve([*BASE, "--lr", "2e-4"])
    assert (args.num_layers, args.block_size, args.loss_fn) == (5, 8, "kl_div")
    assert (args.sample_from_anchor, args.sliding_window_non_causal) == (True, False)
    assert (args.muon_lr, args.per_position_loss_weight) == (2e-4, "fixed-exp-decay")
    assert (args.epochs, args.max_anchors, args.total_seq_len, args.num_workers) == (
        20,
        512,
        8192,
        12,
    )
    assert (args.optimizer, args.scheduler_type, args.checkpoint_freq) == ("muon", "linear", 1.0)
    assert args.on_missing == "generate" and args.hidden_states_backend == "file"


def test_config_yaml_is_layered_under_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "train": {
                    "verifier": {"verifier_name_or_path": "/v"},
                    "optimizer": {"lr": 0.5, "optimizer": "adamw"},
                    "data": {"total_seq_len": 128},
                    "seed": 7,
                    "jax": {"mesh": "fsdp=-1"},
                }
            }
        )
    )
    args = cli.resolve(["--config", str(path), "--lr", "0.1", "--epochs", "3"])
    assert (args.lr, args.optimizer, args.total_seq_len, args.seed, args.epochs) == (
        0.1,
        "adamw",
        128,
        7,
        3,
    )
    assert args.mesh == "fsdp=-1" and args.muon_lr == 0.1
    assert (args.provenance["lr"], args.provenance["optimizer"], args.provenance["epochs"]) == (
        "flag",
        "yaml",
        "flag",
    )
    # A flat mapping works too; run.yaml round-trips.
    flat = tmp_path / "flat.yaml"
    flat.write_text(yaml.safe_dump({"verifier_name_or_path": "/v", "block_size": 4}))
    assert cli.resolve(["--config", str(flat)]).block_size == 4
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(args.dump_yaml())
    assert cli.resolve(["--config", str(dumped)]).values == args.values


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"train": {"optimizer": {"lrr": 1}}}, "unknown keys optimizer.lrr"),
        ({"train": {"optimizer": {"lr": "fast"}}}, "--lr expects float"),
        ({"train": {"optimizer": {"optimizer": "sgd"}}}, "must be one of"),
        ({"train": {"data": {"lr": 1.0}}}, "unknown keys data.lr"),
        ([1, 2], "top-level mapping"),
    ],
)
def test_bad_config_files(tmp_path, content, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(content))
    with pytest.raises(cli.ConfigError, match=message):
        cli.resolve(["--config", str(path), *BASE])


def test_help_lists_the_jax_flags(capsys):
    with pytest.raises(SystemExit):
        cli.resolve(["--help"])
    out = capsys.readouterr().out
    for flag in (
        "--mesh",
        "--rows-per-step",
        "--coordinator-address",
        "--keep-checkpoints",
        "--mooncake-writer-threads",
        "--dry-run",
        "--config",
    ):
        assert flag in out


def test_draft_decoder_derived_from_the_verifier(tmp_path):
    verifier = write_verifier(
        tmp_path / "v",
        vocab=512,
        hidden=24,
        layers=12,
        heads=6,
        kv=2,
        head_dim=4,
        intermediate=None,
        tokenizer=True,
    )
    args = cli.resolve(
        [
            "--verifier-name-or-path",
            str(verifier),
            "--data-path",
            str(tmp_path),
            "--full-attention-indices",
            "1",
            "--sliding-window",
            "64",
        ]
    )
    setup = draft_init.build_draft(args)
    cfg = setup.cfg
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (5, 24, 72)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (6, 2, 4)
    assert cfg.layer_types == ("sliding_attention", "full_attention") + ("sliding_attention",) * 3
    assert cfg.sliding_window == 64 and cfg.rope_theta == 10000.0
    assert cfg.aux_hidden_state_layer_ids == (2, 6, 9)  # [2, n//2, n-3]
    # Tokenizer without a mask token and with 509 < 512 ids: the first unused id.
    assert cfg.mask_token_id == 509
    assert setup.vocab_maps is None and setup.params is None


def test_target_layers_default_to_the_extraction_record(tmp_path):
    verifier = write_verifier(tmp_path / "v", layers=12)
    hs = tmp_path / "data" / "hidden_states"
    hs.mkdir(parents=True)
    (hs / "extraction_config.json").write_text(json.dumps({"layer_ids": [1, 5, 12]}))
    args = cli.resolve(
        [
            "--verifier-name-or-path",
            str(verifier),
            "--data-path",
            str(tmp_path / "data"),
            "--mask-token-id",
            "3",
        ]
    )
    assert draft_init.build_draft(args).cfg.aux_hidden_state_layer_ids == (1, 5)


def test_no_arguments_runs_the_demo_or_names_the_command(tmp_path, monkeypatch, capsys):
    demo = tmp_path / "train.yaml"
    demo.write_text(
        yaml.safe_dump(
            {
                "train": {
                    "verifier": {"verifier_name_or_path": "runs/nowhere/verifier"},
                    "data": {"data_path": "runs/nowhere/data"},
                }
            }
        )
    )
    monkeypatch.setattr(cli, "DEMO_CONFIG", demo)
    assert train.main([]) == 2
    err = capsys.readouterr().err
    assert cli.DEMO_PREPARE_COMMAND in err and "runs/nowhere/verifier" in err
    assert str(cli.REPO_ROOT) in err  # the demo's relative paths are relative to the repository
