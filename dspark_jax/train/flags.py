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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dspark_jax import run_file
from dspark_jax.cli import ConfigError
from dspark_jax.run_file import (  # noqa: F401  (the flag table, re-exported for callers)
    BY_DEST,
    FLAGS,
    GROUPS,
    NO_EFFECT,
    ONLINE,
    OTHER_TYPE,
    SPECULATOR_TYPE,
    SUPPORTED,
    Flag,
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
        return run_file.dump({d: v for d, v in self.values.items() if self.provided(d)})

    def save(self, folder: str | os.PathLike) -> None:
        """``run.yaml`` (round-trips through --config) + ``train_command.txt``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / run_file.RUN_FILE).write_text(self.dump_yaml())
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
        return run_file.load(path)
    except ConfigError as e:
        raise ConfigError(f"--config {e}") from None


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
    """Reference validations, unsupported features, conflicts; raises ConfigError. One
    function per concern, in the order a user meets them."""
    _validate_model(args)
    _validate_hidden_states(args)
    _validate_schedule(args.values)
    _validate_objective(args)
    _validate_logging(args.values)
    _validate_processes(args.values)


def _validate_model(args: TrainArgs) -> None:
    """The speculator, the verifier and the draft decoder's definition."""
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


def _validate_hidden_states(args: TrainArgs) -> None:
    """Where the hidden states come from: the backend's own flags, online generation."""
    v = args.values
    if v["hidden_states_dtype"] == "float16":
        raise ConfigError(
            "hidden_states_dtype float16 is not supported (requires gradient scaling); use bfloat16."
        )
    if v["hidden_states_dtype"] not in ("bfloat16", "float32"):
        raise ConfigError(
            f"--hidden-states-dtype must be bfloat16 or float32, got {v['hidden_states_dtype']!r}"
        )
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


def _validate_schedule(v: dict[str, Any]) -> None:
    """Steps, epochs, checkpoints, data split and loader, --compile-for."""
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


def _validate_objective(args: TrainArgs) -> None:
    """The loss, its per-position weighting and the Draft-OPD stage."""
    v = args.values
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


def _validate_processes(v: dict[str, Any]) -> None:
    """The multi-process launch: explicit coordinates go together."""
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
