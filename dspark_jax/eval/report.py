"""Tables, CSV, JSON and plots of ``python -m dspark_jax.eval`` (host side, no JAX).

:func:`build_report` turns the per-dataset block statistics into one JSON-able dict
(the ``summary.json`` the tools read); every other output is rendered from it.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dspark_jax.eval import acceptance, calibration
from dspark_jax.eval import served as served_mod

log = logging.getLogger(__name__)

# (rule, conditioning): the per-slot statistic each method reads.
METHODS = {
    ("analytic", "free_running"): "accept_fr",
    ("greedy", "free_running"): "greedy_fr",
    ("analytic", "teacher_forcing"): "accept_tf",
    ("greedy", "teacher_forcing"): "greedy_tf",
}
RULE_TITLES = {
    "analytic": "analytic (rejection sampling at T=1: sum_v min(q, p))",
    "greedy": "greedy (T=0: drafted argmax == verifier argmax)",
}
CONDITIONING_TITLES = {
    "free_running": "Markov head on the drafter's own tokens (free running, as vLLM drafts)",
    "teacher_forcing": "Markov head on the dataset's tokens (teacher forcing, as in training)",
}
# Calibration rules: (confidence logits, realised conditional acceptance) statistics.
CALIBRATION_RULES = {
    "sampled": ("conf_fr_sampled", "y_sampled"),
    "greedy": ("conf_fr_greedy", "greedy_fr"),
}


def method_key(rule: str, conditioning: str) -> str:
    return f"{rule}/{conditioning}"


@dataclasses.dataclass
class DatasetBlocks:
    """Every evaluated (valid) block of one dataset, host arrays.

    ``arrays``: the :mod:`dspark_jax.eval.slot_statistics` statistics ([n, B]) plus ``mask``
    [n, B], ``context_pos`` [n], ``row`` [n], ``document`` [n] and, with a confidence
    head, ``y_sampled`` [n, B] (realised accept/reject draws of the analytic rule).
    ``longest_document``: the longest document's length in tokens (as read, after
    truncation to the row), the context-length buckets the report shows reach it.
    """

    name: str
    arrays: dict[str, np.ndarray]
    rows: int
    documents: int
    skipped_documents: int = 0
    longest_document: int | None = None
    served: served_mod.ServedSteps | None = None  # the greedy engine's walk (eval/served.py)

    @property
    def blocks(self) -> int:
        return int(self.arrays["mask"].shape[0])

    def select(self, sel: np.ndarray) -> dict[str, np.ndarray]:
        return {k: v[sel] for k, v in self.arrays.items()}


def calibration_split(blocks: DatasetBlocks, fraction: float, seed: int) -> np.ndarray:
    """[n] bool: True for blocks of the fitting split (documents drawn with ``seed``)."""
    doc_key = blocks.arrays["row"].astype(np.int64) * (1 << 32) + blocks.arrays["document"]
    docs = np.unique(doc_key)
    rng = np.random.default_rng(seed)
    fit_docs = docs[rng.permutation(len(docs))[: round(fraction * len(docs))]]
    return np.isin(doc_key, fit_docs)


def _curves(arrays, *, start, num_draft) -> dict[str, acceptance.Curve]:
    return {
        method_key(rule, cond): acceptance.curve(
            arrays[stat].astype(np.float64), arrays["mask"], start=start, num_draft=num_draft
        )
        for (rule, cond), stat in METHODS.items()
    }


def _draft(arrays: dict[str, np.ndarray], name: str, start: int, n: int) -> np.ndarray:
    return acceptance.draft_slots(arrays[name], start, n)


def build_report(
    datasets: Sequence[DatasetBlocks],
    *,
    start: int,
    num_draft: int,
    context_edges: Sequence[int],
    has_confidence: bool,
    calib_fraction: float = 0.5,
    calib_rule: str = "sampled",
    calib_objective: str = "nll",
    ece_bins: int = 20,
    seed: int = 0,
    given_temperatures: dict[str, np.ndarray] | None = None,
    info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Acceptance, context buckets and calibration of every dataset -> summary dict.

    Temperatures: ``given_temperatures`` ({rule: [N]}) when given, else fitted with STS
    on the fitting split pooled over datasets; metrics are reported on the other split
    (the documents outside the fitting split, also for given temperatures).
    """
    report: dict[str, Any] = {
        "format": "dspark-jax/eval-v1",
        **(info or {}),
        "draft_positions": num_draft,
        "methods": {
            method_key(r, c): f"{RULE_TITLES[r]}; {CONDITIONING_TITLES[c]}" for r, c in METHODS
        },
        "context_edges": list(context_edges),
        "datasets": {},
    }
    for ds in datasets:
        arrays = ds.arrays
        entry: dict[str, Any] = {
            "rows": ds.rows,
            "documents": ds.documents,
            "skipped_documents": ds.skipped_documents,
            "blocks": ds.blocks,
            "longest_document": ds.longest_document,
            "acceptance": {
                k: c.as_dict() for k, c in _curves(arrays, start=start, num_draft=num_draft).items()
            },
            "by_context": [],
        }
        for lo, hi, sel in acceptance.context_buckets(
            arrays["context_pos"], context_edges, ds.longest_document
        ):
            sub = ds.select(sel)
            curves = _curves(sub, start=start, num_draft=num_draft)
            entry["by_context"].append(
                {
                    "lo": lo,
                    "hi": hi,
                    "label": acceptance.bucket_label(lo, hi),
                    "blocks": int(sel.sum()),
                    "acceptance": {
                        k: {
                            "acceptance_length": c.as_dict()["acceptance_length"],
                            "cumulative": c.as_dict()["cumulative"],
                        }
                        for k, c in curves.items()
                    },
                }
            )
        if ds.served is not None and ds.served.generated.size:
            entry["served"] = served_mod.summary(
                ds.served, num_draft, context_edges, ds.longest_document
            )
        report["datasets"][ds.name] = entry

    if has_confidence and datasets:
        report["calibration"] = _calibration(
            datasets,
            start=start,
            num_draft=num_draft,
            fraction=calib_fraction,
            rule=calib_rule,
            objective=calib_objective,
            bins=ece_bins,
            seed=seed,
            given=given_temperatures,
        )
    return report


