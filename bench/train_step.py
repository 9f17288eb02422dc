"""One optimizer step of the DSpark drafter: ours (JAX) against speculators 0.9.0 (PyTorch).

Both sides build the same drafter (same DSparkConfig, the same weights: every tensor
is drawn from a seed derived from its speculators key), get the same synthetic packed
row and the same anchors, and run what their trainer runs per step:

* ``jax``: ``row_loss`` (via ``jax.vmap`` over the rows, as ``batch_loss`` does) ->
  ``value_and_grad`` -> ``dspark_jax.optim.build_optimizer`` (clip 1.0, torch-exact
  Muon + AdamW, cosine schedule) -> apply, in one ``jax.jit`` with the state donated,
  bf16 compute on fp32 parameters, frozen verifier tensors in bf16.
* ``reference``: ``DSparkDraftModel.forward`` under ``torch.autocast(bf16)`` with eager
  attention (the dense float [Q, S+Q] mask) and the eager losses (full [Q, V] logits),
  then ``backward``, ``clip_grad_norm_(1.0)``, Muon + AdamW + LambdaLR schedulers built by
  the reference trainer's own ``Trainer.setup_optimizer`` -- the order of
  ``Trainer.train_epoch``. Flex attention and the fused Triton losses need a GPU.

Same loss flags on both sides: ``--loss-fn '{"ce":0.1,"tv":0.9}'``, gamma 4, confidence
head (with Markov features, alpha 1), vanilla Markov head, ``--optimizer muon --lr 1e-4
--scheduler-type cosine --scheduler-warmup-ratio 0.03``; one packed row per step (one
data-parallel rank's work), no gradient checkpointing unless ``--remat``.

    python bench/train_step.py --impl jax|reference|both --preset tiny|small|k3-shape \
        [--steps 5] [--warmup 2] [--seq S] [--anchors A] [--repeat N] [--remat] \
        [--compile-only] [--components] [--profile] [--peak-tflops F]

``--impl both`` runs each implementation in its own subprocess (so peak RSS is not
shared), ``--repeat`` times interleaved, and ends with a ``comparison`` line (medians
of the per-run ratios). ``k3-shape`` on a CPU backend is compile-only for JAX
(``memory_analysis()`` of the step lowered from ``ShapeDtypeStruct``s: nothing is
allocated) and analytic for the reference; on a GPU it runs. ``--components`` times the
JAX step's parts separately (attention fwd/bwd, the vocab-chunked loss fwd/bwd, the
optimizer update); ``--profile`` aggregates a profiler trace of two steps by op
(JAX: XLA ops attributed to their source lines; reference: torch.profiler).

Prints one JSON line per measurement. Benchmarks, not tests: nothing is asserted.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np

from dspark_jax.config import DSparkConfig  # plain Python: no JAX import here

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for launch/
from launch.speculators_config import reference_config  # noqa: E402  (no JAX import either)

LOSS_FN = '{"ce":0.1,"tv":0.9}'
GAMMA, CONF_ALPHA = 4.0, 1.0
OPTIM = dict(lr=1e-4, warmup_ratio=0.03, total_steps=1000)  # the seed run's flags
BF16 = ml_dtypes.bfloat16

# Shared by every preset: Kimi-K3's drafter layout (5 aux layers, block 8, all layers
# sliding), DSpark heads on.
COMMON = dict(
    block_size=8,
    aux_hidden_state_layer_ids=(24, 48, 72, 88, 92),
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    markov_head_type="vanilla",
    enable_confidence_head=True,
    confidence_head_with_markov=True,
    sample_from_anchor=True,
)
PRESETS = {
    # name: (decoder geometry, S = total seq len, A = max anchors)
    "tiny": (
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=2,
            vocab_size=1024,
            sliding_window=64,
            markov_rank=16,
        ),
        256,
        16,
    ),
    "small": (
        dict(
            hidden_size=512,
            intermediate_size=1024,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            num_hidden_layers=2,
            vocab_size=16384,
            sliding_window=512,
            markov_rank=64,
        ),
        2048,
        128,
    ),
    "k3-shape": (  # docs/seed_run.md
        dict(
            hidden_size=7168,
            intermediate_size=14336,
            num_attention_heads=96,
            num_key_value_heads=16,
            head_dim=64,
            num_hidden_layers=5,
            vocab_size=163840,
            sliding_window=2048,
            markov_rank=256,
        ),
        8192,
        1024,
    ),
}
# Dense bf16 tensor-core peaks (vendor spec sheets, no sparsity), FLOP/s.
PEAK_BF16 = {
    "H200": 989.4e12,
    "H100": 989.4e12,
    "H800": 989.4e12,
    "H20": 148e12,
    "B200": 2250e12,
    "B300": 2250e12,
    "GB200": 2500e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
}


def preset_config(name: str) -> tuple[DSparkConfig, int, int]:
    geometry, seq, anchors = PRESETS[name]
    layers = geometry["num_hidden_layers"]
    cfg = DSparkConfig(
        **geometry,
        **COMMON,
        layer_types=("sliding_attention",) * layers,
        mask_token_id=geometry["vocab_size"] - 3,
    )
    return cfg, seq, anchors


# ------------------------------------------------------------------------------ inputs


def synthetic_row(cfg: DSparkConfig, seq: int, seed: int) -> dict[str, np.ndarray]:
    """A packed row: documents of random length (first fifth of each is prompt, loss
    mask 0), ~3% padding at the end, bf16 hidden states ~ N(0, 1)."""
    rng = np.random.default_rng(seed)
    used = int(seq * 0.97)
    lengths = []
    while sum(lengths) < used:
        lengths.append(int(min(rng.integers(seq // 8, seq // 2 + 1), used - sum(lengths))))
    pos = np.zeros(seq, np.int32)
    doc = np.full(seq, -1, np.int32)
    mask = np.zeros(seq, np.int32)
    start = 0
    for i, n in enumerate(lengths):
        pos[start : start + n] = np.arange(n)
        doc[start : start + n] = i
        mask[start + n // 5 : start + n] = 1
        start += n
    h, n_aux = cfg.verifier_hidden_size, cfg.num_aux_layers
    return {
        "hidden_states": rng.standard_normal((seq, n_aux * h), np.float32).astype(BF16),
        "verifier_last_hidden_states": rng.standard_normal((seq, h), np.float32).astype(BF16),
        "input_ids": rng.integers(0, cfg.vocab_size - 4, seq).astype(np.int32),
        "loss_mask": mask,
        "position_ids": pos,
        "document_ids": doc,
    }


def pick_anchors(loss_mask: np.ndarray, num: int, block: int, seed: int):
    """speculators' select_anchors rule: loss_mask[p] == 1 and p < S - B, min(A, #valid)
    drawn without replacement, sorted; the rest p = 0, invalid."""
    ok = np.flatnonzero(loss_mask[:-block] == 1)
    take = min(num, ok.size)
    chosen = np.sort(np.random.default_rng(seed).choice(ok, take, replace=False))
    anchors = np.zeros(num, np.int32)
    anchors[:take] = chosen
    return anchors, np.arange(num) < take


def init_tensor(key: str, shape: tuple[int, ...], cfg: DSparkConfig) -> np.ndarray:
    """Deterministic fp32 initial value of speculators tensor ``key`` (torch layout)."""
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    if key.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    if key.endswith(".bias"):
        return np.zeros(shape, np.float32)
    if key.endswith("markov_w2.weight"):
        bound = cfg.markov_rank**-0.5
        return rng.uniform(-bound, bound, shape).astype(np.float32)
    std = 0.01 if key.endswith("markov_w1.weight") else 0.02
    return (std * rng.standard_normal(shape, np.float32)).astype(np.float32)


def frozen_tensors(cfg: DSparkConfig) -> dict[str, np.ndarray]:
    """The verifier tensors, bf16 values (as stored in a verifier checkpoint), torch layout."""
    h = cfg.hidden_size
    rng = np.random.default_rng(1234)
    head = (0.02 * rng.standard_normal((cfg.draft_vocab_size, h), np.float32)).astype(BF16)
    return {
        "embed_tokens.weight": (0.02 * rng.standard_normal((cfg.vocab_size, h), np.float32)).astype(
            BF16
        ),
        "lm_head.weight": head,  # draft vocab = verifier vocab: the same head
        "verifier_norm.weight": np.ones(cfg.verifier_hidden_size, BF16),
    }


# ------------------------------------------------------------------------------ analytics


def visible_pairs(cfg: DSparkConfig, row, anchors, valid) -> list[int]:
    """Per layer: (query, key) pairs the attention mask lets through (context + block)."""
    doc = row["document_ids"]
    starts = np.zeros_like(doc)
    for i in range(1, doc.size):
        starts[i] = starts[i - 1] if doc[i] == doc[i - 1] else i
    b = cfg.block_size
    out = []
    for layer in range(cfg.num_hidden_layers):
        w = cfg.layer_sliding_window(layer)
        p = anchors.astype(np.int64)
        lo = starts[p] if w is None else np.maximum(starts[p], p - w)
        ctx = np.where((doc[p] != -1), np.maximum(p - lo, 0), 0)  # padding anchors too
        causal = w is not None and not cfg.sliding_window_non_causal
        blk = b * (b + 1) // 2 if causal else b * b
        out.append(int(b * ctx.sum() + blk * anchors.size))
    return out


def model_flops(cfg: DSparkConfig, seq: int, num_anchors: int, pairs: list[int], rows: int = 1):
    """Model FLOPs of one optimizer step (matmuls only, 2 per multiply-add), by term.

    Backward = 2x forward for trainable paths (dX and dW); 1x where only one side needs a
    gradient (fc: the hidden states are data; the draft lm_head: frozen, dX only); the
    target logits (verifier head, no gradient) forward only. Recomputation (remat) and
    the Newton-Schulz optimizer matmuls are not model FLOPs and not counted.
    """
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv, v, r = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.draft_vocab_size,
        cfg.markov_rank,
    )
    q = num_anchors * cfg.block_size
    fwd = {
        "fc": 2 * seq * cfg.num_aux_layers * cfg.verifier_hidden_size * h,
        "qo_proj": cfg.num_hidden_layers * 2 * 2 * q * h * nq * d,
        "kv_proj": cfg.num_hidden_layers * 2 * 2 * (seq + q) * h * nkv * d,
        "mlp": cfg.num_hidden_layers * 3 * 2 * q * h * i,
        "attention": sum(2 * 2 * nq * d * p for p in pairs),
        "draft_logits": 2 * q * h * v,
        "markov_bias": 2 * q * r * v,
        "target_logits": 2 * q * cfg.verifier_hidden_size * v,
        "confidence": 2 * q * (h + r),
    }
    bwd_factor = {"fc": 1, "draft_logits": 1, "target_logits": 0}
    total = {k: rows * f * (1 + bwd_factor.get(k, 2)) for k, f in fwd.items()}
    return sum(total.values()), total


def newton_schulz_flops(cfg: DSparkConfig, ns_steps: int = 5) -> int:
    """Muon's Newton-Schulz matmul FLOPs per step (not model FLOPs; both trainers run it on
    every data-parallel rank): per m x n matrix, m <= n, ns_steps x (4 m^2 n + 2 m^3)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    shapes = [(h, cfg.num_aux_layers * cfg.verifier_hidden_size)]
    shapes += cfg.num_hidden_layers * [
        (nq * d, h),
        (nkv * d, h),
        (nkv * d, h),
        (h, nq * d),
        (i, h),
        (i, h),
        (h, i),
    ]
    total = 0
    for a, b in shapes:
        m, n = min(a, b), max(a, b)
        total += ns_steps * (4 * m * m * n + 2 * m**3)
    return total


