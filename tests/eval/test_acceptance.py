"""Acceptance math and the free-running slot scan on synthetic drafters with known answers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.eval import acceptance
from dspark_jax.eval import report as eval_report
from dspark_jax.eval.slot_statistics import slot_statistics
from dspark_jax.model.heads import ConfidenceHead, MarkovHead
from tests.converters.helpers import make_vocab
from tests.eval.conftest import eval_config, numpy_module
from tests.numerics import U, assert_within, overlap_bound

F64 = 16 * 2.0**-53  # a few float64 roundings

A, B, H, VD = 5, 4, 32, 8


def stats(hidden, th, head, vhead, prev, key, markov, conf, d2t, start):
    """slot_statistics under one jit (heads closed over): one compilation per test."""

    @jax.jit
    def f(hidden, th, head, vhead, prev, key, d2t):
        return slot_statistics(hidden, th, head, vhead, prev, key, markov_head=markov,
                               conf_head=conf, conf_with_markov=True, d2t=d2t, start_pos=start,
                               anchor_chunk=2)  # fmt: skip

    return f(hidden, th, head, vhead, prev, key, d2t)


def test_curve_definitions_by_hand():
    values = np.array([[1.0, 0.5, 1.0, 0.2], [0.5, 1.0, 0.0, 1.0], [0.9, 0.9, 0.9, 0.9]])
    mask = np.array([[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]])  # block 3 not counted
    c = acceptance.curve(values, mask)
    # float64 products of <= 4 factors and means of <= 3 terms: a few roundings of 2^-53.
    tol = {"rtol": F64, "atol": 0}
    np.testing.assert_allclose(c.cumulative, [0.75, 0.5, 0.25, 0.05], **tol)
    assert c.acceptance_length == pytest.approx(2.55, rel=F64, abs=0)
    np.testing.assert_allclose(c.conditional, [0.75, 0.5 / 0.75, 0.5, 0.2], **tol)
    np.testing.assert_allclose(c.slot_mean, [0.75, 0.75, 0.5, 0.6], **tol)
    assert c.blocks == 2

    # A masked-out slot ends the accepted run (training's cumprod(accept * mask)).
    c = acceptance.curve(np.ones((1, 4)), np.array([[1, 1, 0, 1]]))
    np.testing.assert_array_equal(c.cumulative, [1, 1, 0, 0])  # products of 0s and 1s: exact
    assert c.acceptance_length == 3.0
    # DFlash layout: slot 0 is the anchor, draft positions are slots 1..B-1.
    c = acceptance.curve(np.array([[0.0, 1.0, 0.5, 0.5]]), np.array([[0, 1, 1, 1]]), start=1)
    np.testing.assert_array_equal(c.cumulative, [1.0, 0.5, 0.25])  # powers of 2: exact
    c = acceptance.curve(
        np.array([[0.0, 1.0, 0.5, 0.5]]), np.array([[0, 1, 1, 1]]), start=1, num_draft=2
    )
    assert c.acceptance_length == 2.5


def test_context_buckets():
    pos = np.array([0, 10, 300, 5000, 40000])
    got = [
        (lo, hi, int(sel.sum())) for lo, hi, sel in acceptance.context_buckets(pos, (0, 256, 4096))
    ]
    assert got == [(0, 256, 2), (256, 4096, 1), (4096, None, 2)]
    assert acceptance.bucket_label(2048, 4096) == "2K-4K"
    assert acceptance.bucket_label(4096, None) == "4K+"


def test_default_buckets_reach_a_million_tokens_and_skip_what_the_data_does_not_reach():
    # Context positions of a long-row set: every power-of-two bucket from 0 to 1M+ except
    # 64K-128K (no anchor there though documents run through it) holds blocks.
    pos = np.array([0, 255, 256, 1000, 5000, 40000, 131072, 200000, 300000, 600000,
                    1048575, 1048576, 1048577])  # fmt: skip
    want = {  # (lo, hi) -> blocks
        (0, 256): 2, (256, 512): 1, (512, 1024): 1, (4096, 8192): 1, (32768, 65536): 1,
        (65536, 131072): 0, (131072, 262144): 2, (262144, 524288): 1, (524288, 1048576): 2,
        (1048576, None): 2,
    }  # fmt: skip
    # Buckets between 1K and 4K and 8K..32K hold no block but lie below the longest document.
    for lo in (1024, 2048, 8192, 16384):
        want[(lo, 2 * lo)] = 0
    got = acceptance.context_buckets(pos, longest=1048578)
    assert {(lo, hi): int(sel.sum()) for lo, hi, sel in got} == want
    assert [lo for lo, _, _ in got] == sorted(lo for lo, _ in want)
    assert sum(int(sel.sum()) for _, _, sel in got) == pos.size  # a partition
    assert acceptance.bucket_label(524288, 1048576) == "512K-1M"
    assert acceptance.bucket_label(1048576, None) == "1M+"

    # Short data: the 1M edges add no row; an empty bucket below the longest document stays.
    short = acceptance.context_buckets(np.array([3, 700]), longest=2048)
    assert [(acceptance.bucket_label(lo, hi), int(s.sum())) for lo, hi, s in short] == [
        ("0-256", 1), ("256-512", 0), ("512-1K", 1), ("1K-2K", 0),
    ]  # fmt: skip
    assert len(acceptance.context_buckets(np.array([3, 700]))) == 2  # no length: blocks only

    # The report's markdown and CSV carry those buckets (an empty one as 0 blocks, n/a).
    n, blk = 3, 4
    x = np.where(pos[:, None] >= 262144, 0.5, 1.0) * np.ones((pos.size, blk))
    arrays = {
        name: x for name in ("accept_fr", "greedy_fr", "accept_tf", "greedy_tf")
    } | {  # fmt: skip
        "mask": np.ones((pos.size, blk)), "context_pos": pos,
        "row": np.arange(pos.size), "document": np.zeros(pos.size, np.int64),
    }  # fmt: skip
    data = eval_report.DatasetBlocks("long", arrays, rows=pos.size, documents=pos.size,
                                     longest_document=1048578)  # fmt: skip
    report = eval_report.build_report(
        [data], start=1, num_draft=n, context_edges=acceptance.DEFAULT_CONTEXT_EDGES,
        has_confidence=False,
    )  # fmt: skip
    md = eval_report.markdown(report)
    # x = 1 below 256K: every position accepted, length n + 1; 0.5 from 256K: 1 + sum 0.5^k.
    assert md.count(f"| long | 0-256 | 2 | {'| '.join([f'{n + 1:.2f} '] * 4)}|") == 1
    assert md.count("| long | 64K-128K | 0 | n/a | n/a | n/a | n/a |") == 1
    assert md.count(f"| long | 1M+ | 2 | {'| '.join([f'{1.875:.2f} '] * 4)}|") == 1
    lines = eval_report.context_csv(report).splitlines()
    assert len(lines) == 1 + 4 * len(want)
    assert "long,analytic,free_running,524288,1048576,2,1.875,0.5,0.25,0.125" in lines
    assert "long,analytic,free_running,1048576,,2,1.875,0.5,0.25,0.125" in lines
    assert "long,greedy,teacher_forcing,65536,131072,0,,,," in lines


def _heads(cfg, zero_w2=True):
    markov = numpy_module(lambda: MarkovHead(cfg, jnp.float32, nnx.Rngs(0)), seed=0, scale=0.3)
    conf = numpy_module(
        lambda: ConfidenceHead(cfg.hidden_size + cfg.markov_rank, jnp.float32, nnx.Rngs(1)), seed=1
    )
    if zero_w2:
        markov.markov_w2.kernel[...] = jnp.zeros_like(markov.markov_w2.kernel[...])
    return markov, conf


def _blocks(stats: dict, name: str) -> eval_report.DatasetBlocks:
    arrays = {k: np.asarray(v) for k, v in stats.items()}
    n = arrays["accept_tf"].shape[0]
    arrays.update(
        mask=np.ones((n, B), np.float32),
        context_pos=np.arange(n) * 700,
        row=np.zeros(n, np.int64),
        document=np.arange(n),
    )
    return eval_report.DatasetBlocks(name, arrays, rows=1, documents=n)


@pytest.mark.parametrize("start", [0])  # start=1 (DFlash layout): test_training_metrics
def test_identical_and_disjoint_drafters_give_exact_tables(start):
    cfg = eval_config(draft_vocab_size=VD)
    rng = np.random.default_rng(0)
    markov, conf = _heads(cfg)
    prev = jnp.asarray(rng.integers(0, cfg.vocab_size - 1, (A, B)), jnp.int32)
    d2t = jnp.asarray(make_vocab(cfg)[0])

    # draft == verifier: same hidden states, same head, no Markov bias.
    hidden = jnp.asarray(rng.standard_normal((A, B, H)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((H, VD)), jnp.float32)
    same = stats(hidden, hidden, head, head, prev, jax.random.key(0), markov, conf, d2t, start)
    # q = p up to the round-off of two fp32 evaluations of the same logits (the Markov
    # bias is exactly 0): sum_v min(q, p) = 1 within each slot's tests.numerics.overlap_bound.
    flat_h = np.asarray(hidden).reshape(A * B, H)
    r = overlap_bound(flat_h, head, flat_h, head)[0].reshape(A, B)
    for name in ("accept_tf", "accept_fr"):
        assert_within(same[name], np.ones((A, B)), r, name)
    for name in ("greedy_tf", "greedy_fr"):
        assert np.asarray(same[name]).all()

    # Disjoint supports: the drafter only puts mass on ids 0..3, the verifier on 4..7.
    hidden = hidden.at[..., 0].set(1.0)
    draft_head = jnp.zeros((H, VD)).at[0, :4].set(200.0)
    verifier_head = jnp.zeros((H, VD)).at[0, 4:].set(200.0)
    apart = stats(hidden, hidden, draft_head, verifier_head, prev, jax.random.key(0), markov, conf,
                  d2t, start)  # fmt: skip
    for name in ("accept_tf", "accept_fr", "greedy_tf", "greedy_fr"):
        assert not np.asarray(apart[name]).any(), name

    n = B - start
    report = eval_report.build_report(
        [_blocks(same, "same"), _blocks(apart, "apart")],
        start=start, num_draft=n, context_edges=(0, 1024), has_confidence=False,
    )  # fmt: skip
    md = eval_report.markdown(report)
    ones = " | ".join(["100.0%"] * n)
    zeros = " | ".join(["0.0%"] * n)
    assert md.count(f"| same | {ones} | {n + 1}.00 |") == 4  # all four methods
    assert md.count(f"| apart | {zeros} | 1.00 |") == 4
    for key, entry in report["datasets"]["same"]["acceptance"].items():
        # 1 + sum of n prefix products of accept values each within r of 1: <= n(n+1)/2 r.
        tol = n * (n + 1) / 2 * float(r.max())
        assert entry["acceptance_length"] == pytest.approx(n + 1, rel=0, abs=tol), key
        assert report["datasets"]["apart"]["acceptance"][key]["acceptance_length"] == 1.0
    buckets = report["datasets"]["same"]["by_context"]
    assert [(b["label"], b["blocks"]) for b in buckets] == [("0-1K", 2), ("1K+", 3)]
    assert eval_report.acceptance_csv(report).count("\n") == 1 + 2 * 4 * n


@pytest.mark.parametrize("head_type", ["vanilla", "rnn"])  # gated: as vanilla + a gate
def test_free_running_follows_the_drafters_own_tokens(head_type):
    """The scan equals a slot-by-slot loop that feeds each drafted token to the next slot."""
    cfg = eval_config(draft_vocab_size=16, markov_head_type=head_type)
    rng = np.random.default_rng(1)
    markov, conf = _heads(cfg, zero_w2=False)
    markov.markov_w2.kernel[...] = markov.markov_w2.kernel[...] * 10.0  # a strong bias
    d2t = jnp.asarray(make_vocab(cfg)[0])
    prev = jnp.asarray(rng.integers(0, cfg.vocab_size - 1, (A, B)), jnp.int32)
    hidden = jnp.asarray(rng.standard_normal((A, B, H)), jnp.float32)
    th = jnp.asarray(rng.standard_normal((A, B, H)), jnp.float32)
    vhead = jnp.asarray(rng.standard_normal((H, 16)) * 60.0, jnp.float32)  # ~one-hot targets
    th = hidden + 0.3 * th  # a drafter that often agrees with the verifier
    head = vhead / 30.0 + jnp.asarray(rng.standard_normal((H, 16)), jnp.float32)
    start = 0
    got = stats(hidden, th, head, vhead, prev, jax.random.key(3), markov, conf, d2t, start)

    @jax.jit
    def oracle(hidden, th, head, vhead, prev, d2t):
        """Slot by slot, each drafted token fed to the next slot's Markov head."""
        w2 = markov.w2_kernel()
        logp = jax.nn.log_softmax(th @ vhead, axis=-1)
        target = jnp.argmax(logp, axis=-1)
        greedy, accept, conf_g, sure, feats, conf_in = [], [], [], [], [], []
        known = jnp.ones(A, bool)  # blocks whose earlier accepted draws are (almost) certain
        prev_g = prev_s = prev[:, 0]
        state_g = state_s = markov.initial_state(A, jnp.float32)
        for k in range(B):
            if k <= start:
                prev_g = prev_s = prev[:, k]
            emb = markov.prev_embeddings(prev_g)
            state_g, f = markov.step(state_g, emb, hidden[:, k])
            d = jnp.argmax(hidden[:, k] @ head + f @ w2, axis=-1)
            greedy.append(d == target[:, k])
            conf_in.append(jnp.concatenate([hidden[:, k], emb], axis=-1))
            conf_g.append(conf(conf_in[-1]))
            prev_g = d + d2t[d]
            # Analytic path: the accepted token's law is min(q, p) / accept, here ~all of
            # it on the verifier's argmax unless q puts almost nothing there (then the
            # later slots of that block depend on a random draw and are not compared).
            emb = markov.prev_embeddings(prev_s)
            state_s, f = markov.step(state_s, emb, hidden[:, k])
            feats.append(f)
            logq = jax.nn.log_softmax(hidden[:, k] @ head + f @ w2, axis=-1)
            overlap = jnp.exp(jnp.minimum(logq, logp[:, k]))
            accept.append(overlap.sum(-1))
            sure.append(known)
            known = known & (overlap[jnp.arange(A), target[:, k]] > 0.9999 * overlap.sum(-1))
            prev_s = target[:, k] + d2t[target[:, k]]
        return [jnp.stack(x, 1) for x in (greedy, accept, conf_g, sure, feats, conf_in)]

    greedy, accept, conf_g, sure, feats, conf_in = oracle(hidden, th, head, vhead, prev, d2t)
    np.testing.assert_array_equal(got["greedy_fr"], greedy)
    sure = np.asarray(sure)
    assert sure[:, -1].sum() >= 2
    # Overlaps: the bound of tests.numerics.overlap_bound, with the
    # Markov features' own round-off added to the draft logits. vanilla: a W1 row, exact.
    # rnn: per slot a (2r + H)-term joint projection (|state| <= 1), tanh / sigmoid
    # (1-Lipschitz), <= B steps deep: |df| <= 2 B (2r + H + 8) u F, F its largest
    # absolute evaluation; the logits then move by <= |df| max_v sum_r |w2_rv|.
    r_, w2 = cfg.markov_rank, np.asarray(markov.w2_kernel(), np.float64)
    d_f = 0.0
    if head_type == "rnn":
        x_abs = r_ + np.abs(np.asarray(hidden)).sum(-1).max() + r_ * float(
            np.abs(np.asarray(markov.markov_w1.embedding[...])).max())  # fmt: skip
        kernel = np.abs(np.asarray(markov.joint_proj.kernel[...])).max()
        F = x_abs * kernel + np.abs(np.asarray(markov.joint_proj.bias[...])).max()
        d_f = 2 * B * (2 * r_ + H + 8) * U * F * np.abs(w2).sum(0).max()

    def flat(x):
        return np.asarray(x).reshape(A * B, -1)

    bound = overlap_bound(flat(hidden), head, flat(th), vhead, flat(feats), w2, d_f)[0]
    assert_within(np.asarray(got["accept_fr"])[sure], np.asarray(accept)[sure],
                  bound.reshape(A, B)[sure], "accept_fr")  # fmt: skip
    # Confidence logits: one (H + r)-term projection of the same inputs (the greedy tokens
    # agree, checked above): <= 2 (H + r + 2) u (|x| |W| + |b|).
    c_abs = np.abs(np.asarray(conf_in)) @ np.abs(np.asarray(conf.proj.kernel[...]))[:, 0]
    c_abs += np.abs(np.asarray(conf.proj.bias[...]))[0]
    assert_within(got["conf_fr_greedy"], conf_g, 2 * (H + r_ + 2) * U * c_abs, "conf_fr_greedy")
    # Some slots match, and the bias is strong enough that conditioning on the drafter's
    # own tokens changes the outcome.
    assert 0 < np.asarray(got["greedy_fr"]).mean() < 1
    assert np.abs(np.asarray(got["accept_fr"]) - np.asarray(got["accept_tf"])).max() > 0.01
