"""GGUF files for llama.cpp's server, written by llama.cpp's own converter.

    python -m launch.llamacpp_gguf --verifier configs/demo/verifier --out verifier.gguf
    python -m launch.llamacpp_gguf --verifier configs/demo/verifier --drafter runs/demo/export \\
        --out runs/demo/export/draft.gguf

Runs ``convert_hf_to_gguf.py`` (and its ``gguf-py``) from the pinned llama.cpp source
distribution (``launch/engines/build_llama_server.sh --source`` unpacks it; ``--llama-cpp``
or ``DSPARK_LLAMACPP_SRC`` names another tree) in this process, on a verifier's HF folder,
or on a speculators DSpark folder with ``--target-model-dir`` the verifier (the draft GGUF
takes the verifier's tokenizer). ``python -m converters export --target llama.cpp`` calls
this for the drafter.

The converter knows byte-level BPE tokenizers by a hash of how they split a test text and
refuses others ("BPE pre-tokenizer was not recognized"). ``--pre-tokenizer NAME`` names one
of llama.cpp's pre-tokenizers (``src/llama-vocab.cpp``) for such a tokenizer; by default a
tokenizer.json whose pre-tokenizer is plain ``ByteLevel`` with GPT-2's split regex (the
demo verifier's) is named ``gpt-2``, and any other unknown one is refused as before.
Needs torch, transformers, numpy, sentencepiece and PyYAML (the ``extract`` extra).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = ROOT / "launch/engines/build_llama_server.sh"
OUTTYPES = ("f32", "f16", "bf16")

log = logging.getLogger("launch.llamacpp_gguf")


class GGUFError(RuntimeError):
    """The conversion failed (the message says where)."""


def llama_cpp_source(path: str | None = None) -> Path:
    """The llama.cpp tree: ``path``, ``$DSPARK_LLAMACPP_SRC``, or the pinned sdist unpacked
    by the build script (cached; one download the first time)."""
    path = path or os.environ.get("DSPARK_LLAMACPP_SRC")
    if not path:
        out = subprocess.run(
            ["bash", str(BUILD_SCRIPT), "--source"], check=True, capture_output=True, text=True
        )
        path = out.stdout.strip().splitlines()[-1]
    src = Path(path)
    if not (src / "convert_hf_to_gguf.py").is_file():
        raise GGUFError(f"{src}: no convert_hf_to_gguf.py (not a llama.cpp tree)")
    return src


def default_pre_tokenizer(verifier: Path) -> str | None:
    """``gpt-2`` for a tokenizer.json whose pre-tokenizer is plain ByteLevel with GPT-2's
    regex (what the hash check would find if it knew the vocabulary); else None."""
    path = verifier / "tokenizer.json"
    if not path.is_file():
        return None
    pre = json.loads(path.read_text()).get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        if not pre.get("add_prefix_space", False):
            return "gpt-2"
    return None


def convert(
    model: Path,
    out: Path,
    *,
    outtype: str = "f32",
    target_model_dir: Path | None = None,
    pre_tokenizer: str | None = None,
    llama_cpp: str | None = None,
) -> Path:
    """``convert_hf_to_gguf.py model --outfile out --outtype T [--target-model-dir V]``,
    in this process, with ``pre_tokenizer`` for a tokenizer it does not recognise."""
    src = llama_cpp_source(llama_cpp)
    for p in (str(src / "gguf-py"), str(src)):
        if p not in sys.path:
            sys.path.insert(0, p)
    import convert_hf_to_gguf  # noqa: PLC0415  (from the llama.cpp tree above)
    from conversion.base import TextModel  # noqa: PLC0415

    original = TextModel.get_vocab_base_pre
    if pre_tokenizer is not None and not getattr(original, "_dspark_named", False):

        def named(self, tokenizer) -> str:
            try:
                return original(self, tokenizer)
            except NotImplementedError:
                log.info("tokenizer not in llama.cpp's hash list: pre-tokenizer %r", pre_tokenizer)
                return pre_tokenizer

        named._dspark_named = True
        TextModel.get_vocab_base_pre = named
    argv = [str(model), "--outfile", str(out), "--outtype", outtype]
    if target_model_dir is not None:
        argv += ["--target-model-dir", str(target_model_dir)]
    saved = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    try:
        convert_hf_to_gguf.main()
    except SystemExit as e:
        if e.code:
            raise GGUFError(f"convert_hf_to_gguf.py {' '.join(argv)}: exit {e.code}") from None
    except NotImplementedError as e:
        raise GGUFError(
            f"{target_model_dir or model}: {e} (name one of llama.cpp's pre-tokenizers with "
            "--pre-tokenizer)"
        ) from None
    finally:
        sys.argv = saved
        TextModel.get_vocab_base_pre = original
    if not out.is_file():
        raise GGUFError(f"convert_hf_to_gguf.py wrote no {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.llamacpp_gguf", description=__doc__)
    p.add_argument("--verifier", required=True, help="the verifier's HF folder")
    p.add_argument("--drafter", help="a speculators DSpark folder (omit: the verifier's GGUF)")
    p.add_argument("--out", required=True, help="the .gguf file to write")
    p.add_argument("--outtype", choices=OUTTYPES, default="f32")
    p.add_argument("--pre-tokenizer", help="llama.cpp pre-tokenizer name for an unknown hash")
    p.add_argument("--llama-cpp", help="llama.cpp source tree (default: the pinned sdist)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    verifier = Path(args.verifier)
    if not (verifier / "config.json").is_file():
        print(f"error: --verifier {verifier}: no config.json", file=sys.stderr)
        return 1
    if args.drafter and not (Path(args.drafter) / "config.json").is_file():
        print(f"error: --drafter {args.drafter}: no config.json", file=sys.stderr)
        return 1
    pre = args.pre_tokenizer or default_pre_tokenizer(verifier)
    try:
        if args.drafter:
            convert(Path(args.drafter), Path(args.out), outtype=args.outtype,
                    target_model_dir=verifier, pre_tokenizer=pre, llama_cpp=args.llama_cpp)  # fmt: skip
        else:
            convert(verifier, Path(args.out), outtype=args.outtype, pre_tokenizer=pre,
                    llama_cpp=args.llama_cpp)  # fmt: skip
    except (GGUFError, subprocess.CalledProcessError, ValueError, OSError) as e:
        # ValueError: the converter's own refusals (an unsupported Markov head, a bad d2t)
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
