"""Optimiser, gradient clipping and LR schedules of speculators 0.9.0, in optax.

What the reference does (``speculators/train``), reproduced here:

* ``optimizers.py::split_named_params_for_muon`` — a trainable parameter goes to
  Muon iff it is 2-D, ``min(shape) > 1`` and its name contains none of
  ``embed_tokens, lm_head, codebook, markov_w1, markov_w2``; everything else
  (norms, biases, Markov factors, the ``[1, N]`` confidence projection) to AdamW.
  We decide on the *speculators key* of each Flax path
  (``converters.keys.speculators_key``), so the name rule is literally the same.
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

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from converters.keys import speculators_key

# speculators/train/optimizers.py::_ADAMW_NAME_HINTS
ADAMW_NAME_HINTS = ("embed_tokens", "lm_head", "codebook", "markov_w1", "markov_w2")
OPTIMIZERS = ("adamw", "muon")
SCHEDULER_TYPES = ("linear", "cosine", "none")
MUON_ADJUST_LR_FNS = ("original", "match_rms_adamw")

# torch/optim/_muon.py defaults (not exposed as flags by the reference).
MUON_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
MUON_EPS = 1e-7
MUON_NESTEROV = True
# torch.optim.AdamW defaults (the reference passes only lr and weight_decay).
ADAMW_BETAS = (0.9, 0.999)
ADAMW_EPS = 1e-8
# trainer.py: clip_grad_norm_(model.parameters(), 1.0) (hard-coded); torch adds 1e-6.
MAX_GRAD_NORM = 1.0
CLIP_EPS = 1e-6

# The reference CLI's defaults (speculators/train/config/schema.py OptimizerArgs,
# SchedulerArgs); muon_lr None -> lr (TrainConfig._resolve_derived_defaults).
CLI_DEFAULTS: dict[str, Any] = {
    "optimizer": "muon",
    "lr": 1e-3,
    "weight_decay": 0.01,
    "muon_lr": None,
    "muon_momentum": 0.95,
    "muon_weight_decay": 0.1,
    "muon_ns_steps": 5,
    "muon_adjust_lr_fn": "match_rms_adamw",
    "scheduler_type": "linear",
    "scheduler_warmup_steps": None,
    "scheduler_warmup_ratio": None,
    "scheduler_total_steps": None,
    "scheduler_num_cosine_cycles": 0.5,
}


# --------------------------------------------------------------------------- paths


def _path_parts(path: Iterable) -> list[str]:
    """Key path of a leaf -> name parts; drops the ``value`` attribute of nnx.Variable."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    if len(parts) > 1 and parts[-1] in ("value", "raw_value"):
        parts = parts[:-1]
    return parts


def leaf_key(path: Iterable) -> tuple[str, bool]:
    """(speculators key, stored transposed w.r.t. torch) of a parameter's key path."""
    return speculators_key(_path_parts(path))


def is_muon_param(key: str, shape: tuple[int, ...]) -> bool:
    """speculators' split_named_params_for_muon rule, on a speculators key and torch shape."""
    return len(shape) == 2 and min(shape) > 1 and not any(hint in key for hint in ADAMW_NAME_HINTS)


def param_labels(params) -> Any:
    """Tree of ``"muon"`` / ``"adamw"`` labels (same structure as ``params``)."""

    def label(path, x):
        key, _ = leaf_key(path)
        return "muon" if is_muon_param(key, tuple(x.shape)) else "adamw"

    return jax.tree_util.tree_map_with_path(label, params)


def muon_param_keys(params) -> list[str]:
    """Speculators keys of the parameters Muon optimises (sorted), for logs and tests."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    keys = []
    for path, x in flat:
        key, _ = leaf_key(path)
        if is_muon_param(key, tuple(x.shape)):
            keys.append(key)
    return sorted(keys)


# ------------------------------------------------------------------------ clipping


def global_grad_norm(grads) -> jax.Array:
    """torch's total norm: the 2-norm of the per-tensor 2-norms (fp32)."""
    leaves = jax.tree.leaves(grads)
    if not leaves:
        return jnp.zeros([], jnp.float32)
    norms = jnp.stack([jnp.linalg.norm(g.astype(jnp.float32).ravel()) for g in leaves])
    return jnp.linalg.norm(norms)