def reference_memory_model(cfg: DSparkConfig, seq: int, num_anchors: int) -> dict[str, float]:
    """What speculators 0.9.0 (eager attention, eager losses, autocast bf16, no gradient
    checkpointing) holds at its peak, in GiB, counted from its code; lower bounds.

    * dense masks: ``create_float_mask`` builds a bool [Q, S+Q] mask, then a bf16 float
      copy, per distinct layer type (full / sliding); both live through the step.
    * eager attention, per layer: softmax(fp32) output [Nh, Q, S+Q] kept for backward,
      plus its bf16 cast kept by the PV matmul: 6 B per score, for every layer.
    * full logits: lm_head out, Markov bias, their sum and the targets in bf16 [Q, V];
      ce's fp32 cast + log-softmax, tv's two fp32 softmaxes and their minimum: >= 4 x 2 B
      + 5 x 4 B per [Q, V] entry at the loss.
    * state: fp32 params + grads, Muon momentum, AdamW moments, fp32 frozen
      embedding + lm_head + verifier_lm_head.
    """
    gib = 2.0**-30
    q, kv = num_anchors * cfg.block_size, seq + num_anchors * cfg.block_size
    kinds = len({cfg.layer_sliding_window(i) is None for i in range(cfg.num_hidden_layers)})
    h, v, vt = cfg.hidden_size, cfg.draft_vocab_size, cfg.vocab_size
    muon, adam = trainable_counts(cfg)
    return {
        "dense_mask_gib": kinds * q * kv * 3 * gib,
        "eager_attention_gib": cfg.num_hidden_layers * cfg.num_attention_heads * q * kv * 6 * gib,
        "full_logits_gib": q * v * (4 * 2 + 5 * 4) * gib,
        "params_grads_opt_gib": (muon * 12 + adam * 16) * gib,
        "frozen_fp32_gib": (vt * h + 2 * v * h) * 4 * gib,
    }


