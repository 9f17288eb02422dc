"""Routed tokens to their experts and back: the dispatch of a sparse (MoE) block.

Given tokens x [T, H], each token's k experts and weights (the router's, forward.py) and
the stacked expert weights, :func:`dispatch` returns ``sum_j w_j * expert_{i_j}(x)``
[T, H] fp32. The tokens' k copies are sorted by expert and run through
``lax.ragged_dot`` (``compute``), so each token visits only its k experts.

Rows are flattened into tokens first (routing is per token): under ``jax.vmap`` (the
rows of a batch) a ``custom_vmap`` rule reshapes them, so ``lax.ragged_dot``, which has
no batching rule, never sees a batch dimension, and one exchange serves every row a
device holds.

When the mesh splits the experts (``parallel.expert_parallel_size``: whole experts per
fsdp device), the dispatch is expert parallel (docs/design.md, "Expert parallelism"):
the tokens are split over every device; each device sends each token copy to the
device holding its expert (a ragged all-to-all over fsdp), runs the copies it received
through its own experts and sends the results back. No device gathers another's
experts or tokens. The exchange runs in chunks of tokens whose worst case (every copy
to one device) fits a fixed buffer: exact, never a dropped token.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dspark_jax import parallel

_F32 = jnp.float32
# Rows one device can receive per exchange in the worst case (every copy of a chunk to
# its experts): sizes the chunk. DeepSeek-V3 on fsdp=32 (8 experts per device, k=8):
# chunks of 256 tokens, buffers of 65536 x 7168.
EXCHANGE_ROWS = 65536

# compute(weights, xs [R, H] sorted by expert, sizes [E] int32, expert of each row [R])
# -> [R, H] fp32 (rows past sum(sizes): anything)
Compute = Callable[[dict, jax.Array, jax.Array, jax.Array], jax.Array]


def dispatch(
    x: jax.Array,
    top_w: jax.Array,
    top_i: jax.Array,
    weights: dict[str, jax.Array],
    *,
    compute: Compute,
    num_experts: int,
    exchange_rows: int = EXCHANGE_ROWS,
) -> jax.Array:
    """x [..., H], top_w / top_i [..., k] (weights, expert ids), ``weights`` the stacked
    expert tensors (leading dim the experts) -> [..., H] fp32."""

    def plain(x, top_w, top_i, weights):
        h, k = x.shape[-1], top_i.shape[-1]
        y = _tokens(
            x.reshape(-1, h), top_w.reshape(-1, k), top_i.reshape(-1, k), weights,
            compute, num_experts, exchange_rows,
        )  # fmt: skip
        return y.reshape(*x.shape[:-1], h)

    run = jax.custom_batching.custom_vmap(plain)

    @run.def_vmap
    def _rows(axis_size, in_batched, x, top_w, top_i, weights):
        if any(jax.tree.leaves(in_batched[3])):
            raise ValueError("experts.dispatch: the expert weights must not be batched")
        x, top_w, top_i = (
            a if b else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, b in zip((x, top_w, top_i), in_batched[:3], strict=True)
        )
        return run(x, top_w, top_i, weights), True  # rows are more tokens

    # custom_vmap has no reverse mode; the gradient (tests' error bounds, of one row)
    # is the plain function's.
    @jax.custom_vjp
    def differentiable(x, top_w, top_i, weights):
        return run(x, top_w, top_i, weights)

    def forward(*args):
        return run(*args), args

    def backward(args, ct):
        return jax.vjp(plain, *args)[1](ct)

    differentiable.defvjp(forward, backward)
    return differentiable(x, top_w, top_i, weights)


def _tokens(x, top_w, top_i, weights, compute, num_experts, exchange_rows):
    g = parallel.expert_parallel_size(num_experts)
    if g == 1:
        return _local(x, top_w, top_i, weights, compute, num_experts)
    return _expert_parallel(x, top_w, top_i, weights, compute, num_experts, g, exchange_rows)


def _local(x, top_w, top_i, weights, compute, num_experts):
    """Every expert on this device: copies sorted by expert, one grouped matmul, the k
    results of each token added in expert order."""
    k = top_i.shape[1]
    flat = top_i.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tok = order // k
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    y = compute(weights, x[tok], sizes, flat[order])
    y = y * top_w.reshape(-1)[order][:, None].astype(_F32)
    return jnp.zeros((x.shape[0], x.shape[1]), _F32).at[tok].add(y)


def _expert_parallel(x, top_w, top_i, weights, compute, num_experts, g, exchange_rows):
    """Tokens split over every device of the mesh (padded to a whole number of chunks
    per device), experts over fsdp; each device's chunks exchanged over fsdp."""
    n, h = x.shape
    k = top_i.shape[1]
    e_loc = num_experts // g
    chunk_max = max(1, exchange_rows // (g * min(k, e_loc)))
    devices = parallel.mesh_size()
    per = -(-n // devices)
    chunk = min(chunk_max, per)
    per = -(-per // chunk) * chunk
    pad = per * devices - n
    # padding tokens take expert 0 with weight 0: they ride along, their results unused
    # Whole on every device on both sides of the exchange: the token split stays inside
    # the shard_map. Left to propagate, it split the row's tokens in the layers around
    # it (Kimi-Linear's step then hung on 8 simulated devices: collectives inside loops
    # whose trip counts differ per token range).
    x, top_w, top_i = (
        jax.lax.with_sharding_constraint(jnp.pad(a, ((0, pad), (0, 0))), P())
        for a in (x, top_w, top_i)
    )
    tokens = P(parallel.MESH_AXES)
    w_specs = {name: P(parallel.EXPERT_AXIS) for name in weights}

    def device(x, top_w, top_i, weights):
        def one_chunk(_, c):
            return None, _exchange(*c, weights, compute, num_experts, g)

        split = (a.reshape(per // chunk, chunk, a.shape[1]) for a in (x, top_w, top_i))
        _, y = jax.lax.scan(one_chunk, None, tuple(split))
        return y.reshape(per, h)

    y = parallel.token_shard_map(device, (tokens, tokens, tokens, w_specs), tokens)(
        x, top_w, top_i, weights
    )
    return jax.lax.with_sharding_constraint(y, P())[:n]


def _exchange(x, top_w, top_i, weights, compute, num_experts, g):
    """One chunk on one device (inside the shard_map): x [C, H], top_w / top_i [C, k];
    ``weights`` this device's e_loc experts. Returns [C, H] fp32."""
    axis = parallel.EXPERT_AXIS
    c, h = x.shape
    k = top_i.shape[1]
    e_loc = num_experts // g
    me = jax.lax.axis_index(axis)
    flat = top_i.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # by expert, hence by the device holding it
    tok = order // k
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32).reshape(g, e_loc)
    every = jax.lax.all_gather(counts, axis)  # [source, destination, its local expert]
    pair = every.sum(-1)  # [source, destination] copies
    send = pair[me]
    send_at = jnp.cumsum(send) - send  # my copies for device d start here
    recv = pair[:, me]
    recv_at = jnp.cumsum(recv) - recv  # device s's copies land here in my buffer
    lands = (jnp.cumsum(pair, axis=0) - pair)[me]  # ... and mine here in device d's
    rows = c * g * min(k, e_loc)  # every copy of every device's chunk to me
    dtype = jax.tree.leaves(weights)[0].dtype
    got = parallel.ragged_all_to_all(
        x[tok].astype(dtype), jnp.zeros((rows, h), dtype), send_at, send, lands, recv, axis
    )
    # received: source-major, each source's copies in its expert order. Sort by expert.
    mine = every[:, me]  # [source, local expert]
    segment = jnp.searchsorted(jnp.cumsum(mine.reshape(-1)), jnp.arange(rows), side="right")
    expert = jnp.where(segment < g * e_loc, segment % e_loc, e_loc)  # e_loc: unused row
    perm = jnp.argsort(expert, stable=True)
    y = compute(weights, got[perm], mine.sum(0), jnp.minimum(expert[perm], e_loc - 1))
    y = jnp.zeros((rows, h), _F32).at[perm].set(y)  # back in received order
    back_at = (jnp.cumsum(pair, axis=1) - pair)[:, me]  # my experts' copies in s's order
    y = parallel.ragged_all_to_all(
        y, jnp.zeros((c * k, h), _F32), recv_at, recv, back_at, send, axis
    )
    y = y * top_w.reshape(-1)[order][:, None].astype(_F32)
    return jnp.zeros((c, h), _F32).at[tok].add(y)