def _calibration(datasets, *, start, num_draft, fraction, rule, objective, bins, seed, given):
    splits = {ds.name: calibration_split(ds, fraction, seed) for ds in datasets}
    out: dict[str, Any] = {
        "rule": rule,
        "objective": objective,
        "fit_fraction": fraction,
        "bins": bins,
        "temperatures": {},
        "global_temperature": {},  # one T for all positions: what export folds into the head
        "fit_blocks": int(sum(s.sum() for s in splits.values())) if given is None else 0,
        "source": "given" if given is not None else "fitted (sequential temperature scaling)",
        "datasets": {},
    }

    def arrays_of(ds, sel, r):
        conf_name, label_name = CALIBRATION_RULES[r]
        a = ds.select(sel)
        return (
            _draft(a, conf_name, start, num_draft),
            _draft(a, label_name, start, num_draft),
            _draft(a, "mask", start, num_draft),
        )

    for r in CALIBRATION_RULES:
        if given is not None:
            temps = np.asarray(given[r], np.float64) if r in given else None
            if temps is not None and temps.shape != (num_draft,):
                raise ValueError(
                    f"given temperatures for rule {r!r} have {temps.shape[0]} values, "
                    f"the evaluation has {num_draft} draft positions"
                )
        else:
            parts = [arrays_of(ds, splits[ds.name], r) for ds in datasets]
            logits, labels, masks = (np.concatenate(x) for x in zip(*parts, strict=True))
            if logits.shape[0] == 0:
                log.warning("calibration: the fitting split is empty; temperatures stay 1")
                temps = np.ones(num_draft)
            else:
                temps = calibration.fit_sequential_temperatures(
                    logits, labels, masks, objective=objective, bins=bins
                )
                out["global_temperature"][r] = calibration.fit_global_temperature(
                    logits, labels, masks, objective=objective, bins=bins
                )
        if temps is not None:
            out["temperatures"][r] = [float(t) for t in temps]

    pooled: dict[str, list] = {r: [] for r in CALIBRATION_RULES}
    for ds in datasets:
        # Given temperatures are scored on the same split as fitted ones (comparable).
        report_sel = ~splits[ds.name]
        entry = {"blocks": int(report_sel.sum())}
        for r in CALIBRATION_RULES:
            logits, labels, masks = arrays_of(ds, report_sel, r)
            pooled[r].append((logits, labels, masks))
            entry[r] = _calib_entry(
                logits,
                labels,
                masks,
                out["temperatures"].get(r),
                bins,
                global_t=out["global_temperature"].get(r),
            )
        out["datasets"][ds.name] = entry
    out["all"] = {}
    for r in CALIBRATION_RULES:
        logits, labels, masks = (np.concatenate(x) for x in zip(*pooled[r], strict=True))
        out["all"][r] = _calib_entry(
            logits,
            labels,
            masks,
            out["temperatures"].get(r),
            bins,
            with_bins=True,
            global_t=out["global_temperature"].get(r),
        )
    return out