def trainable_counts(cfg: DSparkConfig) -> tuple[int, int]:
    """(# Muon parameters, # AdamW parameters) of the drafter, by speculators' rule."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv, r = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.markov_rank
    layer = 2 * h * nq * d + 2 * h * nkv * d + 3 * h * i
    muon = cfg.num_aux_layers * cfg.verifier_hidden_size * h + cfg.num_hidden_layers * layer
    adam = (cfg.vocab_size + cfg.draft_vocab_size) * r + (h + r) + 1  # Markov, confidence
    adam += 2 * h + cfg.num_hidden_layers * (2 * h + 2 * d)  # norms
    return muon, adam


# ------------------------------------------------------------------------------ reporting


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def emit(record: dict) -> None:
    record.setdefault("loadavg", [round(x, 2) for x in os.getloadavg()])
    record.setdefault("cpus", os.cpu_count())
    record.setdefault("host", platform.node())
    print(json.dumps(record), flush=True)


def timing(times: list[float]) -> dict:
    return {
        "step_s_median": round(statistics.median(times), 4),
        "step_s_min": round(min(times), 4),
        "step_s_max": round(max(times), 4),
        "step_s_all": [round(t, 4) for t in times],
    }


def base_record(args, impl, cfg, seq, anchors, row, anc, valid) -> dict:
    pairs = visible_pairs(cfg, row, anc, valid)
    flops, _ = model_flops(cfg, seq, anchors, pairs, args.rows)
    return {
        "bench": "train_step",
        "impl": impl,
        "preset": args.preset,
        "S": seq,
        "A": anchors,
        "Q": anchors * cfg.block_size,
        "rows": args.rows,
        "remat": args.remat,
        "dtype": args.hidden_states_dtype,
        "hidden": cfg.hidden_size,
        "layers": cfg.num_hidden_layers,
        "vocab": cfg.draft_vocab_size,
        "valid_anchors": int(valid.sum()),
        "model_flops_per_step": flops,
        "optimizer_flops_per_step": newton_schulz_flops(cfg),
    }


def throughput(rec: dict, median: float, cfg: DSparkConfig, rows_tokens: int, peak: float | None):
    rec["tokens_per_s"] = round(rows_tokens / median, 1)  # packed (non-padding) tokens
    rec["draft_positions_per_s"] = round(rec["rows"] * rec["Q"] / median, 1)
    rec["achieved_tflops"] = round(rec["model_flops_per_step"] / median / 1e12, 4)
    if peak:
        rec["peak_tflops"] = peak / 1e12
        rec["mfu"] = round(rec["model_flops_per_step"] / median / peak, 4)
        # hardware FLOP utilisation counting the optimizer's Newton-Schulz matmuls too
        work = rec["model_flops_per_step"] + rec["optimizer_flops_per_step"]
        rec["fu_with_optimizer"] = round(work / median / peak, 4)


# ------------------------------------------------------------------------------ JAX


def jax_setup(args, cfg: DSparkConfig, seq: int, num_anchors: int, abstract: bool):
    """(step_fn, inputs) for the JAX step. abstract: ShapeDtypeStructs only."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from dspark_jax.model.draft import DSparkDraftModel, FrozenWeights, LossSettings, row_loss
    from dspark_jax.model.params import from_speculators, speculators_key
    from dspark_jax.optim import build_optimizer

    settings = LossSettings.from_loss_fn(
        LOSS_FN,
        num_anchors=num_anchors,
        gamma=GAMMA,
        confidence_head_alpha=CONF_ALPHA,
        vocab_chunk_tokens=args.loss_chunk,
    )
    cdt = jnp.bfloat16 if args.hidden_states_dtype == "bfloat16" else jnp.float32
    model = nnx.eval_shape(
        lambda: DSparkDraftModel(cfg, rngs=nnx.Rngs(0), dtype=cdt, remat=args.remat)
    )
    graphdef, abs_params = nnx.split(model, nnx.Param)
    tx, _ = build_optimizer(
        abs_params,
        optimizer="muon",
        lr=OPTIM["lr"],
        scheduler_type="cosine",
        total_steps=OPTIM["total_steps"],
        warmup_ratio=OPTIM["warmup_ratio"],
    )

    def step(state, frozen, batch, anchors, valid):
        def loss_fn(params):
            m = nnx.merge(graphdef, params)
            losses, _ = jax.vmap(lambda r, a, v: row_loss(m, frozen, r, a, v, settings))(
                batch, anchors, valid
            )
            return losses.mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    r, h, vd = args.rows, cfg.hidden_size, cfg.draft_vocab_size
    sds = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    if abstract:
        state = {"params": abs_params, "opt": jax.eval_shape(tx.init, abs_params)}
        frozen = FrozenWeights(
            sds((cfg.vocab_size, h), bf16),
            sds((h, vd), bf16),
            sds((h, vd), bf16),
            sds((cfg.verifier_hidden_size,), bf16),
        )
        row = synthetic_shapes(cfg, seq, cdt)
        batch = {k: sds((r, *s), d) for k, (s, d) in row.items()}
        anchors = sds((r, num_anchors), jnp.int32)
        valid = sds((r, num_anchors), jnp.bool_)
        return step, (state, frozen, batch, anchors, valid), None

    if args.init == "matched":
        tensors = {}
        for path, var in nnx.to_flat_state(abs_params):
            key, transpose = speculators_key(path)
            shape = tuple(var.shape)[::-1] if transpose else tuple(var.shape)
            tensors[key] = init_tensor(key, shape, cfg)
        params = jax.tree.map(jnp.asarray, from_speculators(tensors, abs_params))  # fp32
        del tensors
        ft = frozen_tensors(cfg)
        head = jnp.asarray(ft["lm_head.weight"].T)
        frozen = FrozenWeights(
            jnp.asarray(ft["embed_tokens.weight"]),
            head,
            head,
            jnp.asarray(ft["verifier_norm.weight"]),
        )
        del ft
    else:  # random on the device (k3-shape on a GPU: no 2.4e9-parameter host init)
        params = jax.jit(
            lambda: nnx.state(
                DSparkDraftModel(cfg, rngs=nnx.Rngs(0), dtype=cdt, remat=args.remat), nnx.Param
            )
        )()
        k1, k2 = jax.random.split(jax.random.key(1))
        head = jax.jit(lambda: (0.02 * jax.random.normal(k1, (h, vd))).astype(bf16))()
        embed = jax.jit(lambda: (0.02 * jax.random.normal(k2, (cfg.vocab_size, h))).astype(bf16))()
        frozen = FrozenWeights(embed, head, head, jnp.ones((cfg.verifier_hidden_size,), bf16))
    state = {"params": params, "opt": jax.jit(tx.init)(params)}
    rows, anc, val = host_batch(args, cfg, seq, num_anchors)
    batch = {k: jnp.asarray(np.stack([rw[k] for rw in rows])) for k in rows[0]}
    batch = {k: x.astype(cdt) if x.dtype == bf16 else x for k, x in batch.items()}
    return step, (state, frozen, batch, jnp.asarray(anc), jnp.asarray(val)), rows


