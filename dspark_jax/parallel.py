"""Mesh, logical-axis rules and multi-host start-up: the only module that knows the mesh.

Modules annotate parameters with logical axis names (``embed``, ``heads``, ...);
``LOGICAL_RULES`` maps them to the mesh axes ``data``, ``fsdp``, ``context``, ``tensor``.
Rows of a batch split over ``(data, fsdp)``, the tokens of a row over ``context``
(docs/design.md, "Context parallelism"); weights shard over ``fsdp`` (ZeRO-3 style) and
``tensor`` (heads, MLP width, vocabulary). One device, 8 simulated CPU devices and
a TPU pod run the same code.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "context", "tensor")
BATCH_AXES = ("data", "fsdp")
CONTEXT_AXIS = "context"  # splits the tokens of a row

# One rule per logical name (NNX semantics: a dict). None = replicated.
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
    "aux_embed": None,  # fc's input (n_aux * Ht); its output dim is already on fsdp
    "markov": None,  # the Markov rank is small
    "norm": None,
    "layers": None,  # the stacked verifier's layer axis (scanned; every device holds all)
    "experts": "fsdp",  # a process stores (and reads) whole experts, its share of them
    "sequence": CONTEXT_AXIS,  # the tokens of a row (every per-token tensor)
}


def parse_mesh(spec: str | Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
    """``"data=2,fsdp=2,context=1,tensor=2"`` -> sizes of the four axes (missing ones 1);
    one size may be -1 (the rest of the devices). Default: all devices on fsdp."""
    if spec is None or spec == "":
        return {"data": 1, "fsdp": num_devices, "context": 1, "tensor": 1}
    if isinstance(spec, str):
        sizes: dict[str, int] = {}
        for part in spec.split(","):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in MESH_AXES:
                raise ValueError(
                    f"--mesh: bad entry {part!r}; expected e.g. 'data=2,fsdp=2,tensor=2' "
                    f"with axes {MESH_AXES}"
                )
            try:
                sizes[name] = int(value)
            except ValueError:
                raise ValueError(
                    f"--mesh: size of {name!r} must be an int, got {value!r}"
                ) from None
    else:
        sizes = dict(spec)
    full = {axis: sizes.get(axis, 1) for axis in MESH_AXES}
    fill = [a for a, n in full.items() if n == -1]
    if len(fill) > 1:
        raise ValueError(f"--mesh: at most one axis may be -1, got {fill}")
    known = int(np.prod([n for n in full.values() if n != -1]))
    if fill:
        if known <= 0 or num_devices % known:
            raise ValueError(f"--mesh: {num_devices} devices do not divide into {full}")
        full[fill[0]] = num_devices // known
    if any(n <= 0 for n in full.values()) or int(np.prod(list(full.values()))) != num_devices:
        raise ValueError(
            f"--mesh: axis sizes {full} multiply to {int(np.prod(list(full.values())))}, "
            f"but there are {num_devices} devices"
        )
    return full


def make_mesh(spec: str | Mapping[str, int] | None = None, devices=None) -> jax.sharding.Mesh:
    """A ('data', 'fsdp', 'context', 'tensor') mesh, Auto axis types (docs/design.md,
    "Mesh axis types")."""
    devices = jax.devices() if devices is None else devices
    sizes = parse_mesh(spec, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    try:
        grid = jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices).devices
    except (ValueError, NotImplementedError) as e:
        if "allow_split_physical_axes" not in str(e):
            raise
        # An axis that is no product of the slice's physical axes (data=8 on a 4x4x4
        # v5p): split a physical axis, as jax.make_mesh itself does on v5e only.
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return jax.sharding.Mesh(_context_by_process(grid), MESH_AXES, axis_types=axis_types)


def _context_by_process(grid: np.ndarray) -> np.ndarray:
    """The device grid with each context group's devices ordered by process (stable).

    jax.make_mesh orders a slice's devices for its physical rings, which on a multi-host
    slice interleaves hosts along an axis (context=8 on a v5p-16: host 0 holds shards 0,
    2, 4, 6). The data pipeline builds one token range per process (process_rows), so a
    process's shards of a row must be neighbours. The context collectives (psum, pmax
    of the attention merge; docs/design.md §7) are reductions, which any order serves.
    Within one process this is the identity.
    """
    axis = MESH_AXES.index(CONTEXT_AXIS)
    groups = np.moveaxis(grid, axis, -1)
    process = np.vectorize(lambda d: d.process_index)(groups)
    order = np.argsort(process, axis=-1, kind="stable")
    return np.moveaxis(np.take_along_axis(groups, order, axis=-1), -1, axis)


def _fit(spec: tuple, shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> P:
    """Map logical names to mesh axes; a dim the axes do not divide stays replicated, and
    a mesh axis goes to the first dim that can take it (experts [E, I, H]: E over fsdp
    when fsdp divides it, else H)."""
    out, used = [], set()
    for name, dim in zip(spec, shape, strict=True):
        axes = LOGICAL_RULES.get(name) if name is not None else None
        if name is not None and name not in LOGICAL_RULES:
            raise ValueError(f"no sharding rule for logical axis {name!r}")
        if axes is not None:
            names = (axes,) if isinstance(axes, str) else axes
            size = int(np.prod([mesh.shape[a] for a in names]))
            if dim % size or used & set(names):
                log.debug("dim %d not divisible by %s=%d (or taken): replicated", dim, axes, size)
                axes = None
            else:
                used |= set(names)
        out.append(axes)
    return P(*out)


def logical_spec(names: tuple, shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> P:
    """The PartitionSpec of an array with logical axis ``names`` (arrays outside nnx)."""
    return _fit(names, shape, mesh)


def state_shardings(state: nnx.State, mesh: jax.sharding.Mesh):
    """NamedShardings for every leaf of an nnx.State (params or optimizer state)
    from the ``out_sharding`` logical names recorded on its Variables."""

    def one(var):
        if isinstance(var, nnx.Variable) and not jax.tree.leaves(var):
            return var  # no array inside (e.g. optax's MaskedNode in a partitioned optimizer)
        names = var.get_metadata().get("out_sharding") if hasattr(var, "get_metadata") else None
        shape = tuple(var.shape) if hasattr(var, "shape") else ()
        spec = _fit(tuple(names), shape, mesh) if names else P()
        return (
            var.replace(NamedSharding(mesh, spec))
            if hasattr(var, "replace")
            else NamedSharding(mesh, spec)
        )

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def frozen_shardings(frozen, mesh: jax.sharding.Mesh):
    """Shardings of FrozenWeights (embedding [Vt, H], heads [H, Vd], norm [H]), by the
    same rules as the parameters."""
    logical = {
        "embed_tokens": ("vocab", "embed"),
        "lm_head": ("embed", "vocab"),
        "verifier_lm_head": ("embed", "vocab"),
        "verifier_norm": ("norm",),
    }
    return type(frozen)(
        **{
            name: NamedSharding(mesh, _fit(logical[name], tuple(getattr(frozen, name).shape), mesh))
            for name in frozen._fields
        }
    )


def batch_sharding(mesh: jax.sharding.Mesh, ndim: int) -> NamedSharding:
    """Rows [R, S, ...] over (data, fsdp), their tokens S over context, the rest replicated."""
    seq = (CONTEXT_AXIS,) if ndim >= 2 else ()
    return NamedSharding(mesh, P(BATCH_AXES, *seq, *([None] * (ndim - 1 - len(seq)))))


def context_size() -> int:
    """Devices the tokens of a row are split over: the ``context`` axis of the mesh set
    with ``jax.set_mesh`` (1 without one). Read at trace time by the model."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or CONTEXT_AXIS not in mesh.axis_names:
        return 1
    return int(mesh.shape[CONTEXT_AXIS])