def clip_by_global_norm_torch(max_norm: float = MAX_GRAD_NORM) -> optax.GradientTransformation:
    """``torch.nn.utils.clip_grad_norm_``: ``g *= min(1, max_norm / (norm + 1e-6))``.

    optax.clip_by_global_norm divides by the norm without the 1e-6 and skips the
    multiply below the threshold; the difference is tiny but feeds the bf16
    Newton-Schulz, so we use torch's formula. Non-finite norms propagate (torch's
    ``error_if_nonfinite=False``).
    """
    if not max_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0, got {max_norm}")

    def update_fn(updates, state, params=None):
        del params
        norm = global_grad_norm(updates)
        coef = jnp.minimum(jnp.float32(max_norm) / (norm + jnp.float32(CLIP_EPS)), 1.0)
        return jax.tree.map(lambda g: (g * coef).astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


# ---------------------------------------------------------------------------- Muon


def _split_constant(v: float, bits: int) -> tuple[float, float]:
    """fp32(v) = hi + lo exactly, ``hi`` with at most ``bits`` significant bits."""
    v32 = float(np.float32(v))
    if v32 == 0.0:
        return 0.0, 0.0
    q = 2.0 ** (math.floor(math.log2(abs(v32))) - bits + 1)
    hi = math.trunc(v32 / q) * q
    return hi, v32 - hi


def _split12(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """fp32 x = hi + lo exactly, each with <= 12 significant bits (bit masking, no FP ops)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFFF000)
    hi = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return hi, x - hi


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Knuth's TwoSum: a + b = s + e exactly."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _addmm_bf16(beta: float, c: jax.Array, alpha: float, acc: jax.Array) -> jax.Array:
    """``bf16(beta*C + alpha*acc)`` for bf16 ``C`` and the fp32 matmul result ``acc``.

    torch's bf16 ``addmm`` (oneDNN on CPU, the cuBLAS epilogue on GPU) forms
    ``beta*C + alpha*acc`` with a fused multiply-add, i.e. essentially exactly,
    then rounds once. In Newton-Schulz the two terms nearly cancel, so the naive
    fp32 ``b*C + c*acc`` (two extra roundings) flips about one bf16 rounding in
    10^4, and the iteration amplifies a flip to several ulps. We form the sum
    exactly instead: ``beta`` splits into 16+8 bits (times the 8-bit bf16 ``C``:
    exact products), ``alpha`` and ``acc`` into 12+12 bits (exact partial products),
    the two large terms are added with TwoSum and the small remainders after.
    Every product here is exact in fp32, so a backend contracting ``x*y + z`` into
    an FMA cannot change the result.
    """
    c32 = c.astype(jnp.float32)
    bh, bl = _split_constant(beta, 16)
    big1, small1 = bh * c32, bl * c32
    if float(np.float32(alpha)) == 1.0:
        big2, small2 = acc, None
    else:
        ah_, al_ = _split_constant(alpha, 12)
        xh, xl = _split12(acc)
        big2 = ah_ * xh
        small2 = (ah_ * xl + al_ * xh) + al_ * xl
    s, e = _two_sum(big1, big2)
    rest = e + small1 if small2 is None else e + (small1 + small2)
    return (s + rest).astype(jnp.bfloat16)


def newton_schulz_torch(
    w: jax.Array,
    ns_coefficients: tuple[float, float, float] = MUON_NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = MUON_EPS,
) -> jax.Array:
    """torch/optim/_muon.py::_zeropower_via_newtonschulz on a matrix in torch layout.

    bf16 operands, matmuls accumulated in fp32 and rounded to bf16; each
    ``addmm(C, A, B, beta, alpha)`` = ``bf16(beta*C + alpha*(A@B))`` rounded once
    (``_addmm_bf16``); the Frobenius norm is taken in fp32 and rounded to bf16,
    clamped at ``eps``, and the division rounded to bf16, as torch's bf16
    ``norm``/``clamp``/``div_`` do. Returns bf16, like torch.
    """
    if w.ndim != 2:
        raise ValueError(f"Newton-Schulz needs a 2-D matrix, got shape {w.shape}")
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    a, b, c = ns_coefficients
    bf16, f32 = jnp.bfloat16, jnp.float32

    def mm(p, q):
        return jnp.matmul(p, q, preferred_element_type=f32)

    x = w.astype(bf16)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    norm = jnp.sqrt(jnp.sum(jnp.square(x.astype(f32)))).astype(bf16)  # bf16 .norm()
    norm = jnp.maximum(norm, jnp.asarray(eps, bf16))  # .clamp(min=eps)
    x = (x.astype(f32) / norm.astype(f32)).astype(bf16)  # .div_ in bf16

    def body(_, x):
        gram = mm(x, x.T).astype(bf16)
        gram_update = _addmm_bf16(b, gram, c, mm(gram, gram))
        return _addmm_bf16(a, x, 1.0, mm(gram_update, x))

    x = jax.lax.fori_loop(0, ns_steps, body, x)  # rolled: 5x smaller graph per matrix
    if tall:
        x = x.T
    return x


def _after(prev: jax.Array | None, x: jax.Array) -> jax.Array:
    """``x``, bit for bit, but computable only once ``prev`` exists.

    The ordering edge that keeps the Muon update one matrix at a time. Without it
    XLA schedules by dependencies only (XLA:CPU breadth-first): every matrix's
    bf16 Newton-Schulz input is computed first and every result before the first
    parameter is written. Measured at Kimi-K3 scale: 14.2 GiB of temporaries with
    the previous grouped version, 4.3 GiB one matrix at a time without this edge,
    0.8-1.6 GiB (one Newton-Schulz working set of the largest matrix) with it.
    ``lax.optimization_barrier`` does not do it: XLA:CPU erases barriers before it
    schedules. So the edge is data: ``z = 0 * |finite(prev[0, 0])|`` is +0.0 for
    every value of ``prev`` (NaN and inf included) and XLA does not fold it (``0 *
    a`` is not 0 in IEEE arithmetic); its bits (all zero) are added to ``x``'s bits
    as integers, which leaves every value exactly as it was (-0.0, NaN, subnormals:
    a float ``x - z`` would flush subnormals on XLA:CPU), so the numerics are
    untouched.
    """
    if prev is None:
        return x
    p = prev[(0,) * prev.ndim].astype(jnp.float32)
    z = jnp.float32(0.0) * jnp.abs(jnp.where(jnp.isfinite(p), p, jnp.float32(0.0)))
    uint = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
    zero_bits = jax.lax.bitcast_convert_type(z, jnp.uint32).astype(uint)
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, uint) + zero_bits, x.dtype)


def _orthogonalize_one(x: jax.Array, transposed: bool, ns: Any) -> tuple[jax.Array, jax.Array]:
    """(bf16 NS result in the wide orientation, fp32 NS of the torch layout in ``x``'s layout).

    torch transposes a tall matrix, orthogonalises the wide one and transposes
    back; we hand NS the wide orientation directly (bitwise the same). So a leaf is
    transposed at most once on the way in, into the bf16 iterate NS stores anyway,
    and once on the way out, which XLA fuses into the elementwise consumer (upcast,
    lr ratio, decay, ``apply_updates``) that writes the parameter: no fp32 result
    or transposed copy is stored.
    """
    w = x.T if transposed else x  # torch layout [out, in]
    flip = w.shape[0] > w.shape[1]
    r = ns(w.T if flip else w)
    o = r.astype(jnp.float32)
    return r, (o.T if transposed != flip else o)


def orthogonalize_leaves(
    leaves: list[jax.Array],
    transposed: list[bool],
    ns_coefficients: tuple[float, float, float] = MUON_NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = MUON_EPS,
) -> list[jax.Array]:
    """``NS`` of each leaf's torch layout (``leaf.T`` where ``transposed``), fp32 out.

    One matrix at a time, in order, like torch's per-parameter loop: leaf ``i``
    enters Newton-Schulz only once leaf ``i-1``'s result exists (``_after``), so
    one matrix's working set is live, not all of them. Equal shapes are not
    batched through a vmapped iteration any more: that needed ``jnp.stack`` copies
    of each group and kept every result alive until the last group was done
    (14.2 GiB of temporaries at Kimi-K3 scale); the results are bitwise the same.
    """
    ns = functools.partial(
        newton_schulz_torch, ns_coefficients=ns_coefficients, ns_steps=ns_steps, eps=eps
    )
    out, prev = [], None
    for x, t in zip(leaves, transposed, strict=True):
        prev, o = _orthogonalize_one(_after(prev, x), t, ns)
        out.append(o)
    return out


class TorchMuonState(NamedTuple):
    momentum_buffer: optax.Updates  # fp32, like the param


def _torch_layout_flags(tree) -> Any:
    """Tree of bools: is the leaf stored transposed w.r.t. torch (a ``kernel``)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: leaf_key(path)[1], tree)


def scale_by_torch_muon(
    momentum: float = 0.95,
    nesterov: bool = MUON_NESTEROV,
    ns_coefficients: tuple[float, float, float] = MUON_NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = MUON_EPS,
) -> optax.GradientTransformation:
    """Momentum + Nesterov + Newton-Schulz of torch.optim.Muon (no lr, no decay).

    ``buf = lerp(buf, g, 1-mu)``; ``u = lerp(g, buf, mu)`` if nesterov else ``buf``;
    ``O = NS(u)`` computed on the torch layout of each leaf (kernels transposed in
    and out). Output is fp32 (the bf16 NS result, upcast exactly as torch's
    ``param.add_(bf16_update)`` does). Leaves must have speculators-key paths.
    """
    if momentum < 0:
        raise ValueError(f"muon momentum must be >= 0, got {momentum}")
    w_buf = jnp.float32(1.0 - momentum)  # torch casts the python weight to fp32
    mu32 = jnp.float32(momentum)

    def lerp(start, end, weight):
        # ATen lerp: |w| < 0.5 -> start + w*(end-start), else end - (end-start)*(1-w)
        if abs(float(weight)) < 0.5:
            return start + weight * (end - start)
        return end - (end - start) * (jnp.float32(1.0) - weight)

    def init_fn(params):
        return TorchMuonState(
            momentum_buffer=jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
        )

    def update_fn(updates, state, params=None):
        del params
        grads, treedef = jax.tree.flatten(updates)
        bufs = treedef.flatten_up_to(state.momentum_buffer)
        flags = jax.tree.leaves(_torch_layout_flags(updates))
        ns = functools.partial(
            newton_schulz_torch, ns_coefficients=ns_coefficients, ns_steps=ns_steps, eps=eps
        )
        new_bufs, out, prev = [], [], None
        for g, b, t in zip(grads, bufs, flags, strict=True):
            # Everything below depends on b, so this leaf's momentum, Nesterov input,
            # bf16 copy and NS start only after the previous leaf's NS result exists.
            b = _after(prev, b)
            g32 = g.astype(jnp.float32)
            buf = lerp(b, g32, w_buf)
            u = lerp(g32, buf, mu32) if nesterov else buf
            prev, o = _orthogonalize_one(u, t, ns)
            new_bufs.append(buf)
            out.append(o)
        return (
            jax.tree.unflatten(treedef, out),
            TorchMuonState(momentum_buffer=jax.tree.unflatten(treedef, new_bufs)),
        )

    return optax.GradientTransformation(init_fn, update_fn)


def muon_lr_ratio(torch_shape: tuple[int, ...], adjust_lr_fn: str | None) -> float:
    """torch/optim/_muon.py::_adjust_lr ratio for a torch-layout shape ``(A, B)``."""
    A, B = torch_shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, A / B))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(A, B))
    return 1.0


