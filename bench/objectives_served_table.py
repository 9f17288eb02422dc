"""The table of bench/README.md, "Objectives judged by served acceptance" (issue 44): each
objective's served-equivalent greedy acceptance (``python -m dspark_jax.eval``'s served
walk, vLLM's rules) on the held-out prompts answered greedily by the verifier, its ratio
to the same seed's baseline, and the evaluator's older figures on the same answers.

Reads ``<runs>/<variant>_s<seed>/eval/summary.json`` (bench/objectives_served.sh); prints
one JSON line per run (``--results`` appends them to a JSONL file), then the markdown table.

    python bench/objectives_served_table.py [--runs runs/objectives_served] [--seeds 42 1 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

VARIANTS = (
    ("baseline", "ce 0.1 + tv 0.9, 2 epochs (the demo's recipe)"),
    ("opd_tail", "Draft-OPD for epoch 2 on the same schedule (issue 28)"),
    ("opd", "1 SFT epoch, then Draft-OPD 1 epoch at a fresh schedule, greedy drafts"),
    ("opd_sampled", "the same, sampled drafts"),
    ("opd_lr0.0003", "the same, greedy drafts, the OPD epoch at lr 3e-4"),
    ("dpard_a0.25", "D-PARD, alpha 0.25"),
    ("dpard_a0.5", "D-PARD, alpha 0.5"),
    ("dpard_a0.75", "D-PARD, alpha 0.75"),
)
DATASET = "heldout_greedy"
COLUMNS = (  # (key, header): served figures, then the evaluator's per-anchor ones
    ("served", "served acceptance length (vLLM rules)"),
    ("tokens_per_pass", "served tokens per verifier pass"),
    ("analytic/free_running", "free-running analytic"),
    ("greedy/free_running", "free-running greedy"),
    ("analytic/teacher_forcing", "teacher-forced analytic"),
)


def figures(summary: dict) -> dict[str, float]:
    entry = summary["datasets"][DATASET]
    out = {"served": entry["served"]["acceptance_length"],
           "tokens_per_pass": entry["served"]["tokens_per_pass"]}  # fmt: skip
    for key, _ in COLUMNS[2:]:
        out[key] = entry["acceptance"][key]["acceptance_length"]
    return out


def cell(values: list[float], unit: str = "") -> str:
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.3f}{unit}"
    sd = statistics.stdev(values)
    return f"{statistics.mean(values):.3f}{unit} ± {sd:.3f} ({len(values)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="runs/objectives_served")
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    ap.add_argument("--results", help="append the per-run lines to this JSONL file")
    args = ap.parse_args()
    runs: dict[tuple[str, int], dict[str, float]] = {}
    lines = []
    for variant, _ in VARIANTS:
        for seed in args.seeds:
            path = Path(args.runs) / f"{variant}_s{seed}" / "eval" / "summary.json"
            if path.exists():
                runs[(variant, seed)] = figures(json.loads(path.read_text()))
                line = {"run": f"{variant}_s{seed}", "dataset": DATASET}
                line |= {k: round(v, 4) for k, v in runs[(variant, seed)].items()}
                lines.append(line)
                print(json.dumps(line))
    if args.results:
        with open(args.results, "a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
    header = ["drafter", "served vs the baseline (same seed)"] + [h for _, h in COLUMNS]
    print("\n| " + " | ".join(header) + " |")
    print("| " + " | ".join(["---"] * len(header)) + " |")
    for variant, title in VARIANTS:
        seeds = [s for s in args.seeds if (variant, s) in runs]
        if not seeds:
            continue
        ratio = [
            runs[(variant, s)]["served"] / runs[("baseline", s)]["served"]
            for s in seeds
            if ("baseline", s) in runs
        ]
        cells = [cell([runs[(variant, s)][k] for s in seeds]) for k, _ in COLUMNS]
        print("| " + " | ".join([f"{title} (seeds {', '.join(map(str, seeds))})",
                                 cell(ratio, "x"), *cells]) + " |")  # fmt: skip


if __name__ == "__main__":
    main()
