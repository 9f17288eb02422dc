"""Optimiser, gradient clipping and LR schedules of speculators 0.9.0, in optax.

What the reference does (``speculators/train``), reproduced here:

* ``optimizers.py::split_named_params_for_muon`` — a trainable parameter goes to
  Muon iff it is 2-D, ``min(shape) > 1`` and its name contains none of
  ``embed_tokens, lm_head, codebook, markov_w1, markov_w2``; everything else
  (norms, biases, Markov factors, the ``[1, N]`` confidence projection) to AdamW.
  We decide on the *speculators key* of each Flax path
  (``dspark_jax.model.params.speculators_key``), so the name rule is literally the same.
* ``optimizers.py::build_optimizers`` — ``--optimizer adamw``: one
  ``torch.optim.AdamW(lr=--lr, weight_decay=--weight-decay)`` over everything;
  ``--optimizer muon``: ``torch.optim.Muon(lr=--muon-lr, momentum=--muon-momentum,
  weight_decay=--muon-weight-decay, ns_steps=--muon-ns-steps,
  adjust_lr_fn=--muon-adjust-lr-fn)`` (nesterov, NS coefficients and eps at
  torch's defaults) plus ``AdamW(lr=--lr, weight_decay=--weight-decay)`` for the
  rest. AdamW betas/eps are torch's defaults (0.9, 0.999, 1e-8), weight decay on
  every AdamW parameter (no mask).
* ``trainer.py::Trainer.train_epoch`` — ``clip_grad_norm_(model.parameters(), 1.0)``
  over all gradients (``grad *= min(1, max_norm / (total_norm + 1e-6))``), then
  ``optimizer.step()`` for each optimiser, *then* ``scheduler.step()``: the update
  of step ``s`` (0-based) uses ``base_lr * lambda(s)``; the first update therefore
  uses ``lambda(0)`` (= 0 when there is warmup).
* ``trainer.py::Trainer.setup_optimizer`` / ``_resolve_scheduler_steps`` — one
  ``LambdaLR`` per optimiser (so Muon and AdamW each scale their own base lr) from
  ``transformers.get_linear_schedule_with_warmup`` or
  ``get_cosine_schedule_with_warmup(num_cycles=--scheduler-num-cosine-cycles)``;
  ``--scheduler-type none``: constant lr. Warmup = ``--scheduler-warmup-steps``,
  else ``int(total * --scheduler-warmup-ratio)``, else ``total // 100``.

Where optax 0.2.8's ready-made pieces differ from the reference, and what we use
instead (each difference is visible in the parity test):

=====================  =========================================  ======================================
                       reference (torch 2.13)                     optax 0.2.8
=====================  =========================================  ======================================
Muon momentum          ``buf.lerp_(g, 1-mu)``: EMA, no bias       ``contrib.muon``: EMA *with* bias
                       correction                                 correction of buf and g (other mix)
Nesterov               ``g.lerp(buf, mu)``                        ``mu*buf_hat + (1-mu)*g_hat``
Newton-Schulz          bf16 operands; ``addmm`` = one rounding    fp32 (input dtype), no bf16 option
                       of ``beta*C + alpha*A@B`` (fp32 acc.)
NS normalisation       ``x / clamp(||x||_F, min=1e-7)``, bf16     ``x / (||x||_F + 1e-8)``
"tall" transpose       on the torch layout ``[out, in]``          on the stored array (ours: [in, out])
update scale           ``0.2*sqrt(max(A, B))`` / ``sqrt(max(1,    ``consistent_rms=0.2`` / width
                       A/B))`` with torch's ``A = out``           scaling with ``fan_out/fan_in``
Muon weight decay      ``p *= 1 - lr*wd`` (unadjusted lr)         same (add_decayed_weights, then lr)
AdamW group            torch AdamW: no Nesterov, decay            ``contrib.muon``'s Adam: Nesterov,
                       ``--weight-decay`` on every AdamW param    decay 0 by default
AdamW bias correction  ``1 - beta**t`` in float64                 fp32: 1.3e-5 off at t=1 for b2=0.999
clipping               ``g *= min(1, max/(norm + 1e-6))``         ``clip_by_global_norm``: no 1e-6
=====================  =========================================  ======================================

So we build it from optax's combinators and stock transforms (``optax.chain``,
``optax.partition``, ``add_decayed_weights``, ``scale_by_learning_rate``) around
three small transforms of our own: ``scale_by_torch_muon``, ``scale_by_torch_adam``
and ``clip_by_global_norm_torch``.

Newton-Schulz in bf16: our kernels are ``[in, out]`` (torch weight transposed). We
orthogonalise the torch layout ``W = K.T`` with torch's operation order (tall ->
transposed to wide, exactly like torch) and transpose back, so even square
matrices, where ``W W^T`` and ``W^T W`` would round differently, match. torch's
bf16 ``addmm`` forms ``beta*C + alpha*acc`` with a fused multiply-add; we form it
exactly with error-free fp32 arithmetic (``_addmm_bf16``) — the naive fp32
expression flips about one bf16 rounding in 10^4, which the iteration amplifies to
several ulps. The result is bit-identical to torch's CPU result for nearly all
matrices up to 64 x 64; what remains is the fp32 accumulation order *inside* the
matmuls (XLA vs oneDNN/cuBLAS), which now and then flips a bf16 rounding, giving
differences below 1% of max|O| (measured on CPU up to 256 x 128).

Usage (both forms are tested)::

    tx, schedules = build_optimizer(params, optimizer="muon", lr=1e-3, total_steps=1000)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)          # stateful NNX
    ...
    params = nnx.state(model, nnx.Param)                   # or functional
    opt_state = tx.init(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)

``schedules`` maps the group name (``"muon"`` / ``"adamw"``) to an optax schedule
``count -> lr``; the lr used by update ``s`` is ``schedules[g](s)`` (what the
reference logs as ``lr`` for that step).
"""

