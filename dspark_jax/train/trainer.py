"""``python -m dspark_jax.train``: train a DSpark drafter like ``speculators train`` 0.9.0.

Flags: :mod:`dspark_jax.train.flags` (the reference's, plus ``--mesh``, ``--rows-per-step``,
``jax.distributed`` and checkpoint retention). Without arguments it trains the demo
(``configs/demo/train.yaml``).

The loop, top to bottom (reference: ``speculators/train/trainer.py``):

* the drafter's config and starting weights (:mod:`dspark_jax.train.drafter_setup`), the
  frozen verifier tensors, the packed data (:mod:`dspark_jax.data.pipeline`);
* trainable params (fp32) and optimiser state (:mod:`dspark_jax.optim`) live as
  sharded arrays on the mesh (:mod:`dspark_jax.parallel`); one ``jax.jit`` step with
  explicit in/out shardings and the state donated: loss, grads, clip, update;
* one optimizer step per batch of ``--rows-per-step`` packed rows; anchors of step
  ``s`` come from ``fold_in(key(seed), s)``, so a resumed run draws the same ones;
* every ``--log-freq`` steps a metrics record with the reference's names (JSONL,
  ``--logger`` trackers, console line) and the throughput (tokens/s, TFLOP/s per
  device, MFU, data wait, device memory: :class:`throughput.Throughput`); validation after every
  epoch (and when training stops at ``--max-steps``); Orbax checkpoints by the reference's rules
  (``--checkpoint-freq``, ``--save-best``), keeping the newest ``--keep-checkpoints``
  and the best one; resume from the latest unless ``--no-resume-from-checkpoint``;
* ``--profile-steps A:B``: a ``jax.profiler`` trace of steps A..B-1 in the run's log dir;
* SIGTERM/SIGINT (or a preemption notice seen by ``jax.distributed``): finish the
  step, save, exit ``128 + signum`` (143, 130; as shells report a killed command, so
  ``make`` and job scripts do not go on with an unfinished run). A second signal kills
  at once.
* resume: the newest checkpoint that restores; newer unreadable ones (a truncated
  file) are named, skipped and moved aside as ``N.unreadable``.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import optim, parallel
from dspark_jax.checkpoint.checkpointer import Checkpointer
from dspark_jax.checkpoint.orbax_io import FORMAT as CHECKPOINT_FORMAT  # what the converters read
from dspark_jax.checkpoint.orbax_io import CheckpointError, unreadable_reason
from dspark_jax.data.files import DataError
from dspark_jax.data.pipeline import PackedData, ProcessRows
from dspark_jax.model.draft import DSparkDraftModel, FrozenWeights, LossSettings
from dspark_jax.train import drafter_setup, flags, online_setup, steps, throughput
from dspark_jax.train.dry_run import dry_run
from dspark_jax.train.flags import ConfigError, TrainArgs
from dspark_jax.train.metrics_log import (
    MetricsLog,
    Progress,
    has_samples,
    normalize_counted_metrics,
    step_metrics,
)
from dspark_jax.verifier import instep
from dspark_jax.verifier.forward import drafted_blocks_supported
from dspark_jax.verifier.frozen import load_verifier_tensors

log = logging.getLogger("dspark_jax.train")

MIN_STEP_PCT = 0.25  # trainer.py: no mid-epoch save this close to the epoch end
OPTIMIZER_NAMES = {"muon": "Muon", "adamw": "AdamW"}  # the reference logs type(opt).__name__


class Interrupted:
    """SIGTERM/SIGINT -> a flag the loop checks between steps; a second signal kills."""

    def __init__(self):
        self.signal: str | None = None
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        del frame
        self.signal, self.signum = signal.Signals(signum).name, int(signum)
        log.warning(
            "received %s: saving a checkpoint after this step (send again to exit now)", self.signal
        )
        self.restore()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()


def _put(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array (the same on every process) -> a global sharded array."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])


def _with_shardings(abstract, shardings):
    """ShapeDtypeStructs carrying the target shardings (an Orbax restore target)."""
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, shardings
    )


def _run_name(template: str | None) -> str:
    now = datetime.datetime.now()
    name = template or "{time}"
    for key, value in {
        "{time}": now.isoformat(timespec="seconds"),
        "{utc_time}": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "{rank}": str(jax.process_index()),
        "{local_rank}": "0",
    }.items():
        name = name.replace(key, value)
    return name


class Trainer:
    def __init__(
        self,
        args: TrainArgs,
        *,
        devices: list | None = None,
        step_callback: Callable[[Trainer], None] | None = None,
        store_factory: Callable[[], Any] | None = None,
    ):
        self.args = args
        self.step_callback = step_callback
        self.store_factory = store_factory  # tests: a Mooncake store fake
        self.is_main = jax.process_index() == 0
        self.setup = drafter_setup.build_draft(args)
        self.cfg = self.setup.cfg
        self.dtype = jnp.bfloat16 if args.hidden_states_dtype == "bfloat16" else jnp.float32
        self.mesh = parallel.make_mesh(args.mesh, devices)
        if args.fsdp_shard and self.mesh.shape["fsdp"] == 1 and self.mesh.size > 1:
            raise ConfigError(f"--fsdp-shard with --mesh {args.mesh}: the mesh has no fsdp axis")
        shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        self.rows_per_step = args.rows_per_step or shards
        if self.rows_per_step % shards:
            raise ConfigError(
                f"--rows-per-step {self.rows_per_step} must be a multiple of data x fsdp = "
                f"{shards} (mesh {dict(self.mesh.shape)})"
            )
        try:
            parallel.check_context_split(self.mesh, args.total_seq_len, self.rows_per_step)
            # The rows and tokens this process feeds (its devices' block of the batch).
            self.ranks, self.tokens = parallel.process_rows(
                self.mesh, self.rows_per_step, args.total_seq_len
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # A step's rows over this process's rows: scales the host-side token and FLOP counts.
        self.process_share = self.rows_per_step / len(self.ranks)
        if self.tokens != (0, args.total_seq_len) and args.on_missing == "generate":
            raise ConfigError(
                f"--on-missing generate with --mesh {args.mesh}: the context axis splits rows "
                "over processes, which read their tokens' hidden states from files only"
            )
        self.settings = LossSettings.from_loss_fn(
            args.loss_fn,
            num_anchors=args.max_anchors,
            gamma=args.dflash_decay_gamma,
            confidence_head_alpha=args.confidence_head_alpha,
            per_position_loss_weight=args.per_position_loss_weight,
            dpace_alpha=args.dpace_alpha,
            dpard_alpha=args.dpard_alpha,
            vocab_chunk_tokens=args.loss_chunk_tokens,
            anchor_sampling=args.anchor_sampling,
            training_stage=args.training_stage,
            gamma_opd=args.gamma_opd,
            lambda_acc=args.lambda_acc,
            lambda_rej=args.lambda_rej,
            opd_drafting=args.opd_drafting,
        )
        # --hidden-states-backend jax: checked now (family, shapes, layer ids), loaded later.
        self.instep = (
            instep.build(
                args.verifier_name_or_path,
                self.cfg,
                args.verifier_dtype,
                args.hidden_states_dtype,
                check_tensors=not (args.dry_run and args.compile_for),
            )
            if args.hidden_states_backend == instep.BACKEND
            else None
        )
        if args.training_stage == "opd":
            why = drafted_blocks_supported(self.instep.cfg)
            if why is not None:
                raise ConfigError(
                    f"--training-stage opd: {args.verifier_name_or_path} has {why}, which the "
                    "verifier's pass over drafted blocks does not handle yet"
                )
            if self.mesh.shape["context"] > 1:
                raise ConfigError(
                    f"--training-stage opd with --mesh {args.mesh}: rows split over a context "
                    "axis are not supported by the drafted-block pass yet"
                )

    # ------------------------------------------------------------------ model
    def abstract_state(self):
        """(graphdef, abstract params) of the drafter, without computing anything."""
        model = nnx.eval_shape(
            lambda: DSparkDraftModel(
                self.cfg, rngs=nnx.Rngs(0), dtype=self.dtype, remat=self.args.gradient_checkpointing
            )
        )
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise RuntimeError("DSparkDraftModel has non-parameter state; the trainer expects none")
        return graphdef, params

    def init_params(self, shardings) -> nnx.State:
        """Fresh (seeded, sharded at birth) or the --from-pretrained weights."""
        if self.setup.params is not None:
            return jax.tree.map(_put, self.setup.params, shardings)
        cfg, dtype, remat, seed = (
            self.cfg,
            self.dtype,
            self.args.gradient_checkpointing,
            self.args.seed,
        )

        def init():
            model = DSparkDraftModel(cfg, rngs=nnx.Rngs(seed), dtype=dtype, remat=remat)
            return nnx.state(model, nnx.Param)

        return jax.jit(init, out_shardings=shardings)()

    def load_frozen(self, verifier_embed: jax.Array | None = None) -> FrozenWeights:
        """The drafter's frozen verifier tensors on the mesh. ``verifier_embed``: the
        in-step verifier's embedding (same logical sharding); when its dtype holds the
        stored values exactly it is the drafter's too, so the embedding is on the devices
        (and read from disk) once."""
        maps = self.setup.vocab_maps
        vt = load_verifier_tensors(
            self.args.verifier_name_or_path, None if maps is None else maps[1]
        )
        try:
            host = FrozenWeights.from_verifier(vt.embed_tokens, vt.lm_head, vt.norm, self.cfg)
        except ValueError as e:
            raise ConfigError(
                f"verifier {self.args.verifier_name_or_path} does not fit the drafter: {e}"
            ) from None
        sh = parallel.frozen_shardings(host, self.mesh)
        head = _put(host.lm_head, sh.lm_head)  # one device copy serves both heads
        stored = host.embed_tokens.dtype
        if verifier_embed is not None and jnp.promote_types(stored, verifier_embed.dtype) == (
            verifier_embed.dtype
        ):
            embed = jax.device_put(verifier_embed, sh.embed_tokens)  # the same array if placed
        else:
            embed = _put(host.embed_tokens, sh.embed_tokens)
        return FrozenWeights(embed, head, head, _put(host.verifier_norm, sh.verifier_norm))

    # ------------------------------------------------------------------ data
    def open_data(self) -> PackedData:
        args, cfg = self.args, self.cfg
        online = online_setup.online_source(args, self.store_factory)
        summary = online_setup.online_summary(args)
        if summary and self.is_main:
            log.info("%s", summary)
        data = PackedData(
            args.data_path,
            drafter_setup.hidden_states_dir(args),
            total_seq_len=args.total_seq_len,
            n_aux=cfg.num_aux_layers,
            hidden_size=cfg.verifier_hidden_size,
            train_data_ratio=args.train_data_ratio,
            process_rows=ProcessRows(self.ranks, self.rows_per_step, self.tokens),
            seed=args.seed,
            on_missing="raise" if self.instep is not None else args.on_missing,
            online=online,
            read_files=args.hidden_states_backend != "mooncake",
            hidden_states_dtype=args.hidden_states_dtype,
            aux_hidden_state_layer_ids=cfg.aux_hidden_state_layer_ids,
            tokens_only=self.instep is not None,
        )
        if self.instep is not None:
            instep.check_token_ids(data.dataset.max_token_id(), self.instep.cfg, args.data_path)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            digest = np.frombuffer(data.plan("train", 0).digest().encode(), np.uint8)
            multihost_utils.assert_equal(digest, "the processes planned different batches")
        return data

    # ------------------------------------------------------------------ steps
    def _compile(self, graphdef, state_sh, frozen_sh):
        self.train_step, self.eval_step = steps.build_steps(
            graphdef, self.mesh, self.settings, self.tx, self.args.seed, self.instep,
            self.setup.vocab_maps, state_sh, frozen_sh,
        )  # fmt: skip

    def _global(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return parallel.global_batch(batch, self.mesh, self.rows_per_step)

    # ------------------------------------------------------------------ checkpoints
    def _meta(self, reason: str, metrics: dict[str, float] | None) -> dict[str, Any]:
        it = self.train_it
        meta = {
            "format": CHECKPOINT_FORMAT,
            "step": self.global_step,
            "config": self.cfg.to_speculators_dict(),
            "global_step": self.global_step,
            "epoch": it.epoch,
            "step_in_epoch": it.step,
            "reason": reason,
            "best_val_loss": None if math.isinf(self.best_val_loss) else self.best_val_loss,
            "best_step": self.ckpt.best_step,
            "seed": self.args.seed,
            "rows_per_step": self.rows_per_step,
            "total_seq_len": self.args.total_seq_len,  # the card's, when run.yaml omits it
            "training_stage": self.settings.training_stage,
        }
        if metrics is not None:
            meta["metrics"] = metrics
        if self.setup.vocab_maps is not None:
            vd = self.cfg.draft_vocab_size
            meta["vocab_maps"] = {"d2t": f"d2t-{vd}.npy", "t2d": f"t2d-{vd}.npy"}
        return meta

    def save(self, reason: str, metrics: dict[str, float] | None = None) -> None:
        step = self.global_step
        if step in self.saved_steps:
            return
        state = {"params": nnx.to_pure_dict(self.state["params"]), "opt": self.state["opt"]}
        meta = self._meta(reason, metrics)
        # Reported by the checkpointer once written (or failed), not when started.
        self.ckpt.save(step, state, meta, self.train_it, force=True, reason=reason)
        self.saved_steps.add(step)

    def restore(self, abstract_state) -> None:
        """Resume from the newest checkpoint that restores. Newer ones that do not (a
        truncated file) are moved aside, and named, only once an older one has restored:
        a failure common to every step (another code version) moves nothing."""
        skipped: list[tuple[int, str]] = []
        for step in sorted(self.ckpt.all_steps(), reverse=True):
            try:
                meta = self.ckpt.meta(step)
            except UNREADABLE as e:
                skipped.append((step, unreadable_reason(e, self.ckpt.directory)))
                continue
            self._check_resumable(step, meta)
            try:
                restored, meta = self.ckpt.restore(step, abstract_state, self.train_it)
            except UNREADABLE as e:
                skipped.append((step, unreadable_reason(e, self.ckpt.directory)))
                continue
            break
        else:
            reasons = "; ".join(f"step {s}: {why}" for s, why in skipped)
            raise CheckpointError(
                f"{self.ckpt.directory}: no checkpoint restores ({reasons}); pass "
                "--no-resume-from-checkpoint to start over, or use another --save-path"
            )
        self._move_aside(skipped, step)
        params = jax.tree.map(lambda x: x, self._abstract_params)
        nnx.replace_by_pure_dict(params, restored["params"])
        self.state = {"params": params, "opt": restored["opt"]}
        self.global_step = int(meta["global_step"])
        self.best_val_loss = meta.get("best_val_loss") or float("inf")
        self.ckpt.best_step = meta.get("best_step")
        stage = meta.get("training_stage", "sft")
        if stage != self.settings.training_stage:
            # Another objective from here on: its validation losses do not compare with the
            # checkpoint's, so the best one restarts (the old best stays until replaced).
            log.info(
                "resuming a --training-stage %s checkpoint with --training-stage %s: the best "
                "validation loss restarts",
                stage,
                self.settings.training_stage,
            )
            self.best_val_loss = float("inf")
        self.saved_steps.add(step)
        self.metrics.resume_at(self.global_step)
        log.info(
            "resumed from %s/%d: epoch %d, step %d of the epoch, global step %d",
            self.ckpt.directory,
            step,
            self.train_it.epoch,
            self.train_it.step,
            self.global_step,
        )

    def _move_aside(self, skipped: list[tuple[int, str]], step: int) -> None:
        """Rename the unreadable steps (process 0, on storage every process sees), so
        that Orbax neither lists them nor refuses to save those steps again."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.assert_equal(
                np.int64(step), "the processes restored different checkpoint steps"
            )
        for bad, why in skipped:
            if self.is_main:
                aside = self.ckpt.move_aside(bad)
                log.warning(
                    "checkpoint step %d is unreadable (%s): skipped (moved to %s); resuming "
                    "from step %d",
                    bad,
                    why,
                    aside.name,
                    step,
                )
        if skipped and jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("dspark: unreadable checkpoints moved aside")
        if skipped:
            self.ckpt.reload()

    def _check_resumable(self, step: int, meta: dict[str, Any]) -> None:
        saved_cfg, cfg = meta.get("config") or {}, self.cfg.to_speculators_dict()
        if saved_cfg != cfg:
            diff = sorted(k for k in set(saved_cfg) | set(cfg) if saved_cfg.get(k) != cfg.get(k))
            raise ConfigError(
                f"{self.ckpt.directory}/{step} was written for another drafter config (fields "
                f"{diff} differ); resume with the same flags, pass --no-resume-from-checkpoint, "
                "or use another --save-path"
            )
        for key, value in (("rows_per_step", self.rows_per_step), ("seed", self.args.seed)):
            if meta.get(key) != value:
                raise ConfigError(
                    f"{self.ckpt.directory}/{step} was written with {key}={meta.get(key)}, this run "
                    f"has {value}; exact resume needs the same value (or --no-resume-from-checkpoint)"
                )

    # ------------------------------------------------------------------ validation
    def validate(self, epoch: int) -> dict[str, float] | None:
        it = self.data.val_iterator(
            epoch=epoch, num_workers=self.args.num_workers, prefetch=self.args.prefetch_factor
        )
        acc, skipped = None, 0
        try:
            for i, batch in enumerate(it):
                skipped += int(np.sum(batch.pop("error_records")))
                m = self.eval_step(
                    self.state["params"],
                    self.frozen,
                    self._global(batch),
                    jnp.int32(epoch),
                    jnp.int32(i),
                )
                acc = m if acc is None else jax.tree.map(jnp.add, acc, m)
        finally:
            it.close()
        if acc is None:
            return None
        host = {k: float(v) for k, v in jax.device_get(acc).items()}
        if not has_samples(host):  # 0/0 is no loss: never recorded, never the best step
            self.progress.message(
                f"validation epoch {epoch}: no supervised token ({skipped} samples skipped); "
                "no validation loss recorded"
            )
            return None
        val = normalize_counted_metrics(host)
        val = {f"{k}_epoch": v for k, v in val.items()}
        self.metrics.log(
            {"val": val, "epoch": epoch, "global_step": self.global_step}, self.global_step
        )
        self.progress.message(
            f"validation epoch {epoch}: loss {val.get('loss_epoch', float('nan')):.4f}, "
            f"accept_len {val.get('accept_len_epoch', float('nan')):.3f}"
        )
        return val

    def end_of_epoch(self, epoch: int) -> None:
        """Validate, then checkpoint by the reference's rules (trainer.run_training)."""
        args = self.args
        val = self.validate(epoch)
        loss = None if val is None else val.get("loss_epoch")
        improved = loss is not None and loss < self.best_val_loss
        if args.save_best:
            should_save = improved
        elif args.checkpoint_freq >= 1:
            should_save = epoch == 0 or (epoch + 1) % int(args.checkpoint_freq) == 0
        else:
            should_save = True
        if should_save and improved:
            self.best_val_loss = loss
            self.ckpt.best_step = self.global_step
        if should_save:
            metrics = {k.removesuffix("_epoch"): v for k, v in val.items()} if val else None
            self.save("epoch_end", metrics)
        # Step timings restart after validation and saving.
        self._window = _new_window()

    # ------------------------------------------------------------------ the run
    def run(self) -> int:
        args = self.args
        if args.dry_run:
            return dry_run(self)
        self.data = self.open_data()
        graphdef, abstract = self.abstract_state()
        self._abstract_params = abstract
        param_sh = parallel.state_shardings(abstract, self.mesh)
        steps0 = self.data.steps_per_epoch("train", 0)
        total = args.max_steps if args.max_steps is not None else args.epochs * steps0
        self.total_steps = total
        self.tx, self.schedules = optim.build_optimizer_from_flags(abstract, args.values, total)
        opt_sh = parallel.state_shardings(jax.eval_shape(self.tx.init, abstract), self.mesh)
        state_sh = {"params": param_sh, "opt": opt_sh}
        if self.instep is not None:  # loaded once, sharded; never in the optimizer state
            vparams = self.instep.load(self.mesh)
            self.frozen = (self.load_frozen(vparams["embed_tokens.weight"]), vparams)
        else:
            self.frozen = self.load_frozen()
        frozen_sh = jax.tree.map(lambda x: x.sharding, self.frozen)
        self._compile(graphdef, state_sh, frozen_sh)

        self.ckpt = Checkpointer(args.save_path, max_to_keep=args.keep_checkpoints)
        self.saved_steps: set[int] = set()
        self.global_step, self.best_val_loss = 0, float("inf")
        self.train_it = self.data.train_iterator(
            num_epochs=args.epochs, num_workers=args.num_workers, prefetch=args.prefetch_factor
        )
        run_dir = Path(args.log_dir) / _run_name(args.run_name)
        self.metrics = MetricsLog(run_dir, flags.loggers(args.values), enabled=self.is_main)
        self.throughput = throughput.Throughput(self.cfg, args, self.mesh, self.process_share)
        self.profiler = throughput.StepProfiler(
            flags.parse_profile_steps(args.profile_steps), run_dir
        )
        self.progress = Progress(total, enabled=self.is_main)
        try:
            if self.ckpt.all_steps() and args.no_resume_from_checkpoint:
                log.warning(
                    "--no-resume-from-checkpoint: deleting the checkpoints in %s", args.save_path
                )
                self.ckpt.delete_all()
            if self.ckpt.all_steps():
                self.restore({
                    "params": nnx.to_pure_dict(_with_shardings(abstract, param_sh)),
                    "opt": _with_shardings(jax.eval_shape(self.tx.init, abstract), opt_sh),
                })  # fmt: skip
            else:
                params = self.init_params(param_sh)
                opt = jax.jit(self.tx.init, out_shardings=opt_sh)(params)
                self.state = {"params": params, "opt": opt}
            if self.is_main:  # the resolved config beside the checkpoints
                args.save(args.save_path)
                self.cfg.save_json(Path(args.save_path) / "config.json")
                if self.setup.vocab_maps is not None:
                    from dspark_jax.checkpoint.orbax_io import save_checkpoint_vocab_maps

                    save_checkpoint_vocab_maps(args.save_path, self.cfg, *self.setup.vocab_maps)
            self.metrics.hparams(flags.run_config(args), self.global_step)
            log.info(
                "training a drafter from %s: %d steps (%d per epoch, %d rows of %d tokens), "
                "mesh %s, metrics %s",
                self.setup.source,
                total,
                steps0,
                self.rows_per_step,
                args.total_seq_len,
                dict(self.mesh.shape),
                self.metrics.path,
            )
            return self.loop()
        finally:
            self.profiler.stop()
            self.train_it.close()
            self.ckpt.close()
            self.metrics.close()

    def loop(self) -> int:
        args = self.args
        interrupted = Interrupted()
        distributed = jax.process_count() > 1
        if not distributed:  # with jax.distributed, JAX's preemption notifier owns SIGTERM
            interrupted.install()
        self.progress.start(self.global_step)
        self._window = _new_window()
        stopped_at_max = False
        try:
            while args.max_steps is None or self.global_step < args.max_steps:
                it = self.train_it
                if it.epoch >= args.epochs:
                    break
                epoch, steps_in_epoch, step_in_epoch = it.epoch, it.steps_in_epoch, it.step
                self.profiler.before(self.global_step)  # the trace shows the data wait too
                t0 = time.perf_counter()
                batch = next(it)
                w = self._window
                w["fetch"] += time.perf_counter() - t0
                w["tokens"] += round(np.sum(batch["document_ids"] != -1) * self.process_share)
                w["flops"] += self.throughput.step_flops(batch)
                w["steps"] += 1
                self.state, metrics = self.train_step(
                    self.state, self.frozen, self._global(batch), jnp.int32(self.global_step)
                )
                self.profiler.after(self.global_step, self.state)
                if self.global_step % args.log_freq == 0:
                    self._log_step(epoch, step_in_epoch + 1, steps_in_epoch, metrics)
                self.global_step += 1
                local_step = step_in_epoch + 1
                if self.step_callback is not None:
                    self.step_callback(self)
                if args.max_steps is not None and self.global_step >= args.max_steps:
                    stopped_at_max = local_step < steps_in_epoch
                    if not stopped_at_max:
                        self.end_of_epoch(epoch)
                    break
                if args.checkpoint_freq < 1 and not args.save_best and local_step < steps_in_epoch:
                    interval = max(1, round(steps_in_epoch * args.checkpoint_freq))
                    if (
                        local_step % interval == 0
                        and steps_in_epoch - local_step >= interval * MIN_STEP_PCT
                    ):
                        self.save("mid_epoch")
                if local_step == steps_in_epoch:
                    self.end_of_epoch(epoch)
                preempted = self.ckpt.reached_preemption(self.global_step) if distributed else False
                if interrupted.signal or preempted:
                    self.save("interrupted")
                    self.ckpt.wait()
                    self.metrics.close()  # trackers print as they finish: before our last line
                    self.progress.message(
                        f"interrupted ({interrupted.signal or 'preemption'}) at step "
                        f"{self.global_step}: checkpoint saved in {args.save_path}; run the same "
                        "command to resume"
                    )
                    # Not done: a shell's status for a killed command (preemption: SIGTERM).
                    return 128 + (interrupted.signum or signal.SIGTERM)
            if stopped_at_max:
                self.end_of_epoch(self.train_it.epoch)
        finally:
            interrupted.restore()
        self.ckpt.wait()
        self.metrics.close()  # trackers print as they finish: before our last line
        self.progress.message(
            f"training done at step {self.global_step}; checkpoints in {args.save_path}"
        )
        return 0

    def _log_step(self, epoch, local_step, steps_in_epoch, metrics) -> None:
        """One metrics record. ``profile`` averages over the steps since the last record
        (the steps in between are dispatched without waiting); tokens of all processes."""
        host = {k: float(v) for k, v in jax.device_get(metrics).items()}
        train = step_metrics(host)
        now, w = time.perf_counter(), self._window
        elapsed = max(now - w["t"], 1e-9)
        profile = {
            "fetch_ms": 1e3 * w["fetch"] / w["steps"],
            "step_ms": 1e3 * elapsed / w["steps"],
            "tokens_per_s": w["tokens"] / elapsed,
            "fetch_frac": w["fetch"] / elapsed,
            **self.throughput.figures(w["flops"], elapsed),
        }
        self._window = _new_window(now)
        lrs = {OPTIMIZER_NAMES[g]: float(s(self.global_step)) for g, s in self.schedules.items()}
        lr_info = lrs if len(lrs) > 1 else next(iter(lrs.values()))
        record = {
            "train": train,
            "profile": profile,
            "epoch": epoch,
            "lr": lr_info,
            "global_step": self.global_step,
        }
        self.metrics.log(record, self.global_step)
        self.progress.update(
            self.global_step + 1,
            epoch,
            local_step,
            steps_in_epoch,
            train,
            next(iter(lrs.values())),
            profile["tokens_per_s"],
            profile=profile,
        )


