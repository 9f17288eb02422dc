# SPDX-License-Identifier: Apache-2.0
import gc
from collections import defaultdict
from functools import cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

GBYTES = 1024 * 1024 * 1024
TPU_HEAD_SIZE_ALIGNMENT = 128
TPU_SECOND_LAST_MINOR = 8


# Note: we suppose the allocated devices in Pathways are contiguous. This is waiting to check from GCP.
def get_device_id_offset(devices):
    int32_max = np.iinfo(np.int32).max
    offset = int32_max
    for dev in devices:
        if dev.id < offset:
            offset = dev.id
    return offset if offset != int32_max else 0


def get_device_name(num_devices: int | None = None):
    kind = jax.devices()[0].device_kind
    if "TPU" not in kind:
        raise RuntimeError("Expected TPU devices")
    suffix = ""
    if kind.endswith(" lite"):
        kind = kind[: -len(" lite")]
        suffix = "e"
    elif kind.endswith("e"):
        kind = kind[:-1]
        suffix = "e"
    elif kind.endswith("p"):
        kind = kind[:-1]
        suffix = "p"
    elif kind == "TPU7x":
        kind = "TPU v7"
    assert kind[:-1] == "TPU v", kind
    kind += suffix
    if num_devices is not None:
        kind += f"-{num_devices}"
    return kind


def get_device_hbm_limit() -> int:
    device_kind = get_device_name()
    if device_kind == "TPU v5p" or device_kind == "TPU v5":
        return 95 * GBYTES
    elif device_kind == "TPU v5e":
        return 16 * GBYTES
    elif device_kind == "TPU v6e" or device_kind == "TPU v4":
        return 32 * GBYTES
    elif device_kind == "TPU v7":
        # 192 * GBYTES / 2 because each JAX device (v7x core) has
        # 1/2 of the total chip HBM
        return 96 * GBYTES
    else:
        raise ValueError(f"Unknown device kind: {device_kind}")


def pathways_hbm_usage_gb(live_arrays, devices: Any) -> list[tuple[float, float]]:
    hbm_used: defaultdict[str, int] = defaultdict(int)
    hbm_limit = get_device_hbm_limit()
    # Do NOT touch array.addressable_shards: under IFRT proxy that property
    # materializes one fresh single-device Array per shard which registers in
    # jax.live_arrays() and is never reclaimed by gc (client holds a strong
    # ref), so repeated calls leak ~n_params*n_dev wrappers per call and the
    # next call double-counts every buffer. Compute per-device bytes purely
    # from sharding metadata (device_set + shard_shape) instead.
    for array in live_arrays:
        try:
            shd = array.sharding
            per_bytes = int(np.prod(shd.shard_shape(array.shape))) * array.dtype.itemsize
            devs = shd.device_set
        except Exception:
            continue
        for d in devs:
            hbm_used[d] += per_bytes
    import logging

    mx = max(hbm_used.values(), default=0)
    logging.getLogger(__name__).info(
        "[hbm-proxy] n_live=%d max_used=%.2fGB limit=%.2fGB",
        len(live_arrays),
        mx / 1e9,
        hbm_limit / 1e9,
    )
    return [(hbm_used[device], hbm_limit) for device in devices]


def get_num_kv_heads_by_tp(total_num_kv_heads: int, tp_size: int) -> int:
    """
    Calculate the number of KV heads per device for tensor parallelism.
    Args:
        total_num_kv_heads: Total number of KV heads in the model
        tp_size: Tensor parallel size (number of devices)
    Returns:
        Number of KV heads per device
    """
    if tp_size >= total_num_kv_heads:
        # When tp_size >= total_kv_heads, each device gets 1 KV head
        # Multiple devices will replicate the same original KV head
        return 1
    else:
        # Normal case: divide KV heads across devices
        return (total_num_kv_heads + tp_size - 1) // tp_size


def get_original_kv_head_id(tp_rank: int, total_num_kv_heads: int, tp_size: int) -> int:
    """
    Determine which original KV head this device should replicate.

    Args:
        tp_rank: Current device rank (0-based)
        total_num_kv_heads: Total number of KV heads in the model
        tp_size: Tensor parallel size

    Returns:
        ID of the original KV head to replicate (0-based)
    """
    if tp_size > total_num_kv_heads:
        # KV head replication case: multiple devices share the same original KV head
        num_kv_head_replicas = (tp_size + total_num_kv_heads - 1) // total_num_kv_heads
        return tp_rank // num_kv_head_replicas
    else:
        # Normal case: each device gets a different range of KV heads
        kv_heads_per_device = get_num_kv_heads_by_tp(total_num_kv_heads, tp_size)
        return (tp_rank * kv_heads_per_device) % total_num_kv_heads


