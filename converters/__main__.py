"""``python -m converters export|import|check`` (see each module for details).

Exit status: 0 on success, 1 when the check fails or the input is unusable (the
message names the file, field or tensor), 2 on bad arguments. Errors are one line;
``--debug`` or ``DSPARK_DEBUG=1`` shows the traceback (:mod:`dspark_jax.cli`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _step(text: str) -> int | str:
    return text if text in ("latest", "best") else int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m converters", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("export", help="Orbax checkpoint -> speculators/vLLM folder")
    e.add_argument("checkpoint", help="Orbax CheckpointManager directory")
    e.add_argument("out", help="output folder (config.json + model.safetensors)")
    e.add_argument("--step", type=_step, default="latest", help="N, latest (default) or best")
    e.add_argument("--best-metric", default="loss", help="meta['metrics'] key for --step best")
    e.add_argument("--best-mode", choices=("min", "max"), default="min")
    e.add_argument(
        "--dtype",
        choices=("bfloat16", "float32", "float16"),
        default="bfloat16",
        help="float dtype of the saved tensors (default bfloat16)",
    )
    e.add_argument(
        "--verifier-name",
        help="verifier name_or_path recorded in config.json (default: the checkpoint config's)",
    )
    e.add_argument("--verifier-architectures", nargs="+", help="recorded in config.json")
    e.add_argument(
        "--verifier-path",
        help="local verifier folder (lm_head rows for a reduced "
        "draft vocab; default: the recorded verifier when it is a local folder)",
    )
    e.add_argument("--d2t", help="d2t .npy (default: d2t-<Vd>.npy in the checkpoint root)")
    e.add_argument("--t2d", help="t2d .npy (default: t2d-<Vd>.npy in the checkpoint root)")
    e.add_argument(
        "--target",
        choices=("vllm", "speculators", "sglang-jax", "llama.cpp"),
        default="vllm",
        help="what the folder must load in (default vllm; speculators allows "
        "gated/rnn heads and non-causal sliding layers; sglang-jax writes its flat "
        "qwen3 config.json layout; llama.cpp adds draft.gguf, written by llama.cpp's "
        "converter: needs --verifier-path)",
    )
    e.add_argument(
        "--gguf-outtype",
        choices=("f32", "f16", "bf16"),
        default="f32",
        help="--target llama.cpp: the draft GGUF's float type (default f32: llama.cpp "
        "rounds activations to the weight type before each matmul)",
    )
    e.add_argument("--overwrite", action="store_true")
    _add_serving_export_args(e)

    i = sub.add_parser("import", help="speculators DSpark/DFlash folder -> Orbax checkpoint")
    i.add_argument("source", help="speculators folder (config.json + safetensors)")
    i.add_argument("checkpoint", help="Orbax CheckpointManager directory to write")
    i.add_argument("--step", type=int, default=0)
    i.add_argument("--verifier-path", help="local verifier folder: check lm_head against it")
    i.add_argument("--overwrite", action="store_true", help="replace an existing step")
    w = i.add_argument_group("DFlash warm start (heads freshly initialised)")
    w.add_argument("--markov-rank", type=int, default=256)
    w.add_argument("--markov-head-type", choices=("vanilla", "gated", "rnn"), default="vanilla")
    w.add_argument("--no-confidence-head", action="store_true")
    w.add_argument("--confidence-head-with-markov", type=_bool, default=True)
    w.add_argument(
        "--sample-from-anchor", type=_bool, default=None, help="default: the DFlash folder's value"
    )
    w.add_argument("--seed", type=int, default=0)

    c = sub.add_parser("check", help="validate a folder against vLLM's dspark loader")
    c.add_argument("folder")
    c.add_argument(
        "--target", choices=("vllm", "speculators", "sglang-jax", "llama.cpp"), default="vllm"
    )
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_serving_check_args(c)
    return p


def _add_serving_export_args(e: argparse.ArgumentParser) -> None:
    e.add_argument(
        "--calibration",
        help="calibration.json of python -m dspark_jax.eval: its global temperature is "
        "folded into the confidence head (vLLM reads none)",
    )
    e.add_argument(
        "--eval-dir",
        help="output folder of python -m dspark_jax.eval: its acceptance table goes into "
        "the model card README.md",
    )


def _add_serving_check_args(c: argparse.ArgumentParser) -> None:
    c.add_argument(
        "--verifier",
        help="verifier folder or config.json (vocabulary, hidden size, layer count) "
        "for the vLLM rules that depend on it",
    )
    c.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="the verifier's tensor-parallel size the drafter is split over (default 1)",
    )


def _warm_start(args):
    from dspark_jax.convert.importer import WarmStart

    return WarmStart(
        markov_rank=args.markov_rank,
        markov_head_type=args.markov_head_type,
        enable_confidence_head=not args.no_confidence_head,
        confidence_head_with_markov=args.confidence_head_with_markov,
        sample_from_anchor=args.sample_from_anchor,
        seed=args.seed,
    )


def _llamacpp_gguf(args):
    """``<out>/draft.gguf`` by llama.cpp's converter (launch/llamacpp_gguf.py, the PyTorch
    side, in a subprocess); None when it failed (its message printed)."""
    import subprocess
    from pathlib import Path

    from dspark_jax.convert.llamacpp_rules import DRAFT_GGUF

    out = Path(args.out) / DRAFT_GGUF
    cmd = [sys.executable, "-m", "launch.llamacpp_gguf", "--verifier", args.verifier_path,
           "--drafter", args.out, "--out", str(out), "--outtype", args.gguf_outtype]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parents[1])
    if done.returncode:
        err = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
        print(f"export failed: {args.out}: the draft GGUF: "
              f"{(err or done.stderr.splitlines() or ['?'])[-1]}", file=sys.stderr)  # fmt: skip
        return None
    return out


def main(argv: list[str] | None = None) -> int:
    from dspark_jax.cli import guarded

    return guarded(_main, argv)


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax's per-restore INFO lines
    if args.command == "check":
        from dspark_jax.convert.check import check_folder

        try:
            report = check_folder(
                args.folder,
                target=args.target,
                verifier=args.verifier,
                tensor_parallel_size=args.tensor_parallel_size,
            )
        except ValueError as e:  # a bad --verifier or --tensor-parallel-size
            print(f"check failed: {e}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(report.as_dict(), indent=2))
        else:
            print(report.format())
        return 0 if report.ok else 1

    from dspark_jax.checkpoint.orbax_io import CheckpointError
    from dspark_jax.cli import reraise_if_debug
    from dspark_jax.convert.check import CheckError
    from dspark_jax.data.vocab import VocabError

    try:
        if args.command == "export":
            from dspark_jax.convert.export import ExportError, export_checkpoint

            if args.target == "llama.cpp" and not args.verifier_path:
                print("export failed: --target llama.cpp needs --verifier-path (the "
                      "verifier's HF folder: the draft GGUF takes its tokenizer)", file=sys.stderr)  # fmt: skip
                return 2
            if args.target == "sglang-jax":
                from dspark_jax.convert.sglang_jax_export import export_sglang_jax

                export_checkpoint = export_sglang_jax  # noqa: F811  (same arguments)
            try:
                report, step = export_checkpoint(
                    args.checkpoint,
                    args.out,
                    step=args.step,
                    best_metric=args.best_metric,
                    best_mode=args.best_mode,
                    d2t_path=args.d2t,
                    t2d_path=args.t2d,
                    dtype=args.dtype,
                    verifier_name_or_path=args.verifier_name,
                    verifier_architectures=args.verifier_architectures,
                    verifier_path=args.verifier_path,
                    target=args.target,
                    overwrite=args.overwrite,
                    calibration=args.calibration,
                    eval_dir=args.eval_dir,
                )
            except ExportError as e:
                reraise_if_debug()
                print(f"export failed: {e}", file=sys.stderr)
                return 1
            if args.target == "llama.cpp":
                gguf = _llamacpp_gguf(args)
                if gguf is None:
                    return 1
            print(f"exported step {step} of {args.checkpoint}\n{report.format()}")
            return 0
        from dspark_jax.convert.importer import ImportFolderError, import_folder

        try:
            result = import_folder(
                args.source,
                args.checkpoint,
                step=args.step,
                warm_start=_warm_start(args),
                verifier_path=args.verifier_path,
                overwrite=args.overwrite,
            )
        except ImportFolderError as e:
            reraise_if_debug()
            print(f"import failed: {e}", file=sys.stderr)
            return 1
        print(
            f"imported {result.kind} folder {args.source} -> {result.step_dir}"
            + (
                f" (vocab maps {', '.join(map(str, result.vocab_maps))})"
                if result.vocab_maps
                else ""
            )
        )
        return 0
    except CheckError as e:
        reraise_if_debug()
        print(
            f"{args.command} refused: the folder fails the {e.report.target} check\n{e}",
            file=sys.stderr,
        )
        return 1
    except (CheckpointError, VocabError, FileNotFoundError) as e:
        reraise_if_debug()
        print(f"{args.command} failed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
