"""The in-step verifier's forward alone, tokens/s: ours (jit, this machine's JAX backend)
against HF transformers (torch, eager attention) on the same random weights, one row.

    python bench/verifier_forward.py --model configs/demo/verifier --tokens 1024
    python bench/verifier_forward.py --qwen3-shape 0.5b --tokens 2048

``--qwen3-shape 0.5b`` builds a random Qwen3-0.6B-shaped model (hidden 1024, 28 layers,
16 x 8 heads of 128, intermediate 3072, vocab 151936) in a temporary folder. Both sides
run fp32 (the CPU's fast path), capture the same layer ids (2, N/2, N-3, N), one document
of ``--tokens`` tokens; the best of ``--repeat`` timed runs after one warm-up (compile).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.verifier import hidden_states, load_params, load_verifier_config

SHAPES = {
    "0.5b": dict(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
}  # fmt: skip


def _hf_model(folder, shape: str | None):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if shape is None:
        return AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    cfg = AutoConfig.for_model("qwen3", **SHAPES[shape])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    model.save_pretrained(folder)
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--qwen3-shape", choices=list(SHAPES), default=None)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch.set_num_threads (1 on a loaded machine: waiting threads spin)",
    )
    args = ap.parse_args()
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or tmp
        model = _hf_model(folder, args.qwen3_shape)
        cfg = load_verifier_config(folder)
        n = cfg.num_hidden_layers
        layer_ids = tuple(sorted({2, n // 2, n - 3, n}))
        params = load_params(folder, cfg, dtype=jnp.float32)
        ids = np.random.default_rng(0).integers(0, cfg.vocab_size, args.tokens).astype(np.int32)
        pos = np.arange(args.tokens, dtype=np.int32)
        doc = np.zeros(args.tokens, np.int32)
        f = jax.jit(lambda p, a, b, c: hidden_states(p, cfg, a, b, c, layer_ids))
        t0 = time.perf_counter()
        f(params, ids, pos, doc).block_until_ready()
        compile_s = time.perf_counter() - t0
        ours = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            f(params, ids, pos, doc).block_until_ready()
            ours.append(time.perf_counter() - t0)
        layers = model.model.layers
        theirs = []
        with torch.inference_mode():
            x = torch.as_tensor(ids, dtype=torch.long)[None]
            for i in range(args.repeat + 1):
                store = {}
                hook = layers[n - 1].register_forward_hook(lambda _m, _a, o: store.setdefault(0, o))
                t0 = time.perf_counter()
                model.model(input_ids=x, use_cache=False)
                if i:
                    theirs.append(time.perf_counter() - t0)
                hook.remove()
        print(
            json.dumps(
                {
                    "model": args.model or f"qwen3-{args.qwen3_shape}",
                    "tokens": args.tokens,
                    "backend": jax.default_backend(),
                    "ours_tok_s": args.tokens / min(ours),
                    "hf_tok_s": args.tokens / min(theirs),
                    "ratio": min(theirs) / min(ours),
                    "ours_compile_s": compile_s,
                    "torch_threads": torch.get_num_threads(),
                }
            )
        )


if __name__ == "__main__":
    main()
