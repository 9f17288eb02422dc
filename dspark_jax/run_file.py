"""``run.yaml``: a training run's flags as given, and the flag table it is spelled in.

One owner for the file ``python -m dspark_jax.train`` writes beside its checkpoints
(and reads back with ``--config``), which the exporter renders as the model card's
training command. Its shape is the reference's (``speculators train``'s run.yaml):
values under ``train:``, by group (``data:``, ``optimizer:``, ...), or flat. The flag
table is here, below the trainer, so that reading a run never imports it; what the
flags *do* (derived defaults, validation) is :mod:`dspark_jax.train.flags`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from dspark_jax.cli import ConfigError

RUN_FILE = "run.yaml"  # beside the checkpoint steps

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

assert len(BY_DEST) == len(FLAGS), "duplicate flag"
assert all(f.group in GROUPS for f in FLAGS)


def load(path: str | os.PathLike) -> dict[str, Any]:
    """``{flag dest: value}`` of a run.yaml (or a ``--config`` in its shape), groups
    flattened; unknown keys refused. Raises ConfigError naming the file."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a top-level mapping")
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
        raise ConfigError(f"{path}: unknown keys {', '.join(sorted(unknown))}")
    return flat


def dump(values: dict[str, Any]) -> str:
    """The run.yaml text of ``{flag dest: value}``: under ``train:``, by group, in the
    table's order; :func:`load` reads it back."""
    nested: dict[str, Any] = {}
    for f in FLAGS:
        if f.dest in values:
            if f.group == "general":
                nested[f.dest] = values[f.dest]
            else:
                nested.setdefault(f.group, {})[f.dest] = values[f.dest]
    return yaml.safe_dump({"train": nested}, sort_keys=False, default_flow_style=False)


def command(values: dict[str, Any]) -> list[str]:
    """``python -m dspark_jax.train`` argv with one flag per value (model cards); it
    parses back to the same values: a true bool as the bare flag, a false one as
    ``--no-<flag>`` where the flag has that form (else left out: store_true's default)."""
    argv = ["python", "-m", "dspark_jax.train"]
    for dest, value in values.items():
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
