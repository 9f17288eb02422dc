"""torch.optim.Muon in optax: momentum, Nesterov, Newton-Schulz one matrix at a time,
the shape-dependent lr ratio and decoupled weight decay."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dspark_jax.model.params import leaf_key
from dspark_jax.optim.newton_schulz import MUON_EPS, MUON_NS_COEFFICIENTS, newton_schulz_torch

MUON_ADJUST_LR_FNS = ("original", "match_rms_adamw")
MUON_NESTEROV = True  # torch.optim.Muon's default (not a reference flag)


def after_previous(prev: jax.Array | None, x: jax.Array) -> jax.Array:
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
    enters Newton-Schulz only once leaf ``i-1``'s result exists (``after_previous``), so
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
        prev, o = _orthogonalize_one(after_previous(prev, x), t, ns)
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
            b = after_previous(prev, b)
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
