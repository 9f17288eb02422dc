"""Anchor sampling and slot masks (docs/math.md, "Anchors and blocks", "Targets and slot masks")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import anchors as A


def _mask(seq, ones):
    m = np.zeros(seq, np.int32)
    m[list(ones)] = 1
    return jnp.asarray(m)


def test_anchors_are_valid_sorted_and_padded():
    seq, block = 32, 4
    mask = _mask(seq, list(range(3, 10)) + list(range(20, 32)))  # 28..31 excluded: p >= S-B
    eligible = {p for p in range(seq) if mask[p] and p < seq - block}
    anchors, valid = jax.jit(A.select_anchors, static_argnums=(2, 3))(
        jax.random.key(0), mask, 20, block
    )
    anchors, valid = np.asarray(anchors), np.asarray(valid)
    n = len(eligible)  # 15 < 20: all eligible positions, then 5 padding anchors
    assert valid.sum() == n and valid[:n].all() and not valid[n:].any()
    assert set(anchors[:n]) == eligible
    assert (np.diff(anchors[:n]) > 0).all()
    assert (anchors[n:] == 0).all()


def test_anchor_draw_is_uniform_without_replacement():
    seq, block, num = 24, 4, 5
    mask = jnp.ones(seq, jnp.int32)
    keys = jax.random.split(jax.random.key(1), 4000)
    draw = jax.jit(jax.vmap(lambda k: A.select_anchors(k, mask, num, block)))
    anchors, valid = draw(keys)
    anchors = np.asarray(anchors)
    assert np.asarray(valid).all()
    assert all(len(set(r)) == num for r in anchors)  # without replacement
    counts = np.bincount(anchors.ravel(), minlength=seq)
    assert counts[seq - block :].sum() == 0
    # Each of the 20 eligible positions is drawn with probability 5/20: 1000 expected.
    # Its count is Binomial(4000, 1/4): sd = sqrt(4000 * 1/4 * 3/4) = 27.4, so the bound
    # 5 * sqrt(1000) = 158 is 5.8 sd (the keys are fixed, so this is deterministic). A
    # biased draw, e.g. a preference for early positions, moves the counts by far more.
    expected = 4000 * num / (seq - block)
    assert np.abs(counts[: seq - block] - expected).max() < 5 * np.sqrt(expected)


def test_anchors_are_a_function_of_the_key_alone():
    """Eager and jit give the same anchors for a key; other keys give other anchors, all
    valid: distinct, sorted, eligible, as many as asked for."""
    seq, num, block = 64, 8, 8
    mask = _mask(seq, list(range(5, 40)) + list(range(48, 64)))  # 56..63: p >= S - B
    eligible = {p for p in range(seq) if mask[p] and p < seq - block}  # 35 + 8 = 43
    jitted = jax.jit(A.select_anchors, static_argnums=(2, 3))
    draws = set()
    for seed in range(8):
        key = jax.random.key(seed)
        eager = A.select_anchors(key, mask, num, block)
        again = jitted(key, mask, num, block)
        for a, b in zip(eager, again, strict=True):
            np.testing.assert_array_equal(a, b)  # integer / bool outputs: exact
        anchors, valid = np.asarray(eager[0]), np.asarray(eager[1])
        assert valid.all() and set(anchors) <= eligible and (np.diff(anchors) > 0).all()
        draws.add(tuple(anchors))
    # 8 draws of 8 out of 43 positions: P(any two coincide) <= 28 / C(43, 8) ~ 2.4e-7.
    assert len(draws) == 8


def test_slot_mask_and_indices():
    loss_mask = _mask(16, [2, 3, 4, 5, 9, 10])
    anchors = jnp.asarray([2, 9, 0], jnp.int32)
    valid = jnp.asarray([True, True, False])
    m = A.slot_loss_mask(loss_mask, anchors, valid, 3, sample_from_anchor=True)
    np.testing.assert_array_equal(m, [1, 1, 1, 1, 1, 0, 0, 0, 0])
    m = A.slot_loss_mask(loss_mask, anchors, valid, 3, sample_from_anchor=False)
    np.testing.assert_array_equal(m, [0, 1, 1, 0, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(
        A.target_indices(anchors, 3, 16, True), [2, 3, 4, 9, 10, 11, 0, 1, 2]
    )
    np.testing.assert_array_equal(
        A.target_indices(anchors, 3, 16, False), [1, 2, 3, 8, 9, 10, 15, 0, 1]
    )
    ids = jnp.arange(16) * 10
    np.testing.assert_array_equal(
        A.previous_tokens(ids, anchors[:2], 3, True), [[20, 30, 40], [90, 100, 110]]
    )
    np.testing.assert_array_equal(
        A.previous_tokens(ids, anchors[:2], 3, False), [[20, 20, 30], [90, 90, 100]]
    )


def test_rejects_nonpositive_anchor_count():
    with pytest.raises(ValueError, match="num_anchors must be positive"):
        A.select_anchors(jax.random.key(0), jnp.ones(8), 0, 2)


# --- per-document anchors (--anchor-sampling per-document)

# One long document beside short ones, then padding: 4 documents, S = 96, B = 4.
_DOC_LENGTHS = (60, 9, 12, 7)


def _packed_row(seq=96):
    doc = np.full(seq, -1, np.int32)
    start = 0
    for d, n in enumerate(_DOC_LENGTHS):
        doc[start : start + n] = d
        start += n
    mask = (doc >= 0).astype(np.int32)
    # Each document's first two tokens are its prompt (unsupervised).
    for d in range(len(_DOC_LENGTHS)):
        mask[np.flatnonzero(doc == d)[:2]] = 0
    return jnp.asarray(mask), jnp.asarray(doc)


def _eligible_per_doc(mask, doc, block):
    mask, doc = np.asarray(mask), np.asarray(doc)
    ok = (mask > 0) & (np.arange(len(mask)) < len(mask) - block) & (doc >= 0)
    return np.bincount(doc[ok], minlength=len(_DOC_LENGTHS)), ok


def test_per_document_shares_follow_supervised_tokens():
    """Every draw gives each document the floor or ceiling of its share A * n_d / N (so
    the short documents beside the long one are never starved), exactly A in all, each
    valid and distinct; over many draws the counts average to the share. The per-row
    rule gets the same shares only on average: some draws leave a short document out."""
    block, num = 4, 8
    mask, doc = _packed_row()
    n, ok = _eligible_per_doc(mask, doc, block)  # [58, 7, 10, 5]: N = 80
    share = num * n / n.sum()  # [5.8, 0.7, 1.0, 0.5]
    keys = jax.random.split(jax.random.key(3), 2000)
    draws = {}
    for rule in A.ANCHOR_SAMPLING:
        draw = jax.jit(
            jax.vmap(lambda k, rule=rule: A.sample_anchors(k, mask, doc, num, block, rule))
        )
        anchors, valid = (np.asarray(x) for x in draw(keys))
        assert valid.all()
        assert all(ok[r].all() and (np.diff(r) > 0).all() for r in anchors)
        draws[rule] = np.stack([np.bincount(np.asarray(doc)[r], minlength=4) for r in anchors])
    per_doc = draws["per-document"]
    assert (per_doc.sum(1) == num).all()
    assert (per_doc >= np.floor(share)).all() and (per_doc <= np.ceil(share)).all()
    # Unbiased: count_d is Bernoulli(frac(share_d)) + floor(share_d), sd <= 0.5 per draw,
    # so the mean of 2000 draws is within 0.5 / sqrt(2000) * 5 = 0.056 (5 sd) of the share.
    np.testing.assert_allclose(per_doc.mean(0), share, atol=0.06)
    # Per-row: the same expectation (hypergeometric), but document 2 (share 1.0) gets no
    # anchor in C(70, 8) / C(80, 8) = 33% of rows (document 1, share 0.7: 46%);
    # per-document it gets exactly one every time.
    # A document's count in a per-row draw is hypergeometric (8 of N = 80 positions, n_d
    # of them its own): the mean of 2000 draws lies within 5 of its standard deviations
    # (false alarm < 1e-6 per document for another PRNG's draws).
    p_d, draws_n = n / n.sum(), len(keys)
    sd = np.sqrt(num * p_d * (1 - p_d) * (n.sum() - num) / (n.sum() - 1) / draws_n)
    per_row_dev = np.abs(draws["per-row"].mean(0) - share)
    assert (per_row_dev <= 5 * sd).all(), (per_row_dev, 5 * sd)
    # The bound notices a bias of 0.15 anchor (one in seven rows moving an anchor).
    assert (np.abs(draws["per-row"].mean(0) - (share + [0.15, 0, -0.15, 0])) > 5 * sd).any()
    assert (draws["per-row"][:, 2] == 0).mean() > 0.25  # 2000 draws: sd 1.1%
    assert (per_doc[:, 2] == 1).all()


def test_per_document_draw_is_uniform_within_each_document():
    block, num = 4, 8
    mask, doc = _packed_row()
    n, ok = _eligible_per_doc(mask, doc, block)
    keys = jax.random.split(jax.random.key(4), 3000)
    draw = jax.jit(jax.vmap(lambda k: A.select_anchors_per_document(k, mask, doc, num, block)))
    anchors, _ = draw(keys)
    counts = np.bincount(np.asarray(anchors).ravel(), minlength=len(ok))
    assert counts[~ok].sum() == 0
    doc_np = np.asarray(doc)
    for d in range(4):
        # Position p of document d: P(drawn) = E[q_d] / n_d = A / N, for every p.
        pos = counts[ok & (doc_np == d)]
        expected = 3000 * num / n.sum()  # 300
        # Binomial(3000, 0.1): sd 16.4; 5 sd = 82 (fixed keys: deterministic).
        assert np.abs(pos - expected).max() < 5 * np.sqrt(3000 * 0.1 * 0.9), (d, pos)


def test_per_document_takes_every_position_when_the_budget_covers_them():
    """N <= A: both rules take every valid position (then invalid padding)."""
    block = 4
    mask, doc = _packed_row()
    n, ok = _eligible_per_doc(mask, doc, block)
    num = int(n.sum()) + 5
    for rule in A.ANCHOR_SAMPLING:
        anchors, valid = A.sample_anchors(jax.random.key(0), mask, doc, num, block, rule)
        anchors, valid = np.asarray(anchors), np.asarray(valid)
        np.testing.assert_array_equal(anchors[valid], np.flatnonzero(ok))
        assert not valid[n.sum() :].any() and (anchors[n.sum() :] == 0).all()


def test_per_document_anchors_are_a_function_of_the_key_alone():
    """Eager == jit for a key (resume: the trainer's keys are fold_in(key(seed), step),
    split per row); other keys give other draws. The default rule is the reference's,
    bit for bit."""
    block, num = 4, 8
    mask, doc = _packed_row()
    jitted = jax.jit(A.sample_anchors, static_argnums=(3, 4, 5))
    draws = set()
    for seed in range(6):
        key = jax.random.fold_in(jax.random.key(42), seed)
        eager = A.select_anchors_per_document(key, mask, doc, num, block)
        for a, b in zip(eager, jitted(key, mask, doc, num, block, "per-document"), strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(
            A.select_anchors(key, mask, num, block),
            jitted(key, mask, doc, num, block, "per-row"),
            strict=True,
        ):
            np.testing.assert_array_equal(a, b)
        draws.add(tuple(np.asarray(eager[0])))
    assert len(draws) == 6


def test_unknown_anchor_sampling_is_refused():
    mask, doc = _packed_row()
    with pytest.raises(ValueError, match="anchor sampling must be one of"):
        A.sample_anchors(jax.random.key(0), mask, doc, 4, 4, "per-token")