def _new_window(t: float | None = None) -> dict[str, float]:
    """The counters of the steps since the last record (``fetch``: data wait, s)."""
    t = time.perf_counter() if t is None else t
    return {"t": t, "steps": 0, "tokens": 0, "fetch": 0.0, "flops": 0.0}


# What a checkpoint that does not restore raises (tensorstore and JSON errors are
# ValueErrors, a missing file an OSError); ConfigError is checked outside these.
UNREADABLE = (ValueError, OSError, KeyError)


def run(
    args: TrainArgs,
    *,
    devices: list | None = None,
    step_callback: Callable[[Trainer], None] | None = None,
    store_factory: Callable[[], Any] | None = None,
) -> int:
    """Train (or --dry-run) with resolved args; returns the exit status."""
    if devices is None and args.dry_run and args.compile_for:  # the mesh's devices
        from dspark_jax.train.compile_target import resolve

        devices = list(resolve(args.compile_for).devices)
    return Trainer(
        args, devices=devices, step_callback=step_callback, store_factory=store_factory
    ).run()


def demo_data_missing(args: TrainArgs) -> str | None:
    """Why the demo cannot start (its verifier or data is missing), or None."""
    missing = [p for p in (args.verifier_name_or_path, args.data_path) if not Path(p).exists()]
    if not missing:
        return None
    return (
        f"the demo needs {', '.join(missing)}, which do not exist yet; create them with:\n"
        f"    {flags.DEMO_PREPARE_COMMAND}\n"
        "then run `python -m dspark_jax.train` again (or pass your own --verifier-name-or-path "
        "and --data-path; see --help)"
    )


