"""Throughput figures of a training run: step FLOPs, peak FLOP/s by device kind, MFU,
device memory.

The FLOP count is analytic (docs/math.md, "Step FLOPs"): the matmuls of one optimizer
step of the drafter, forward and backward, from the config and the step's shapes.
:func:`train_step_flops` gives the *model* FLOPs that MFU divides (each matmul once
forward, twice backward where both gradients are needed, once where one is: the PaLM /
MaxText convention) or, with ``hardware=True``, what the compiled step runs (flash
attention's backward recomputes the scores; the loss chunks, and the decoder layers
under ``--gradient-checkpointing``, recompute their forward). Elementwise work (norms,
RoPE, softmax, the loss terms) and the optimizer update are not counted.

Peak FLOP/s per device kind are the vendors' dense bf16 figures (docs/math.md cites
each); an unknown kind (CPU) has no peak and no MFU. :class:`Throughput` turns them into
a run's ``profile`` figures; :class:`StepProfiler` traces ``--profile-steps``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dspark_jax.config import DSparkConfig
from dspark_jax.model.attention import anchored_block_attention

log = logging.getLogger("dspark_jax.train")

# The tiling of anchored_block_attention as the drafter calls it (its defaults).
Q_BLOCK_GROUP = anchored_block_attention.__kwdefaults__["q_block_group"]
KV_CHUNK = anchored_block_attention.__kwdefaults__["kv_chunk"]

# Dense bf16 peak FLOP/s per chip (docs/math.md, "Step FLOPs", cites the datasheets).
# Matched in order against the lower-cased jax device_kind.
PEAK_BF16_FLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("tpu v4",), 275e12),
    (("tpu v5 lite", "tpu v5e", "tpu v5litepod"), 197e12),
    (("tpu v5p", "tpu v5"), 459e12),
    (("tpu v6 lite", "tpu v6e"), 918e12),
    (("a100",), 312e12),
    (("h100 pcie", "h100-pcie"), 756e12),
    (("h100 nvl", "h200 nvl"), 835e12),
    (("h100", "h200", "gh200"), 989e12),
    (("b200", "gb200"), 2250e12),
)


def peak_flops(device_kind: str) -> float | None:
    """Dense bf16 peak FLOP/s of one device of this kind, or None (unknown, CPU)."""
    kind = device_kind.lower()
    if kind.startswith("tpu v4 lite"):  # v4i, an inference chip: no figure here
        return None
    for names, flops in PEAK_BF16_FLOPS:
        if any(kind.startswith(n) or f" {n}" in f" {kind}" for n in names):
            return flops
    return None


def _mm(m: float, k: float, n: float) -> float:
    return 2.0 * m * k * n


def train_step_flops(
    cfg: DSparkConfig,
    *,
    rows: int,
    num_anchors: int,
    seq_len: int,
    context: Sequence[float],
    remat: bool = False,
    hardware: bool = False,
) -> float:
    """Matmul FLOPs of one train step over ``rows`` packed rows (docs/math.md, "Step FLOPs").

    context[l]: (query, context column) pairs layer ``l`` attends over, summed over the
    rows (see :func:`visible_context`; ``hardware``: the pairs the tiled kernel computes,
    whole chunks of ``KV_CHUNK`` columns per query group).
    """
    parts = step_flops_parts(
        cfg, rows=rows, num_anchors=num_anchors, seq_len=seq_len, context=context,
        remat=remat, hardware=hardware,
    )  # fmt: skip
    return parts["forward"] + parts["backward"] + (parts["recompute"] if hardware else 0.0)


def step_flops_parts(
    cfg: DSparkConfig,
    *,
    rows: int,
    num_anchors: int,
    seq_len: int,
    context: Sequence[float],
    remat: bool = False,
    hardware: bool = False,
) -> dict[str, float]:
    """:func:`train_step_flops` in three parts: ``forward``, ``backward`` (the gradients
    only) and ``recompute`` (forward work the compiled backward redoes: the scores in
    flash attention's backward, the loss chunks' logits, the layers under remat)."""
    L = cfg.num_hidden_layers
    if len(context) != L:
        raise ValueError(f"context has {len(context)} entries for {L} layers")
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    Nh, Nkv, B = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.block_size
    Ht, Vd, r = cfg.verifier_hidden_size, cfg.draft_vocab_size, cfg.markov_rank
    S, Q = seq_len, num_anchors * B
    # Attention queries: the kernel pads the anchors to whole query groups.
    Qa = -(-num_anchors // Q_BLOCK_GROUP) * Q_BLOCK_GROUP * B if hardware else Q

    # fc: the aux hidden states [S, n_aux Ht] -> [S, H]; no gradient to its input.
    fc = _mm(S, cfg.num_aux_layers * Ht, H)
    fwd, bwd, layers_fwd, scores = fc, fc, 0.0, 0.0
    for layer in range(L):
        proj_q = _mm(Q, H, Nh * D) + 2 * _mm(Q, H, Nkv * D)  # q, k, v of the block tokens
        proj_ctx = 2 * _mm(S, H, Nkv * D)  # k, v of the context
        out = _mm(Q, Nh * D, H) + 3 * _mm(Q, H, I)  # o_proj, gate, up, down
        # One unit: a score-sized matmul, 2 Nh D per (query, key) pair: the own block's
        # and, per row (context[] sums the rows), the context's. Forward: Q K^T and P V;
        # backward: dP, dQ, dK, dV.
        unit = 2 * Nh * D * (Qa * B + context[layer] / rows)
        lf = proj_q + proj_ctx + out + 2 * unit
        layers_fwd += lf
        scores += unit
        fwd += lf
        # Weights get dW, inputs dX, except the first layer's block-token input (the
        # frozen embedding: no gradient needed).
        bwd += 2 * (proj_ctx + out) + (2 if layer else 1) * proj_q + 4 * unit
    # Markov head (vanilla: a lookup) and the confidence head; their inputs need dX.
    heads = 0.0
    if r > 0 and cfg.markov_head_type == "gated":
        heads += _mm(Q, H + r, r)
    elif r > 0 and cfg.markov_head_type == "rnn":
        heads += _mm(Q, 2 * r + H, 3 * r)
    if cfg.enable_confidence_head:
        heads += _mm(Q, H + (r if cfg.confidence_head_with_markov else 0), 1)
    fwd, bwd = fwd + heads, bwd + 2 * heads
    # Loss logits: draft (frozen lm_head, dX only), Markov bias (W2 trainable: dW and the
    # feature's dX), target (frozen verifier head on frozen states: no backward).
    draft, markov, target = _mm(Q, H, Vd), _mm(Q, r, Vd) if r > 0 else 0.0, _mm(Q, Ht, Vd)
    fwd += draft + markov + target
    bwd += draft + 2 * markov
    recompute = scores + draft + markov + target + (layers_fwd if remat else 0.0)
    return {"forward": rows * fwd, "backward": rows * bwd, "recompute": rows * recompute}


def visible_context(
    document_ids: np.ndarray,
    loss_mask: np.ndarray,
    cfg: DSparkConfig,
    num_anchors: int,
) -> list[float]:
    """Expected (query, visible context column) pairs per layer of one batch.

    The anchors are drawn inside the step, so this is the expectation over the draw:
    ``min(A, #eligible)`` anchors per row, uniform over the eligible positions
    (``loss_mask`` and ``p < S - B``, as anchors.select_anchors); anchor ``p`` sees the
    ``p - start(doc(p))`` earlier columns of its document (at most ``W`` on sliding
    layers); each of its ``B`` slots attends to them.
    """
    doc = np.asarray(document_ids)
    mask = np.asarray(loss_mask)
    rows, S = doc.shape
    B = cfg.block_size
    pos = np.arange(S)
    starts = np.concatenate([np.ones((rows, 1), bool), doc[:, 1:] != doc[:, :-1]], axis=1)
    doc_start = np.maximum.accumulate(np.where(starts, pos, 0), axis=1)
    offset = (pos - doc_start).astype(np.float64)
    eligible = (mask > 0) & (pos < S - B) & (doc != -1)
    n = eligible.sum(axis=1)
    anchors = np.minimum(n, num_anchors)
    out = []
    for layer in range(cfg.num_hidden_layers):
        w = cfg.layer_sliding_window(layer)
        seen = offset if w is None else np.minimum(offset, w)
        mean = np.where(n > 0, (seen * eligible).sum(axis=1) / np.maximum(n, 1), 0.0)
        out.append(float(B * np.sum(anchors * mean)))
    return out


def device_memory(devices) -> dict[str, float]:
    """Largest bytes in use and peak over ``devices``, in MB (2**20 bytes, as the
    reference's ``memory_mb``); {} where the backend does not report them (CPU)."""
    in_use, peak = [], []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        if not stats or "bytes_in_use" not in stats:
            continue
        in_use.append(stats["bytes_in_use"])
        peak.append(stats.get("peak_bytes_in_use", stats["bytes_in_use"]))
    if not in_use:
        return {}
    return {"in_use": max(in_use) / 2**20, "peak": max(peak) / 2**20}


# ------------------------------------------------------------------ in the training loop
class Throughput:
    """Step FLOPs of each batch (docs/math.md, "Step FLOPs") and the device peak: the
    ``profile`` figures beyond the reference's (TFLOP/s per device, MFU, memory)."""

    def __init__(self, cfg: DSparkConfig, args, mesh, process_share: float):
        """``args``: the run's flags (``max_anchors``, ``total_seq_len``);
        ``process_share``: the row groups one process's rows stand for."""
        self.cfg, self.args = cfg, args
        self.devices = mesh.size
        self.share = process_share
        kinds = {d.device_kind for d in mesh.devices.flat}
        self.peak = peak_flops(kinds.pop()) if len(kinds) == 1 else None

    def step_flops(self, batch: dict[str, np.ndarray]) -> float:
        """Model FLOPs of one step on this process's rows, times the row groups (the
        processes, or fewer when processes share rows)."""
        args = self.args
        context = visible_context(
            batch["document_ids"], batch["loss_mask"], self.cfg, args.max_anchors
        )
        rows = batch["document_ids"].shape[0]
        flops = train_step_flops(
            self.cfg,
            rows=rows,
            num_anchors=args.max_anchors,
            seq_len=args.total_seq_len,
            context=context,
        )
        return flops * self.share

    def figures(self, flops: float, elapsed: float) -> dict[str, Any]:
        per_device = flops / elapsed / self.devices
        out: dict[str, Any] = {
            "tflops_per_device": per_device / 1e12,
            "mfu": None if self.peak is None else per_device / self.peak,
        }
        memory = device_memory(jax.local_devices())
        if memory:
            out["memory_mb"] = memory
        return out


class StepProfiler:
    """``--profile-steps A:B``: ``jax.profiler`` traces steps A..B-1 into ``log_dir``
    (``plugins/profile/<time>/<host>.xplane.pb``: TensorBoard's profile plugin, XProf,
    Perfetto)."""

    def __init__(self, window: tuple[int, int] | None, log_dir: Path):
        self.window, self.log_dir, self.active = window, Path(log_dir), False

    def before(self, step: int) -> None:
        if self.window is not None and not self.active and self.window[0] <= step < self.window[1]:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.log_dir))
            self.active = True

    def after(self, step: int, state) -> None:
        """``step``: the step just dispatched; the trace ends once step B-1 has run."""
        if self.active and step + 1 >= self.window[1]:
            self.stop(state)

    def stop(self, state=None) -> None:
        if not self.active:
            return
        if state is not None:
            jax.block_until_ready(state)
        jax.profiler.stop_trace()
        self.active = False
        log.info("profile of steps %d:%d in %s", *self.window, self.log_dir)
