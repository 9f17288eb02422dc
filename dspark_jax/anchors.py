"""Anchor sampling and block index math (docs/math.md, "Anchors and blocks"), pure functions.

Per packed row of S tokens, exactly A anchors are drawn so shapes stay static: the
valid ones first, sorted ascending, then padding anchors at position 0 marked
invalid, the same layout as speculators' ``select_anchors``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def select_anchors(
    key: jax.Array, loss_mask: jax.Array, num_anchors: int, block_size: int
) -> tuple[jax.Array, jax.Array]:
    """Draw min(A, #valid) anchors uniformly without replacement.

    loss_mask: [S] (0/1). A position p is a valid anchor iff loss_mask[p] == 1 and
    p < S - block_size. Returns anchors [A] int32 (valid ones sorted ascending,
    then zeros) and valid [A] bool.
    """
    (seq_len,) = loss_mask.shape
    if num_anchors <= 0:
        raise ValueError(f"num_anchors must be positive, got {num_anchors}")
    positions = jnp.arange(seq_len, dtype=jnp.int32)
    eligible = (loss_mask > 0) & (positions < seq_len - block_size)
    # Random keys on eligible positions, +inf elsewhere: the A smallest keys are a
    # uniform sample without replacement among eligible positions.
    scores = jnp.where(eligible, jax.random.uniform(key, (seq_len,)), jnp.inf)
    k = min(num_anchors, seq_len)
    neg_top, picked = jax.lax.top_k(-scores, k)
    picked_valid = jnp.isfinite(neg_top)
    # Sort picked positions ascending, invalid ones last (sort key seq_len).
    order_key = jnp.where(picked_valid, picked, seq_len)
    order = jnp.argsort(order_key)
    anchors = jnp.where(picked_valid[order], picked[order], 0).astype(jnp.int32)
    valid = picked_valid[order]
    if k < num_anchors:  # more anchors than positions: pad with invalid zeros
        pad = num_anchors - k
        anchors = jnp.concatenate([anchors, jnp.zeros((pad,), jnp.int32)])
        valid = jnp.concatenate([valid, jnp.zeros((pad,), bool)])
    return anchors, valid


def block_indices(anchors: jax.Array, block_size: int) -> jax.Array:
    """Row positions of every block slot: [A] -> [A*B], slot k of anchor p at p + k."""
    offsets = jnp.arange(block_size, dtype=anchors.dtype)
    return (anchors[:, None] + offsets[None, :]).reshape(-1)


def target_indices(
    anchors: jax.Array, block_size: int, seq_len: int, sample_from_anchor: bool
) -> jax.Array:
    """Row position whose verifier distribution is slot k's target: [A*B].

    sample_from_anchor: p + k (slot k predicts token p+k+1); otherwise p + k - 1
    (wrapping like the reference; slot 0 is masked out of the loss anyway).
    """
    idx = block_indices(anchors, block_size)
    return idx if sample_from_anchor else (idx - 1) % seq_len


def slot_loss_mask(
    loss_mask: jax.Array,
    anchors: jax.Array,
    valid: jax.Array,
    block_size: int,
    sample_from_anchor: bool,
) -> jax.Array:
    """m[j*B + k] = loss_mask[p_j + k] * valid_j (slot 0 zeroed without sample_from_anchor).

    loss_mask [S], anchors [A], valid [A] -> [A*B] float32.
    """
    m = loss_mask[block_indices(anchors, block_size)].astype(jnp.float32)
    m = m * jnp.repeat(valid.astype(jnp.float32), block_size)
    if not sample_from_anchor:
        slot = jnp.arange(m.shape[0]) % block_size
        m = jnp.where(slot == 0, 0.0, m)
    return m


def previous_tokens(
    input_ids: jax.Array, anchors: jax.Array, block_size: int, sample_from_anchor: bool
) -> jax.Array:
    """The token the Markov head conditions slot k on (teacher forcing): [A, B].

    sample_from_anchor: input_ids[p + k] (the token at the position slot k predicts
    from). Otherwise slot k predicts token p + k, so it conditions on p + k - 1, with
    slot 0 repeating the anchor token like the reference.
    """
    tokens = input_ids[block_indices(anchors, block_size)].reshape(-1, block_size)
    if sample_from_anchor:
        return tokens
    return jnp.concatenate([tokens[:, :1], tokens[:, :-1]], axis=1)
