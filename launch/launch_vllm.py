"""Launch ``vllm serve`` for hidden-state extraction (speculators' ``scripts/launch_vllm.py``).

Same command line as the reference launcher (docs/seed_run.md, "Extraction"):

    python -m launch.launch_vllm MODEL [--hidden-states-backend file|fp8|mooncake]
        [backend flags, e.g. --hidden-states-path DIR or --mooncake-master HOST:PORT ...]
        [--target-layer-ids IDS ...] [--[no-]include-last-layer] [--trust-remote-code]
        [--dry-run] -- VLLM_SERVE_ARGS

It adds ``--speculative_config`` (method ``extract_hidden_states``, the layer ids of
:func:`launch.hs_files.resolve_layer_ids`: speculators' defaults, ascending as vLLM
captures them) and ``--kv_transfer_config`` (built by the chosen backend), sets
vLLM's ``--dtype`` to the dtype it would pick itself (:mod:`launch.vllm_dtype`; ``auto``
resolved for ``--compute-capability``), refuses the file connectors for MLA
verifiers (:mod:`launch.mla`) and replaces itself with ``python -m
vllm.entrypoints.cli.main serve``.
The backends and their flags come from ``hs_connectors`` when it is installed
(file, fp8, mooncake, exactly as the reference); without it only ``file`` exists.
Then run ``python -m launch.extract_hidden_states --backend vllm --endpoint
http://HOST:PORT/v1 ...`` (offline files) or the trainer with ``--vllm-endpoint``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import warnings
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launch.hs_files import resolve_layer_ids  # noqa: E402
from launch.mla import file_transport_refusal  # noqa: E402
from launch.vllm_backend import (  # noqa: E402
    FILE_CONNECTORS,
    file_kv_transfer_config,
    option_value,
    serve_command,
    set_option,
)
from launch.vllm_dtype import serving_dtype, target_capability  # noqa: E402


class _FileBackend:
    """The file connector, for environments without hs_connectors."""

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--hidden-states-path",
            default="/tmp/hidden_states",  # noqa: S108
            help="folder the connector writes to (default /tmp/hidden_states)",
        )

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict:
        return file_kv_transfer_config(args.hidden_states_path)


def backends() -> dict:
    try:
        from hs_connectors import HiddenStatesBackend

        registry = dict(HiddenStatesBackend.registry)
    except ImportError:
        registry = {}
    registry.setdefault("file", _FileBackend)
    return registry


def parse_args(argv=None):
    registry = backends()
    ap = argparse.ArgumentParser(
        description="Launch vLLM for hidden states extraction",
        usage="launch_vllm.py MODEL [--hidden-states-backend BACKEND] "
        "[--target-layer-ids IDS [IDS ...]] -- *VLLM_ARGS",
    )
    ap.add_argument("model", help="model name or path")
    ap.add_argument("--hidden-states-backend", choices=list(registry), default="file")
    for cls in registry.values():
        cls.add_launch_args(ap)
    ap.add_argument(
        "--target-layer-ids",
        type=int,
        nargs="+",
        help="aux layer ids, served in ascending order (default [2, N//2, N-3, N]); "
        "pass the same to the trainer",
    )
    ap.add_argument(
        "--include-last-layer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="append the last layer N to --target-layer-ids (default: yes)",
    )
    ap.add_argument(
        "--compute-capability",
        default=None,
        help="GPU class vLLM runs on, for its --dtype auto (default: this machine's GPU, else 8.0)",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    ap.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="for reading the model config (pass it after -- for vLLM too)",
    )
    args, vllm_args = ap.parse_known_args(argv)
    if "--" in vllm_args:
        vllm_args.remove("--")
    return args, vllm_args, registry


def build(argv=None) -> tuple[list[str], bool]:
    """The ``vllm serve`` command line, and whether this is a dry run."""
    args, vllm_args, registry = parse_args(argv)
    from transformers import AutoConfig

    full = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    config = getattr(full, "text_config", None) or full
    layer_ids = resolve_layer_ids(
        args.target_layer_ids, int(config.num_hidden_layers), args.include_last_layer
    )
    if args.target_layer_ids:
        warnings.warn(
            f"Using custom target layer ids {layer_ids}; pass the same "
            "--target-layer-ids to the trainer.",
            stacklevel=2,
        )
    kv = registry[args.hidden_states_backend].build_kv_transfer_config(args)
    refusal = file_transport_refusal(full, args.model)
    if refusal and kv.get("kv_connector") in FILE_CONNECTORS:
        raise ValueError(refusal)
    capability = target_capability(args.compute_capability)
    dtype = serving_dtype(
        option_value(vllm_args, "--dtype") or "auto", full, args.model, capability
    )
    vllm_args = set_option(vllm_args, "--dtype", dtype)
    return serve_command(args.model, layer_ids, kv, vllm_args), args.dry_run


def main(argv=None) -> int:
    try:
        cmd, dry = build(argv)
    except ValueError as e:
        print(f"launch_vllm: error: {e}", file=sys.stderr)
        return 2
    print("Running command:\n" + shlex.join(cmd), flush=True)
    if not dry:
        os.execvp(cmd[0], cmd)  # noqa: S606
    return 0


if __name__ == "__main__":
    sys.exit(main())
