"""Anchor selection against speculators 0.9.0's own sampling (``models/dflash/utils.py``,
``select_anchors``, the rule DSpark and DFlash training call per row), not against our
reading of it: the same rows (documents, loss masks, max anchors) are drawn ``DRAWS``
times by both trainers and the distributions of anchor positions are compared.

The law both must follow: the n eligible positions (loss mask set, p < S - block) and
k = min(A, n) of them drawn uniformly without replacement. Per draw, position i is taken
with probability p = k / n and the indicators have Var p(1-p), Cov -p(1-p)/(n-1); their
sum is exactly k. So over D independent draws the count vector C has covariance
D p(1-p) n/(n-1) (I - 11'/n), and

    T = (n-1)/n * sum_i (C_i - D p)^2 / (D p (1-p))   ~ chi2(n - 1)      (per position)

(the CLT over D draws; 11' drops out because sum_i (C_i - D p) = 0). For two independent
samplers of the same law the difference of their counts has twice that covariance:
T2 = (n-1)/n * sum_i (C_i - C'_i)^2 / (2 D p (1-p)) ~ chi2(n-1). Per document: the
number of anchors in document d per draw is hypergeometric(n, n_d, k); the histograms
of that number over D draws are compared by Pearson's chi-square, against the exact pmf
and between the two samplers (2 x m contingency table), after pooling cells to an
expected count >= 5.

Every test rejects at ``ALPHA`` = 1e-6 (a false alarm once in a million CI runs; the
draws are seeded, so a run is deterministic anyway). Power: a planted bias that never
draws the last eligible position (see ``test_a_planted_bias_fails``) moves T by about
D p / (1-p); the noncentral chi-square gives its probability of being caught, asserted
> 1 - 1e-9 below for each row.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

pytest.importorskip("speculators")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.reference

import jax  # noqa: E402
from scipy import stats  # noqa: E402
from speculators.models.dflash.utils import select_anchors as reference_select  # noqa: E402

from dspark_jax.anchors import select_anchors  # noqa: E402

ALPHA = 1e-6
DRAWS = 2000
BLOCK = 4


def _rows() -> list[tuple[str, np.ndarray, np.ndarray, int]]:
    """(name, loss_mask [S], document_ids [S], max anchors): packed rows of several
    documents with prompt (unsupervised) spans and padding, generated from a seed."""
    rng = np.random.default_rng(30)
    rows = []
    for name, seq, docs, num in (
        ("three-docs", 64, 3, 8),
        ("one-doc-sparse", 48, 1, 5),
        ("many-docs", 96, 6, 16),
        ("budget-half", 40, 2, 12),
    ):
        cuts = np.sort(rng.choice(np.arange(4, seq - 6), docs - 1, replace=False))
        doc = np.full(seq, -1, np.int32)
        bounds = [0, *cuts.tolist(), seq - int(rng.integers(0, 5))]  # trailing padding
        mask = np.zeros(seq, np.int32)
        for d, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            doc[lo:hi] = d
            prompt = int(rng.integers(1, max(2, (hi - lo) // 3)))  # unsupervised prompt
            mask[lo + prompt : hi] = rng.random(hi - lo - prompt) < 0.85  # and a few holes
        rows.append((name, mask, doc, num))
    return rows


ROWS = _rows()


def _eligible(mask: np.ndarray) -> np.ndarray:
    return (mask > 0) & (np.arange(len(mask)) < len(mask) - BLOCK)


def _ours(mask: np.ndarray, num: int, seed: int, bias: bool = False) -> np.ndarray:
    """[DRAWS, A] anchors (-1 where invalid) from dspark_jax.anchors.select_anchors.
    ``bias``: the planted bug, the last eligible position never drawn."""
    if bias:
        mask = mask.copy()
        mask[np.flatnonzero(_eligible(mask))[-1]] = 0
    keys = jax.random.split(jax.random.key(seed), DRAWS)
    draw = jax.jit(jax.vmap(lambda k: select_anchors(k, mask, num, BLOCK)))
    anchors, valid = (np.asarray(x) for x in draw(keys))
    return np.where(valid, anchors, -1)


@functools.cache
def _theirs(row: int) -> np.ndarray:
    """[DRAWS, A] anchors (-1 where invalid) from speculators' select_anchors on ROWS[row]
    (seeded by the row; computed once for both tests)."""
    _, mask, _, num = ROWS[row]
    torch.manual_seed(row)
    m = torch.from_numpy(mask[None].astype(np.int64))
    out = np.empty((DRAWS, num), np.int64)
    for i in range(DRAWS):
        anchors, valid = reference_select(m, num, BLOCK)
        out[i] = np.where(valid.numpy(), anchors.numpy(), -1)
    return out


def _position_counts(draws: np.ndarray, ok: np.ndarray) -> np.ndarray:
    counts = np.bincount(draws[draws >= 0].ravel(), minlength=len(ok))
    assert counts[~ok].sum() == 0, "an ineligible position was drawn"
    return counts[ok]


def _per_position_stat(counts: np.ndarray, k: int, other: np.ndarray | None = None) -> float:
    """T (against the law) or T2 (against ``other``), both ~ chi2(n-1) under the law."""
    n = len(counts)
    p = k / n
    var = DRAWS * p * (1 - p) * (1 if other is None else 2)
    diff = counts - (DRAWS * p if other is None else other)
    return float((n - 1) / n * np.sum(diff**2) / var)


def _pooled(expected: np.ndarray, *observed: np.ndarray):
    """Merge adjacent cells (in order) until each expected count is >= 5."""
    groups, cur = [], []
    for i in range(len(expected)):
        cur.append(i)
        if expected[cur].sum() >= 5:
            groups.append(cur)
            cur = []
    if cur:
        groups[-1].extend(cur)
    merge = lambda a: np.array([a[g].sum() for g in groups])  # noqa: E731
    return merge(expected), *(merge(o) for o in observed)


def _per_document_counts(draws: np.ndarray, doc: np.ndarray, d: int) -> np.ndarray:
    """[DRAWS] anchors in document d per draw."""
    in_doc = np.where(draws >= 0, doc[np.maximum(draws, 0)] == d, False)
    return in_doc.sum(1)


def _check_row(mask, doc, num, ours: np.ndarray, theirs: np.ndarray) -> list[str]:
    """Every test of the module's docstring on one row; the failures, as text."""
    ok = _eligible(mask)
    n = int(ok.sum())
    k = min(num, n)
    crit = stats.chi2.isf(ALPHA, n - 1)
    failures = []
    # the layout: k valid anchors, ascending and distinct, then invalid padding
    for name, draws in (("ours", ours), ("theirs", theirs)):
        valid = draws >= 0
        if not (valid[:, :k].all() and not valid[:, k:].any()):
            failures.append(f"{name}: not k={k} valid anchors first")
        if not (np.diff(draws[:, :k], axis=1) > 0).all():
            failures.append(f"{name}: valid anchors not strictly ascending")
    c_ours, c_theirs = _position_counts(ours, ok), _position_counts(theirs, ok)
    for label, t in (
        ("ours vs the law", _per_position_stat(c_ours, k)),
        ("theirs vs the law", _per_position_stat(c_theirs, k)),
        ("ours vs theirs", _per_position_stat(c_ours, k, c_theirs)),
    ):
        if t > crit:
            failures.append(f"per position, {label}: T={t:.1f} > {crit:.1f} (df {n - 1})")
    for d in np.unique(doc[ok]):
        n_d = int((ok & (doc == d)).sum())
        support = np.arange(k + 1)
        pmf = stats.hypergeom.pmf(support, n, n_d, k)
        h_ours = np.bincount(_per_document_counts(ours, doc, d), minlength=k + 1)
        h_theirs = np.bincount(_per_document_counts(theirs, doc, d), minlength=k + 1)
        exp, o_ours, o_theirs = _pooled(DRAWS * pmf, h_ours, h_theirs)
        if len(exp) < 2:
            continue  # one possible count (the document is always fully covered or empty)
        cells = len(exp)
        for label, obs in (("ours", o_ours), ("theirs", o_theirs)):
            t = float(np.sum((obs - exp) ** 2 / exp))
            if t > stats.chi2.isf(ALPHA, cells - 1):
                failures.append(f"document {d}, {label} vs hypergeometric: chi2={t:.1f}")
        table = np.stack([o_ours, o_theirs])
        table = table[:, table.sum(0) > 0]
        if table.shape[1] > 1:
            t, _, dof, _ = stats.chi2_contingency(table, correction=False)
            if t > stats.chi2.isf(ALPHA, dof):
                failures.append(f"document {d}, ours vs theirs: chi2={t:.1f} (df {dof})")
    return failures