def scale_by_muon_lr_adjustment(adjust_lr_fn: str | None) -> optax.GradientTransformation:
    """Multiply each leaf by torch Muon's shape-dependent lr ratio (torch layout)."""
    if adjust_lr_fn is not None and adjust_lr_fn not in MUON_ADJUST_LR_FNS:
        raise ValueError(
            f"muon_adjust_lr_fn must be one of {MUON_ADJUST_LR_FNS}, got {adjust_lr_fn!r}"
        )

    def update_fn(updates, state, params=None):
        del params

        def scale(path, u):
            transposed = leaf_key(path)[1]
            shape = tuple(u.shape)[::-1] if transposed else tuple(u.shape)
            return u * jnp.asarray(muon_lr_ratio(shape, adjust_lr_fn), u.dtype)

        return jax.tree_util.tree_map_with_path(scale, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def torch_muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    momentum: float = 0.95,
    weight_decay: float = 0.1,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = "match_rms_adamw",
    nesterov: bool = MUON_NESTEROV,
    ns_coefficients: tuple[float, float, float] = MUON_NS_COEFFICIENTS,
    eps: float = MUON_EPS,
) -> optax.GradientTransformation:
    """torch.optim.Muon: ``p <- p*(1 - lr*wd) - lr*ratio(shape)*NS(nesterov(buf))``."""
    if weight_decay < 0:
        raise ValueError(f"muon weight decay must be >= 0, got {weight_decay}")
    return optax.chain(
        scale_by_torch_muon(momentum, nesterov, ns_coefficients, ns_steps, eps),
        scale_by_muon_lr_adjustment(adjust_lr_fn),
        optax.add_decayed_weights(weight_decay),  # decoupled, times the unadjusted lr
        optax.scale_by_learning_rate(learning_rate),
    )