def synthetic_shapes(cfg: DSparkConfig, seq: int, dtype):
    import jax.numpy as jnp

    h, n_aux = cfg.verifier_hidden_size, cfg.num_aux_layers
    return {
        "hidden_states": ((seq, n_aux * h), dtype),
        "verifier_last_hidden_states": ((seq, h), dtype),
        "input_ids": ((seq,), jnp.int32),
        "loss_mask": ((seq,), jnp.int32),
        "position_ids": ((seq,), jnp.int32),
        "document_ids": ((seq,), jnp.int32),
    }


def host_batch(args, cfg: DSparkConfig, seq: int, num_anchors: int):
    rows = [synthetic_row(cfg, seq, seed=args.seed + i) for i in range(args.rows)]
    picks = [
        pick_anchors(rw["loss_mask"], num_anchors, cfg.block_size, args.seed + i)
        for i, rw in enumerate(rows)
    ]
    return rows, np.stack([p[0] for p in picks]), np.stack([p[1] for p in picks])


def memory_record(compiled) -> dict:
    mem = compiled.memory_analysis()
    mib = 2.0**-20
    if mem is None:
        return {}
    return {
        "compiled_temp_mib": round(mem.temp_size_in_bytes * mib, 1),
        "compiled_argument_mib": round(mem.argument_size_in_bytes * mib, 1),
        "compiled_output_mib": round(mem.output_size_in_bytes * mib, 1),
        "compiled_alias_mib": round(mem.alias_size_in_bytes * mib, 1),
    }


