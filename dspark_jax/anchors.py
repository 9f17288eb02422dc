"""Anchor sampling and block index math (docs/math.md, "Anchors and blocks"), pure functions.

Per packed row of S tokens, exactly A anchors are drawn so shapes stay static: the
valid ones first, sorted ascending, then padding anchors at position 0 marked
invalid, the same layout as speculators' ``select_anchors``.

Two rules pick them (``--anchor-sampling``):

* ``per-row`` (the reference's, the default): A positions uniformly without
  replacement among the row's eligible ones, whatever document they belong to
  (``select_anchors``).
* ``per-document``: the row's budget of A anchors is first split over its documents in
  proportion to their eligible (supervised) positions, each document getting the floor
  or the ceiling of its share ``A * n_d / N`` (systematic rounding: unbiased, and the
  shares add up to exactly A), then each document's quota is drawn uniformly without
  replacement among its own positions (``select_anchors_per_document``). Same
  eligibility, same expected anchors per document, same compute; what changes is that a
  short document packed beside a long one gets its share every time instead of by
  chance (per-row, a document with 30 of a row's 900 supervised positions and A = 32
  gets no anchor at all in a third of the rows). speculators PR #1071 (unmerged) instead
  gives every document A anchors, which multiplies the compute by the documents per row;
  this keeps its useful part, no starved document, within the reference's budget.
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


def select_anchors_per_document(
    key: jax.Array,
    loss_mask: jax.Array,
    document_ids: jax.Array,
    num_anchors: int,
    block_size: int,
) -> tuple[jax.Array, jax.Array]:
    """Draw min(A, #valid) anchors, each document's count proportional to its valid ones.

    loss_mask, document_ids: [S] (document ids 0.. in row order, -1 on padding; the
    packing's ``document_ids``). Valid anchors as in ``select_anchors``. With N valid
    positions, n_d of them in document d: if N <= A every valid position is taken (as
    per-row); otherwise document d gets q_d = floor((E_d A + r) / N) - floor((E_{d-1} A +
    r) / N) anchors, E_d = n_0 + ... + n_d and r uniform in [0, N): q_d is floor or
    ceil of A n_d / N, E[q_d] = A n_d / N, sum q_d = A. Within a document, the q_d
    positions of smallest uniform keys (uniform without replacement). Same output layout
    as ``select_anchors``; a function of the key alone (static shapes, jit-friendly).
    """
    (seq_len,) = loss_mask.shape
    if num_anchors <= 0:
        raise ValueError(f"num_anchors must be positive, got {num_anchors}")
    if seq_len * (num_anchors + 1) >= 2**32:  # E_d * A + r < S * (A + 1) in uint32
        raise ValueError(
            f"per-document anchors need S * (A + 1) < 2**32, got S={seq_len}, A={num_anchors}"
        )
    k_scores, k_offset = jax.random.split(key)
    positions = jnp.arange(seq_len, dtype=jnp.int32)
    eligible = (loss_mask > 0) & (positions < seq_len - block_size) & (document_ids >= 0)
    # Documents are numbered 0.. within the row, so fewer than S of them; ineligible
    # positions go to segment S (dropped by segment_sum, sorted last below).
    doc = jnp.where(eligible, document_ids.astype(jnp.int32), seq_len)
    counts = jax.ops.segment_sum(eligible.astype(jnp.uint32), doc, num_segments=seq_len)
    total = counts.sum()
    ends = jnp.cumsum(counts)  # E_d
    starts = ends - counts  # E_{d-1}
    a = jnp.uint32(num_anchors)
    safe_total = jnp.maximum(total, 1)
    r = jax.random.randint(k_offset, (), 0, safe_total.astype(jnp.int32)).astype(jnp.uint32)
    quota = (ends * a + r) // safe_total - (starts * a + r) // safe_total
    quota = jnp.where(total <= a, counts, quota)
    # Rank of each eligible position among its document's by a uniform key: sort by
    # (document, key); the rank is the sorted index minus the document's first index.
    scores = jax.random.uniform(k_scores, (seq_len,))
    order = jnp.lexsort((scores, doc))
    first = starts.astype(jnp.int32)  # eligible positions sort by document first
    rank_sorted = positions - first[jnp.minimum(doc[order], seq_len - 1)]
    chosen_sorted = (doc[order] < seq_len) & (
        rank_sorted < quota[jnp.minimum(doc[order], seq_len - 1)].astype(jnp.int32)
    )
    chosen = jnp.zeros((seq_len,), bool).at[order].set(chosen_sorted)
    # Chosen positions ascending, then padding: the A smallest of (position or S).
    k = min(num_anchors, seq_len)
    neg_top, _ = jax.lax.top_k(-jnp.where(chosen, positions, seq_len), k)
    picked = -neg_top  # ascending
    valid = picked < seq_len
    anchors = jnp.where(valid, picked, 0).astype(jnp.int32)
    if k < num_anchors:
        pad = num_anchors - k
        anchors = jnp.concatenate([anchors, jnp.zeros((pad,), jnp.int32)])
        valid = jnp.concatenate([valid, jnp.zeros((pad,), bool)])
    return anchors, valid


ANCHOR_SAMPLING = ("per-row", "per-document")


def sample_anchors(
    key: jax.Array,
    loss_mask: jax.Array,
    document_ids: jax.Array,
    num_anchors: int,
    block_size: int,
    sampling: str = "per-row",
) -> tuple[jax.Array, jax.Array]:
    """``--anchor-sampling``: per-row (``select_anchors``, the reference's rule, which
    ignores documents) or per-document (``select_anchors_per_document``)."""
    if sampling == "per-row":
        return select_anchors(key, loss_mask, num_anchors, block_size)
    if sampling == "per-document":
        return select_anchors_per_document(key, loss_mask, document_ids, num_anchors, block_size)
    raise ValueError(f"anchor sampling must be one of {ANCHOR_SAMPLING}, got {sampling!r}")


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
