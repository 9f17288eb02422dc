"""Issue 19: our trainer vs speculators 0.9.0's on the demo, the pieces parity tests miss.

Sub-commands (each prints JSON lines; none trains):

* ``plan``: which documents form each step, in which order, per epoch, train and
  validation splits, ours (``dspark_jax.data.packing.plan_epoch``) vs the reference's
  ``MultipackDistributedBatchSamplerV2`` on the real demo lengths (``seq_len`` of the
  prepared rows), for the given seeds and epochs. Reports steps, identical rows
  (same documents in the same order), same document sets per row.
* ``anchors``: anchor sampling on the real packed rows of one epoch: our
  ``select_anchors`` (JAX) vs the reference's (torch) drawn ``--draws`` times per row;
  distribution of anchors per document (by document length), per row position
  (64-token bins) and per position inside the document, plus the count of anchors
  per row. Reports the largest relative gap between the two histograms and the
  gap expected from sampling noise alone (two independent draws of ours).
* ``valnoise``: trained drafters (``--checkpoint`` Orbax save-paths or speculators
  folders) scored on the validation rows under ``--keys`` anchor draws, the same draws
  for every drafter: how much of a validation number is anchor sampling, and a paired
  comparison of ours and the reference's drafters free of it.
* ``table``: the 3 x 2 table from finished runs (``runs/{baseline,reference}_s{seed}``):
  per-epoch validation loss, accept_len, full_acc, per-position acceptance, mean and
  spread (sample std and max-min) over seeds, and 100-step windows of the training
  metrics. ``--markdown`` prints the bench/README table.

Usage:
  python bench/seed_study.py plan --data-path DIR [--seeds 42 1 2] [--epochs 2]
  python bench/seed_study.py anchors --data-path DIR [--seed 42] [--draws 20]
  python bench/seed_study.py valnoise --data-path DIR --checkpoint RUN/checkpoints RUN2/model
  python bench/seed_study.py table [--runs runs] [--seeds 42 1 2] [--markdown] \
      [--valnoise FILE.jsonl]

The runs themselves: ``python -m dspark_jax.train --config configs/demo/train.yaml
--data-path DIR --seed S --save-path RUN/checkpoints --log-dir RUN/logs --run-name NAME``
and ``python bench/reference_demo_train.py --seed S --data-path DIR --metrics-out
RUN/metrics.jsonl --save-model RUN/model > RUN/train.log``.
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

import numpy as np

S_DEMO, A_DEMO, B_DEMO = 1024, 32, 8  # demo total_seq_len, max_anchors, block size


def _lengths_and_masks(data_path: str, ratio: float = 0.9):
    import datasets

    ds = datasets.load_from_disk(data_path)
    n = len(ds)
    split = int(n * ratio)
    seq_len = np.asarray(ds["seq_len"], np.int64)
    return ds, seq_len, split


# ------------------------------------------------------------------ plan
def cmd_plan(ns) -> None:
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    from dspark_jax.data.packing import plan_epoch
    from dspark_jax.data.pipeline import VAL_SEED

    _, seq_len, split = _lengths_and_masks(ns.data_path)
    splits = {"train": seq_len[:split], "val": seq_len[split:]}
    for seed in ns.seeds:
        for name, lengths in splits.items():
            plan_seed = seed if name == "train" else VAL_SEED
            for epoch in range(ns.epochs):
                ours = plan_epoch(lengths, ns.seq, 1, plan_seed, epoch)
                sampler = MultipackDistributedBatchSamplerV2(ns.seq, lengths, 1, 0, seed=plan_seed)
                ref = sampler._generate_batches(epoch)
                same_order = sum(
                    np.array_equal(ours.row(t, 0), r) for t, r in enumerate(ref)
                    if t < ours.num_steps
                )  # fmt: skip
                same_set = sum(
                    set(ours.row(t, 0).tolist()) == set(np.asarray(r).tolist())
                    for t, r in enumerate(ref)
                    if t < ours.num_steps
                )
                print(
                    json.dumps({
                        "piece": "plan",
                        "seed": seed,
                        "split": name,
                        "plan_seed": plan_seed,
                        "epoch": epoch,
                        "steps_ours": ours.num_steps,
                        "steps_reference": len(ref),
                        "rows_same_docs_same_order": int(same_order),
                        "rows_same_doc_set": int(same_set),
                        "docs_ours": int(len(ours.docs)),
                        "docs_reference": int(sum(len(r) for r in ref)),
                    })
                )  # fmt: skip


# ------------------------------------------------------------------ anchors
def _packed_masks(ds, seq_len, split, seed: int, epoch: int, seq: int, max_rows: int):
    """loss_mask rows [R, S], document index per position [R, S] (-1: padding) and
    per-position offset inside its document, packed as the reference's CollateFn."""
    from dspark_jax.data.packing import plan_epoch

    plan = plan_epoch(seq_len[:split], seq, 1, seed, epoch)
    rows = min(plan.num_steps, max_rows)
    masks = np.zeros((rows, seq), np.int32)
    docs = np.full((rows, seq), -1, np.int32)
    offs = np.full((rows, seq), -1, np.int32)
    doc_lens = np.zeros((rows, seq), np.int32)
    for t in range(rows):
        p = 0
        for j, d in enumerate(plan.row(t, 0).tolist()):
            lm = np.asarray(ds[int(d)]["loss_mask"], np.int32)[: seq - p]
            n = len(lm)
            masks[t, p : p + n] = lm
            docs[t, p : p + n] = j
            offs[t, p : p + n] = np.arange(n)
            doc_lens[t, p : p + n] = n
            p += n
            if p >= seq:
                break
    return masks, docs, offs, doc_lens


