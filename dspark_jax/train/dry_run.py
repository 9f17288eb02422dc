"""``--dry-run``: build and initialise the drafter, save it, report what the run needs.

Like the reference (``flags.py``: "persist an initialized checkpoint and exit before
training"), the initialised drafter is written to ``--save-path`` as a speculators
folder (``config.json`` + ``model.safetensors`` in ``--hidden-states-dtype``), which
``--from-pretrained`` accepts. The report adds what a JAX run needs to know before it
starts: the resolved geometry, the Muon/AdamW split, the mesh and rows per step, the
state of the data, and where generated samples come from (online transport).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np
from flax import nnx

from dspark_jax import optim
from dspark_jax.data.files import DataError, PreparedDataset
from dspark_jax.data.hs_names import hs_path
from dspark_jax.model.params import leaf_key, to_host
from dspark_jax.train import drafter_setup, flags, online_setup
from dspark_jax.verifier.frozen import load_verifier_tensors


class PlannedRun(Protocol):
    """What the dry run reads off the trainer (``trainer.Trainer`` provides it)."""

    args: flags.TrainArgs
    cfg: Any
    setup: drafter_setup.DraftSetup
    mesh: jax.sharding.Mesh
    rows_per_step: int
    is_main: bool

    def abstract_state(self) -> tuple[Any, Any]: ...

    def init_params(self, shardings) -> nnx.State: ...


def missing_hidden_states(args: flags.TrainArgs) -> tuple[int, list[int]]:
    """(rows of the prepared dataset, the rows without an ``hs_{i}.safetensors``)."""
    hs = drafter_setup.hidden_states_dir(args)
    n = len(PreparedDataset(Path(args.data_path)))
    have = set(os.listdir(hs)) if hs.is_dir() else set()
    return n, [i for i in range(n) if hs_path(hs, i).name not in have]


def _data_report(args: flags.TrainArgs) -> str:
    data = Path(args.data_path)
    if not data.is_dir():
        return f"data: {data} does not exist (yet)"
    if args.hidden_states_backend == "jax":  # the step computes them; no file is read
        try:
            return f"data: {len(PreparedDataset(data))} rows in {data}; hidden states in the step"
        except (DataError, OSError) as e:
            return f"data: {data}: {e}"
    try:
        n, missing = missing_hidden_states(args)
    except (DataError, OSError) as e:
        return f"data: {data}: {e}"
    hs = drafter_setup.hidden_states_dir(args)
    return f"data: {n} rows in {data}; {len(missing)} without a hidden-state file in {hs}"


def _drafter_lines(trainer: PlannedRun, params) -> list[str]:
    """Geometry, vocabulary and parameter counts (``params``: arrays or shapes)."""
    args, cfg = trainer.args, trainer.cfg
    keys = set(optim.muon_param_keys(params)) if args.optimizer == "muon" else set()
    sizes = {p: int(np.prod(v.get_value().shape)) for p, v in nnx.to_flat_state(params)}
    total = sum(sizes.values())
    n_muon = sum(n for p, n in sizes.items() if leaf_key(p)[0] in keys)
    return [
        (
            f"drafter from {trainer.setup.source}: {cfg.num_hidden_layers} layers, hidden "
            f"{cfg.hidden_size}, heads {cfg.num_attention_heads}/{cfg.num_key_value_heads} x "
            f"{cfg.head_dim}, mlp {cfg.intermediate_size}, layer types "
            f"{list(cfg.layer_types or [])}, window {cfg.sliding_window}, rope "
            f"{cfg.rope_scaling.rope_type} theta {cfg.rope_theta:g}, verifier norm "
            f"{cfg.verifier_norm_style}"
            + (
                f", target logits soft-capped at {cfg.verifier_logit_softcapping:g}"
                if cfg.verifier_logit_softcapping is not None
                else ""
            )
        ),
        (
            f"vocab {cfg.vocab_size}, draft vocab {cfg.draft_vocab_size}, block "
            f"{cfg.block_size}, aux layers {list(cfg.aux_hidden_state_layer_ids)}, mask token "
            f"{cfg.mask_token_id}, markov {cfg.markov_head_type} rank {cfg.markov_rank}, "
            f"confidence head {cfg.enable_confidence_head}"
        ),
        (
            f"trainable parameters: {total:,} ({args.optimizer}: Muon {n_muon:,} in "
            f"{len(keys)} matrices, AdamW {total - n_muon:,})"
        ),
    ]


def dry_run(trainer: PlannedRun) -> int:
    args = trainer.args
    if args.compile_for:  # shapes only: no weights, no data, nothing written
        from dspark_jax.train.compile_report import compile_report

        if trainer.is_main:
            for line in _drafter_lines(trainer, trainer.abstract_state()[1]):
                print(f"[dry-run] {line}", flush=True)
        return compile_report(trainer)
    cfg = trainer.cfg
    save = Path(args.save_path)
    if trainer.is_main:
        args.save(save)
    _, abstract = trainer.abstract_state()
    # On one device: the weights go to the host anyway, and a mesh would generate
    # every replicated parameter once per device.
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    host = to_host(trainer.init_params(jax.tree.map(lambda _: one, abstract)))
    lines = [
        *_drafter_lines(trainer, host),
        (
            f"mesh {dict(trainer.mesh.shape)} over {trainer.mesh.size} devices "
            f"({jax.process_count()} processes); {trainer.rows_per_step} packed rows of "
            f"{args.total_seq_len} tokens per step"
        ),
        _data_report(args),
    ]
    online = online_setup.online_summary(args)
    if online:
        lines.append(online)
    if not trainer.is_main:
        return 0
    from dspark_jax.convert.card import CARD_FILE
    from dspark_jax.convert.check import check_folder
    from dspark_jax.convert.export import export_params

    maps = trainer.setup.vocab_maps
    lm_head = None
    if cfg.uses_draft_vocab:
        lm_head = load_verifier_tensors(args.verifier_name_or_path, maps[1]).lm_head
    # Written beside run.yaml (and any checkpoints) in --save-path, not over them.
    with tempfile.TemporaryDirectory(dir=save.parent) as tmp:
        export_params(cfg, host, Path(tmp) / "draft", dtype=args.hidden_states_dtype,
                      vocab_maps=maps, lm_head=lm_head, target="speculators")  # fmt: skip
        for f in (Path(tmp) / "draft").iterdir():
            if f.name != CARD_FILE:  # a model card is for exported drafters, not --save-path
                shutil.move(str(f), save / f.name)
    report = check_folder(save, target="vllm")
    check = "vLLM check: ok" if report.ok else "vLLM check fails: " + "; ".join(report.errors)
    lines.append(
        f"saved the initialised drafter to {save} (config.json + model.safetensors); {check}"
    )
    for line in lines:
        print(f"[dry-run] {line}", flush=True)
    return 0
