"""``python -m dspark_jax.train`` flags: the reference trainer's, plus a few for JAX.

Every flag of ``speculators train`` 0.9.0 (``speculators/train/config/schema.py`` and
the hidden-states backends' train args) exists here with the same name, type and
default, grouped as in the reference so that its ``run.yaml`` loads with
``--config``. Precedence is the reference's: flag > YAML > default; derived
defaults (``--num-layers``, ``--loss-fn``, ``--block-size``, ...) are resolved as in
``TrainConfig._resolve_derived_defaults`` for ``--speculator-type dspark``.

What each flag does here is one of:

* supported: same meaning as the reference;
* ``ONLINE``: the online transport (vLLM endpoint, Mooncake; supported, see
  dspark_jax/data/online/source.py): it applies only with ``--on-missing generate`` or
  ``--hidden-states-backend mooncake``, and giving it otherwise is an error;
* ``OTHER_TYPE``: an option of another speculator type (eagle3, dflash2, xpress,
  peagle, mtp): giving it is an error (the reference warns and ignores it);
* a few reference flags select a PyTorch implementation detail with no JAX
  counterpart; they are accepted and their help says why (``NO_EFFECT``).

Deviations from the reference, each deliberate:

* ``--speculator-type`` defaults to ``dspark`` (the only type trained here; the
  reference's default is eagle3).
* ``--target-layer-ids`` unset: the ids recorded by ``launch/``'s extractor in
  ``<hidden states>/extraction_config.json`` when present (so the draft reads the
  layers the files hold), else the reference's ``[2, n//2, n-3]``.
* unknown ``--config`` keys are an error (the reference warns).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from dspark_jax.cli import ConfigError

SUPPORTED, NO_EFFECT, ONLINE, OTHER_TYPE = "supported", "no_effect", "online", "other_type"
SPECULATOR_TYPE = "dspark"
# Groups of the reference's run.yaml (schema._GROUPS), then ours.
GROUPS = (
    "general",
    "verifier",
    "draft",
    "data",
    "generation",
    "loss",
    "optimizer",
    "scheduler",
    "trainer",
    "logging",
    "dflash",
    "dflash2",
    "dspark",
    "xpress",
    "peagle",
    "mtp",
    "backend",
    "jax",
)
REPO_ROOT = Path(__file__).resolve().parents[2]  # dspark_jax/train/flags.py
DEMO_CONFIG = REPO_ROOT / "configs" / "demo" / "train.yaml"
# The demo data: configs/demo/README.md ("Use").
DEMO_PREPARE_COMMAND = (
    "python -m launch.prepare_data --model configs/demo/verifier --data "
    "configs/demo/conversations.jsonl --output runs/demo/data --seq-length 1024 "
    "--minimum-valid-tokens 16 --draft-vocab-size 2048 && python -m "
    "launch.extract_hidden_states --backend hf --model configs/demo/verifier "
    "--preprocessed-data runs/demo/data --target-layer-ids 1 2 3"
)


@dataclasses.dataclass(frozen=True)
class Flag:
    dest: str
    group: str
    default: Any = None
    type: Callable | None = str  # None: a boolean flag
    help: str = ""
    choices: tuple | None = None
    nargs: str | None = None
    optional_bool: bool = False  # --x/--no-x (else a bool is store_true)
    status: str = SUPPORTED
    owner: str | None = None  # OTHER_TYPE: the speculator type using it

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")


def _f(dest, group, default=None, type=str, help="", **kw) -> Flag:
    return Flag(dest, group, default, type, help, **kw)


def _bool(dest, group, default=False, help="", optional=None, **kw) -> Flag:
    # The reference renders True/None-default bools as --x/--no-x, False ones as store_true.
    optional = default is not False if optional is None else optional
    return Flag(dest, group, default, None, help, optional_bool=optional, **kw)


def _other(dest, group, owner, default=None, type=str, **kw) -> Flag:
    return Flag(
        dest,
        group,
        default,
        type,
        f"{owner} only (not trained here)",
        status=OTHER_TYPE,
        owner=owner,
        **kw,
    )


def _online(dest, group, default=None, type=str, help="", **kw) -> Flag:
    return Flag(dest, group, default, type, help, status=ONLINE, **kw)


# fmt: off
FLAGS: tuple[Flag, ...] = (
    # --- general
    _f("speculator_type", "general", SPECULATOR_TYPE,
       help="Speculator type; dspark_jax trains 'dspark' only (the reference's default is eagle3)."),
    _bool("dry_run", "general",
          help="Build and initialise the drafter, save it to --save-path (config.json + "
          "model.safetensors), report what the run needs (online transport included), exit."),
    _f("seed", "general", 42, int, "Random seed (init, data order, anchors)."),
    _bool("deterministic_cuda", "general",
          help="Deterministic GPU kernels (sets XLA's --xla_gpu_deterministic_ops)."),
    # --- verifier
    _f("verifier_name_or_path", "verifier", "",
       help="Local HF folder of the verifier (config.json + safetensors); no network access."),
    _f("verifier_dtype", "jax", "bfloat16", choices=("bfloat16", "float32"),
       help="--hidden-states-backend jax: dtype of the verifier's weights and matmuls "
       "(its residual stream, norms and softmax are fp32)."),
    _bool("trust_remote_code", "verifier", status=NO_EFFECT,
          help="Accepted for compatibility: dspark_jax reads config.json and tensors only and "
          "never executes model code."),
    # --- draft
    _f("from_pretrained", "draft", "",
       help="Start from a drafter: an Orbax checkpoint folder (python -m converters import, or "
       "a previous --save-path), a speculators folder (config.json + model.safetensors), or a "
       "folder with only config.json (fresh weights from that config)."),
    _f("draft_config", "draft", "",
       help="Qwen3 decoder config (JSON file or folder with config.json) for the draft layers; "
       "a full speculators config.json also works (its transformer_layer_config is used)."),
    _f("num_layers", "draft", None, int, "Draft decoder layers to synthesise (default: 5)."),
    _f("draft_arch", "draft", None, help="Draft decoder architecture (qwen3 only here).",
       choices=("llama", "qwen3")),
    _f("draft_hidden_act", "draft", "silu", help="Draft activation (silu only here)."),
    _bool("draft_mrope_full_head_hack", "draft", True,
          help="MRoPE verifiers with partial_rotary_factor < 1: rescale mrope_section to the "
          "full head and set partial_rotary_factor 1.0 (the drafter trains text-only, full-head "
          "RoPE either way; turning it off is refused, as vLLM would then rotate part of it)."),
    _f("target_layer_ids", "draft", None, int, nargs="+",
       help="Verifier layer ids of the aux hidden states (default: the extractor's record in "
       "<hidden states>/extraction_config.json, else [2, n//2, n-3])."),
    _f("token_freq_path", "draft", None, help="token_freq.pt for building vocab maps."),
    _f("draft_vocab_size", "draft", None, int, "Draft vocabulary size."),
    _f("d2t_path", "draft", None, help="Draft-to-target vocab map (.npy)."),
    _f("t2d_path", "draft", None, help="Target-to-draft vocab map (.npy)."),
    _f("mask_token_id", "draft", None, int,
       "Mask token id (default: the verifier tokenizer's mask token, else its first unused "
       "id, else pad/eos/unk, as the reference)."),
    _bool("norm_before_residual", "draft", True, status=OTHER_TYPE, owner="eagle3",
          help="eagle3 only (not trained here)"),
    _bool("embed_requires_grad", "draft", False, optional=True, status=OTHER_TYPE,
          owner="eagle3", help="eagle3 only (not trained here)"),
    _bool("norm_before_fc", "draft", None, status=OTHER_TYPE, owner="eagle3",
          help="eagle3 only (not trained here)"),
    _bool("fc_norm", "draft", False, status=OTHER_TYPE, owner="eagle3",
          help="eagle3 only (not trained here)"),
    _bool("norm_output", "draft", None, status=OTHER_TYPE, owner="eagle3",
          help="eagle3 only (not trained here)"),
    _f("sliding_window", "draft", 2048, int, "Window of the sliding-attention draft layers."),
    _f("full_attention_indices", "draft", [], int, nargs="+",
       help="Draft layers with full attention (the others slide)."),
    _bool("sliding_window_non_causal", "draft", None,
          help="Bidirectional attention inside a block on sliding layers (default: off)."),
    _f("draft_attn_impl", "draft", "simple_flex_attention", status=NO_EFFECT,
       choices=("simple_flex_attention", "sdpa", "eager"),
       help="PyTorch attention kernel choice; all three compute the same function, which "
       "dspark_jax computes with its own tiled attention."),
    # --- data
    _f("data_path", "data", "./output",
       help="Prepared dataset folder (vocab maps, token_freq.pt, hidden_states/)."),
    _f("hidden_states_backend", "data", "file", choices=("file", "fp8", "mooncake", "jax"),
       help="file / fp8: hs_{i}.safetensors files (bf16 or fp8 + scales), also how "
       "generated samples arrive (shared storage); mooncake: generated samples arrive "
       "through a Mooncake store and no files are read; jax: the verifier runs inside the "
       "step on the training mesh (prepared dataset only, no hidden-state files)."),
    _f("total_seq_len", "data", 8192, int, "Tokens per packed row."),
    _f("train_data_ratio", "data", 0.9, float, "Fraction of rows for training; the rest validate."),
    _f("hidden_states_dtype", "data", "bfloat16",
       help="Hidden-state and compute dtype: bfloat16 (bf16 matmuls, fp32 master weights) or "
       "float32."),
    _f("num_workers", "data", 12, int, "Data loader worker processes (Grain)."),
    _f("prefetch_factor", "data", 4, int, "Batches prefetched per worker."),
    _f("max_anchors", "data", 512, int, "Anchors (blocks) per packed row."),
    # --- generation (online)
    _online("vllm_endpoint", "generation", "http://localhost:8000/v1",
            help="Extractor endpoint (vllm serve or launch/serve_hidden_states.py) for "
            "--on-missing generate; its served model id must equal --verifier-name-or-path."),
    _f("on_missing", "generation", "generate", choices=("generate", "skip", "warn", "raise"),
       help="A sample without hidden states: generate (ask --vllm-endpoint; samples whose "
       "generation fails are skipped and counted), skip, warn (skip + log) or raise."),
    _f("on_generate", "generation", "delete", choices=("delete",), status=NO_EFFECT,
       help="Deprecated in the reference, no effect."),
    _online("request_timeout", "generation", 120.0, float,
            "Seconds per extractor request, and to wait for its tensors."),
    _online("max_retries", "generation", 3, int,
            "Retries of a request after a connection error, timeout or HTTP 408/429/5xx."),
    _online("generation_validation_retries", "generation", 2, int,
            "Extra full generate/load/validate round trips for a sample that failed."),
    _online("max_consecutive_generation_failures", "generation", 20, int,
            "Stop the run after this many consecutive samples failed every round trip "
            "(per data process)."),
    # --- loss
    _f("loss_implementation", "loss", "fused", choices=("fused", "eager"), status=NO_EFFECT,
       help="PyTorch kernel choice; dspark_jax always reduces over vocab chunks (same values)."),
    _f("loss_fn", "loss", None,
       help='Loss name or JSON weights, e.g. \'{"ce": 0.1, "tv": 0.9}\' (default: kl_div).'),
    _f("training_stage", "loss", "sft", choices=("sft", "opd"),
       help="opd: Draft-OPD (arXiv 2605.29343; docs/math.md, \"Draft-OPD\"): the drafter drafts "
       "its blocks itself and learns from the verifier's distributions on its drafted prefixes "
       "(forward KL on accepted, decayed reverse KL on rejected slots) instead of --loss-fn; "
       "needs --hidden-states-backend jax. Usually after an sft stage (--from-pretrained)."),
    _f("gamma_opd", "loss", 0.8, float,
       "Draft-OPD: decay gamma**k of the reverse KL at slot k of a block, in (0, 1]."),
    _f("lambda_acc", "loss", 1.0, float, "Draft-OPD: weight of the accepted slots' forward KL."),
    _f("lambda_rej", "loss", 1.0, float, "Draft-OPD: weight of the rejected slots' reverse KL."),
    _f("opd_drafting", "loss", "greedy", choices=("greedy", "sampled"),
       help="Draft-OPD: the drafter's tokens are its argmax (the paper's setting) or drawn "
       "from its distribution (seeded by --seed and the step)."),
    _other("ttt_steps", "loss", "eagle3", 3, int),
    _other("ttt_step_loss_decay", "loss", "eagle3", 1.0, float),
    # --- optimizer
    _f("optimizer", "optimizer", "muon", choices=("adamw", "muon"),
       help="muon: Muon for 2-D weight matrices, AdamW for the rest."),
    _f("lr", "optimizer", 1e-3, float, "Learning rate (AdamW / base group)."),
    _f("weight_decay", "optimizer", 0.01, float, "AdamW weight decay."),
    _f("muon_lr", "optimizer", None, float, "Muon group lr (default: --lr)."),
    _f("muon_momentum", "optimizer", 0.95, float, "Muon momentum."),
    _f("muon_weight_decay", "optimizer", 0.1, float, "Muon weight decay."),
    _f("muon_ns_steps", "optimizer", 5, int, "Newton-Schulz steps."),
    _f("muon_adjust_lr_fn", "optimizer", "match_rms_adamw",
       choices=("original", "match_rms_adamw"), help="Muon lr adjustment."),
    # --- scheduler
    _f("scheduler_type", "scheduler", "linear", choices=("linear", "cosine", "none"),
       help="LR schedule."),
    _f("scheduler_warmup_steps", "scheduler", None, int, "Warmup steps."),
    _f("scheduler_warmup_ratio", "scheduler", None, float, "Warmup fraction of the total."),
    _f("scheduler_total_steps", "scheduler", None, int,
       "Schedule length (default: --max-steps, else epochs x steps of epoch 0)."),
    _f("scheduler_num_cosine_cycles", "scheduler", 0.5, float, "Cosine cycles."),
    # --- trainer
    _f("epochs", "trainer", 20, int, "Training epochs."),
    _f("checkpoint_freq", "trainer", 1.0, float,
       "Checkpoint every N epochs; < 1: every that fraction of an epoch (and at epoch ends)."),
    _bool("save_best", "trainer",
          help="Save only when the validation loss improves (and on interruption)."),
    _bool("no_resume_from_checkpoint", "trainer",
          help="Start from scratch; existing checkpoints in --save-path are deleted."),
    _f("log_freq", "trainer", 1, int, "Log training metrics every N steps."),
    _f("save_path", "trainer", "./output/checkpoints",
       help="Checkpoints (Orbax), run.yaml, train_command.txt, config.json."),
    _bool("fsdp_shard", "trainer",
          help="Shard parameters over devices: the default mesh already puts every device on "
          "'fsdp'; with --mesh it requires an fsdp axis > 1."),
    _bool("gradient_checkpointing", "trainer",
          help="Recompute each decoder layer in the backward pass (less activation memory)."),
    _f("max_steps", "trainer", None, int, "Stop after this many optimizer steps."),
    # --- logging
    _f("logger", "logging", "",
       help="Comma-separated trackers: tensorboard, wandb, trackio, mlflow (pip install "
       "'dspark-jax[loggers]'); metrics always go to <log-dir>/<run-name>/metrics.jsonl."),
    _f("log_dir", "logging", "./logs", help="Directory for training logs."),
    _f("run_name", "logging", None, help="Run name (default: the start time)."),
    # --- dflash (shared DFlash-family backbone knobs)
    _f("block_size", "dflash", None, int, "Block size (default 8)."),
    _bool("sample_from_anchor", "dflash", None,
          help="Slot k predicts token p+k+1 (default: on for dspark)."),
    _f("dflash_decay_gamma", "dflash", 4.0, float, "Position-weight decay gamma."),
    _f("per_position_loss_weight", "dflash", None,
       choices=("fixed-exp-decay", "dpace", "dpard"),
       help="Position weights (default fixed-exp-decay); dpard: D-PARD, with --loss-fn "
       "renyi_half (speculators PR #1078, not in 0.9.0; docs/math.md §7)."),
    _f("dpace_alpha", "dflash", 0.5, float, "D-PACE smoothing constant."),
    _f("dpard_alpha", "dflash", 0.5, float,
       "D-PARD acceptance-floor smoothing constant, in (0, 1)."),
    # --- dflash2, xpress, peagle, mtp: other speculator types
    _other("conv_kernel_size", "dflash2", "dflash2", 2, int),
    _other("conv_group_size", "dflash2", "dflash2", 16, int),
    _other("selector_rank", "dflash2", "dflash2", 256, int),
    _other("selector_top_k", "dflash2", "dflash2", 16, int),
    _other("selector_loss_alpha", "dflash2", "dflash2", 1.0, float),
    # --- dspark
    _f("markov_rank", "dspark", 256, int, "Markov head rank (0 disables it)."),
    _f("markov_head_type", "dspark", "vanilla", choices=("vanilla", "gated", "rnn"),
       help="Markov head variant."),
    _bool("enable_confidence_head", "dspark", True, help="Train the confidence head."),
    _bool("confidence_head_with_markov", "dspark", True,
          help="Feed the Markov embedding into the confidence head."),
    _f("confidence_head_alpha", "dspark", 1.0, float, "Weight of the confidence BCE term."),
    _other("xpress_rank", "xpress", "xpress", 256, int),
    _other("xpress_mlp_ratio", "xpress", "xpress", 2, int),
    _other("num_jacobi_passes", "xpress", "xpress", 6, int),
    _other("consistency_weight", "xpress", "xpress", 0.3, float),
    _other("consistency_passes", "xpress", "xpress", 3, int),
    _other("base_anchor_weight", "xpress", "xpress", 0.6, float),
    _bool("ce_from_data", "xpress", status=OTHER_TYPE, owner="xpress",
          help="xpress only (not trained here)"),
    _bool("base_anchor_full_weight", "xpress", status=OTHER_TYPE, owner="xpress",
          help="xpress only (not trained here)"),
    _other("num_depths", "peagle", "peagle", 8, int),
    _other("down_sample_ratio", "peagle", "peagle", 0.7, float),
    _other("down_sample_ratio_min", "peagle", "peagle", 0.2, float),
    _other("num_speculative_steps", "mtp", "mtp", 3, int),
    _other("step_weight_beta", "mtp", "mtp", 0.6, float),
    # --- hidden-states backends (the reference's backend train args)
    _f("hidden_states_path", "backend", None,
       help="Folder of hs_{i}.safetensors (default: <data-path>/hidden_states)."),
    _online("mooncake_master", "backend", "127.0.0.1:50051", help="Mooncake master."),
    _online("mooncake_metadata_server", "backend", "P2PHANDSHAKE",
            help="Mooncake metadata server."),
    _online("mooncake_protocol", "backend", "tcp", choices=("tcp", "rdma"),
            help="Mooncake protocol."),
    _online("mooncake_device", "backend", "", help="Mooncake device(s)."),
    _online("mooncake_global_segment_gib", "backend", 4.0, float, "Mooncake global segment."),
    _online("mooncake_local_buffer_gib", "backend", 2.0, float, "Mooncake local buffer."),
    _online("mooncake_writer_threads", "backend", 4, int,
            "Mooncake writer threads (extractor side; accepted for the seed command)."),
    # --- JAX (not in the reference)
    _f("mesh", "jax", None,
       help="Device mesh, e.g. 'data=2,fsdp=2,tensor=2' (one axis may be -1); default: every "
       "device on fsdp. 'context=C' splits each row's tokens over C devices (long rows; "
       "--total-seq-len must be a multiple of C); over several processes, each reads and "
       "holds only its tokens' hidden states."),
    _f("compile_for", "jax", None,
       help="With --dry-run: compile the train and eval steps for a target instead of "
       "initialising the drafter, and report per-chip memory against its HBM, the "
       "collectives and whether it fits (exit 1 if not); no verifier weights or data are "
       "read. 'local' (this machine's devices), 'tpu:<topology>' e.g. tpu:v5p:2x2x2, "
       "tpu:v5e:4x4 (needs the tpu extra); docs/tpu.md."),
    _f("rows_per_step", "jax", None, int,
       "Packed rows per optimizer step over all devices (default: one per data-parallel "
       "device, like the reference's one row per GPU); a multiple of data x fsdp."),
    _f("coordinator_address", "jax", None,
       help="jax.distributed coordinator host:port (default: auto-detected on TPU pods and "
       "Slurm; single process otherwise)."),
    _f("num_processes", "jax", None, int, "jax.distributed process count."),
    _f("requests_in_flight", "jax", 4, int,
       "With --on-missing generate: extractor requests at once per data process (the "
       "loader works on as many steps ahead as that takes, at least two)."),
    _f("process_id", "jax", None, int, "jax.distributed process id."),
    _f("keep_checkpoints", "jax", 3, int,
       "Checkpoints kept (the newest ones; the best validation one is kept as well)."),
    _f("loss_chunk_tokens", "jax", 1024, int,
       "Slots per vocabulary-sized chunk of the loss (memory vs. speed)."),
    _f("profile_steps", "jax", None,
       help="A:B: a jax.profiler trace of optimizer steps A to B-1 into "
       "<log-dir>/<run-name>/profile (TensorBoard's profile plugin, XProf, Perfetto)."),
    _f("anchor_sampling", "jax", "per-row", choices=("per-row", "per-document"),
       help="How a packed row's --max-anchors anchors are drawn: per-row, uniformly over the "
       "row (the reference's rule); per-document, split over the row's documents in "
       "proportion to their supervised positions, then uniformly within each "
       "(dspark_jax/anchors.py). Both deterministic per (seed, step, row)."),
    _f("verifier_norm_style", "jax", "auto", choices=("auto", "plain", "gemma"),
       help="The verifier's final norm for the training targets: plain x * w or gemma "
       "x * (1 + w); auto: speculators' choice from the verifier config's model_type "
       "(gemma for gemma/gemma2/gemma3/qwen3_5/recurrent_gemma families)."),
    _f("verifier_logit_softcapping", "jax", "reference", choices=("reference", "served"),
       help="The verifier logits the targets are: reference, lm_head(norm(h)) as "
       "speculators computes them; served, cap * tanh(. / cap) with the verifier config's "
       "final_logit_softcapping (Gemma 2), the logits vLLM serves (docs/math.md §3)."),
)
# fmt: on

BY_DEST: dict[str, Flag] = {f.dest: f for f in FLAGS}
DECODER_SHAPING = (
    "num_layers",
    "draft_arch",
    "draft_hidden_act",
    "sliding_window",
    "full_attention_indices",
)
PATH_FLAGS = (
    "verifier_name_or_path",
    "data_path",
    "save_path",
    "log_dir",
    "draft_config",
    "from_pretrained",
    "hidden_states_path",
    "token_freq_path",
    "d2t_path",
    "t2d_path",
)
assert len(BY_DEST) == len(FLAGS), "duplicate flag"
assert all(f.group in GROUPS for f in FLAGS)


@dataclasses.dataclass
class TrainArgs:
    """Resolved flags: attribute access by dest, plus where each value came from."""

    values: dict[str, Any]
    provenance: dict[str, str]  # dest -> "flag" | "yaml" | "default"
    argv: list[str]
    demo: bool = False

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def provided(self, dest: str) -> bool:
        return self.provenance.get(dest, "default") != "default"

    def as_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def dump_yaml(self) -> str:
        """The reference's run.yaml shape: provided values under ``train:``, by group."""
        nested: dict[str, Any] = {}
        for f in FLAGS:
            if self.provided(f.dest):
                if f.group == "general":
                    nested[f.dest] = self.values[f.dest]
                else:
                    nested.setdefault(f.group, {})[f.dest] = self.values[f.dest]
        return yaml.safe_dump({"train": nested}, sort_keys=False, default_flow_style=False)

    def save(self, folder: str | os.PathLike) -> None:
        """``run.yaml`` (round-trips through --config) + ``train_command.txt``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "run.yaml").write_text(self.dump_yaml())
        from importlib.metadata import PackageNotFoundError, version

        lines = [f"# Timestamp: {datetime.datetime.now(datetime.UTC).isoformat()}"]
        for pkg in ("dspark-jax", "jax", "flax", "optax", "orbax-checkpoint", "grain"):
            try:
                lines.append(f"# {pkg}: {version(pkg)}")
            except PackageNotFoundError:
                lines.append(f"# {pkg}: not installed")
        lines.append(shlex.join(["python", "-m", "dspark_jax.train", *self.argv]))
        (folder / "train_command.txt").write_text("\n".join(lines) + "\n")


# ----------------------------------------------------------------------------- parsing


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dspark_jax.train",
        description="Train a DSpark drafter (flags of speculators 0.9.0 `speculators train`). "
        "Without arguments: the demo (configs/demo/train.yaml).",
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="PATH",
        help="YAML config (the reference's run.yaml shape: keys under 'train:', "
        "by group, or flat). Flags override it.",
    )
    p.add_argument(
        "--dump-config", action="store_true", help="Print the resolved config as run.yaml and exit."
    )
    groups = {g: p.add_argument_group(g) for g in GROUPS}
    for f in FLAGS:
        kw: dict[str, Any] = {"dest": f.dest, "default": argparse.SUPPRESS, "help": f.help}
        if f.type is None:
            action = argparse.BooleanOptionalAction if f.optional_bool else "store_true"
            groups[f.group].add_argument(f.flag, action=action, **kw)
            continue
        kw["type"] = f.type
        if f.choices:
            kw["choices"] = f.choices
        if f.nargs:
            kw["nargs"] = f.nargs
        groups[f.group].add_argument(f.flag, **kw)
    return p


def _load_yaml(path: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"--config '{path}' could not be read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config '{path}' is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config '{path}' must contain a top-level mapping")
    stage = data.get("train")
    data = stage if isinstance(stage, dict) else data
    flat: dict[str, Any] = {}
    unknown = []
    for key, value in data.items():
        if key in GROUPS and isinstance(value, dict):
            for leaf, v in value.items():
                f = BY_DEST.get(leaf)
                if f is None or (key != "general" and f.group != key):
                    unknown.append(f"{key}.{leaf}")
                else:
                    flat[leaf] = v
        elif key in BY_DEST:
            flat[key] = value
        else:
            unknown.append(key)
    if unknown:
        raise ConfigError(f"--config '{path}': unknown keys {', '.join(sorted(unknown))}")
    return flat


def read_run_yaml(run_yaml: str | os.PathLike) -> dict[str, Any]:
    """Every flag's value for a run.yaml: its values over the defaults (not validated)."""
    values = {f.dest: f.default for f in FLAGS}
    values.update(_load_yaml(str(run_yaml)))
    return values