from dspark_jax.optim.adamw import (
    ADAMW_BETAS,
    ADAMW_EPS,
    TorchAdamState,
    scale_by_torch_adam,
    torch_adamw,
)
from dspark_jax.optim.build import CLI_DEFAULTS, build_optimizer, build_optimizer_from_flags
from dspark_jax.optim.clipping import (
    CLIP_EPS,
    MAX_GRAD_NORM,
    clip_by_global_norm_torch,
    global_grad_norm,
)
from dspark_jax.optim.muon import (
    MUON_NESTEROV,
    TorchMuonState,
    muon_lr_ratio,
    orthogonalize_leaves,
    scale_by_muon_lr_adjustment,
    scale_by_torch_muon,
    torch_muon,
)
from dspark_jax.optim.newton_schulz import MUON_EPS, MUON_NS_COEFFICIENTS, newton_schulz_torch
from dspark_jax.optim.partition import (
    ADAMW_NAME_HINTS,
    is_muon_param,
    muon_param_keys,
    param_labels,
)
from dspark_jax.optim.schedules import (
    current_lrs,
    lr_lambda,
    make_schedule,
    resolve_scheduler_steps,
)

__all__ = [
    "ADAMW_BETAS",
    "ADAMW_EPS",
    "ADAMW_NAME_HINTS",
    "CLIP_EPS",
    "MAX_GRAD_NORM",
    "MUON_EPS",
    "MUON_NESTEROV",
    "MUON_NS_COEFFICIENTS",
    "CLI_DEFAULTS",
    "TorchAdamState",
    "TorchMuonState",
    "build_optimizer",
    "build_optimizer_from_flags",
    "clip_by_global_norm_torch",
    "current_lrs",
    "global_grad_norm",
    "is_muon_param",
    "lr_lambda",
    "make_schedule",
    "muon_lr_ratio",
    "muon_param_keys",
    "newton_schulz_torch",
    "orthogonalize_leaves",
    "param_labels",
    "resolve_scheduler_steps",
    "scale_by_muon_lr_adjustment",
    "scale_by_torch_adam",
    "scale_by_torch_muon",
    "torch_adamw",
    "torch_muon",
]