def run_jax(args, cfg, seq, num_anchors, compile_only: bool) -> None:
    import jax

    rss0 = rss_mib()
    step, inputs, rows = jax_setup(args, cfg, seq, num_anchors, abstract=compile_only)
    jstep = jax.jit(step, donate_argnums=0)
    t0 = time.perf_counter()
    compiled = jstep.lower(*inputs).compile()
    compile_s = time.perf_counter() - t0
    rec = {
        "bench": "train_step",
        "impl": "jax",
        "preset": args.preset,
        "S": seq,
        "A": num_anchors,
        "Q": num_anchors * cfg.block_size,
        "rows": args.rows,
        "remat": args.remat,
        "dtype": args.hidden_states_dtype,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "compile_s": round(compile_s, 2),
        "loss_chunk": args.loss_chunk,
        **memory_record(compiled),
    }
    if compile_only:
        rec["mode"] = "compile-only"
        rec["reference_model_gib"] = {
            k: round(x, 2) for k, x in reference_memory_model(cfg, seq, num_anchors).items()
        }
        rec["peak_rss_mib"] = round(rss_mib(), 1)
        emit(rec)
        return
    state, frozen, batch, anchors, valid = inputs
    rec.update(
        base_record(
            args,
            "jax",
            cfg,
            seq,
            num_anchors,
            rows[0],
            np.asarray(anchors[0]),
            np.asarray(valid[0]),
        )
    )
    rec["rss_setup_mib"] = round(rss_mib(), 1)
    rec["rss_imports_mib"] = round(rss0, 1)
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        t = time.perf_counter()
        state, loss = compiled(state, frozen, batch, anchors, valid)
        losses.append(float(loss))  # blocks until the step is done
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    rec.update(timing(times))
    rec["loss_first"], rec["loss_last"] = round(losses[0], 6), round(losses[-1], 6)
    tokens = sum(int((rw["document_ids"] != -1).sum()) for rw in rows)
    throughput(rec, statistics.median(times), cfg, tokens, args.peak_flops)
    rec["peak_rss_mib"] = round(rss_mib(), 1)
    stats = jax.devices()[0].memory_stats() or {}  # None on CPU
    if "peak_bytes_in_use" in stats:
        rec["device_peak_mib"] = round(stats["peak_bytes_in_use"] / 2**20, 1)
        rec["device_limit_mib"] = round(stats.get("bytes_limit", 0) / 2**20, 1)
    emit(rec)
    if args.profile:
        emit(jax_profile(compiled, state, frozen, batch, anchors, valid, args))
    if args.components:
        jax_components(args, cfg, seq, num_anchors, rows, anchors, valid)


def jax_profile(compiled, state, frozen, batch, anchors, valid, args, steps: int = 2) -> dict:
    """Self time per XLA op over ``steps`` steps, grouped by the source line it came from."""
    import tempfile

    import jax

    where = hlo_op_sources(compiled)
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(steps):
                state, loss = compiled(state, frozen, batch, anchors, valid)
                float(loss)
        trace = next(Path(tmp).rglob("*.trace.json.gz"))
        with gzip.open(trace) as f:
            events = json.load(f)["traceEvents"]
    by_op = self_times(events)
    total = sum(by_op.values())
    by_src: dict[str, float] = {}
    by_cat: dict[str, float] = {}
    by_prim: dict[str, float] = {}
    for op, us in by_op.items():
        src, prim = where.get(op, ("?", "?"))
        by_src[src] = by_src.get(src, 0.0) + us
        by_prim[prim] = by_prim.get(prim, 0.0) + us
        cat = categorize(src)
        by_cat[cat] = by_cat.get(cat, 0.0) + us
    top = sorted(by_src.items(), key=lambda kv: -kv[1])[: args.profile_top]
    prims = sorted(by_prim.items(), key=lambda kv: -kv[1])[: args.profile_top]
    return {
        "bench": "profile",
        "impl": "jax",
        "preset": args.preset,
        "steps": steps,
        "traced_op_s_per_step": round(total / 1e6 / steps, 4),
        "by_component_pct": {
            k: round(100 * v / total, 1) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])
        },
        "top_sources": [
            {"src": s, "pct": round(100 * us / total, 1), "s_per_step": round(us / 1e6 / steps, 4)}
            for s, us in top
        ],
        # jax primitive each (fused) XLA op was emitted for (a fusion: its root's)
        "top_primitives": [
            {"op": p, "pct": round(100 * us / total, 1), "s_per_step": round(us / 1e6 / steps, 4)}
            for p, us in prims
        ],
    }