class TorchAdamState(NamedTuple):
    count: jax.Array  # int32, number of updates so far (torch's ``step``)
    exp_avg: optax.Updates
    exp_avg_sq: optax.Updates


def _bias_correction(beta: float, t: jax.Array) -> jax.Array:
    """``1 - beta**t`` without fp32 cancellation (torch evaluates it in float64).

    optax's ``bias_correction`` computes ``1 - beta**t`` in fp32: at ``t = 1`` with
    ``beta = 0.999`` that is 1.3e-5 off, which moves every AdamW update by 6e-6
    relative. ``-expm1(t * log(beta))`` is accurate to ~1e-7.
    """
    return -jnp.expm1(t.astype(jnp.float32) * jnp.float32(math.log(beta)))


def scale_by_torch_adam(
    b1: float = ADAMW_BETAS[0], b2: float = ADAMW_BETAS[1], eps: float = ADAMW_EPS
) -> optax.GradientTransformation:
    """torch.optim.AdamW's step without lr and decay (``_single_tensor_adamw``):

    ``m = lerp(m, g, 1-b1)``; ``v = v*b2 + (1-b2)*g*g``;
    ``u = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps)`` (eps outside the sqrt, after
    the bias correction, like torch).
    """
    w1 = jnp.float32(1.0 - b1)

    def init_fn(params):
        def zeros(p):
            return jnp.zeros_like(p, jnp.float32)

        return TorchAdamState(
            count=jnp.zeros([], jnp.int32),
            exp_avg=jax.tree.map(zeros, params),
            exp_avg_sq=jax.tree.map(zeros, params),
        )

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        g32 = jax.tree.map(lambda g: g.astype(jnp.float32), updates)
        m = jax.tree.map(lambda m, g: m + w1 * (g - m), state.exp_avg, g32)
        v = jax.tree.map(lambda v, g: v * b2 + (g * g) * (1.0 - b2), state.exp_avg_sq, g32)
        bc1 = _bias_correction(b1, count)
        bc2_sqrt = jnp.sqrt(_bias_correction(b2, count))
        u = jax.tree.map(lambda m, v: (m / bc1) / (jnp.sqrt(v) / bc2_sqrt + eps), m, v)
        return u, TorchAdamState(count=count, exp_avg=m, exp_avg_sq=v)

    return optax.GradientTransformation(init_fn, update_fn)


