"""How --max-anchors anchors fall on the documents of packed rows, per-row vs
per-document (dspark_jax/anchors.py), on a prepared dataset: exact expectations from
the packing plan, no drawing, no hidden states read.

Per row with N valid anchor positions (loss_mask == 1, p < S - B) and A anchors
(N > A), a document with n of them gets, per-row, a hypergeometric count (no anchor
with probability C(N - n, A) / C(N, A)); per-document, floor or ceil of A n / N (no
anchor with probability 1 - frac(A n / N) when A n / N < 1, else never). Both give each
valid position probability min(1, A / N). Prints one JSON line: the share of documents
(and of documents shorter than the median) that get no anchor in their row, and the
share of supervised positions that are anchors, per rule.

    python bench/anchor_coverage.py runs/demo/data --seq 1024 --anchors 32 --block 8
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np


def log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--train-data-ratio", type=float, default=0.9)
    args = ap.parse_args()
    import datasets

    from dspark_jax.data.packing import plan_epoch

    ds = datasets.load_from_disk(args.data)
    n_train = int(len(ds) * args.train_data_ratio)
    masks = [np.asarray(m, np.int8) for m in ds.select(range(n_train))["loss_mask"]]
    lengths = np.array([len(m) for m in masks])
    plan = plan_epoch(lengths, args.seq, 1, args.seed, 0)
    S, A, B = args.seq, args.anchors, args.block
    docs_n, zero_row, zero_doc, covered_pos = [], [], [], 0
    supervised = 0
    for step in range(plan.num_steps):
        counts, fill = [], 0
        for d in plan.row(step, 0):
            m = masks[d][: S - fill]
            pos = np.arange(fill, fill + len(m))
            counts.append(int(((m > 0) & (pos < S - B)).sum()))
            fill += len(m)
            if fill >= S:
                break
        total = sum(counts)
        supervised += total
        covered_pos += min(A, total)
        for n in counts:
            if n == 0:
                continue
            docs_n.append(n)
            if total <= A:
                zero_row.append(0.0)
                zero_doc.append(0.0)
                continue
            zero_row.append(
                math.exp(log_comb(total - n, A) - log_comb(total, A)) if total - n >= A else 0.0
            )
            share = A * n / total
            zero_doc.append(1.0 - share if share < 1 else 0.0)
    docs_n = np.array(docs_n)
    short = docs_n < np.median(docs_n)
    zero_row, zero_doc = np.array(zero_row), np.array(zero_doc)
    print(
        json.dumps(
            {
                "data": args.data,
                "rows": plan.num_steps,
                "documents": len(docs_n),
                "S": S,
                "A": A,
                "B": B,
                "anchors_per_supervised_position": round(covered_pos / supervised, 4),
                "docs_without_anchor": {
                    "per-row": round(float(zero_row.mean()), 4),
                    "per-document": round(float(zero_doc.mean()), 4),
                },
                "short_docs_without_anchor": {
                    "per-row": round(float(zero_row[short].mean()), 4),
                    "per-document": round(float(zero_doc[short].mean()), 4),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