def command_line(run_yaml: str | os.PathLike) -> list[str]:
    """``python -m dspark_jax.train`` argv with one flag per value of a run.yaml (what the
    run was given), for model cards; it parses back to the same values."""
    argv = ["python", "-m", "dspark_jax.train"]
    for dest, value in _load_yaml(str(run_yaml)).items():
        f = BY_DEST[dest]
        if value is None:
            continue
        if f.type is None:
            if value:
                argv.append(f.flag)
            elif f.optional_bool:
                argv.append("--no-" + f.flag[2:])
        elif f.nargs:
            argv += [f.flag, *map(str, value if isinstance(value, list) else [value])]
        else:
            argv += [f.flag, str(value)]
    return argv


def _coerce(f: Flag, value: Any, source: str) -> Any:
    """Type-check a YAML value like argparse would parse the flag."""
    if value is None:
        return None
    try:
        if f.type is None:
            if not isinstance(value, bool):
                raise TypeError
            return value
        if f.nargs:
            items = value if isinstance(value, list) else [value]
            return [f.type(v) for v in items]
        if f.type is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if f.type is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError
        value = f.type(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {f.flag} expects {_type_name(f)}, got {value!r}") from None
    if f.choices and value not in f.choices:
        raise ConfigError(f"{source}: {f.flag} must be one of {list(f.choices)}, got {value!r}")
    return value


def _type_name(f: Flag) -> str:
    if f.type is None:
        return "true/false"
    name = getattr(f.type, "__name__", str(f.type))
    return f"a list of {name}" if f.nargs else name


def resolve(argv: Sequence[str] | None = None) -> TrainArgs:
    """Parse argv (no argv: the demo config), layer YAML under flags, validate.

    Raises ConfigError (the caller turns it into exit status 2) or SystemExit (argparse
    errors, ``--help``, ``--dump-config``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    demo = not argv
    if demo:
        if not DEMO_CONFIG.exists():
            raise ConfigError(
                f"no arguments given and the demo config {DEMO_CONFIG} is missing; pass "
                "--verifier-name-or-path and --data-path (see --help)"
            )
        argv = ["--config", str(DEMO_CONFIG)]
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    cli = {k: v for k, v in ns.items() if k in BY_DEST}
    yaml_values: dict[str, Any] = {}
    if ns.get("config"):
        yaml_values = {
            k: _coerce(BY_DEST[k], v, f"--config '{ns['config']}'")
            for k, v in _load_yaml(ns["config"]).items()
        }
    values: dict[str, Any] = {}
    provenance: dict[str, str] = {}
    for f in FLAGS:
        if f.dest in cli:
            values[f.dest], provenance[f.dest] = cli[f.dest], "flag"
        elif f.dest in yaml_values:
            values[f.dest], provenance[f.dest] = yaml_values[f.dest], "yaml"
        else:
            default = list(f.default) if isinstance(f.default, list) else f.default
            values[f.dest], provenance[f.dest] = default, "default"
    if demo:
        for dest in PATH_FLAGS:  # the demo's relative paths are relative to the repository
            if (
                values[dest]
                and provenance[dest] != "default"
                and not Path(values[dest]).is_absolute()
            ):
                values[dest] = str(REPO_ROOT / values[dest])
    args = TrainArgs(values, provenance, argv, demo=demo)
    _derive_defaults(args)
    validate(args)
    if ns.get("dump_config"):
        sys.stdout.write(args.dump_yaml())
        raise SystemExit(0)
    return args


def _derive_defaults(args: TrainArgs) -> None:
    """``TrainConfig._resolve_derived_defaults`` for dspark."""
    v = args.values
    defaults = {
        "draft_arch": "qwen3",
        "norm_before_fc": False,
        "norm_output": False,
        "sliding_window_non_causal": False,
        "muon_lr": v["lr"],
        "num_layers": 5,
        "per_position_loss_weight": "fixed-exp-decay",
        "loss_fn": "kl_div",
        "block_size": 8,
        "sample_from_anchor": True,
    }
    for dest, value in defaults.items():
        if v[dest] is None:
            v[dest] = value


# -------------------------------------------------------------------------- validation


def validate(args: TrainArgs) -> None:
    """Reference validations, unsupported features, conflicts; raises ConfigError."""
    v = args.values
    if v["speculator_type"] != SPECULATOR_TYPE:
        raise ConfigError(
            f"--speculator-type {v['speculator_type']}: dspark_jax trains --speculator-type "
            "dspark only"
        )
    for f in FLAGS:
        if f.status == OTHER_TYPE and args.provided(f.dest):
            raise ConfigError(
                f"{f.flag} is an option of {f.owner}; dspark_jax trains --speculator-type dspark only"
            )
    if not args.provided("verifier_name_or_path"):
        raise ConfigError(
            "missing required value: set --verifier-name-or-path or provide it in --config"
        )
    if v["draft_arch"] != "qwen3":
        raise ConfigError(
            f"--draft-arch {v['draft_arch']}: dspark_jax builds qwen3 draft layers only"
        )
    if v["draft_hidden_act"] != "silu":
        raise ConfigError(
            f"--draft-hidden-act {v['draft_hidden_act']}: dspark_jax's draft MLP is SiLU only"
        )
    if v["hidden_states_dtype"] == "float16":
        raise ConfigError(
            "hidden_states_dtype float16 is not supported (requires gradient scaling); use bfloat16."
        )
    if v["hidden_states_dtype"] not in ("bfloat16", "float32"):
        raise ConfigError(
            f"--hidden-states-dtype must be bfloat16 or float32, got {v['hidden_states_dtype']!r}"
        )
    if v["checkpoint_freq"] <= 0:
        raise ConfigError("--checkpoint-freq must be > 0")
    if v["checkpoint_freq"] > 1 and not float(v["checkpoint_freq"]).is_integer():
        raise ConfigError(
            f"--checkpoint-freq={v['checkpoint_freq']} is not an integer. Values > 1 are "
            "treated as epoch counts and must be whole numbers."
        )
    if v["max_steps"] is not None and v["max_steps"] < 1:
        raise ConfigError("--max-steps must be >= 1")
    if v["generation_validation_retries"] < 0:
        raise ConfigError("--generation-validation-retries must be >= 0")
    if v["max_consecutive_generation_failures"] <= 0:
        raise ConfigError("--max-consecutive-generation-failures must be > 0")
    for dest in (
        "epochs",
        "log_freq",
        "total_seq_len",
        "max_anchors",
        "loss_chunk_tokens",
        "keep_checkpoints",
        "block_size",
    ):
        if v[dest] is None or v[dest] < 1:
            raise ConfigError(f"{BY_DEST[dest].flag} must be >= 1, got {v[dest]}")
    if not 0.0 < v["train_data_ratio"] < 1.0:
        raise ConfigError(f"--train-data-ratio must be in (0, 1), got {v['train_data_ratio']}")
    if v["num_workers"] < 0 or v["prefetch_factor"] < 0:
        raise ConfigError("--num-workers and --prefetch-factor must be >= 0")
    if v["compile_for"] is not None:
        if not v["dry_run"]:
            raise ConfigError(
                f"--compile-for {v['compile_for']} compiles the steps without training: add "
                "--dry-run"
            )
        from dspark_jax.train.compile_target import parse

        parse(v["compile_for"])
    if v["rows_per_step"] is not None and v["rows_per_step"] < 1:
        raise ConfigError(f"--rows-per-step must be >= 1, got {v['rows_per_step']}")
    from dspark_jax.losses import parse_loss_fn

    try:
        parse_loss_fn(v["loss_fn"])
    except ValueError as e:
        raise ConfigError(f"--loss-fn: {e}") from None
    if v["per_position_loss_weight"] == "dpace":
        if v["loss_fn"] != "ce":
            raise ConfigError("--per-position-loss-weight=dpace requires --loss-fn=ce")
        if not 0.0 < v["dpace_alpha"] <= 1.0:
            raise ConfigError(f"--dpace-alpha must be in (0, 1], got {v['dpace_alpha']}")
    if v["per_position_loss_weight"] == "dpard":
        if parse_loss_fn(v["loss_fn"]) != {"renyi_half": 1.0}:
            raise ConfigError("--per-position-loss-weight=dpard requires --loss-fn=renyi_half")
        if not 0.0 < v["dpard_alpha"] < 1.0:
            raise ConfigError(f"--dpard-alpha must be in (0, 1), got {v['dpard_alpha']}")
    if v["training_stage"] == "opd":
        if v["hidden_states_backend"] != "jax":
            raise ConfigError(
                "--training-stage opd needs --hidden-states-backend jax: the targets of the "
                "drafter's own blocks come from the verifier run in the step (got "
                f"--hidden-states-backend {v['hidden_states_backend']})"
            )
        if not 0.0 < v["gamma_opd"] <= 1.0:
            raise ConfigError(f"--gamma-opd must be in (0, 1], got {v['gamma_opd']}")
        if min(v["lambda_acc"], v["lambda_rej"]) < 0 or v["lambda_acc"] + v["lambda_rej"] <= 0:
            raise ConfigError(
                f"--lambda-acc {v['lambda_acc']} and --lambda-rej {v['lambda_rej']} must be "
                ">= 0 with a positive sum"
            )
    else:
        given = [
            BY_DEST[d].flag
            for d in ("gamma_opd", "lambda_acc", "lambda_rej", "opd_drafting")
            if args.provided(d)
        ]
        if given:
            raise ConfigError(f"{', '.join(given)} only apply with --training-stage opd")
    # Draft-init contract (resolution._validate_draft_init).
    shaping = [BY_DEST[d].flag for d in DECODER_SHAPING if args.provided(d)]
    if v["from_pretrained"]:
        conflicts = shaping + (["--draft-config"] if v["draft_config"] else [])
        if conflicts:
            raise ConfigError(
                "--from-pretrained loads a complete draft model and takes precedence over all "
                "other model-definition options, so these conflict with it (remove them): "
                + ", ".join(conflicts)
            )
    elif v["draft_config"] and shaping:
        raise ConfigError(
            "--draft-config defines the draft decoder, so these flags conflict with it "
            "(remove them): " + ", ".join(shaping)
        )
    _validate_logging(v)
    if v["hidden_states_backend"] != "mooncake":
        given = [f.flag for f in FLAGS if f.dest.startswith("mooncake_") and args.provided(f.dest)]
        if given:
            raise ConfigError(
                f"{', '.join(given)} only apply with --hidden-states-backend mooncake "
                f"(got {v['hidden_states_backend']})"
            )
    elif args.provided("hidden_states_path"):
        raise ConfigError("--hidden-states-path applies to the file and fp8 backends, not mooncake")
    if v["hidden_states_backend"] == "jax":
        if args.provided("hidden_states_path"):
            raise ConfigError("--hidden-states-path: --hidden-states-backend jax reads no files")
        if args.provided("on_missing") and v["on_missing"] == "generate":
            raise ConfigError(
                "--on-missing generate: --hidden-states-backend jax computes every sample's "
                "hidden states in the step; nothing is generated"
            )
    elif args.provided("verifier_dtype"):
        raise ConfigError("--verifier-dtype applies to --hidden-states-backend jax only")
    if v["on_missing"] != "generate":
        given = [
            f.flag
            for f in FLAGS
            if f.group == "generation" and f.status == ONLINE and args.provided(f.dest)
        ]
        if given:
            raise ConfigError(
                f"{', '.join(given)} only apply with --on-missing generate (got {v['on_missing']})"
            )
    for dest, low in (
        ("request_timeout", 1e-9),
        ("max_retries", 0),
        ("generation_validation_retries", 0),
        ("max_consecutive_generation_failures", 1),
        ("requests_in_flight", 1),
    ):
        if v[dest] < low:
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(f"{flag} must be {'> 0' if low < 1 else f'>= {low}'}, got {v[dest]}")
    if args.provided("on_generate"):
        warnings.warn(
            "--on-generate is deprecated and has no effect: generated hidden states are always "
            "deleted after loading.",
            FutureWarning,
            stacklevel=2,
        )
    if (v["num_processes"] is None) != (v["process_id"] is None) or (
        v["num_processes"] is not None and v["coordinator_address"] is None
    ):
        raise ConfigError(
            "--coordinator-address, --num-processes and --process-id go together "
            "(or none of them: auto-detection)"
        )


# ---------------------------------------------------------------- logging

LOGGERS = ("tensorboard", "wandb", "trackio", "mlflow")


def loggers(v: dict[str, Any]) -> list[str]:
    """``--logger`` as a list (comma-separated, as the reference splits it)."""
    return [x.strip() for x in v["logger"].split(",") if x.strip()]


def parse_profile_steps(spec: str | None) -> tuple[int, int] | None:
    """``--profile-steps A:B`` -> (A, B): steps A..B-1 (0-based optimizer steps)."""
    if spec is None:
        return None
    try:
        a, b = (int(x) for x in str(spec).split(":"))
    except ValueError:
        a = b = -1
    if not 0 <= a < b:
        raise ConfigError(f"--profile-steps must be A:B with 0 <= A < B, got {spec!r}")
    return a, b


def _validate_logging(v: dict[str, Any]) -> None:
    from dspark_jax.train.trackers import missing_packages

    names = loggers(v)
    for name in names:
        if name not in LOGGERS:
            raise ConfigError(
                f"--logger {name} is not supported (supported: {', '.join(LOGGERS)}); "
                "metrics always go to <log-dir>/<run-name>/metrics.jsonl"
            )
    missing = missing_packages(names)
    if missing:
        raise ConfigError(missing)
    parse_profile_steps(v["profile_steps"])


def run_config(args: TrainArgs) -> dict[str, Any]:
    """The config record the trackers get, shaped as the reference's ``log_run_config``
    (``TrainConfig.model_dump``): root fields at the top, the others under their group,
    the hidden-states backend's flags under ``hidden_states_backend_args`` (the mooncake
    ones with --hidden-states-backend mooncake, else --hidden-states-path) and ours
    under ``jax``."""
    v = args.values
    out: dict[str, Any] = {}
    backend: dict[str, Any] = {}
    mooncake = v["hidden_states_backend"] == "mooncake"
    for f in FLAGS:
        if f.group == "general":
            out[f.dest] = v[f.dest]
        elif f.group == "backend":
            if f.dest.startswith("mooncake_") == mooncake:
                backend[f.dest] = v[f.dest]
        else:
            out.setdefault(f.group, {})[f.dest] = v[f.dest]
    if backend:
        out["hidden_states_backend_args"] = backend
    return out


# ---------------------------------------------------------------- online transport


def describe(args: TrainArgs) -> str:
    """One line per provided value, for logs."""
    return json.dumps({d: v for d, v in args.values.items() if args.provided(d)}, default=str)