class _StderrHandler(logging.StreamHandler):
    """A handler on ``sys.stderr`` as it is when each record is written, not as it was
    when the handler was made: a later command in the same process (a test, a notebook)
    may have replaced it, and the old stream may be closed."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        del value  # StreamHandler.__init__ assigns one: sys.stderr is read at each record


def setup_logging(level: int = logging.INFO) -> None:
    """Our messages on stderr (the root logger is already claimed by a dependency's import)."""
    logger = logging.getLogger("dspark_jax")
    if not any(getattr(h, "_dspark", False) for h in logger.handlers):
        handler = _StderrHandler()
        handler._dspark = True
        handler.setFormatter(
            logging.Formatter("[%(asctime)s] %(levelname)s %(message)s", "%H:%M:%S")
        )
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    from dspark_jax.cli import guarded

    return guarded(_main, argv)


def _main(argv: list[str]) -> int:
    setup_logging()
    from dspark_jax.cli import reraise_if_debug
    from dspark_jax.data.vocab import VocabError

    try:
        args = flags.resolve(argv)
        if args.demo:
            why = demo_data_missing(args)
            if why:
                print(f"error: {why}", file=sys.stderr)
                return 2
        if args.deterministic_cuda:
            os.environ["XLA_FLAGS"] = (
                os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true"
            ).strip()
        parallel.initialize_distributed(
            args.coordinator_address, args.num_processes, args.process_id
        )
        return run(args)
    except ConfigError as e:
        reraise_if_debug()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (DataError, VocabError, CheckpointError) as e:
        reraise_if_debug()
        print(f"error: {e}", file=sys.stderr)
        return 1
