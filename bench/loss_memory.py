"""Compile-only memory of one DSpark loss + gradient at the Kimi-K3 loss shape.

Q = 1024 anchors x B 8 = 8192 slots, H = 7168, Vd = 163840, Markov rank 256, bf16
hidden states and heads, loss ``{"ce":0.1,"tv":0.9}`` + confidence BCE. Inputs are
``jax.ShapeDtypeStruct``s, so nothing is allocated: the program is lowered and
compiled for the default backend and ``memory_analysis()`` is read. One fp32 [Q, Vd]
array is 5.4 GB; the naive version (full logits) holds several.

Gradients are taken w.r.t. draft hidden, Markov feature, Markov W2 and confidence
logits; the draft lm_head is frozen (docs/math.md, "The draft forward") and passed through
stop_gradient, except in the ``chunked+lm_head_grad`` row, which shows the cost of training it.

On the CPU backend XLA upcasts the bf16 operands of the backward matmul to fp32, so
every row there includes an fp32 copy of one [H, Vd] head (4.38 GiB) that the program
itself does not ask for (its StableHLO keeps that matmul in bf16); on GPU/TPU the
chunked floor is lower by that much. The slope between chunk sizes (~4 fp32 [C, Vd]
arrays live at the peak) is backend independent.

    python bench/loss_memory.py [--chunks 256 1024 2048] [--no-naive] [--no-lm-head-grad]

Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from dspark_jax.losses import dspark_loss, parse_loss_fn, per_position_values

ANCHORS, BLOCK, HIDDEN, VOCAB, RANK = 1024, 8, 7168, 163840, 256
SLOTS = ANCHORS * BLOCK
LOSS_FN = '{"ce":0.1,"tv":0.9}'


def naive_values(h, lm_head, th, verifier_head, feat, w2, *, terms):
    """The same per-slot values from full fp32 [Q, Vd] logits (no chunking)."""
    f32 = jnp.float32
    z = jnp.dot(h, lm_head, preferred_element_type=f32) + jnp.dot(
        feat, w2, preferred_element_type=f32
    )
    t = jax.lax.stop_gradient(jnp.dot(th, verifier_head, preferred_element_type=f32))
    logq, logp = jax.nn.log_softmax(z), jax.nn.log_softmax(t)
    labels = jnp.argmax(t, axis=-1)
    overlap = jnp.minimum(jnp.exp(logq), jnp.exp(logp)).sum(-1)
    out = {}
    if "ce" in terms:
        out["ce"] = -jnp.take_along_axis(logq, labels[:, None], axis=-1)[:, 0]
    if "tv" in terms:
        out["tv"] = 1.0 - overlap
    out["accept"] = jax.lax.stop_gradient(overlap)
    out["pred_ids"] = jnp.argmax(z, axis=-1).astype(jnp.int32)
    out["target_ids"] = labels.astype(jnp.int32)
    return out


def make_loss(impl: str, chunk: int | None, train_lm_head: bool):
    weights = parse_loss_fn(LOSS_FN)

    def loss(h, feat, w2, conf, lm_head, th, verifier_head, mask):
        if not train_lm_head:
            lm_head = jax.lax.stop_gradient(lm_head)
        if impl == "naive":
            vals = naive_values(h, lm_head, th, verifier_head, feat, w2, terms=tuple(weights))
        else:
            vals = per_position_values(
                h, lm_head, th, verifier_head, feat, w2, terms=tuple(weights), chunk_size=chunk
            )
        return dspark_loss(vals, conf, mask, block_size=BLOCK, loss_weights=weights)

    argnums = (0, 1, 2, 3, 4) if train_lm_head else (0, 1, 2, 3)
    return jax.value_and_grad(loss, argnums=argnums, has_aux=True)


def measure(impl: str, chunk: int | None, train_lm_head: bool = False) -> dict:
    bf16, S = jnp.bfloat16, jax.ShapeDtypeStruct
    args = (
        S((SLOTS, HIDDEN), bf16),  # draft hidden
        S((SLOTS, RANK), bf16),  # Markov feature
        S((RANK, VOCAB), bf16),  # Markov W2
        S((SLOTS,), jnp.float32),  # confidence logits
        S((HIDDEN, VOCAB), bf16),  # draft lm_head
        S((SLOTS, HIDDEN), bf16),  # verifier last hidden (normed)
        S((HIDDEN, VOCAB), bf16),  # verifier head
        S((SLOTS,), jnp.int32),  # loss mask
    )
    start = time.perf_counter()
    compiled = jax.jit(make_loss(impl, chunk, train_lm_head)).lower(*args).compile()
    mem = compiled.memory_analysis()
    return {
        "bench": "loss_memory",
        "impl": impl + ("+lm_head_grad" if train_lm_head else ""),
        "chunk": chunk,
        "temp_bytes": mem.temp_size_in_bytes,
        "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "temp_gib": round(mem.temp_size_in_bytes / 2**30, 2),
        "backend": jax.default_backend(),
        "compile_s": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--no-naive", action="store_true")
    parser.add_argument("--no-lm-head-grad", action="store_true")
    args = parser.parse_args()
    for chunk in args.chunks:
        print(json.dumps(measure("chunked", chunk)), flush=True)
    if not args.no_lm_head_grad:
        print(json.dumps(measure("chunked", 1024, train_lm_head=True)), flush=True)
    if not args.no_naive:
        print(json.dumps(measure("naive", None)), flush=True)


if __name__ == "__main__":
    main()