@pytest.mark.parametrize("row", range(len(ROWS)), ids=[r[0] for r in ROWS])
def test_anchor_positions_follow_speculators_law(row):
    _, mask, doc, num = ROWS[row]
    failures = _check_row(mask, doc, num, _ours(mask, num, row), _theirs(row))
    assert not failures, failures


@pytest.mark.parametrize("row", range(len(ROWS)), ids=[r[0] for r in ROWS])
def test_a_planted_bias_fails(row):
    """Never drawing the last eligible position (an off-by-one in the block cut-off) is
    caught, by power computed from the noncentral chi-square, and in fact."""
    _, mask, doc, num = ROWS[row]
    n = int(_eligible(mask).sum())
    p = min(num, n) / n
    # Biased: C_last ~ 0 instead of D p; the other n-1 counts share D k, each + D p/(n-1).
    # Noncentrality of T: (n-1)/n * ((D p)^2 + (n-1) (D p/(n-1))^2) / (D p (1-p)).
    lam = (n - 1) / n * (DRAWS * p) ** 2 * (1 + 1 / (n - 1)) / (DRAWS * p * (1 - p))
    power = stats.ncx2.sf(stats.chi2.isf(ALPHA, n - 1), n - 1, lam)
    assert power > 1 - 1e-9, (lam, power)
    failures = _check_row(mask, doc, num, _ours(mask, num, row, bias=True), _theirs(row))
    assert any("per position, ours vs the law" in f for f in failures), failures
    assert any("per position, ours vs theirs" in f for f in failures), failures
