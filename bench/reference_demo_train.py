"""Train the demo drafter with the *reference* (speculators==0.9.0) pieces on CPU.

The reference ``Trainer`` assumes CUDA (``.to(local_rank)``, CUDA autocast) and its
fused losses need Triton, so this script drives the reference building blocks
directly, single process, CPU, fp32, mirroring ``speculators/train/cli.py:main``,
``Trainer.setup_optimizer``, ``Trainer.train_epoch`` and ``Trainer.val_epoch``:

* config: ``TrainConfig.from_sources`` on configs/demo/train.yaml (the reference's
  own resolution, derived defaults included) with ``loss_implementation=eager`` and
  ``draft_attn_impl=eager`` layered on top as flags;
* model: ``parse_vocab_mappings`` + ``build_draft_model`` (``create_transformer_layer_config``
  + ``DSparkDraftModel.from_training_args``);
* data: the hidden-states backend's ``from_train_args`` + ``create_train_val_loaders``;
* optimizers: ``build_optimizers(TrainerConfig)`` + one transformers cosine schedule per
  optimizer, exactly as ``Trainer.setup_optimizer``;
* step: forward(**batch, **train_call_kwargs), zero_grad, backward, clip 1.0, step,
  scheduler step; validation sums metrics, divides by the batch count, normalises.

Usage:
  nice -n 10 .venv/bin/python bench/reference_demo_train.py [--epochs N] [--max-steps N] \
      [--seed S] [--data-path DIR] [--verifier DIR] [--config YAML] [--metrics-out FILE.jsonl] [--save-model DIR]

``--save-model DIR``: the trained drafter, ``save_pretrained`` into DIR (fp32 tensors; the
reference ``Trainer`` casts to bf16 when it saves), plus ``DIR_epoch{E}`` after every
epoch; ``python -m dspark_jax.eval --checkpoint DIR`` loads it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def newton_schulz_fp32_matmuls(grad, ns_coefficients, ns_steps, eps):
    """torch/optim/_muon.py::_zeropower_via_newtonschulz with the same bf16 values: bf16
    operands multiplied in fp32 (as a bf16 GEMM accumulates), ``addmm``'s
    ``beta*C + alpha*(A@B)`` formed in float64 (essentially exact, as its fused epilogue)
    and rounded to bf16 once; the norm in fp32 rounded to bf16 (dspark_jax/optim/
    newton_schulz.py is the same arithmetic in JAX). Only the matmuls' accumulation order
    differs from torch's bf16 kernel (Newton-Schulz amplifies its flips to a few bf16 ulps
    of the update)."""
    a, b, c = ns_coefficients
    x = grad.bfloat16()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    norm = x.float().square().sum().sqrt().bfloat16().clamp(min=eps)
    x = (x.float() / norm.float()).bfloat16()
    for _ in range(ns_steps):
        gram = (x.float() @ x.float().T).bfloat16()
        update = (b * gram.double() + c * (gram.float() @ gram.float()).double()).bfloat16()
        x = (a * x.double() + (update.float() @ x.float()).double()).bfloat16()
    return x.T if tall else x


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=str(ROOT / "configs/demo/train.yaml"))
    p.add_argument("--epochs", type=int, default=None, help="override train.trainer.epochs")
    p.add_argument("--max-steps", type=int, default=None, help="reference --max-steps")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument(
        "--metrics-out", default=None, help="optional JSONL of train metrics every 10 steps"
    )
    p.add_argument("--seed", type=int, default=None, help="override train.general.seed")
    p.add_argument("--data-path", default=None, help="override train.data.data_path")
    p.add_argument("--verifier", default=None, help="override train.verifier.verifier_name_or_path")
    p.add_argument("--save-model", default=None, help="save_pretrained folder of the drafter")
    p.add_argument(
        "--muon-fp32-matmuls", action="store_true",
        help="Muon's bf16 Newton-Schulz with its matmuls in fp32 on bf16 values, each result "
        "rounded to bf16 once (for CPUs without native bf16, where torch's bf16 matmul is "
        "~13x slower than fp32)",
    )  # fmt: skip
    ns = p.parse_args()

    torch.set_num_threads(ns.threads)
    if ns.muon_fp32_matmuls:
        import torch.optim._muon as muon

        muon._zeropower_via_newtonschulz = newton_schulz_fp32_matmuls

    import os

    os.chdir(ROOT)  # the demo YAML uses repo-relative paths

    from speculators.model import SpeculatorModel
    from speculators.train.cli import build_draft_model, parse_vocab_mappings, set_seed
    from speculators.train.config.schema import TrainConfig
    from speculators.train.dataloader import create_train_val_loaders
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import TrainerConfig, _resolve_scheduler_steps
    from speculators.train.utils import normalize_counted_metrics
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    try:
        from hs_connectors import HiddenStatesBackend
    except ImportError:  # pragma: no cover
        from speculators.train.cli import HiddenStatesBackend  # type: ignore

    save_dir = tempfile.mkdtemp(prefix="ref_demo_ckpt_")
    cli = {
        "loss_implementation": "eager",
        "draft_attn_impl": "eager",
        "save_path": save_dir,
        "log_dir": save_dir,
    }
    if ns.epochs is not None:
        cli["epochs"] = ns.epochs
    if ns.max_steps is not None:
        cli["max_steps"] = ns.max_steps
    if ns.seed is not None:
        cli["seed"] = ns.seed
    if ns.data_path is not None:
        cli["data_path"] = str(Path(ns.data_path).resolve())
    if ns.verifier is not None:
        cli["verifier_name_or_path"] = str(Path(ns.verifier).resolve())
    cfg = TrainConfig.from_sources(cli=cli, config_path=ns.config, argv=sys.argv)
    args = argparse.Namespace(**cfg.flatten())

    set_seed(args.seed, args.deterministic_cuda)
    hidden_states_dtype = getattr(torch, args.hidden_states_dtype)
    assert hidden_states_dtype == torch.float32, args.hidden_states_dtype

    d2t, t2d, draft_vocab_size = parse_vocab_mappings(args)
    model_class = SpeculatorModel.registry[args.speculator_type]
    model = build_draft_model(args, model_class, t2d, d2t, draft_vocab_size)
    model = model.to(torch.float32)
    num_target_layers = len(model.target_layer_ids)
    hidden_size = model.config.transformer_layer_config.hidden_size
    SpeculatorModel.verify_training_compatible(model)

    backend_cls = HiddenStatesBackend.registry[args.hidden_states_backend]
    transfer = backend_cls.from_train_args(args, args.data_path)
    train_loader, val_loader = create_train_val_loaders(
        data_path=args.data_path,
        total_seq_len=args.total_seq_len,
        hidden_states_dtype=hidden_states_dtype,
        transfer=transfer,
        vllm_endpoint=args.vllm_endpoint,
        on_missing=args.on_missing,
        verifier_name_or_path=args.verifier_name_or_path,
        request_timeout=args.request_timeout,
        max_retries=args.max_retries,
        generation_validation_retries=args.generation_validation_retries,
        max_consecutive_generation_failures=args.max_consecutive_generation_failures,
        hidden_size=hidden_size,
        num_target_layers=num_target_layers,
        num_workers=0,
        prefetch_factor=args.prefetch_factor,
        preprocess=None,  # dspark: no preprocess (cli.py preprocess_fns)
        train_data_ratio=args.train_data_ratio,
        seed=args.seed,
    )
    train_call_kwargs, val_call_kwargs = model_class.get_trainer_kwargs(**vars(args))

    config = TrainerConfig(
        num_epochs=args.epochs,
        save_path=args.save_path,
        lr=args.lr,
        train_call_kwargs=train_call_kwargs,
        val_call_kwargs=val_call_kwargs,
        optimizer=args.optimizer,
        weight_decay=args.weight_decay,
        muon_lr=args.muon_lr,
        muon_momentum=args.muon_momentum,
        muon_weight_decay=args.muon_weight_decay,
        muon_ns_steps=args.muon_ns_steps,
        muon_adjust_lr_fn=args.muon_adjust_lr_fn,
        scheduler_type=args.scheduler_type,
        scheduler_warmup_steps=args.scheduler_warmup_steps,
        scheduler_warmup_ratio=args.scheduler_warmup_ratio,
        scheduler_total_steps=args.scheduler_total_steps,
        scheduler_num_cosine_cycles=args.scheduler_num_cosine_cycles,
        hidden_states_dtype=hidden_states_dtype,
        log_freq=args.log_freq,
        max_steps=args.max_steps,
    )

    # Trainer.setup_optimizer (fresh run: last_epoch = -1)
    optimizers = build_optimizers(model, config)
    warmup, total = _resolve_scheduler_steps(config, len(train_loader))
    if config.scheduler_type == "none":
        schedulers = []
    elif config.scheduler_type == "linear":
        schedulers = [
            get_linear_schedule_with_warmup(
                o, num_warmup_steps=warmup, num_training_steps=total, last_epoch=-1
            )
            for o in optimizers
        ]
    else:
        schedulers = [
            get_cosine_schedule_with_warmup(
                o,
                num_warmup_steps=warmup,
                num_training_steps=total,
                num_cycles=config.scheduler_num_cosine_cycles,
                last_epoch=-1,
            )
            for o in optimizers
        ]

    print(
        json.dumps(
            {
                "impl": "reference",
                "setup": True,
                "seed": args.seed,
                "data_path": args.data_path,
                "train_batches_per_epoch": len(train_loader),
                "val_batches": len(val_loader),
                "warmup_steps": warmup,
                "total_steps": total,
                "epochs": config.num_epochs,
                "max_steps": config.max_steps,
                "n_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "optimizers": [type(o).__name__ for o in optimizers],
                "loss_config": str(train_call_kwargs["loss_config"]),
                "max_anchors": train_call_kwargs["max_anchors"],
                "gamma": train_call_kwargs["gamma"],
                "layer_types": model.config.transformer_layer_config.layer_types,
                "sliding_window": model.config.transformer_layer_config.sliding_window,
                "mask_token_id": args.mask_token_id,
                "target_layer_ids": list(model.target_layer_ids),
            }
        ),
        flush=True,
    )

    metrics_out = open(ns.metrics_out, "w") if ns.metrics_out else None
    global_step = 0
    t_start = time.time()
    stop = False
    for epoch in range(config.num_epochs):
        t_ep = time.time()
        # ---- Trainer.train_epoch
        model.train()
        if hasattr(train_loader.batch_sampler, "set_epoch"):
            train_loader.batch_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v for k, v in batch.items()}
            _draft, loss, metrics = model(**batch, **(config.train_call_kwargs or {}))
            for o in optimizers:
                o.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for o in optimizers:
                o.step()
            lrs = {type(o).__name__: o.param_groups[0]["lr"] for o in optimizers}
            for s in schedulers:
                s.step()
            if global_step % config.log_freq == 0 and metrics_out is not None:
                m = normalize_counted_metrics({k: v.item() for k, v in metrics.items()}, 1)
                metrics_out.write(
                    json.dumps({"train": m, "epoch": epoch, "lr": lrs, "global_step": global_step})
                    + "\n"
                )
                metrics_out.flush()
            if global_step % ns.log_every == 0:
                m = normalize_counted_metrics({k: v.item() for k, v in metrics.items()}, 1)
                print(
                    json.dumps(
                        {
                            "impl": "reference",
                            "progress": True,
                            "epoch": epoch,
                            "global_step": global_step,
                            "loss": m.get("loss"),
                            "accept_len": m.get("accept_len"),
                            "lr": lrs,
                            "elapsed_s": round(time.time() - t_start, 1),
                        }
                    ),
                    flush=True,
                )
            global_step += 1
            if config.max_steps is not None and global_step >= config.max_steps:
                stop = True
                break

        # ---- Trainer.val_epoch
        model.eval()
        if hasattr(val_loader.batch_sampler, "set_epoch"):
            val_loader.batch_sampler.set_epoch(epoch)
        acc: dict[str, torch.Tensor] = {}
        n_val = len(val_loader)
        with torch.no_grad():
            for batch in val_loader:
                _d, _l, metrics = model(**batch, **(config.val_call_kwargs or {}))
                for k, v in metrics.items():
                    acc[k] = v.float() if k not in acc else acc[k] + v.float()
        vm = {k: v.item() / n_val for k, v in acc.items()}
        vm = normalize_counted_metrics(vm, 1)
        print(
            json.dumps(
                {
                    "impl": "reference",
                    "epoch": epoch,
                    "val_accept_len": vm.get("accept_len"),
                    "val_loss": vm.get("loss"),
                    "train_steps": global_step,
                    "seconds": round(time.time() - t_ep, 1),
                    "val": vm,
                }
            ),
            flush=True,
        )
        if metrics_out is not None:
            metrics_out.write(json.dumps({"val": vm, "epoch": epoch, "global_step": global_step}))
            metrics_out.write("\n")
            metrics_out.flush()
        if ns.save_model:
            model.save_pretrained(f"{ns.save_model}_epoch{epoch}")
        if stop:
            break
    if ns.save_model:
        model.save_pretrained(ns.save_model)
    print(
        json.dumps({"impl": "reference", "total_seconds": round(time.time() - t_start, 1)}),
        flush=True,
    )


if __name__ == "__main__":
    main()
