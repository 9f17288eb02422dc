"""Initial parameter statistics per tensor: ours vs speculators 0.9.0, same drafter config.

The reference: ``build_draft_model`` (``DSparkDraftModel.from_training_args``:
``__init__`` + ``post_init``, then the heads built after it) seeded with
``set_seed(seed)`` as ``speculators train`` does; ours: the trainer's
``DSparkDraftModel(cfg, rngs=nnx.Rngs(seed))``. Both from the same resolved config
(default: the demo's). Prints one JSON line per trainable tensor (speculators key,
shape, mean/std/min/max of each side, the std ratio) and a summary line listing the
tensors whose std or mean differ by more than ``--tol`` (relative; mean: in units of
the reference std).

Usage:
  python bench/init_stats.py [--config configs/demo/train.yaml] [--data-path DIR] [--seed 42]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def stats(x: np.ndarray) -> dict[str, float]:
    x = np.asarray(x, np.float64)
    return {
        "mean": float(x.mean()),
        "std": float(x.std()),
        "min": float(x.min()),
        "max": float(x.max()),
    }


def reference_tensors(config: str, data_path: str | None, seed: int) -> dict[str, np.ndarray]:
    import os

    import torch
    from speculators.model import SpeculatorModel
    from speculators.train.cli import build_draft_model, parse_vocab_mappings, set_seed
    from speculators.train.config.schema import TrainConfig

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        cli = {"seed": seed, "draft_attn_impl": "eager"}
        if data_path:
            cli["data_path"] = str(Path(data_path).resolve())
        cfg = TrainConfig.from_sources(cli=cli, config_path=config, argv=[sys.argv[0]])
        args = argparse.Namespace(**cfg.flatten())
        set_seed(args.seed, args.deterministic_cuda)
        d2t, t2d, draft_vocab_size = parse_vocab_mappings(args)
        model_class = SpeculatorModel.registry[args.speculator_type]
        model = build_draft_model(args, model_class, t2d, d2t, draft_vocab_size)
    finally:
        os.chdir(cwd)
    return {
        k: p.detach().to(torch.float32).numpy()
        for k, p in model.named_parameters()
        if p.requires_grad
    }


def our_tensors(config: str, data_path: str | None, seed: int) -> dict[str, np.ndarray]:
    import jax
    from flax import nnx

    from dspark_jax.model.draft import DSparkDraftModel
    from dspark_jax.model.params import to_speculators
    from dspark_jax.train import drafter_setup, flags

    argv = ["--config", config, "--seed", str(seed)]
    if data_path:
        argv += ["--data-path", data_path]
    args = flags.resolve(argv)
    cfg = drafter_setup.build_draft(args).cfg

    def init():
        model = DSparkDraftModel(cfg, rngs=nnx.Rngs(seed), dtype=jax.numpy.float32)
        return nnx.state(model, nnx.Param)

    return {k: np.asarray(v) for k, v in to_speculators(jax.jit(init)()).items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=str(ROOT / "configs/demo/train.yaml"))
    p.add_argument("--data-path", default=None)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--tol", type=float, default=0.1)
    ns = p.parse_args()
    ref = reference_tensors(ns.config, ns.data_path, ns.seed)
    ours = our_tensors(ns.config, ns.data_path, ns.seed)
    differ = []
    for key in sorted(set(ref) | set(ours)):
        if key not in ref or key not in ours:
            print(json.dumps({"key": key, "only": "ours" if key in ours else "reference"}))
            differ.append(key)
            continue
        r, o = stats(ref[key]), stats(ours[key])
        ratio = o["std"] / r["std"] if r["std"] > 0 else (1.0 if o["std"] == 0 else float("inf"))
        scale = r["std"] if r["std"] > 0 else 1.0
        mean_gap = abs(o["mean"] - r["mean"]) / scale
        bad = abs(ratio - 1) > ns.tol or mean_gap > ns.tol
        if bad:
            differ.append(key)
        print(
            json.dumps({
                "key": key,
                "shape": list(ref[key].shape),
                "reference": r,
                "ours": o,
                "std_ratio": round(ratio, 4),
                "differs": bad,
            })
        )  # fmt: skip
    print(json.dumps({"summary": True, "tensors": len(ref), "differ": differ}))


if __name__ == "__main__":
    main()
