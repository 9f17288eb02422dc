"""Step FLOPs (docs/math.md, "Step FLOPs") against XLA's own count of the compiled step,
the expected visible context by hand, peaks by device kind, memory and the console line."""

from __future__ import annotations

import io
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.model.draft import DSparkDraftModel, LossSettings, batch_loss
from dspark_jax.train import throughput
from dspark_jax.train.metrics_log import Progress
from tests.model.test_draft import random_batch, random_frozen, tiny_config


def test_flops_are_xlas_count_of_the_compiled_forward_and_step():
    """XLA's cost analysis counts a loop body once, so the shapes make every loop run once:
    one loss chunk (chunk = Q slots), one query group (A <= 16), one context chunk (S <=
    512; the kernel pads S to 512 and computes the whole chunk). Rows are vmapped (not a
    loop), layers unrolled. XLA also counts elementwise work, which the analytic count
    leaves out: ``0 <= xla - analytic <= E``, E a bound of that work (below). In the step,
    XLA may also merge the target logits' recompute with their forward (a loop of one
    trip is inlined, and they do not depend on the parameters): that one matmul may be
    missing from its count."""
    rows, seq, A = 2, 128, 8
    cfg = tiny_config(hidden_size=512, intermediate_size=1024, head_dim=128, vocab_size=512,
                      mask_token_id=511, layer_types=None, sliding_window=None,
                      markov_rank=16)  # fmt: skip
    B, L = cfg.block_size, cfg.num_hidden_layers
    rng = np.random.default_rng(0)
    batch, frozen = random_batch(rng, cfg, rows=rows, seq=seq), random_frozen(rng, cfg)
    model = DSparkDraftModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, remat=False)
    settings = LossSettings.from_loss_fn(
        '{"ce": 0.1, "tv": 0.9}', num_anchors=A, vocab_chunk_tokens=A * B
    )
    graphdef, params = nnx.split(model)

    def loss(params, batch, key):
        return batch_loss(nnx.merge(graphdef, params), frozen, batch, key, settings)[0]

    def xla_flops(fn):
        lowered = jax.jit(fn).lower(params, batch, jax.random.key(0))
        return lowered.compile().cost_analysis()["flops"]

    xla_forward, xla_step = xla_flops(loss), xla_flops(jax.value_and_grad(loss))
    assert throughput.Q_BLOCK_GROUP >= A and throughput.KV_CHUNK >= seq
    Qa, C = throughput.Q_BLOCK_GROUP * B, throughput.KV_CHUNK  # padded queries, columns
    context = [rows * Qa * C] * L
    parts = throughput.step_flops_parts(
        cfg, rows=rows, num_anchors=A, seq_len=seq, context=context, hardware=True
    )
    hw = throughput.train_step_flops(
        cfg, rows=rows, num_anchors=A, seq_len=seq, context=context, hardware=True
    )
    assert hw == parts["forward"] + parts["backward"] + parts["recompute"]
    # E: <= 10 elementwise flops per element per pass (exp, max, sub, mul, select, add,
    # compare, ...). Logits: draft and target [Q, Vd] per row (passes: forward;
    # recompute, backward). Scores [Qa, B + C] per head and layer (forward; backward).
    # Activations [Q, 6H + 3I + 3 Nh D] and [S, H + 2 Nkv D] per layer (forward;
    # backward, twice). Every parameter: its gradient's adds (backward).
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    Nh, Nkv, Q = cfg.num_attention_heads, cfg.num_key_value_heads, A * B
    logits = rows * Q * cfg.draft_vocab_size * 2
    scores = rows * L * Nh * Qa * (B + C)
    acts = rows * L * (Q * (6 * H + 3 * I + 3 * Nh * D) + seq * (H + 2 * Nkv * D))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    bound_forward = 10 * (logits + scores + acts)
    bound_step = bound_forward + 10 * (2 * logits + scores + 2 * acts + n_params)
    assert 0 <= xla_forward - parts["forward"] <= bound_forward, (xla_forward, parts)
    merged = rows * 2 * Q * cfg.verifier_hidden_size * cfg.draft_vocab_size
    assert -merged <= xla_step - hw <= bound_step, (xla_step, hw, bound_step)
    assert bound_step + merged < 0.04 * hw  # a tight check: matmuls dominate this config
    # Model FLOPs (what MFU divides) leave out the recompute and the padded queries.
    model_flops = throughput.train_step_flops(
        cfg, rows=rows, num_anchors=A, seq_len=seq, context=context
    )
    assert model_flops < parts["forward"] + parts["backward"] < hw