def get_available_device_memory(
    device, distributed=False, empty_cache=True, device_indexes: list[int] | None = None
):
    """
    Get available memory for device:device_id.
    When distributed is True, the available memory is the minimum available memory of all devices.
    """

    def filter_devices(device_list, device_indexes):
        offset = get_device_id_offset(device_list)
        if device_indexes is not None:
            selected_devices = []
            for dev in device_list:
                if dev.id - offset in device_indexes:
                    selected_devices.append(dev)
        else:
            selected_devices = device_list
        return selected_devices

    if device == "tpu":
        raw_devices = jax.local_devices()
        devices = filter_devices(raw_devices, device_indexes)
        if empty_cache:
            gc.collect()  # collect garbage to free up memory used by quantization
            # Note: remove it due to cache miss occurring in multi engines running in one process. Initializing later engines results in clearing cache for the earlier ones.
            # TODO: Remove it in the future if do not meet device memory fraction problems.
            # jax.clear_caches()
        avail_mem = []
        for dev in devices:
            stats = dev.memory_stats()
            avail_mem.append(stats["bytes_limit"] - stats["bytes_in_use"])
        avail_mem = jnp.array([min(avail_mem) / (1 << 10)], dtype=jnp.float32)
    elif "proxy" in device:
        raw_devices = jax.devices()
        devices = filter_devices(raw_devices, device_indexes)
        if empty_cache:
            gc.collect()
        live_arrays = jax.live_arrays()
        pathways_hbm_used_mem = pathways_hbm_usage_gb(live_arrays, devices)
        avail_mem = jnp.array(
            [(hbm_limit - hbm_used) / (1 << 10) for hbm_used, hbm_limit in pathways_hbm_used_mem],
            dtype=jnp.float32,
        )
    elif device in ("gpu", "cuda"):
        # Note: remove it due to cache miss occurring in multi engines running in one process. Initializing later engines results in clearing cache for the earlier ones.
        # TODO: Remove it in the future if do not meet device memory fraction problems.
        # if empty_cache:
        #    jax.clear_caches()
        devices = [d for d in jax.local_devices() if getattr(d, "platform", None) == "gpu"]
        if not devices:
            raise RuntimeError("No GPU devices found by JAX")
        avail = []
        for dev in devices:
            stats = dev.memory_stats()
            avail.append(stats["bytes_limit"] - stats["bytes_in_use"])
        avail_mem = jnp.array([min(avail) / (1 << 10)], dtype=jnp.float32)
    elif device == "cpu":
        import psutil

        memory = psutil.virtual_memory()
        free_gpu_memory = memory.available
        avail_mem = jnp.array([free_gpu_memory / (1 << 10)], dtype=jnp.float32)
    else:
        raise ValueError(f"Invalid device: {device}")

    if distributed:
        # Use pmap to find the minimum available memory across all devices.
        mesh = jax.make_mesh((jax.device_count(),), ("device"))

        @jax.shard_map(mesh=mesh, in_specs=PartitionSpec(None), out_specs=PartitionSpec(None))
        def _get_available_memory_distributed(a):
            return jax.lax.pmin(a, axis_name="device")

        # We broadcast the local min memory to all devices and then find the global min.
        # i64 dtype cannot be all-reduce min
        assert (
            avail_mem.dtype != jnp.float64 and avail_mem.dtype != jnp.int64
        ), "avail_mem must be i32 dtype"
        global_min_mem = _get_available_memory_distributed(avail_mem)[0]
        free_gpu_memory = global_min_mem.item()
    else:
        free_gpu_memory = avail_mem.min().item()

    return int(free_gpu_memory * (1 << 10))


@cache
def _canonical_named_sharding(mesh, spec, memory_kind) -> "jax.sharding.NamedSharding":
    return jax.sharding.NamedSharding(mesh, spec, memory_kind=memory_kind)


def canonicalize_sharding(sharding):
    """Map equal NamedShardings onto one canonical object per (mesh, spec).

    jaxlib's PjitFunctionCache fast-path compares input shardings by object
    pointer; handing pjit a fresh NamedSharding every step defeats that
    fast-path and, under dp=1 + Pathways proxy, misses the cpp cache entirely
    (issue #1452). Shardings with explicit logical device ids are passed
    through untouched, as they are not covered by the (mesh, spec,
    memory_kind) cache key.
    """
    if isinstance(sharding, jax.sharding.NamedSharding) and (
        getattr(sharding, "_logical_device_ids", None) is None
    ):
        return _canonical_named_sharding(sharding.mesh, sharding.spec, sharding.memory_kind)
    return sharding


def device_array(data, sharding=None, **kwargs) -> jax.Array:
    if sharding is None:
        return jax.device_put(data, device=sharding, **kwargs)

    sharding = canonicalize_sharding(sharding)

    def _to_device(arr):
        arr = np.asarray(arr)

        def fn(idx, a=arr):
            return a[idx]

        return jax.make_array_from_callback(arr.shape, sharding, fn)

    return jax.tree.map(_to_device, data)


_IS_TPU_RUNTIME_CACHED: bool | None = None


def is_tpu_runtime() -> bool:
    """Return True if the current JAX runtime is on TPU devices.

    Prefer checking actual devices; fall back to default backend if necessary.
    """
    global _IS_TPU_RUNTIME_CACHED
    if _IS_TPU_RUNTIME_CACHED is not None:
        return _IS_TPU_RUNTIME_CACHED
    try:
        devs = jax.devices()
        _IS_TPU_RUNTIME_CACHED = len(devs) > 0 and all(d.platform == "tpu" for d in devs)
    except Exception:
        _IS_TPU_RUNTIME_CACHED = jax.default_backend() == "tpu"
    return _IS_TPU_RUNTIME_CACHED


def print_memory(stage_name):
    """Print current memory usage"""
    memory = get_memory_usage()
    print(f"\n[{stage_name}] Memory usage:")
    for device, usage in memory.items():
        print(f"  {device}: {usage}GB" if isinstance(usage, float) else f"  {device}: {usage}")
    return memory


def get_memory_usage():
    """Get actual memory usage if available"""
    try:
        stats = {}
        for i, device in enumerate(jax.devices()):
            try:
                device_stats = device.memory_stats()
                stats[f"device_{i}"] = device_stats.get("bytes_in_use", 0) / (1024**3)
            except Exception:
                stats[f"device_{i}"] = "N/A"
        return stats
    except Exception:
        return {f"device_{i}": "N/A" for i in range(len(jax.devices()))}