def _pb_fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) of one protobuf message, decoded by protobuf without its
    schema (jaxlib ships no HLO ``_pb2``): every field is an unknown field of ``Empty``."""
    from google.protobuf import empty_pb2
    from google.protobuf.unknown_fields import UnknownFieldSet

    msg = empty_pb2.Empty()
    msg.ParseFromString(buf)
    return [(f.field_number, f.data) for f in UnknownFieldSet(msg)]


def _short_path(file: str) -> str:
    """A source path relative to site-packages or to this repository."""
    root = str(Path(__file__).resolve().parents[1]) + "/"
    return file.split("site-packages/")[-1].removeprefix(root)


def hlo_op_sources(compiled) -> dict[str, str]:
    """HLO instruction name -> 'file:line function' of the innermost project frame.

    The compiled HLO text names each instruction's ``stack_frame_id``; the frames live in
    the module proto's ``stack_frame_index`` (HloModuleProto field 17: file_names=1,
    function_names=2, file_locations=3 {file=1, function=2, line=3}, stack_frames=4
    {location=1, parent=2}; ids are 1-based), decoded here from the wire format.
    """
    import re

    module = compiled.runtime_executable().hlo_modules()[0]
    index = [v for f, v in _pb_fields(module.as_serialized_hlo_module_proto()) if f == 17]
    files, funcs, locs, frames = [], [], [], []
    for f, v in _pb_fields(index[0]) if index else []:
        if f == 1:
            files.append(bytes(v).decode())
        elif f == 2:
            funcs.append(bytes(v).decode())
        elif f == 3:
            d = dict(_pb_fields(v))
            locs.append((d.get(1, 0), d.get(2, 0), d.get(3, 0)))
        elif f == 4:
            d = dict(_pb_fields(v))
            frames.append((d.get(1, 0), d.get(2, 0)))

    def describe(frame_id: int) -> str:
        chain = []
        while 0 < frame_id <= len(frames):
            loc, frame_id = frames[frame_id - 1]
            fi, fn, line = locs[loc - 1]
            chain.append((files[fi - 1], funcs[fn - 1] if fn else "?", line))
        for file, fn, line in chain:  # innermost frame from our package or optax
            if "dspark_jax" in file or "optax" in file:
                return f"{_short_path(file)}:{line} {fn}"
        return f"{Path(chain[0][0]).name}:{chain[0][2]} {chain[0][1]}" if chain else "?"

    out = {}
    inst = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
    for line in compiled.as_text().splitlines():
        m = inst.match(line)
        if not m:
            continue
        frame = re.search(r"stack_frame_id=(\d+)", line)
        op = re.search(r'op_name="([^"]+)"', line)
        prim = op.group(1).rsplit("/", 1)[-1] if op else "?"
        out[m.group(1)] = (describe(int(frame.group(1))) if frame else "?", prim)
    return out


def self_times(events: list[dict]) -> dict[str, float]:
    """Self duration (us) per hlo_op, on XLA executor threads (children subtracted)."""
    per_thread: dict = {}
    for e in events:
        if e.get("ph") == "X" and "hlo_op" in e.get("args", {}):
            per_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    out: dict[str, float] = {}
    for evs in per_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, op, child_time]
        for e in evs:
            while stack and stack[-1][0] <= e["ts"]:
                _, op, child, dur = stack.pop()
                out[op] = out.get(op, 0.0) + dur - child
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e["ts"] + e["dur"], e["args"]["hlo_op"], 0.0, e["dur"]])
        while stack:
            _, op, child, dur = stack.pop()
            out[op] = out.get(op, 0.0) + dur - child
    return out


def categorize(src: str) -> str:
    for key, cat in (
        ("attention.py", "attention"),
        ("losses.py", "loss (vocab chunks)"),
        ("optim/", "optimizer"),
        ("_muon", "optimizer"),
        ("optax", "optimizer"),
        ("layers.py", "decoder (proj/mlp/norm/rope)"),
        ("heads.py", "markov/conf heads"),
        ("draft.py", "drafter glue"),
        ("anchors.py", "drafter glue"),
    ):
        if key in src:
            return cat
    return "other"


def jax_components(args, cfg, seq, num_anchors, rows, anchors, valid) -> None:
    """Time the step's parts on their own (jitted, same shapes): where a step's time goes."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from dspark_jax import losses as L
    from dspark_jax.model.attention import anchored_block_attention
    from dspark_jax.model.draft import DSparkDraftModel, LossSettings
    from dspark_jax.optim import build_optimizer

    def bench(name, fn, *xs, n=args.steps, **extra):
        f = jax.jit(fn)
        jax.block_until_ready(f(*xs))
        times = []
        for _ in range(n):
            t = time.perf_counter()
            jax.block_until_ready(f(*xs))
            times.append(time.perf_counter() - t)
        emit(
            {
                "bench": "component",
                "impl": "jax",
                "preset": args.preset,
                "component": name,
                **timing(times),
                **extra,
            }
        )

    key = jax.random.key(0)
    q, b = num_anchors * cfg.block_size, cfg.block_size
    nq, nkv, d, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    bf16 = jnp.bfloat16
    ks = jax.random.split(key, 8)
    qx = jax.random.normal(ks[0], (q, nq, d), bf16)
    kc, vc = (jax.random.normal(k, (seq, nkv, d), bf16) for k in ks[1:3])
    kb, vb = (jax.random.normal(k, (q, nkv, d), bf16) for k in ks[3:5])
    anc, doc = anchors[0], jnp.asarray(rows[0]["document_ids"])
    w = cfg.layer_sliding_window(0)

    def attn(qx, kc, vc, kb, vb, anc, doc):
        return anchored_block_attention(
            qx,
            kc,
            vc,
            kb,
            vb,
            anc,
            doc,
            block_size=b,
            sliding_window=w,
            causal_in_block=w is not None,
        )

    layers = cfg.num_hidden_layers
    xs = (qx, kc, vc, kb, vb, anc, doc)
    bench("attention_fwd (1 layer)", attn, *xs, layers=layers)
    bench(
        "attention_fwd_bwd (1 layer)",
        jax.grad(lambda *xs: attn(*xs).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3, 4)),
        *xs,
        layers=layers,
    )

    # Loss: the vocab-chunked per-slot values + DSpark reduction, fwd and fwd+bwd.
    settings = LossSettings.from_loss_fn(
        LOSS_FN, num_anchors=num_anchors, vocab_chunk_tokens=args.loss_chunk
    )
    vd, r = cfg.draft_vocab_size, cfg.markov_rank
    hid = jax.random.normal(ks[5], (q, h), bf16)
    th = jax.random.normal(ks[6], (q, h), bf16)
    feat = (0.01 * jax.random.normal(ks[7], (q, r))).astype(bf16)
    w2 = (0.05 * jax.random.normal(ks[0], (r, vd))).astype(bf16)
    head = (0.02 * jax.random.normal(ks[1], (h, vd))).astype(bf16)
    conf = jnp.zeros((q,), jnp.float32)
    mask = jnp.ones((q,), jnp.int32)
    weights = dict(settings.loss_weights)

    def loss(hid, feat, w2, conf, head, th, mask):
        vals = L.per_position_values(
            hid,
            jax.lax.stop_gradient(head),
            th,
            head,
            feat,
            w2,
            terms=tuple(weights),
            chunk_size=args.loss_chunk,
        )
        return L.dspark_loss(vals, conf, mask, block_size=b, loss_weights=weights)[0]

    xs = (hid, feat, w2, conf, head, th, mask)
    bench("loss_fwd", loss, *xs)
    bench("loss_fwd_bwd", jax.grad(loss, argnums=(0, 1, 2, 3)), *xs)

    # Optimizer: clip + Muon (bf16 Newton-Schulz, torch-exact) + AdamW on param-shaped grads.
    model = nnx.eval_shape(lambda: DSparkDraftModel(cfg, rngs=nnx.Rngs(0), dtype=bf16))
    _, abs_params = nnx.split(model, nnx.Param)
    params = jax.tree.map(lambda s: 0.02 * jnp.ones(s.shape, s.dtype), abs_params)
    tx, _ = build_optimizer(
        params,
        optimizer="muon",
        lr=1e-4,
        scheduler_type="cosine",
        total_steps=1000,
        warmup_ratio=0.03,
    )
    opt = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)

    def update(grads, opt, params):
        u, o = tx.update(grads, opt, params)
        return optax.apply_updates(params, u), o

    bench("optimizer_update", update, grads, opt, params)


