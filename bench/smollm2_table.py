"""The real-model table of bench/smollm2_run.sh, from its run folder, as markdown and JSON.

    python bench/smollm2_table.py --out runs/smollm2 [--json FILE]

Per drafter (ours in-step, ours from files and speculators 0.9.0 from the same files, one
row per seed): its last validation ``accept_len`` (each trainer's own, teacher-forced on
the training distribution) and the served-equivalent acceptance length (llama.cpp's rules)
on the answers llama.cpp served, per dataset (``judge/<name>/summary.json``). Then, for the
drafter that was served: served vs predicted acceptance length per verifier GGUF and
dataset, and decode tokens/s with and without it (``served-<gguf>-<data>.json``).
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path


def last_val(path: Path, key: str) -> float | None:
    """The last validation record's ``key`` in a metrics JSONL (ours or the reference's)."""
    val = None
    if path.is_file():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "val" in rec:
                val = rec["val"].get(key, val)
    return val


def drafters(out: Path) -> list[dict]:
    rows = []
    names = ["instep"] + sorted(
        Path(p).name for p in glob.glob(str(out / "judge" / "*")) if Path(p).name != "instep"
    )
    for name in names:
        summary = out / "judge" / name / "summary.json"
        if not summary.is_file():
            continue
        datasets = json.loads(summary.read_text())["datasets"]
        kind, _, seed = name.partition("-")
        if kind == "ref":
            trainer, val = "speculators 0.9.0", last_val(out / name / "metrics.jsonl", "accept_len")
        else:
            metrics = glob.glob(str(out / name / "logs" / "**" / "metrics.jsonl"), recursive=True)
            trainer = "dspark-jax"
            val = last_val(Path(metrics[0]), "accept_len_epoch") if metrics else None
        rows.append({
            "drafter": name, "trainer": trainer,
            "data": "verifier in the step" if kind == "instep" else "hidden-state files",
            "seed": int(seed) if seed else 42, "val_accept_len": val,
            "served_equivalent": {k: v["served"]["acceptance_length"] for k, v in datasets.items()},
        })  # fmt: skip
    return rows


def served(out: Path) -> list[dict]:
    rows = []
    for path in sorted(out.glob("served-*-*.json")):
        _, gguf, data = path.stem.split("-", 2)
        rec = json.loads(path.read_text())
        speed = rec.get("decode_speed") or {}
        rows.append({
            "verifier_gguf": gguf, "dataset": data, "prompts": rec["prompts"],
            "served": rec["served"]["acceptance_length"],
            "predicted": rec["predicted"]["acceptance_length"],
            "prompts_by_why": rec["prompts_by_why"],
            "tokens_per_s": speed.get("median_tokens_per_s"), "speedup": speed.get("speedup"),
            "speed_prompts": speed.get("prompts"),
        })  # fmt: skip
    return rows


def fmt(x, nd=3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def markdown(rows: list[dict], srv: list[dict]) -> str:
    sets = sorted({k for r in rows for k in r["served_equivalent"]})
    lines = [
        "| drafter | trainer | data | seed | val accept_len | "
        + " | ".join(f"served-equivalent, {s}" for s in sets)
        + " |",
        "| --- " * (5 + len(sets)) + "|",
    ]
    for r in rows:
        cells = [r["drafter"], r["trainer"], r["data"], str(r["seed"]), fmt(r["val_accept_len"])]
        cells += [fmt(r["served_equivalent"].get(s)) for s in sets]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| verifier GGUF | dataset | prompts | served | predicted | prompts by why | "
        "decode tok/s with / without | speed-up |",
        "| --- " * 8 + "|",
    ]
    for s in srv:
        tps = s["tokens_per_s"]
        speed = "-" if not tps else f"{tps['with']:.1f} / {tps['without']:.1f}"
        why = ", ".join(f"{k} {v}" for k, v in s["prompts_by_why"].items())
        lines.append(
            f"| {s['verifier_gguf']} | {s['dataset']} | {s['prompts']} | {fmt(s['served'])} | "
            f"{fmt(s['predicted'])} | {why} | {speed} | {fmt(s['speedup'], 2)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/smollm2", help="bench/smollm2_run.sh's OUT")
    p.add_argument("--json", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    out = Path(args.out)
    rows, srv = drafters(out), served(out)
    if not rows and not srv:
        p.error(f"{out}: no judge/*/summary.json and no served-*.json (run bench/smollm2_run.sh)")
    print(markdown(rows, srv))
    if args.json:
        Path(args.json).write_text(json.dumps({"drafters": rows, "served": srv}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