def _calib_entry(logits, labels, masks, temps, bins, with_bins=False, global_t=None):
    before = calibration.position_metrics(logits, labels, masks, None, bins=bins)
    entry = {
        "uncalibrated": {
            "summary": calibration.summary(before),
            "per_position": [m.as_dict(with_bins) for m in before],
        }
    }
    if temps is not None:
        after = calibration.position_metrics(logits, labels, masks, np.asarray(temps), bins=bins)
        entry["calibrated"] = {
            "summary": calibration.summary(after),
            "per_position": [m.as_dict(with_bins) for m in after],
        }
    if global_t is not None:
        one = calibration.position_metrics(
            logits, labels, masks, np.full(logits.shape[1], global_t), bins=bins
        )
        entry["global"] = {
            "temperature": global_t,
            "summary": calibration.summary(one),
            "per_position": [m.as_dict(with_bins) for m in one],
        }
    return entry


# ------------------------------------------------------------------ rendering
def _pct(v) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.1f}%"


def _f(v, digits=2) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def acceptance_table(report: dict[str, Any], key: str) -> list[str]:
    """Markdown lines: per dataset, the share accepted through each draft position and
    the acceptance length under method ``key`` (the model card's table)."""
    n = report["draft_positions"]
    header = ["data", *[f"pos{k}" for k in range(n)], "acceptance length"]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(["---"] * len(header)) + " |"]
    for name, entry in report["datasets"].items():
        c = entry["acceptance"][key]
        cells = [name, *[_pct(v) for v in c["cumulative"]], _f(c["acceptance_length"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


SERVED_TITLE = (
    "### Served-equivalent (compare with an engine): greedy speculative decoding of each "
    "response, drafting at the anchors the engine's acceptances visit"
)


def served_table(report: dict[str, Any]) -> list[str]:
    """Markdown lines of the served-equivalent walk (eval/served.py), or none."""
    entries = {n: e["served"] for n, e in report["datasets"].items() if e.get("served")}
    if not entries:
        return []
    n = report["draft_positions"]
    lines = [
        "",
        SERVED_TITLE,
        "",
        "Exact when each response is the verifier's own greedy continuation (served text or "
        "greedy `launch.regenerate`); `acceptance length` = 1 + accepted / drafts, as the "
        "engines count; `tokens/pass` = generated tokens / verifier passes (prefill included).",
        "",
    ]
    header = ["data", *[f"pos{k}" for k in range(n)], "acceptance length", "tokens/pass",
              "drafts", "responses"]  # fmt: skip
    lines += ["| " + " | ".join(header) + " |", "| " + " | ".join(["---"] * len(header)) + " |"]
    for name, e in entries.items():
        cells = [name, *[_pct(v) for v in e["cumulative"]], _f(e["acceptance_length"]),
                 _f(e["tokens_per_pass"]), str(e["drafts"]), str(e["responses"])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    n = report["draft_positions"]
    title = report.get("checkpoint", "drafter")
    step = report.get("step")
    lines = [
        f"# Acceptance of {title}" + (f" (step {step})" if step is not None else ""),
        "",
        (
            f"{n} draft tokens. `posK`: share of drafts whose position K is accepted (all of "
            "positions 0..K accepted; vLLM's per-position acceptance rate); acceptance length "
            "= 1 + sum of the `posK` (the bonus token counted)."
        ),
    ]
    lines += served_table(report)
    for rule, cond in METHODS:
        lines += ["", f"### {RULE_TITLES[rule]}; {CONDITIONING_TITLES[cond]}", ""]
        lines += acceptance_table(report, method_key(rule, cond))

    lines += ["", "### Acceptance length by context length (anchor position in its document)", ""]
    heads = [
        "data",
        "context",
        "blocks",
        *[f"{r}, {c.replace('_', ' ')}" for r, c in METHODS],
    ]
    lines.append("| " + " | ".join(heads) + " |")
    lines.append("| " + " | ".join(["---"] * len(heads)) + " |")
    for name, entry in report["datasets"].items():
        for b in entry["by_context"]:
            cells = [name, b["label"], str(b["blocks"])]
            cells += [
                _f(b["acceptance"][method_key(r, c)]["acceptance_length"]) for r, c in METHODS
            ]
            lines.append("| " + " | ".join(cells) + " |")

    cal = report.get("calibration")
    if cal:
        lines += [
            "",
            (
                "### Confidence head: prefix-survival calibration "
                f"({'documents outside the fitting split' if cal['fit_fraction'] else 'all blocks'}; "
                f"temperatures {cal['source']}, objective {cal['objective']})"
            ),
            "",
            "| data | rule | blocks | ECE | ECE after STS | ECE at global T | AUROC | Brier "
            "| Brier after STS |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        rows = list(cal["datasets"].items()) + [("all", {"blocks": None, **cal["all"]})]
        for name, entry in rows:
            for rule in CALIBRATION_RULES:
                e = entry[rule]
                before = e["uncalibrated"]["summary"]
                after = e.get("calibrated", {}).get("summary", {})
                one = e.get("global", {}).get("summary", {})
                blocks = entry["blocks"] if entry["blocks"] is not None else ""
                lines.append(
                    f"| {name} | {rule} | {blocks} | {_f(before['ece'], 4)} | "
                    f"{_f(after.get('ece'), 4)} | {_f(one.get('ece'), 4)} | "
                    f"{_f(before['auroc'], 3)} | {_f(before['brier'], 4)} | "
                    f"{_f(after.get('brier'), 4)} |"
                )
        for rule, temps in cal["temperatures"].items():
            lines.append("")
            lines.append(f"STS temperatures ({rule}): " + ", ".join(f"{t:.3f}" for t in temps))
        for rule, t in cal.get("global_temperature", {}).items():
            lines.append("")
            lines.append(f"Global temperature ({rule}; what export --calibration folds): {t:.4f}")
    return "\n".join(lines) + "\n"


def _csv(rows: list[list[Any]]) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue()


def _cell(v) -> Any:
    return "" if v is None or (isinstance(v, float) and not math.isfinite(v)) else v


def acceptance_csv(report: dict[str, Any]) -> str:
    rows = [[
        "dataset", "rule", "conditioning", "position", "cumulative", "conditional",
        "slot_mean", "slots", "blocks", "acceptance_length",
    ]]  # fmt: skip
    for name, entry in report["datasets"].items():
        for rule, cond in METHODS:
            c = entry["acceptance"][method_key(rule, cond)]
            for k in range(report["draft_positions"]):
                rows.append([
                    name, rule, cond, k, _cell(c["cumulative"][k]), _cell(c["conditional"][k]),
                    _cell(c["slot_mean"][k]), c["slots"][k], c["blocks"], _cell(c["acceptance_length"]),
                ])  # fmt: skip
        if entry.get("served"):  # the walk: drafts are its blocks, every slot drafted
            e = entry["served"]
            for k in range(report["draft_positions"]):
                rows.append([name, "greedy", "served", k, _cell(e["cumulative"][k]), "", "",
                             e["drafts"], e["drafts"], _cell(e["acceptance_length"])])  # fmt: skip
    return _csv(rows)


def context_csv(report: dict[str, Any]) -> str:
    n = report["draft_positions"]
    rows = [["dataset", "rule", "conditioning", "context_lo", "context_hi", "blocks",
             "acceptance_length", *[f"pos{k}" for k in range(n)]]]  # fmt: skip
    for name, entry in report["datasets"].items():
        for b in entry["by_context"]:
            for rule, cond in METHODS:
                a = b["acceptance"][method_key(rule, cond)]
                rows.append([name, rule, cond, b["lo"], _cell(b["hi"]), b["blocks"],
                             _cell(a["acceptance_length"]), *map(_cell, a["cumulative"])])  # fmt: skip
        for b in entry.get("served", {}).get("by_context", []):
            rows.append([name, "greedy", "served", b["lo"], _cell(b["hi"]), b["drafts"],
                         _cell(b["acceptance_length"]), *map(_cell, b["cumulative"])])  # fmt: skip
    return _csv(rows)


def calibration_csv(report: dict[str, Any]) -> str:
    rows = [["dataset", "rule", "temperatures", "position", "n", "ece", "auroc", "brier",
             "pred_mean", "label_mean"]]  # fmt: skip
    cal = report.get("calibration") or {}
    entries = list((cal.get("datasets") or {}).items())
    if cal:
        entries.append(("all", cal["all"]))
    for name, entry in entries:
        for rule in CALIBRATION_RULES:
            for which in ("uncalibrated", "calibrated", "global"):
                if which not in entry[rule]:
                    continue
                for k, m in enumerate(entry[rule][which]["per_position"]):
                    rows.append([name, rule, which, k, m["n"], _cell(m["ece"]), _cell(m["auroc"]),
                                 _cell(m["brier"]), _cell(m["pred_mean"]), _cell(m["label_mean"])])  # fmt: skip
    return _csv(rows)


def json_safe(value: Any) -> Any:
    """``value`` with NaN/inf as null (strict JSON): an empty split or a one-class AUROC
    has no value, which the tables show as n/a."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_outputs(report: dict[str, Any], out_dir: Path, *, plots: bool = True) -> dict[str, Path]:
    # Every text is rendered before the first file is written: all or none.
    texts = {
        "markdown": ("acceptance.md", markdown(report)),
        "csv": ("acceptance.csv", acceptance_csv(report)),
        "context_csv": ("acceptance_by_context.csv", context_csv(report)),
        "json": ("summary.json", json.dumps(json_safe(report), indent=1, allow_nan=False) + "\n"),
    }
    if report.get("calibration"):
        texts["calibration_csv"] = ("calibration.csv", calibration_csv(report))
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for what, (name, text) in texts.items():
        files[what] = out_dir / name
        files[what].write_text(text)
    if plots:
        files.update(write_plots(report, out_dir))
    return files


# ------------------------------------------------------------------ plots
def write_plots(report: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'dspark-jax[eval]'): no plots")
        return {}
    files = {}
    n = report["draft_positions"]
    names = list(report["datasets"])
    colors = {name: f"C{i % 10}" for i, name in enumerate(names)}

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), squeeze=False)
    for ax, rule in zip(axes[0], ("analytic", "greedy"), strict=True):
        for name in names:
            acc = report["datasets"][name]["acceptance"]
            for cond, style in (("free_running", "-o"), ("teacher_forcing", "--")):
                c = acc[method_key(rule, cond)]
                y = [np.nan if v is None else 100 * v for v in c["cumulative"]]
                label = (
                    f"{name} (AL {_f(c['acceptance_length'])})"
                    if cond == "free_running"
                    else f"{name}, teacher forcing (AL {_f(c['acceptance_length'])})"
                )
                ax.plot(range(n), y, style, color=colors[name], label=label, markersize=4)
        ax.set_title(RULE_TITLES[rule], fontsize=10)
        ax.set_xlabel("draft position")
        ax.set_ylabel("accepted through this position (%)")
        ax.set_xticks(range(n))
        ax.set_ylim(0, 100)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Acceptance by position: {report.get('checkpoint', '')}", fontsize=11)
    fig.tight_layout()
    files["plot_position"] = out_dir / "acceptance_by_position.png"
    fig.savefig(files["plot_position"], dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), squeeze=False)
    for ax, rule in zip(axes[0], ("analytic", "greedy"), strict=True):
        labels: list[str] = []
        for name in names:
            buckets = report["datasets"][name]["by_context"]
            for b in buckets:
                if b["label"] not in labels:
                    labels.append(b["label"])
        order = {lab: i for i, lab in enumerate(labels)}
        for name in names:
            buckets = report["datasets"][name]["by_context"]
            xs = [order[b["label"]] for b in buckets]
            ys = [
                np.nan
                if (v := b["acceptance"][method_key(rule, "free_running")]["acceptance_length"])
                is None
                else v
                for b in buckets
            ]
            ax.plot(xs, ys, "-o", color=colors[name], label=name, markersize=4)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=30)
        ax.set_xlabel("context length (tokens before the anchor in its document)")
        ax.set_ylabel("acceptance length")
        ax.set_ylim(1, n + 1)
        ax.set_title(f"{rule}, free running", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    files["plot_context"] = out_dir / "acceptance_by_context.png"
    fig.savefig(files["plot_context"], dpi=120)
    plt.close(fig)

    cal = report.get("calibration")
    if cal:
        for rule in CALIBRATION_RULES:
            entry = cal["all"][rule]
            ncols = min(4, n)
            nrows = -(-n // ncols)
            fig, axes = plt.subplots(
                nrows, ncols, figsize=(3.6 * ncols, 3.4 * nrows), squeeze=False
            )
            for k in range(nrows * ncols):
                ax = axes[k // ncols][k % ncols]
                if k >= n:
                    ax.axis("off")
                    continue
                ax.plot([0, 1], [0, 1], ":", color="0.6", linewidth=1)
                for which, color in (("uncalibrated", "C1"), ("calibrated", "C0")):
                    if which not in entry:
                        continue
                    m = entry[which]["per_position"][k]
                    # Bins with a handful of blocks are noise on a plot (kept in the JSON).
                    least = max(5, 0.002 * m["n"])
                    bins = [b for b in m.get("reliability") or [] if b["count"] >= least]
                    ax.plot([b["pred"] for b in bins], [b["label"] for b in bins], "-o",
                            color=color, markersize=3,
                            label=f"{which.replace('uncalibrated', 'raw')} ECE {_f(m['ece'], 3)}")  # fmt: skip
                ax.set_xlim(0, 1)
                ax.set_ylim(0, 1)
                ax.set_title(f"position {k}", fontsize=9)
                ax.set_xlabel("predicted survival", fontsize=8)
                ax.set_ylabel("observed survival", fontsize=8)
                ax.legend(fontsize=7, loc="upper left")
                ax.grid(True, alpha=0.3)
            fig.suptitle(
                f"Confidence calibration ({rule} acceptance, held-out split, all datasets)",
                fontsize=11,
            )
            fig.tight_layout()
            path = out_dir / f"calibration_{rule}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            files[f"plot_calibration_{rule}"] = path
    return files