def torch_adamw(
    learning_rate: optax.ScalarOrSchedule, weight_decay: float
) -> optax.GradientTransformation:
    """torch.optim.AdamW at torch's defaults (betas 0.9/0.999, eps 1e-8, no amsgrad):
    ``p <- p*(1 - lr*wd) - lr * adam(g)``, decay on every parameter it is given."""
    if weight_decay < 0:
        raise ValueError(f"weight decay must be >= 0, got {weight_decay}")
    return optax.chain(
        scale_by_torch_adam(),
        optax.add_decayed_weights(weight_decay),  # no mask: the reference decays all
        optax.scale_by_learning_rate(learning_rate),
    )


# ------------------------------------------------------------------------ schedules


def resolve_scheduler_steps(
    total_steps: int, warmup_steps: int | None = None, warmup_ratio: float | None = None
) -> tuple[int, int]:
    """speculators/train/trainer.py::_resolve_scheduler_steps (given the total).

    The reference's total is ``--scheduler-total-steps``, else ``--max-steps``, else
    ``epochs * len(train_loader)``; the caller resolves that. Returns
    ``(warmup_steps, total_steps)``.
    """
    if warmup_steps is not None:
        if warmup_ratio is not None:
            warnings.warn(
                "Both scheduler_warmup_steps and scheduler_warmup_ratio are set; "
                "using scheduler_warmup_steps.",
                stacklevel=2,
            )
        return int(warmup_steps), int(total_steps)
    if warmup_ratio is not None:
        if not 0 <= warmup_ratio <= 1:
            raise ValueError("scheduler_warmup_ratio must be between 0 and 1.")
        return int(total_steps * warmup_ratio), int(total_steps)
    return int(total_steps) // 100, int(total_steps)


