"""The table of bench/README.md, "On-policy data and per-document anchors": acceptance
lengths of the demo drafters (baseline, on-policy, per-document anchors, both, D-PARD,
Draft-OPD, and the reference trainer's baseline) on the two held-out sets, mean and spread over
seeds.

Reads ``<runs>/<variant>_s<seed>/eval*/summary.json`` (``python -m dspark_jax.eval``
with ``--dataset heldout=...`` and/or ``--dataset heldout_onpolicy=...``, in one
output folder or several); prints one JSON line per run, then the markdown table. A
run without a summary is listed as missing.

    python bench/onpolicy_table.py --runs RUNS [--seeds 42 1 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

VARIANTS = (
    ("reference", "reference trainer (speculators 0.9.0), original data"),
    ("baseline", "ours, original data (per-row anchors)"),
    ("onpolicy", "ours, on-policy data"),
    ("perdoc", "ours, original data, per-document anchors"),
    ("both", "ours, on-policy data, per-document anchors"),
    ("dpard", "ours, original data, D-PARD (renyi_half, dpard, alpha 0.5)"),
    ("opd", "ours, original data, Draft-OPD after a ce/tv epoch"),
    # bench/objectives_measure.sh with TAG=_onpolicy (the on-policy rows)
    ("baseline_onpolicy", "ours, on-policy data, in-step"),
    ("dpard_onpolicy", "ours, on-policy data, D-PARD"),
    ("opd_onpolicy", "ours, on-policy data, Draft-OPD after a ce/tv epoch"),
)
# The run each variant is paired with (same seed): the baseline on the same data, except
# the on-policy baseline, paired with the original-data one (the data's effect).
PAIRED = {
    "dpard_onpolicy": "baseline_onpolicy",
    "opd_onpolicy": "baseline_onpolicy",
    "baseline_onpolicy": "baseline",
}
DATASETS = (
    ("heldout_onpolicy", "held-out prompts, verifier's answers"),
    ("heldout", "held-out, original answers"),
)
METHODS = (
    ("analytic/free_running", "free-running analytic"),
    ("greedy/free_running", "free-running greedy"),
    ("analytic/teacher_forcing", "teacher-forced analytic"),
)


def cell(values: list[float]) -> str:
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.3f} (1 seed)"
    sd = statistics.stdev(values)
    return f"{statistics.mean(values):.3f} ± {sd:.3f} ({len(values)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, help="folder of <variant>_s<seed> run folders")
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    args = ap.parse_args()
    values: dict[tuple[str, str, str], list[float]] = {}
    by_seed: dict[tuple[str, str, str, int], float] = {}
    missing = []
    for variant, _ in VARIANTS:
        for seed in args.seeds:
            paths = sorted((Path(args.runs) / f"{variant}_s{seed}").glob("eval*/summary.json"))
            if not paths:
                missing.append(f"{variant}_s{seed}")
                continue
            found = {}
            for path in paths:
                found.update(json.loads(path.read_text())["datasets"])
            line = {"run": f"{variant}_s{seed}"}
            for ds, _ in DATASETS:
                acc = found.get(ds, {}).get("acceptance", {})
                for key, _ in METHODS:
                    if key in acc:
                        v = acc[key]["acceptance_length"]
                        values.setdefault((variant, ds, key), []).append(v)
                        by_seed[(variant, ds, key, seed)] = v
                        line[f"{ds}:{key}"] = round(v, 4)
            print(json.dumps(line))
    header = ["drafter"] + [f"{d}: {m}" for _, d in DATASETS for _, m in METHODS]
    print()
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join(["---"] * len(header)) + " |")
    ran = [(v, t) for v, t in VARIANTS if any(k[0] == v for k in values)]
    for variant, title in ran:
        cells = [
            cell(values.get((variant, ds, key), [])) for ds, _ in DATASETS for key, _ in METHODS
        ]
        print("| " + " | ".join([title, *cells]) + " |")
    # Paired with the baseline of the same seed (same rows, anchors and first epoch):
    # the per-seed difference cancels what the seeds share.
    print()
    print("| minus the same seed's baseline | " + " | ".join(header[1:]) + " |")
    print("| " + " | ".join(["---"] * len(header)) + " |")
    for variant, title in ran:
        base = PAIRED.get(variant, "baseline")
        if variant == "baseline":
            continue
        if variant == "baseline_onpolicy":
            title += " (minus the original-data baseline)"
        cells = []
        for ds, _ in DATASETS:
            for key, _ in METHODS:
                diffs = [
                    by_seed[(variant, ds, key, s)] - by_seed[(base, ds, key, s)]
                    for s in args.seeds
                    if (variant, ds, key, s) in by_seed and (base, ds, key, s) in by_seed
                ]
                cells.append(cell(diffs).replace("(1 seed)", "(1)"))
        print("| " + " | ".join([title, *cells]) + " |")
    if missing:
        print(f"\nmissing: {' '.join(missing)}")


if __name__ == "__main__":
    main()