def tracing_mesh(mesh: jax.sharding.Mesh):
    """Context manager: the mesh the model sees while a step is traced (context_size,
    the shard_maps). The step's arguments must already live on ``mesh``."""
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def check_context_split(mesh: jax.sharding.Mesh, seq_len: int, rows: int | None = None) -> None:
    """Raise ValueError unless rows of seq_len tokens split evenly over the context axis
    and every process holds one token range of each of its rows of a batch of ``rows``
    rows (default: one per data x fsdp shard; :func:`process_rows`): a context group may
    span processes, each then reads only its tokens' hidden states."""
    c = mesh.shape[CONTEXT_AXIS]
    if seq_len % c:
        raise ValueError(f"--total-seq-len {seq_len} must be a multiple of the mesh's context={c}")
    rows = rows_per_step(mesh) if rows is None else rows
    for p in sorted({d.process_index for d in mesh.devices.flat}):
        process_rows(mesh, rows, seq_len, p)


def process_rows(
    mesh: jax.sharding.Mesh, rows: int, seq_len: int, process_index: int | None = None
) -> tuple[tuple[int, ...], tuple[int, int]]:
    """The rows and tokens ``((r, ...), (lo, hi))`` of a [rows, seq_len] batch
    (:func:`batch_sharding`) that a process's devices hold.

    Every process builds exactly those rows (sorted; they need not be consecutive: a
    slice's device order may give a host rows 0 and 2) and, of each, the hidden states of
    tokens ``[lo, hi)`` (data.pipeline.ProcessRows): the whole row unless the context
    axis spans processes. ``jax.make_array_from_process_local_data`` places them.
    Raises ValueError when the process's shards are no grid of rows x one token range
    (e.g. a context group whose processes hold interleaved token ranges: the mesh's
    device order must keep each process's shards of a row contiguous).
    """
    p = jax.process_index() if process_index is None else process_index
    index = batch_sharding(mesh, 2).devices_indices_map((rows, seq_len))
    mine = {
        tuple(sl.indices(n)[:2] for sl, n in zip(ix, (rows, seq_len), strict=True))
        for d, ix in index.items()
        if d.process_index == p
    }
    if not mine:
        raise ValueError(f"process {p} holds no device of the mesh")
    row_shards = sorted({r for r, _ in mine})
    token_shards = sorted({t for _, t in mine})
    lo, hi = token_shards[0][0], token_shards[-1][1]
    contiguous = all(a[1] == b[0] for a, b in zip(token_shards, token_shards[1:], strict=False))
    if len(mine) != len(row_shards) * len(token_shards) or not contiguous:
        shards = ", ".join(f"rows {r[0]}:{r[1]} tokens {t[0]}:{t[1]}" for r, t in sorted(mine))
        raise ValueError(
            f"--mesh {dict(mesh.shape)}: process {p}'s devices hold {shards} of the "
            f"[{rows}, {seq_len}] batch, not the same token range of each of its rows; the "
            "data pipeline builds one token range per process (order the mesh so each "
            "process's context shards are neighbours: parallel.make_mesh does)"
        )
    return tuple(i for a, b in row_shards for i in range(a, b)), (lo, hi)


