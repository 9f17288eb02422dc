"""The trainer's two compiled steps (also what ``--dry-run --compile-for`` compiles):
``train_step(state, frozen, batch, step) -> (state, metrics)`` (the state donated) and
``eval_step(params, frozen, batch, epoch, index) -> metrics``.

With the in-step verifier (``--hidden-states-backend jax``) ``frozen`` is (FrozenWeights,
verifier params) and each step first computes its rows' hidden states; the objective is
the SFT loss or Draft-OPD's (``--training-stage``). Both trace under the run's mesh, so
the drafter and the verifier see its context split. Anchors are drawn from keys folded
from the seed: the step number for training, (VAL_STREAM, epoch, batch index) for
validation, so a resumed run repeats the uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dspark_jax import parallel
from dspark_jax.model.draft import LossSettings, batch_loss
from dspark_jax.train.opd import opd_batch_loss
from dspark_jax.verifier.instep import InStepVerifier

VAL_STREAM = 2**31 - 1  # fold_in tag of the validation anchors' key stream


def build_steps(
    graphdef: nnx.GraphDef,
    mesh: jax.sharding.Mesh,
    settings: LossSettings,
    tx: optax.GradientTransformation,
    seed: int,
    verifier: InStepVerifier | None,
    vocab_maps: tuple[np.ndarray, np.ndarray] | None,
    state_sh: Any,
    frozen_sh: Any,
):
    """(train_step, eval_step), jitted with the state's and frozen tensors' shardings."""
    base_key = jax.random.key(seed)
    d2t = None if vocab_maps is None else np.asarray(vocab_maps[0])

    def with_hidden_states(frozen, batch):
        """In-step backend: frozen = (FrozenWeights, verifier params); the rows' hidden
        states are computed first (no gradient reaches the verifier)."""
        if verifier is None:
            return frozen, None, batch
        frozen, vparams = frozen
        with parallel.tracing_mesh(mesh):  # the verifier reads the context split too
            return frozen, vparams, verifier.fill(vparams, batch)

    def objective(params, frozen, vparams, batch, key):
        """The stage's loss and metrics; the model reads the mesh's context split."""
        model = nnx.merge(graphdef, params)
        with parallel.tracing_mesh(mesh):
            if settings.training_stage == "opd":
                table = None if d2t is None else jnp.asarray(d2t)
                return opd_batch_loss(model, frozen, verifier, vparams, batch, key, settings, table)
            return batch_loss(model, frozen, batch, key, settings)

    def train_step(state, frozen, batch, step):
        key = jax.random.fold_in(base_key, step)
        frozen, vparams, batch = with_hidden_states(frozen, batch)

        def loss_fn(params):
            return objective(params, frozen, vparams, batch, key)

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = dict(metrics)
        metrics["error_records_sum"] = jnp.sum(batch["error_records"]).astype(jnp.float32)
        metrics["error_records_total"] = jnp.float32(1.0)
        return {"params": params, "opt": opt}, metrics

    def eval_step(params, frozen, batch, epoch, index):
        frozen, vparams, batch = with_hidden_states(frozen, batch)
        key = jax.random.fold_in(
            jax.random.fold_in(jax.random.fold_in(base_key, VAL_STREAM), epoch), index
        )
        return objective(params, frozen, vparams, batch, key)[1]

    replicated = NamedSharding(mesh, P())  # metrics: readable on every process
    train = jax.jit(
        train_step,
        in_shardings=(state_sh, frozen_sh, None, None),
        out_shardings=(state_sh, replicated),
        donate_argnums=0,
    )
    evaluate = jax.jit(
        eval_step,
        in_shardings=(state_sh["params"], frozen_sh, None, None, None),
        out_shardings=replicated,
    )
    return train, evaluate
