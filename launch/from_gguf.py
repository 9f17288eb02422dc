"""A GGUF file -> an HF verifier folder (what llama.cpp users have -> what we train for).

    python -m launch.from_gguf --gguf SmolLM2-135M-Instruct.Q4_1.gguf --output runs/smollm2/verifier

transformers reads the GGUF (``gguf_file=``: its config, tokenizer and chat template, the
tensors dequantized; needs the ``gguf`` and ``accelerate`` packages of the ``extract``
extra) but refuses to save a GGUF-loaded model, so the model is rebuilt plainly from its
config (no ``quantization_config``), the dequantized state dict loaded strictly (every
tensor present, none left over; tied embeddings stay tied) and saved as safetensors in
``--dtype`` (bfloat16 by default) with the tokenizer. The tokenizer's BOS rule is checked
against the GGUF's own (``tokenizer.ggml.add_bos_token``): some GGUF tokenizers lose it
through transformers (Gemma's), which makes the model's output garbage; it is restored.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

log = logging.getLogger("launch.from_gguf")
DTYPES = ("bfloat16", "float16", "float32")


class GGUFImportError(ValueError):
    """The GGUF cannot be turned into an HF folder (the message names the file)."""


def gguf_metadata(path: Path) -> dict:
    """The GGUF's key-value metadata (scalars and strings) that the import checks."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    out = {}
    for name in ("general.architecture", "tokenizer.ggml.add_bos_token",
                 "tokenizer.ggml.bos_token_id", "tokenizer.chat_template"):  # fmt: skip
        field = reader.get_field(name)
        if field is not None:
            out[name] = field.contents()
    return out


def convert(gguf: Path, output: Path, dtype: str = "bfloat16") -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not gguf.is_file():
        raise GGUFImportError(f"--gguf {gguf}: no such file")
    if output.exists() and any(output.iterdir()):
        raise GGUFImportError(f"--output {output}: exists and is not empty")
    meta = gguf_metadata(gguf)
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, low_cpu_mem_usage=True
    )
    state = loaded.state_dict()
    del loaded
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = dtype
    torch_dtype = getattr(torch, dtype)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise GGUFImportError(
            f"{gguf}: the dequantized tensors do not fit {type(plain).__name__}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    plain = plain.to(torch_dtype)

    want_bos = meta.get("tokenizer.ggml.add_bos_token")
    probe = tokenizer("a")["input_ids"]
    has_bos = bool(probe) and probe[0] == tokenizer.bos_token_id
    if want_bos is not None and bool(want_bos) != has_bos and tokenizer.bos_token_id is not None:
        log.warning("%s: the GGUF's add_bos_token is %s, transformers' tokenizer %s: restored",
                    gguf, bool(want_bos), has_bos)  # fmt: skip
        tokenizer.add_bos_token = bool(want_bos)
        if (tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]) != bool(want_bos):
            raise GGUFImportError(f"{gguf}: cannot restore the tokenizer's BOS rule")
    if not getattr(tokenizer, "chat_template", None) and meta.get("tokenizer.chat_template"):
        tokenizer.chat_template = meta["tokenizer.chat_template"]

    from dspark_jax import file_mode

    output.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(output, safe_serialization=True)
    tokenizer.save_pretrained(output)
    for f in output.iterdir():  # safetensors writes 0600: the umask's modes, as every export
        file_mode.share(f)
    log.info("%s -> %s (%s, %s, %d tensors)", gguf, output, config.model_type, dtype, len(state))
    return output


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.from_gguf", description=__doc__)
    p.add_argument("--gguf", required=True, help="the .gguf file")
    p.add_argument("--output", required=True, help="the HF folder to write (new or empty)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        convert(Path(args.gguf), Path(args.output), args.dtype)
    except (GGUFImportError, ValueError, OSError) as e:
        # ValueError/OSError: transformers' or gguf's refusal of a corrupt or unknown file
        print(f"error: {args.gguf}: {e}" if not isinstance(e, GGUFImportError) else f"error: {e}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