def _hist(anchor_rows, valid_rows, docs, offs, doc_lens, seq):
    pos_bins = np.zeros(seq // 64, np.float64)
    off_bins = np.zeros(seq // 64, np.float64)
    len_bins = np.zeros(4, np.float64)  # anchors by document length quartile edges
    per_doc = []
    per_row = []
    edges = [128, 256, 512]
    for i, (a, v) in enumerate(zip(anchor_rows, valid_rows, strict=True)):
        t = i % len(docs)  # draw d of row t is entry d * rows + t
        a = np.asarray(a)[np.asarray(v)]
        per_row.append(len(a))
        np.add.at(pos_bins, a // 64, 1)
        np.add.at(off_bins, offs[t, a] // 64, 1)
        np.add.at(len_bins, np.searchsorted(edges, doc_lens[t, a], side="right"), 1)
        counts = np.bincount(docs[t, a], minlength=int(docs[t].max()) + 1)
        per_doc.extend(counts.tolist())
    n = max(1, len(anchor_rows))
    return {
        "per_position_64": pos_bins / n,
        "per_doc_offset_64": off_bins / n,
        "per_doc_length_bin": len_bins / n,
        "anchors_per_doc_mean": float(np.mean(per_doc)),
        "anchors_per_doc_std": float(np.std(per_doc)),
        "anchors_per_row_mean": float(np.mean(per_row)),
    }


def _draw_ours(masks, draws: int, seed: int):
    import jax

    from dspark_jax.anchors import select_anchors

    fn = jax.jit(jax.vmap(lambda k, m: select_anchors(k, m, A_DEMO, B_DEMO)))
    out_a, out_v = [], []
    for d in range(draws):
        keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), d), len(masks))
        a, v = fn(keys, masks)
        out_a.extend(np.asarray(a))
        out_v.extend(np.asarray(v))
    return out_a, out_v


def _draw_reference(masks, draws: int, seed: int):
    import torch
    from speculators.models.dflash.utils import select_anchors

    torch.manual_seed(seed)
    out_a, out_v = [], []
    for _ in range(draws):
        for m in masks:
            a, v = select_anchors(torch.from_numpy(m)[None], A_DEMO, B_DEMO)
            out_a.append(a.numpy())
            out_v.append(v.numpy())
    return out_a, out_v


def _gap(h1, h2) -> dict[str, float]:
    out = {}
    for k in ("per_position_64", "per_doc_offset_64", "per_doc_length_bin"):
        a, b = np.asarray(h1[k]), np.asarray(h2[k])
        out[k] = float(np.max(np.abs(a - b)) / max(np.max(b), 1e-9))
    for k in ("anchors_per_doc_mean", "anchors_per_row_mean"):
        out[k] = float(abs(h1[k] - h2[k]) / max(h2[k], 1e-9))
    return out


def cmd_anchors(ns) -> None:
    ds, seq_len, split = _lengths_and_masks(ns.data_path)
    masks, docs, offs, doc_lens = _packed_masks(ds, seq_len, split, ns.seed, 0, S_DEMO, ns.max_rows)
    ours = _hist(*_draw_ours(masks, ns.draws, ns.seed), docs, offs, doc_lens, S_DEMO)
    ours2 = _hist(*_draw_ours(masks, ns.draws, ns.seed + 1000), docs, offs, doc_lens, S_DEMO)
    reps = ns.draws
    ref = _hist(*_draw_reference(masks, reps, ns.seed), docs, offs, doc_lens, S_DEMO)
    print(
        json.dumps({
            "piece": "anchors",
            "rows": len(masks),
            "draws": ns.draws,
            "ours": {k: np.round(v, 3).tolist() for k, v in ours.items()},
            "reference": {k: np.round(v, 3).tolist() for k, v in ref.items()},
            "gap_ours_vs_reference": _gap(ours, ref),
            "gap_ours_vs_ours_other_key": _gap(ours, ours2),
        })
    )  # fmt: skip


# ------------------------------------------------------------------ valnoise
def cmd_valnoise(ns) -> None:
    """Validation metrics of one trained drafter under ``--keys`` anchor draws on the same
    validation rows (epoch ``--epoch``'s plan): the part of a validation number's spread
    that is anchor sampling, not training."""
    import jax
    import jax.numpy as jnp

    from dspark_jax import optim, parallel
    from dspark_jax.checkpoint.load import load_drafter
    from dspark_jax.train import flags
    from dspark_jax.train.metrics_log import normalize_counted_metrics
    from dspark_jax.train.trainer import Trainer

    argv = ["--config", ns.config, "--data-path", ns.data_path]
    t = Trainer(flags.resolve(argv + ["--save-path", "/tmp/seed_study_unused"]))
    t.data = t.open_data()
    graphdef, abstract = t.abstract_state()
    param_sh = parallel.state_shardings(abstract, t.mesh)
    t.tx, _ = optim.build_optimizer_from_flags(abstract, t.args.values, 1)
    opt_sh = parallel.state_shardings(jax.eval_shape(t.tx.init, abstract), t.mesh)
    t.frozen = t.load_frozen()
    frozen_sh = jax.tree.map(lambda x: x.sharding, t.frozen)
    t._compile(graphdef, {"params": param_sh, "opt": opt_sh}, frozen_sh)
    batches = []
    it = t.data.val_iterator(epoch=ns.epoch, num_workers=0, prefetch=2)
    for batch in it:
        batch.pop("error_records")
        batches.append(t._global(batch))
    it.close()
    for checkpoint in ns.checkpoint:
        loaded = load_drafter(checkpoint)
        assert loaded.cfg == t.cfg, f"{checkpoint} is not the config's drafter"
        params = jax.tree.map(jnp.asarray, loaded.params)
        out = []
        for k in range(ns.keys):
            acc = None
            for i, batch in enumerate(batches):
                # The "epoch" argument only selects the anchors' key stream here: draw k
                # is the same for every checkpoint (paired comparison).
                m = t.eval_step(params, t.frozen, batch, jnp.int32(1000 + k), jnp.int32(i))
                acc = m if acc is None else jax.tree.map(jnp.add, acc, m)
            host = {x: float(v) for x, v in jax.device_get(acc).items()}
            out.append(normalize_counted_metrics(host))
        keys = list(KEYS) + sorted(
            (x for x in out[0] if x.startswith("position_")), key=lambda x: int(x.split("_")[1])
        )
        summary = {x: _ms([v[x] for v in out]) for x in keys}
        line = {"piece": "valnoise", "checkpoint": checkpoint, "keys": ns.keys, "summary": summary}
        print(json.dumps(line), flush=True)


# ------------------------------------------------------------------ table
KEYS = ("loss", "accept_len", "full_acc")
IMPLS = ("ours", "ours_initfix", "reference")


def _ours_records(run: Path):
    files = glob.glob(str(run / "logs" / "*" / "metrics.jsonl"))
    recs = []
    for f in files:
        recs += [json.loads(line) for line in open(f) if line.strip()]
    val = {
        r["epoch"]: {k.removesuffix("_epoch"): v for k, v in r["val"].items()}
        for r in recs
        if "val" in r
    }
    train = [(r["global_step"], r["train"]) for r in recs if "train" in r]
    return val, train


def _reference_records(run: Path):
    val, train = {}, []
    mfile = run / "metrics.jsonl"
    if mfile.exists():
        for line in open(mfile):
            r = json.loads(line)
            if "val" in r:
                val[r["epoch"]] = r["val"]
            elif "train" in r:
                train.append((r["global_step"], r["train"]))
    if not val and (run / "train.log").exists():  # older runs: validation lines of the log
        for line in open(run / "train.log"):
            if line.startswith("{") and '"val"' in line:
                r = json.loads(line)
                val[r["epoch"]] = r["val"]
    return val, train


def _ms(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    m = float(np.mean(xs))
    sd = float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0
    return {"mean": m, "std": sd, "range": float(max(xs) - min(xs)), "n": len(xs), "values": xs}


def _windows(train, width=100):
    out = {}
    for step, m in train:
        w = step // width
        for k in KEYS:
            if m.get(k) is not None:
                out.setdefault(w, {}).setdefault(k, []).append(m[k])
    return {w * width: {k: float(np.mean(v)) for k, v in d.items()} for w, d in sorted(out.items())}


def cmd_table(ns) -> None:
    runs = Path(ns.runs)
    impls = {
        "ours": ("baseline", _ours_records),
        "ours_initfix": ("initfix", _ours_records),
        "reference": ("reference", _reference_records),
    }
    result = {}
    for impl, (prefix, reader) in impls.items():
        per_seed = {}
        for seed in ns.seeds:
            run = runs / f"{prefix}_s{seed}"
            if not run.exists():
                continue
            if not ns.partial and not (run / "DONE").exists():
                continue
            val, train = reader(run)
            per_seed[seed] = {
                "val": val,
                "windows": _windows(train),
                "done": (run / "DONE").exists(),
            }
        result[impl] = per_seed
    summary = {}
    for impl, per_seed in result.items():
        epochs = sorted({e for s in per_seed.values() for e in s["val"]})
        for e in epochs:
            vals = [s["val"].get(e) for s in per_seed.values()]
            vals = [v for v in vals if v]
            keys = list(KEYS) + sorted(
                {k for v in vals for k in v if k.startswith("position_")},
                key=lambda k: int(k.split("_")[1]),
            )
            summary.setdefault(impl, {})[e] = {k: _ms([v.get(k) for v in vals]) for k in keys}
    rescored = _rescored(ns.valnoise, impls) if ns.valnoise else {}
    print(json.dumps({"table": summary, "runs": result, "rescored": rescored}))
    if ns.markdown:
        print(markdown(summary, result, ns.seeds))
        if rescored:
            print(markdown_rescored(rescored, ns.seeds))


def _rescored(path, impls):
    """valnoise lines -> {impl: {seed: summary}} (runs named PREFIX_sSEED)."""
    prefixes = {prefix: impl for impl, (prefix, _) in impls.items()}
    out: dict = {}
    for line in open(path):
        r = json.loads(line)
        if "summary" not in r:
            continue
        run = next(p for p in Path(r["checkpoint"]).parts if "_s" in p)
        prefix, seed = run.rsplit("_s", 1)
        out.setdefault(prefixes[prefix], {})[int(seed)] = r["summary"]
    return out


def markdown_rescored(rescored, seeds) -> str:
    lines = ["\nThe final drafters re-scored on the validation rows with the same anchor draws "]
    lines[0] += "(mean over the draws; then mean ± sample std over seeds):\n"
    lines.append("| | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± std | range |")
    lines.append("| --- " * (len(seeds) + 3) + "|")
    for key in KEYS:
        for impl in IMPLS:
            if impl not in rescored:
                continue
            per = [rescored[impl].get(s, {}).get(key, {}) for s in seeds]
            vals = [p["mean"] for p in per if p]
            ms = _ms(vals)
            cells = [_fmt(p["mean"]) if p else "-" for p in per]
            tail = f"{ms['mean']:.4f} ± {ms['std']:.4f} | {ms['range']:.4f}" if ms else "- | -"
            lines.append(f"| {key} {impl} | " + " | ".join(cells) + f" | {tail} |")
    return "\n".join(lines)


def _fmt(x, nd=4):
    return "-" if x is None else f"{x:.{nd}f}"


def markdown(summary, result, seeds) -> str:
    lines = []
    for e in sorted({e for s in summary.values() for e in s}):
        lines.append(f"\nValidation after epoch {e} (mean ± sample std over seeds; range):\n")
        lines.append("| | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± std | range |")
        lines.append("| --- " * (len(seeds) + 3) + "|")
        for key in ("loss", "accept_len", "full_acc"):
            for impl in IMPLS:
                if not summary.get(impl, {}).get(e):
                    continue
                cell = summary.get(impl, {}).get(e, {}).get(key)
                per = [
                    result[impl].get(s, {}).get("val", {}).get(e, {}).get(key) for s in seeds
                ]  # fmt: skip
                row = [_fmt(v) for v in per]
                ms = "-" if cell is None else f"{cell['mean']:.4f} ± {cell['std']:.4f}"
                rg = "-" if cell is None else f"{cell['range']:.4f}"
                lines.append(f"| {key} {impl} | " + " | ".join(row) + f" | {ms} | {rg} |")
        pos_keys = sorted(
            {k for s in summary.values() for k in s.get(e, {}) if k.startswith("position_")},
            key=lambda k: int(k.split("_")[1]),
        )
        if pos_keys:
            lines.append("\nPer-position acceptance (mean over seeds):\n")
            lines.append("| | " + " | ".join(k.split("_")[1] for k in pos_keys) + " |")
            lines.append("| --- " * (len(pos_keys) + 1) + "|")
            for impl in IMPLS:
                if not summary.get(impl, {}).get(e):
                    continue
                cells = [summary.get(impl, {}).get(e, {}).get(k) for k in pos_keys]
                row = ["-" if c is None else f"{c['mean']:.3f}" for c in cells]
                lines.append(f"| {impl} | " + " | ".join(row) + " |")
    lines.append("\nTraining metrics, 100-step windows (mean over the window and the seeds):\n")
    impls = [i for i in IMPLS if result.get(i)]
    cols = [f"{k} {i}" for k in ("loss", "accept_len") for i in impls]
    lines.append("| steps | " + " | ".join(cols) + " |")
    lines.append("| --- " * (len(cols) + 1) + "|")
    starts = sorted({w for i in impls for s in result[i].values() for w in s["windows"]})
    for w in starts:
        row = []
        for k in ("loss", "accept_len"):
            for i in impls:
                xs = [s["windows"][w][k] for s in result[i].values() if w in s["windows"]]
                row.append(_fmt(float(np.mean(xs)) if xs else None, 3))
        lines.append(f"| {w}-{w + 99} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("plan")
    a.add_argument("--data-path", required=True)
    a.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    a.add_argument("--epochs", type=int, default=2)
    a.add_argument("--seq", type=int, default=S_DEMO)
    b = sub.add_parser("anchors")
    b.add_argument("--data-path", required=True)
    b.add_argument("--seed", type=int, default=42)
    b.add_argument("--draws", type=int, default=20)
    b.add_argument("--max-rows", type=int, default=200)
    c = sub.add_parser("table")
    c.add_argument("--runs", default="runs")
    c.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    c.add_argument("--markdown", action="store_true")
    c.add_argument("--partial", action="store_true", help="include runs without DONE")
    c.add_argument("--valnoise", default=None, help="valnoise JSONL of the runs' drafters")
    d = sub.add_parser("valnoise")
    d.add_argument(
        "--checkpoint", nargs="+", required=True, help="--save-paths (latest step) or folders"
    )
    d.add_argument("--data-path", required=True)
    d.add_argument(
        "--config", default=str(Path(__file__).resolve().parents[1] / "configs/demo/train.yaml")
    )
    d.add_argument("--keys", type=int, default=4)
    d.add_argument("--epoch", type=int, default=1)
    ns = p.parse_args()
    cmds = {"plan": cmd_plan, "anchors": cmd_anchors, "table": cmd_table, "valnoise": cmd_valnoise}
    cmds[ns.cmd](ns)


if __name__ == "__main__":
    main()
