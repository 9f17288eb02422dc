"""Step time and memory of both implementations as S (total seq len) and A (max anchors) double.

Each point is one ``bench/train_step.py`` subprocess (its own peak RSS) on the ``small``
preset's drafter with S or A overridden; the other one stays at the preset's value
(S 2048, A 128). Measured per point:

* step time: median of the timed steps;
* memory, JAX: the compiled step's temp memory (``memory_analysis()``: activations and
  scratch that XLA allocates per step) and the process's peak RSS;
* memory, reference: the step's RSS growth (peak RSS minus RSS after setup: what the
  forward/backward/optimizer step allocates on top of weights and optimizer state) and
  the peak RSS, plus the analytic size of its dense masks + eager attention + full logits.

Exponents are log-log slopes: least squares over all points (``slope_fit``) and between the
two largest points (``slope_last``, the asymptotic one). Results are appended to a JSONL
file (the latest point of each kind wins); ``--plot-only`` refits and redraws from it, so
the sweep can be split into invocations of under 5 minutes each on 2 cores, e.g.:

    python bench/scaling.py --axis S --impl jax --points 1024 2048 4096 8192
    python bench/scaling.py --axis S --impl jax --points 16384 32768
    python bench/scaling.py --axis S --impl reference --points 1024 2048 4096 8192
    python bench/scaling.py --axis S --impl reference --points 16384
    python bench/scaling.py --axis S --impl reference --points 32768
    python bench/scaling.py --axis A --impl jax --points 32 64 128
    python bench/scaling.py --axis A --impl jax --points 256 512
    python bench/scaling.py --axis A --impl reference --points 32 64 128
    python bench/scaling.py --axis A --impl reference --points 256 512
    python bench/scaling.py --plot-only            # fits + bench/results/scaling.png

Needs matplotlib for the plot (the optional ``bench`` extra). Prints one JSON line per
measurement and per fit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_POINTS = {"S": [1024, 2048, 4096, 8192, 16384, 32768], "A": [32, 64, 128, 256, 512]}
BASE = {"S": 2048, "A": 128}  # the small preset's


def run_point(impl: str, axis: str, value: int, args) -> dict:
    seq = value if axis == "S" else BASE["S"]
    anchors = value if axis == "A" else BASE["A"]
    warmup = args.warmup if impl == "jax" else args.ref_warmup
    cmd = [
        sys.executable,
        str(HERE / "train_step.py"),
        "--impl",
        impl,
        "--preset",
        args.preset,
        "--seq",
        str(seq),
        "--anchors",
        str(anchors),
        "--steps",
        str(args.steps),
        "--warmup",
        str(warmup),
        "--hidden-states-dtype",
        args.hidden_states_dtype,
    ]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-3000:])
        return {
            "bench": "scaling_point",
            "impl": impl,
            "axis": axis,
            "S": seq,
            "A": anchors,
            "error": f"exit {proc.returncode}",
        }
    rec = next(
        json.loads(x)
        for x in proc.stdout.splitlines()
        if x.startswith("{") and json.loads(x).get("bench") == "train_step"
    )
    out = {
        "bench": "scaling_point",
        "impl": impl,
        "axis": axis,
        "preset": args.preset,
        "S": seq,
        "A": anchors,
        "dtype": args.hidden_states_dtype,
        "step_s": rec["step_s_median"],
        "step_s_all": rec["step_s_all"],
        "peak_rss_mib": rec["peak_rss_mib"],
        "loadavg": rec["loadavg"],
    }
    if impl == "jax":
        out["memory_mib"] = rec["compiled_temp_mib"]
        out["memory_kind"] = "compiled temp"
        out["compile_s"] = rec["compile_s"]
    else:
        out["memory_mib"] = round(rec["peak_rss_mib"] - rec["rss_setup_mib"], 1)
        out["memory_kind"] = "step RSS growth"
        model = rec["reference_model_gib"]
        out["analytic_mib"] = round(
            1024
            * (model["dense_mask_gib"] + model["eager_attention_gib"] + model["full_logits_gib"]),
            1,
        )
    return out


def slope(xs: list[float], ys: list[float]) -> float | None:
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return round(sum((p[0] - mx) * (p[1] - my) for p in pts) / den, 3)


def latest(records: list[dict]) -> dict[tuple, dict]:
    """The last measurement of each (impl, axis, S, A, dtype)."""
    out = {}
    for r in records:
        if r.get("bench") == "scaling_point" and "error" not in r:
            out[(r["impl"], r["axis"], r["S"], r["A"], r.get("dtype", "bfloat16"))] = r
    return out


def fits(points: dict[tuple, dict]) -> list[dict]:
    out = []
    series: dict[tuple, list[dict]] = {}
    for (impl, axis, _, _, dtype), r in points.items():
        series.setdefault((impl, axis, dtype), []).append(r)
    for (impl, axis, dtype), rs in sorted(series.items()):
        rs.sort(key=lambda r: r[axis])
        xs = [r[axis] for r in rs]
        rec = {"bench": "scaling_fit", "impl": impl, "axis": axis, "dtype": dtype, "points": xs}
        for metric in ("step_s", "memory_mib", "peak_rss_mib", "analytic_mib"):
            ys = [r.get(metric) for r in rs]
            if all(y is not None for y in ys):
                rec[f"{metric}_slope_fit"] = slope(xs, ys)
                rec[f"{metric}_slope_last"] = slope(xs[-2:], ys[-2:])
        rec["memory_kind"] = rs[0].get("memory_kind")
        out.append(rec)
    return out


def plot(points: dict[tuple, dict], fit_recs: list[dict], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    colors = {"jax": "tab:blue", "reference": "tab:red"}
    slopes = {(f["impl"], f["axis"], f["dtype"]): f for f in fit_recs}
    dtypes = sorted({k[4] for k in points})
    for col, axis in enumerate(("S", "A")):
        for dtype in dtypes:
            for impl in ("jax", "reference"):
                rs = sorted(
                    (
                        r
                        for k, r in points.items()
                        if k[0] == impl and k[1] == axis and k[4] == dtype
                    ),
                    key=lambda r: r[axis],
                )
                if not rs:
                    continue
                xs = [r[axis] for r in rs]
                f = slopes.get((impl, axis, dtype), {})
                tag = impl if len(dtypes) == 1 else f"{impl} {dtype}"
                style = "-" if dtype == "bfloat16" else ":"
                ax = axes[0, col]
                ax.plot(
                    xs,
                    [r["step_s"] for r in rs],
                    style,
                    marker="o",
                    color=colors[impl],
                    label=f"{tag} (slope {f.get('step_s_slope_fit')})",
                )
                ax = axes[1, col]
                ax.plot(
                    xs,
                    [r["memory_mib"] for r in rs],
                    style,
                    marker="o",
                    color=colors[impl],
                    label=f"{tag} {rs[0]['memory_kind']} (slope {f.get('memory_mib_slope_fit')})",
                )
                ax.plot(
                    xs,
                    [r["peak_rss_mib"] for r in rs],
                    "--",
                    marker=".",
                    color=colors[impl],
                    alpha=0.5,
                    label=f"{tag} peak RSS",
                )
                if impl == "reference" and dtype == dtypes[0]:
                    ax.plot(
                        xs,
                        [r["analytic_mib"] for r in rs],
                        "-.",
                        color="tab:orange",
                        label="reference analytic: masks + eager attn + logits",
                    )
        fixed = "A" if axis == "S" else "S"
        for row, ylabel in enumerate(("step time (s)", "memory (MiB)")):
            ax = axes[row, col]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_xlabel(f"{axis} ({fixed} = {BASE[fixed]})")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    load = sorted({tuple(r["loadavg"][:1]) for r in points.values()})
    fig.suptitle(
        f"DSpark step, 'small' drafter, {os.cpu_count()} CPU cores "
        f"(1-min load {load[0][0]}-{load[-1][0]})"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(json.dumps({"bench": "scaling_plot", "path": str(path)}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--axis", choices=("S", "A", "both"), default="both")
    p.add_argument("--impl", nargs="+", choices=("jax", "reference"), default=["jax", "reference"])
    p.add_argument(
        "--points",
        type=int,
        nargs="+",
        help=f"values of the axis (default: S {DEFAULT_POINTS['S']}, A {DEFAULT_POINTS['A']})",
    )
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1, help="JAX untimed steps (after compile)")
    p.add_argument("--ref-warmup", type=int, default=0, help="reference untimed steps")
    p.add_argument("--hidden-states-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--out", type=Path, default=HERE / "results" / "scaling.jsonl")
    p.add_argument("--plot", type=Path, default=HERE / "results" / "scaling.png")
    p.add_argument("--plot-only", action="store_true")
    args = p.parse_args()

    records = []
    if args.out.exists():
        records = [json.loads(x) for x in args.out.read_text().splitlines() if x.strip()]
    if not args.plot_only:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        axes = ("S", "A") if args.axis == "both" else (args.axis,)
        for axis in axes:
            for value in args.points or DEFAULT_POINTS[axis]:
                for impl in args.impl:
                    rec = run_point(impl, axis, value, args)
                    print(json.dumps(rec), flush=True)
                    records.append(rec)
                    with args.out.open("a") as f:
                        f.write(json.dumps(rec) + "\n")
    points = latest(records)
    fit_recs = fits(points)
    for f in fit_recs:
        print(json.dumps(f), flush=True)
    if points:
        try:
            plot(points, fit_recs, args.plot)
        except ImportError:
            print(
                json.dumps(
                    {
                        "bench": "scaling_plot",
                        "error": "matplotlib is not installed (pip install 'dspark-jax[bench]')",
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