# ------------------------------------------------------------------------------ reference


def run_reference(args, cfg, seq, num_anchors) -> None:
    if args.rows != 1:
        raise SystemExit("--impl reference runs one packed row per step (one rank's work)")
    if args.preset == "k3-shape" and not args.force:
        rec = {
            "bench": "train_step",
            "impl": "reference",
            "preset": args.preset,
            "S": seq,
            "A": num_anchors,
            "Q": num_anchors * cfg.block_size,
            "mode": "analytic",
        }
        rec["reference_model_gib"] = {
            k: round(x, 2) for k, x in reference_memory_model(cfg, seq, num_anchors).items()
        }
        rec["reference_model_total_gib"] = round(sum(rec["reference_model_gib"].values()), 1)
        emit(rec)
        return
    import types

    import speculators.models.dflash.core as dflash_core
    import torch
    from speculators.losses import eager, resolve_loss_config
    from speculators.models.dspark import DSparkDraftModel as RefModel
    from speculators.train.trainer import Trainer, TrainerConfig

    rss0 = rss_mib()
    torch.manual_seed(0)
    model = RefModel(reference_config(cfg))  # fp32 parameters, like the reference trainer
    sd = {
        k: torch.from_numpy(init_tensor(k, tuple(p.shape), cfg))
        for k, p in model.named_parameters()
        if p.requires_grad
    }
    ft = frozen_tensors(cfg)
    head = torch.from_numpy(ft["lm_head.weight"].astype(np.float32))
    sd["embed_tokens.weight"] = torch.from_numpy(ft["embed_tokens.weight"].astype(np.float32))
    sd["lm_head.weight"] = head
    sd["verifier_lm_head.weight"] = head.clone()  # two fp32 copies, as the reference loads it
    sd["verifier_norm.weight"] = torch.from_numpy(ft["verifier_norm.weight"].astype(np.float32))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or set(missing) - {"t2d", "d2t"}:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    del sd, ft, head
    if args.remat:
        model.gradient_checkpointing_enable()
    model.train()

    config = TrainerConfig(
        lr=OPTIM["lr"],
        num_epochs=1,
        save_path="unused",
        optimizer="muon",
        muon_lr=OPTIM["lr"],
        scheduler_type="cosine",
        scheduler_warmup_ratio=OPTIM["warmup_ratio"],
    )
    trainer = types.SimpleNamespace(  # what Trainer.setup_optimizer reads
        model=model,
        config=config,
        resume_from_checkpoint=False,
        checkpointer=types.SimpleNamespace(previous_epoch=-1),
        train_loader=range(OPTIM["total_steps"]),
    )
    Trainer.setup_optimizer(trainer)

    rows, anc, val = host_batch(args, cfg, seq, num_anchors)
    row = rows[0]
    anchors_t, valid_t = torch.from_numpy(anc[0].astype(np.int64)), torch.from_numpy(val[0])
    dflash_core.select_anchors = lambda loss_mask, num, block: (anchors_t, valid_t)

    def t(name, dtype):
        x = row[name]
        x = x.astype(np.float32) if x.dtype == BF16 else x
        return torch.from_numpy(np.ascontiguousarray(x))[None].to(dtype)

    batch = {
        "hidden_states": t("hidden_states", getattr(torch, args.hidden_states_dtype)),
        "verifier_last_hidden_states": t(
            "verifier_last_hidden_states", getattr(torch, args.hidden_states_dtype)
        ),
        "input_ids": t("input_ids", torch.long),
        "loss_mask": t("loss_mask", torch.long),
        "position_ids": t("position_ids", torch.long),
        "document_ids": t("document_ids", torch.long),
    }
    call_kwargs = dict(
        loss_config=resolve_loss_config(LOSS_FN, "eager"),
        tv_loss_fn=eager.tv_loss,
        gamma=GAMMA,
        max_anchors=num_anchors,
        confidence_head_alpha=CONF_ALPHA,
        per_position_loss_weight="fixed-exp-decay",
    )

    dtype = getattr(torch, args.hidden_states_dtype)  # TrainerConfig.hidden_states_dtype

    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}

    def step() -> float:  # Trainer.train_epoch's order
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            _, loss, _ = model(**batch, **call_kwargs)
        t1 = time.perf_counter()
        Trainer._optimizers_zero_grad(trainer)
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        Trainer._optimizers_step(trainer)
        Trainer._schedulers_step(trainer)
        t3 = time.perf_counter()
        for name, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
            phases[name].append(dt)
        return float(loss.detach())

    rec = base_record(args, "reference", cfg, seq, num_anchors, row, anc[0], val[0])
    rec.update(
        torch_threads=torch.get_num_threads(),
        rss_imports_mib=round(rss0, 1),
        rss_setup_mib=round(rss_mib(), 1),
    )
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        losses.append(step())
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    rec.update(timing(times))
    rec["phase_s_median"] = {
        k: round(statistics.median(v[args.warmup :]), 4) for k, v in phases.items()
    }
    rec["loss_first"], rec["loss_last"] = round(losses[0], 6), round(losses[-1], 6)
    throughput(
        rec, statistics.median(times), cfg, int((row["document_ids"] != -1).sum()), args.peak_flops
    )
    rec["reference_model_gib"] = {
        k: round(x, 3) for k, x in reference_memory_model(cfg, seq, num_anchors).items()
    }
    rec["peak_rss_mib"] = round(rss_mib(), 1)
    emit(rec)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                step()
        avg = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in avg)
        top = sorted(avg, key=lambda e: -e.self_cpu_time_total)[: args.profile_top]
        emit(
            {
                "bench": "profile",
                "impl": "reference",
                "preset": args.preset,
                "steps": 2,
                "traced_op_s_per_step": round(total / 1e6 / 2, 4),
                "top_ops": [
                    {
                        "op": e.key,
                        "pct": round(100 * e.self_cpu_time_total / total, 1),
                        "s_per_step": round(e.self_cpu_time_total / 1e6 / 2, 4),
                        "calls_per_step": e.count // 2,
                    }
                    for e in top
                ],
            }
        )