def row_vmap_axes(rows: int | None = None) -> tuple[str, ...] | None:
    """``spmd_axis_name`` of the vmap over a batch's rows: the batch axes when the row's
    tokens are split over context (see context_shard_map), else None. Also None for a
    batch of ``rows`` the batch axes cannot split (eval's one row at a time: replicated
    over them, each device of a batch group computes it)."""
    if context_size() == 1:
        return None
    if rows is not None:
        shape = jax.sharding.get_abstract_mesh().shape
        if rows % math.prod(shape[a] for a in BATCH_AXES):
            return None
    return BATCH_AXES


def constrain_tokens(x: jax.Array) -> jax.Array:
    """Keep a per-token array x [S, ...] split over context (its other dims free), so the
    partitioner never gathers a row's tokens; identity without a context split."""
    if context_size() == 1:
        return x
    spec = P(CONTEXT_AXIS, *([P.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, spec)


def sequence_take(x: jax.Array, idx: jax.Array) -> jax.Array:
    """``x[idx]`` for a per-token array x [S, ...] whose S may be split over ``context``.

    idx [N] int (0 <= idx < S). Split, each device takes the rows it holds (zeros for
    the others) and a psum adds them: exact (one nonzero term per row), and it moves
    N rows, not the whole sequence. No gradient flows to x (the callers gather token
    ids, masks and the frozen verifier states).
    """
    x = jax.lax.stop_gradient(x)
    if context_size() == 1:
        return x[idx]
    return context_shard_map(shard_take, (P(CONTEXT_AXIS), P()), P())(x, idx)


def context_shard_map(f, in_specs, out_specs):
    """``jax.shard_map`` of a per-device function of a row split over ``context``.

    Manual over the batch axes too: under the rows' vmap (``spmd_axis_name=
    row_vmap_axes()``) each device then takes its own rows, and the function's loops
    (data-dependent trip counts) stay per device; a batch axis left automatic would put
    the partitioner's collectives inside them, where devices disagree on the trip count.
    ``tensor`` stays automatic.
    """
    return jax.shard_map(
        f,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names={*BATCH_AXES, CONTEXT_AXIS},
        check_vma=False,  # loop carries mix replicated and per-shard values
    )


def previous_shard_rows(xs: jax.Array, n: int, fill) -> jax.Array:
    """Inside a shard_map over ``context``: the last n rows [n, ...] of the previous
    shard of the sequence (``fill`` on the first shard), passed by one collective
    permute. The halo of a causal window of n + 1 tokens; shards must hold >= n rows."""
    if xs.shape[0] < n:
        raise ValueError(
            f"a context shard of {xs.shape[0]} tokens is shorter than the {n} tokens a "
            "window reads from the shard before it: use fewer context shards"
        )
    c = jax.lax.axis_size(CONTEXT_AXIS)
    tail = jax.lax.ppermute(xs[xs.shape[0] - n :], CONTEXT_AXIS, [(i, i + 1) for i in range(c - 1)])
    return jnp.where(jax.lax.axis_index(CONTEXT_AXIS) > 0, tail, jnp.asarray(fill, xs.dtype))


def shard_take(xs: jax.Array, idx: jax.Array) -> jax.Array:
    """Inside a shard_map over ``context``: rows idx [N] (row positions) of the
    sequence whose equal shards xs [S / C, ...] the devices hold -> [N, ...] on every
    device. Each device contributes its own rows, zeros elsewhere; psum adds them."""
    n = xs.shape[0]
    i = idx - jax.lax.axis_index(CONTEXT_AXIS) * n
    mine = ((i >= 0) & (i < n)).reshape(-1, *([1] * (xs.ndim - 1)))
    rows = jnp.where(mine, xs[jnp.clip(i, 0, n - 1)], jnp.zeros((), xs.dtype))
    if rows.dtype == jnp.bool_:
        return jax.lax.psum(rows.astype(jnp.int32), CONTEXT_AXIS).astype(jnp.bool_)
    if jnp.issubdtype(rows.dtype, jnp.floating):
        # The bit patterns are summed as unsigned integers of the same width: one term is
        # the row, the others +0.0 (all bits 0), so the sum is the row bit for bit (-0.0
        # and NaN included) at the same bytes. A bf16 psum here would abort XLA's CPU
        # compiler (docs/xla_cpu_bf16_psum.md).
        bits = jnp.dtype(f"uint{8 * rows.dtype.itemsize}")
        summed = jax.lax.psum(jax.lax.bitcast_convert_type(rows, bits), CONTEXT_AXIS)
        return jax.lax.bitcast_convert_type(summed, rows.dtype)
    return jax.lax.psum(rows, CONTEXT_AXIS)


def rows_per_step(mesh: jax.sharding.Mesh, rows_per_replica: int = 1) -> int:
    """Global rows per step: one packed row per data-parallel replica, like the reference."""
    return rows_per_replica * mesh.shape["data"] * mesh.shape["fsdp"]


def global_batch(
    local: Mapping[str, np.ndarray], mesh: jax.sharding.Mesh, rows: int | None = None
) -> dict[str, jax.Array]:
    """This process's part of a step's batch -> global arrays (multi-host safe).

    ``local``: the pipeline's batch of the process's rows (:func:`process_rows`, in
    their global order), the
    hidden states of its tokens ``[lo, hi)`` only, token ids and masks [R, S] whole
    (cut to ``[lo, hi)`` here). ``rows``: global rows (default: one per data x fsdp
    shard). Rows split over (data, fsdp), tokens over context.
    """
    rows = rows_per_step(mesh) if rows is None else rows
    seq_len = int(local["input_ids"].shape[1])
    rows_here, (lo, hi) = process_rows(mesh, rows, seq_len)
    out = {}
    for k, v in local.items():
        if v.shape[0] != len(rows_here):
            raise ValueError(
                f"batch[{k!r}] has {v.shape[0]} rows; this process holds {len(rows_here)} "
                f"of the {rows}"
            )
        if v.ndim >= 2 and v.shape[1] == seq_len and hi - lo != seq_len:
            v = v[:, lo:hi]  # whole-row ids and masks: this process's tokens
        if v.ndim >= 2 and v.shape[1] != hi - lo:
            raise ValueError(f"batch[{k!r}] has {v.shape[1]} tokens; this process holds {lo}:{hi}")
        sharding = batch_sharding(mesh, v.ndim)
        global_shape = (rows, *((seq_len,) if v.ndim >= 2 else ()), *v.shape[2:])
        out[k] = jax.make_array_from_process_local_data(sharding, v, global_shape)
    return out


def slurm_local_device_ids(env) -> list[int] | None:
    """All of the node's GPUs for a one-task-per-node Slurm step, else None.

    JAX's Slurm detection gives each process the single device ``SLURM_LOCALID``
    (one task per GPU). Our recipes run one process per node that drives every local
    GPU, so then the process gets them all: ``CUDA_VISIBLE_DEVICES`` (set by Slurm for
    the step's GPUs) or ``SLURM_GPUS_ON_NODE`` count them. ``JAX_LOCAL_DEVICE_IDS``,
    when set, wins (JAX reads it).
    """
    if env.get("JAX_LOCAL_DEVICE_IDS"):
        return None
    # SLURM_TASKS_PER_NODE looks like "1(x2)" or "4,2"
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    if {t.split("(")[0] for t in per_node.split(",")} != {"1"}:
        return None
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    n = len(visible) or int(env.get("SLURM_GPUS_ON_NODE") or 0)
    return list(range(n)) if n > 1 else None


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """Start jax.distributed when launched as several processes; returns True if it did.

    Explicit arguments win; otherwise JAX's own cluster detection (Cloud TPU pods,
    Slurm, JAX_COORDINATOR_ADDRESS) is used when the environment names one. A plain
    single-process run does nothing.
    """
    if jax.distributed.is_initialized():
        return True
    explicit = coordinator_address is not None
    slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ
    tpu_pod = "TPU_WORKER_HOSTNAMES" in os.environ and "," in os.environ["TPU_WORKER_HOSTNAMES"]
    env = "JAX_COORDINATOR_ADDRESS" in os.environ
    if not (explicit or slurm or tpu_pod or env):
        return False
    kwargs = {}
    if explicit:
        kwargs = {
            "coordinator_address": coordinator_address,
            "num_processes": num_processes,
            "process_id": process_id,
        }
    elif slurm and (ids := slurm_local_device_ids(os.environ)) is not None:
        kwargs["local_device_ids"] = ids
    jax.distributed.initialize(**kwargs)
    log.info(
        "jax.distributed: process %d of %d, %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return True


# Expert parallelism (verifier/experts.py): the experts split over fsdp (LOGICAL_RULES),
# the tokens of a batch over every axis, each device sending its tokens to their experts.
EXPERT_AXIS = "fsdp"


def expert_parallel_size(num_experts: int) -> int:
    """Devices the experts of the mesh set with ``jax.set_mesh`` / :func:`tracing_mesh`
    are split over (whole experts each, as :func:`_fit` places them): the fsdp axis when
    it divides ``num_experts``, else 1 (no mesh, or experts replicated or split by width)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        return 1
    n = int(mesh.shape[EXPERT_AXIS])
    return n if n > 1 and num_experts % n == 0 else 1


def mesh_size() -> int:
    """Devices of the mesh the model is traced under (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else math.prod(mesh.shape.values())


def token_shard_map(f, in_specs, out_specs):
    """``jax.shard_map`` manual over every mesh axis: tokens split over all of them
    (``P(MESH_AXES)``), the function's collectives named explicitly."""
    return jax.shard_map(f, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                      axis_name: str):  # fmt: skip
    """``jax.lax.ragged_all_to_all`` (one slice per device of ``axis_name``), inside a
    shard_map. XLA:CPU has no ragged all-to-all (UNIMPLEMENTED), so on CPU the same
    semantics run as an all-gather of every operand and its offsets, each device writing
    the slices sent to it: exact, but |axis| times the operand's memory (tests and
    --mesh on one host); TPU and GPU lower the collective itself."""

    def gathered(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        me = jax.lax.axis_index(axis_name)
        ops = jax.lax.all_gather(operand, axis_name)  # [g, N, ...]
        starts = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # [g] per source
        sizes = jax.lax.all_gather(send_sizes, axis_name)[:, me]
        lands = jax.lax.all_gather(output_offsets, axis_name)[:, me]
        j = jnp.arange(operand.shape[0])[None]
        sent = (j >= starts[:, None]) & (j < (starts + sizes)[:, None])
        dest = jnp.where(sent, lands[:, None] + j - starts[:, None], output.shape[0])
        return output.at[dest.reshape(-1)].set(ops.reshape(-1, *operand.shape[1:]), mode="drop")

    def native(*args):
        return jax.lax.ragged_all_to_all(*args, axis_name=axis_name)

    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    return jax.lax.platform_dependent(*args, cpu=gathered, default=native)
