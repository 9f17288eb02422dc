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