# ------------------------------------------------------------------------------ both


def run_both(args, argv: list[str]) -> None:
    """Each implementation in its own subprocess, ``--repeat`` times, interleaved."""
    passthrough, skip = [], False
    for a in argv:  # drop --impl and --repeat (and their values)
        if skip:
            skip = False
        elif a in ("--impl", "--repeat"):
            skip = True
        elif not a.startswith(("--impl=", "--repeat=")):
            passthrough.append(a)
    runs: dict[str, list[dict]] = {"jax": [], "reference": []}
    for _ in range(args.repeat):
        for impl in ("jax", "reference"):
            cmd = [sys.executable, __file__, "--impl", impl, *passthrough]
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
            if proc.returncode:
                sys.stderr.write(proc.stderr[-4000:])
                raise SystemExit(f"{impl} run failed (exit {proc.returncode})")
            for line in proc.stdout.splitlines():
                if line.startswith("{"):
                    print(line, flush=True)
                    rec = json.loads(line)
                    if rec.get("bench") == "train_step":
                        runs[impl].append(rec)
    jx, rf = runs["jax"], runs["reference"]
    if not jx or not rf or "step_s_median" not in jx[0] or "step_s_median" not in rf[0]:
        return
    time_ratios = [a["step_s_median"] / b["step_s_median"] for a, b in zip(jx, rf)]
    rss_ratios = [a["peak_rss_mib"] / b["peak_rss_mib"] for a, b in zip(jx, rf)]
    emit(
        {
            "bench": "comparison",
            "preset": args.preset,
            "S": jx[0]["S"],
            "A": jx[0]["A"],
            "repeats": len(time_ratios),
            "jax_step_s_median": statistics.median(a["step_s_median"] for a in jx),
            "reference_step_s_median": statistics.median(b["step_s_median"] for b in rf),
            "step_time_ratio_jax_over_ref": round(statistics.median(time_ratios), 3),
            "step_time_ratios": [round(x, 3) for x in time_ratios],
            "jax_peak_rss_mib": statistics.median(a["peak_rss_mib"] for a in jx),
            "reference_peak_rss_mib": statistics.median(b["peak_rss_mib"] for b in rf),
            "peak_rss_ratio_jax_over_ref": round(statistics.median(rss_ratios), 3),
            # Without the libraries' own footprint (RSS after imports: torch + transformers +
            # speculators ~540 MiB, JAX ~160 MiB before its backend starts).
            "rss_over_imports_ratio_jax_over_ref": round(
                statistics.median(
                    (a["peak_rss_mib"] - a["rss_imports_mib"])
                    / (b["peak_rss_mib"] - b["rss_imports_mib"])
                    for a, b in zip(jx, rf)
                ),
                3,
            ),
            "jax_compiled_temp_mib": jx[0].get("compiled_temp_mib"),
            "loss_first": {"jax": jx[0]["loss_first"], "reference": rf[0]["loss_first"]},
        }
    )


# ------------------------------------------------------------------------------ main


def peak_for_device(explicit: float | None) -> float | None:
    if explicit:
        return explicit * 1e12
    try:
        name = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            check=False,
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return None
    if not name:
        return None
    for key in sorted(PEAK_BF16, key=len, reverse=True):
        if key in name[0]:
            return PEAK_BF16[key]
    return None


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=("jax", "reference", "both"), required=True)
    p.add_argument("--preset", choices=tuple(PRESETS), default="small")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps first (JAX: the "
        "compiled step's first calls; compile time is reported on its own)",
    )
    p.add_argument("--seq", type=int, help="override S (total seq len)")
    p.add_argument("--anchors", type=int, help="override A (max anchors)")
    p.add_argument("--rows", type=int, default=1, help="packed rows per step (JAX only)")
    p.add_argument("--remat", action="store_true", help="gradient checkpointing on both sides")
    p.add_argument(
        "--hidden-states-dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="both trainers' flag: the hidden states' dtype and the compute dtype "
        "(JAX: the model's dtype; reference: torch.autocast, off for float32)",
    )
    p.add_argument("--loss-chunk", type=int, default=1024, help="JAX loss slots per vocab chunk")
    p.add_argument(
        "--init",
        choices=("matched", "device"),
        default=None,
        help="JAX weights: matched to the reference (host numpy) or random on the "
        "device (default: matched, device for k3-shape)",
    )
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="JAX: lower + compile from ShapeDtypeStructs, report memory_analysis()",
    )
    p.add_argument("--force", action="store_true", help="run k3-shape for real even on CPU")
    p.add_argument("--components", action="store_true", help="JAX: time the step's parts")
    p.add_argument("--profile", action="store_true", help="aggregate a trace of 2 steps by op")
    p.add_argument("--profile-top", type=int, default=15)
    p.add_argument("--repeat", type=int, default=1, help="--impl both: runs of each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak bf16 TFLOP/s for MFU (default: from nvidia-smi's GPU name)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.impl == "both":
        run_both(args, argv)
        return
    cfg, seq, num_anchors = preset_config(args.preset)
    seq, num_anchors = args.seq or seq, args.anchors or num_anchors
    if args.init is None:
        args.init = "device" if args.preset == "k3-shape" else "matched"
    args.peak_flops = peak_for_device(args.peak_tflops)
    if args.impl == "jax":
        import jax

        compile_only = args.compile_only or (
            args.preset == "k3-shape" and jax.default_backend() == "cpu" and not args.force
        )
        run_jax(args, cfg, seq, num_anchors, compile_only)
    else:
        run_reference(args, cfg, seq, num_anchors)


if __name__ == "__main__":
    main()