def test_visible_context_by_hand():
    # One row: document 0 at 0-4, document 1 at 5-8, padding 9-11; B = 2, so anchors are
    # eligible at p < 10 with loss_mask: 0..8, offsets in their document 0,1,2,3,4,0,1,2,3.
    cfg = tiny_config(num_hidden_layers=2, block_size=2, sliding_window=2,
                      layer_types=("sliding_attention", "full_attention"))  # fmt: skip
    doc = np.array([[0] * 5 + [1] * 4 + [-1] * 3])
    mask = (doc >= 0).astype(np.int32)
    sliding, full = throughput.visible_context(doc, mask, cfg, num_anchors=4)
    assert full == pytest.approx(2 * 4 * 16 / 9)  # B x anchors x mean offset
    assert sliding == pytest.approx(2 * 4 * 12 / 9)  # offsets capped at W = 2
    mask[0, :5] = 0  # only document 1 eligible: 4 positions, all drawn
    assert throughput.visible_context(doc, mask, cfg, 8)[1] == pytest.approx(2 * 6)
    assert throughput.visible_context(doc, 0 * mask, cfg, 8) == [0.0, 0.0]


@pytest.mark.parametrize(
    "kind, peak",
    [
        ("TPU v4", 275e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5", 459e12),
        ("TPU v5p", 459e12),
        ("TPU v6 lite", 918e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA B200", 2250e12),
        ("cpu", None),
        ("TPU v4 lite", None),
    ],
)
def test_peak_by_device_kind(kind, peak):
    assert throughput.peak_flops(kind) == peak


def test_device_memory_where_reported():
    dev = lambda stats: types.SimpleNamespace(memory_stats=lambda: stats)  # noqa: E731
    mib = 2**20
    got = throughput.device_memory(
        [dev({"bytes_in_use": 3 * mib, "peak_bytes_in_use": 5 * mib}), dev({"bytes_in_use": mib})]
    )
    assert got == {"in_use": 3.0, "peak": 5.0}
    assert throughput.device_memory([dev(None)]) == {}
    assert throughput.device_memory(jax.devices("cpu")) == {}  # XLA:CPU reports none


def test_progress_line_shows_the_throughput():
    out = io.StringIO()
    p = Progress(100, stream=out, interval=0.0)
    p.start(0)
    profile = {"step_ms": 250.0, "fetch_ms": 12.5, "fetch_frac": 0.05, "tokens_per_s": 4096.0,
               "tflops_per_device": 123.4, "mfu": 0.125,
               "memory_mb": {"in_use": 2048.0, "peak": 3072.0}}  # fmt: skip
    p.update(10, 0, 10, 50, {"loss": 1.0, "accept_len": 2.0}, 1e-3, 4096.0, profile=profile)
    line = out.getvalue()
    assert "4,096 tok/s | step 250 ms | 123 TFLOP/s/device | MFU 12.5%" in line
    assert "data wait 12.5 ms (5%) | mem 2.00 GiB (peak 3.00)" in line
    out = io.StringIO()
    Progress(100, stream=out, interval=0.0).update(
        1, 0, 1, 50, {}, 1e-3, 1.0, profile={"step_ms": 1.0, "mfu": None}
    )
    assert "MFU n/a" in out.getvalue()