def lr_lambda(
    step: int,
    *,
    scheduler_type: str,
    warmup_steps: int,
    total_steps: int,
    num_cosine_cycles: float = 0.5,
) -> float:
    """The LambdaLR multiplier in plain Python (transformers 5.19 formulas)."""
    if scheduler_type == "none":
        return 1.0
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    if scheduler_type == "linear":
        return max(0.0, float(total_steps - step) / float(max(1, total_steps - warmup_steps)))
    if scheduler_type == "cosine":
        progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cosine_cycles) * 2.0 * progress)))
    raise ValueError(f"scheduler_type must be one of {SCHEDULER_TYPES}, got {scheduler_type!r}")


def make_schedule(
    base_lr: float,
    *,
    scheduler_type: str,
    warmup_steps: int,
    total_steps: int,
    num_cosine_cycles: float = 0.5,
) -> optax.Schedule:
    """``count -> base_lr * lambda(count)`` (jittable), the lr of update ``count``.

    transformers' lambdas, unclamped like the reference: cosine past ``total``
    rises again (``num_cycles=0.5`` -> lambda(1.5*total) = 0.5); linear stays 0.
    """
    if scheduler_type not in SCHEDULER_TYPES:
        raise ValueError(f"scheduler_type must be one of {SCHEDULER_TYPES}, got {scheduler_type!r}")
    base = float(base_lr)
    if scheduler_type == "none":
        return optax.constant_schedule(base)
    w = int(warmup_steps)
    span = float(max(1, total_steps - w))

    def schedule(count):
        s = jnp.asarray(count, jnp.float32)
        warm = s / float(max(1, w))
        if scheduler_type == "linear":
            decay = jnp.maximum(0.0, (float(total_steps) - s) / span)
        else:
            progress = (s - w) / span
            decay = jnp.maximum(
                0.0, 0.5 * (1.0 + jnp.cos(math.pi * float(num_cosine_cycles) * 2.0 * progress))
            )
        return base * jnp.where(s < w, warm, decay)

    return schedule


# --------------------------------------------------------------------------- build


def build_optimizer(
    params=None,
    *,
    optimizer: str = CLI_DEFAULTS["optimizer"],
    lr: float = CLI_DEFAULTS["lr"],
    weight_decay: float = CLI_DEFAULTS["weight_decay"],
    muon_lr: float | None = None,
    muon_momentum: float = CLI_DEFAULTS["muon_momentum"],
    muon_weight_decay: float = CLI_DEFAULTS["muon_weight_decay"],
    muon_ns_steps: int = CLI_DEFAULTS["muon_ns_steps"],
    muon_adjust_lr_fn: str = CLI_DEFAULTS["muon_adjust_lr_fn"],
    scheduler_type: str = CLI_DEFAULTS["scheduler_type"],
    total_steps: int | None = None,
    warmup_steps: int | None = None,
    warmup_ratio: float | None = None,
    num_cosine_cycles: float = CLI_DEFAULTS["scheduler_num_cosine_cycles"],
    max_grad_norm: float = MAX_GRAD_NORM,
) -> tuple[optax.GradientTransformation, dict[str, optax.Schedule]]:
    """The reference's clipping + optimiser(s) + per-group schedules as one optax transform.

    params: the trainable parameter tree (``nnx.state(model, nnx.Param)`` or its
    pure-array form), used only to check the flags against it (a Muon run with no
    Muon parameter is allowed, like the reference); may be None.
    total_steps: the resolved scheduler horizon (required unless
    ``scheduler_type == "none"``). ``muon_lr`` None -> ``lr`` (the CLI's rule).

    Returns ``(tx, schedules)``: ``tx = chain(torch clip_grad_norm_, partition(muon |
    adamw))``; ``schedules`` = ``{"muon": ..., "adamw": ...}`` (``{"adamw": ...}`` for
    ``optimizer="adamw"``).
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"Unsupported optimizer: {optimizer!r} (expected one of {OPTIMIZERS})")
    if scheduler_type not in SCHEDULER_TYPES:
        raise ValueError(
            f"Unsupported scheduler_type: {scheduler_type!r} (expected one of {SCHEDULER_TYPES})"
        )
    if muon_adjust_lr_fn not in MUON_ADJUST_LR_FNS:
        raise ValueError(
            f"Unsupported muon_adjust_lr_fn: {muon_adjust_lr_fn!r} "
            f"(expected one of {MUON_ADJUST_LR_FNS})"
        )
    for name, value in (("lr", lr), ("muon_lr", muon_lr)):
        if value is not None and not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if (
        isinstance(muon_ns_steps, bool)
        or not isinstance(muon_ns_steps, int)
        or not 0 <= muon_ns_steps < 100
    ):
        raise ValueError(f"muon_ns_steps must be an int in [0, 100), got {muon_ns_steps!r}")
    if scheduler_type == "none":
        warm, total = 0, 0
    else:
        if total_steps is None or total_steps < 0:
            raise ValueError(
                f"total_steps (the scheduler horizon) must be a non-negative int for "
                f"scheduler_type={scheduler_type!r}, got {total_steps!r}"
            )
        warm, total = resolve_scheduler_steps(total_steps, warmup_steps, warmup_ratio)
    if muon_lr is None:
        muon_lr = lr
    if params is not None and not jax.tree.leaves(params):
        raise ValueError("No trainable parameters found to optimize.")

    def sched(base):
        return make_schedule(
            base,
            scheduler_type=scheduler_type,
            warmup_steps=warm,
            total_steps=total,
            num_cosine_cycles=num_cosine_cycles,
        )

    clip = clip_by_global_norm_torch(max_grad_norm)
    if optimizer == "adamw":
        adam_sched = sched(lr)
        return optax.chain(clip, torch_adamw(adam_sched, weight_decay)), {"adamw": adam_sched}

    schedules = {"muon": sched(muon_lr), "adamw": sched(lr)}
    tx = optax.partition(
        {
            "muon": torch_muon(
                schedules["muon"],
                momentum=muon_momentum,
                weight_decay=muon_weight_decay,
                ns_steps=muon_ns_steps,
                adjust_lr_fn=muon_adjust_lr_fn,
            ),
            "adamw": torch_adamw(schedules["adamw"], weight_decay),
        },
        param_labels,
    )
    return optax.chain(clip, tx), schedules


def build_optimizer_from_flags(params, flags: dict[str, Any], total_steps: int | None):
    """``build_optimizer`` from the reference's flag names (``CLI_DEFAULTS`` keys)."""
    f = {**CLI_DEFAULTS, **{k: v for k, v in flags.items() if k in CLI_DEFAULTS}}
    total = f["scheduler_total_steps"] if f["scheduler_total_steps"] is not None else total_steps
    return build_optimizer(
        params,
        optimizer=f["optimizer"],
        lr=f["lr"],
        weight_decay=f["weight_decay"],
        muon_lr=f["muon_lr"],
        muon_momentum=f["muon_momentum"],
        muon_weight_decay=f["muon_weight_decay"],
        muon_ns_steps=f["muon_ns_steps"],
        muon_adjust_lr_fn=f["muon_adjust_lr_fn"],
        scheduler_type=f["scheduler_type"],
        total_steps=total,
        warmup_steps=f["scheduler_warmup_steps"],
        warmup_ratio=f["scheduler_warmup_ratio"],
        num_cosine_cycles=f["scheduler_num_cosine_cycles"],
    )


def current_lrs(schedules: dict[str, optax.Schedule], step) -> dict[str, jax.Array]:
    """The lr each group uses for update ``step`` (the reference's logged ``lr``)."""
    return {name: s(step) for name, s in schedules.items()}


__all__ = [
    "ADAMW_NAME_HINTS",
    "CLI_DEFAULTS",
    "TorchAdamState",
    "TorchMuonState",
    "build_optimizer",
    "build_optimizer_from_flags",
    "clip_by_global_norm_torch",
    "current_lrs",
    "global_grad_norm",
    "is_muon_param",
    "leaf_key",
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
