"""``--compile-for``: the devices a step is compiled for, and their memory.

* ``local``: this process's devices (``jax.devices()``); memory from the device's own
  ``memory_stats()`` where it reports one (TPU, GPU), else the host's RAM (CPU).
* ``tpu:<topology>`` (``tpu:v5p:2x2x2``, ``tpu:v5e:4x4``, ``tpu:v6e:2x4``,
  ``tpu:v4:2x2x1``): compile-only devices of that slice from libtpu
  (``jax.experimental.topologies.get_topology_desc``), on any machine with the ``tpu``
  extra; HBM per chip from the cited table in docs/tpu.md ("HBM per chip").
* ``gpu:<h100|h200|target-config file>:<GPUs per node>[x<nodes>]``: compile-only CUDA
  devices from XLA's description of the GPU, on any machine with the CUDA plugin (the
  ``cuda-compile`` extra); memory = the description's ``device_memory_size``
  (docs/tpu.md, "GPU targets").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import re
import sys
from pathlib import Path

import jax

from dspark_jax.cli import ConfigError

GIB = 2**30
# docs/tpu.md, "HBM per chip": the Google Cloud TPU docs' figures, read as GiB (their
# "GB" are binary: libtpu's compiler itself allows 15.75 GiB on a v5e and 31.25 on a v6e).
HBM_PER_CHIP = {
    "v4": 32 * GIB,  # cloud.google.com/tpu/docs/v4: "32 GiB"
    "v5e": 16 * GIB,  # cloud.google.com/tpu/docs/v5e: "16 GB"
    "v5p": 95 * GIB,  # cloud.google.com/tpu/docs/v5p: "95GB"
    "v6e": 32 * GIB,  # cloud.google.com/tpu/docs/v6e: "32 GB"
}
# libtpu's device_kind for each generation (what a compile-only device reports).
DEVICE_KINDS = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite"}
# v4 and v5p chips join their two TensorCores into one device ("megacore"), as on a
# real slice (MaxText's accelerator_to_spec_map: chip_config_name "megacore").
MEGACORE = {"v4", "v5p"}
TOPOLOGY = re.compile(r"^(v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})$")
GPU_TARGET = re.compile(r"^(.+):(\d+)(?:x(\d+))?$")
TPU_EXTRA = "the tpu extra: pip install -e '.[tpu]' (jax[tpu]==0.10.2 pulls libtpu 0.0.42.1)"


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the steps are compiled for."""

    spec: str  # the flag's value
    devices: tuple  # jax devices (compile-only for a TPU or GPU target)
    memory_per_device: int  # bytes
    memory_source: str  # what memory_per_device is, for the report
    chips: int


def parse(spec: str) -> tuple[str, str]:
    """``local`` | ``tpu:<gen>:<AxB[xC]>`` | ``gpu:...`` -> (platform, topology)."""
    platform, _, topology = spec.partition(":")
    if spec == "local":
        return "local", ""
    if platform == "tpu" and TOPOLOGY.match(topology):
        return "tpu", topology
    if platform == "gpu" and GPU_TARGET.match(topology):
        return "gpu", topology
    raise ConfigError(
        f"--compile-for {spec!r}: expected 'local', 'tpu:<generation>:<topology>' with a "
        f"generation of {sorted(HBM_PER_CHIP)} (e.g. tpu:v5p:2x2x2, tpu:v5e:4x4), or "
        f"'gpu:<{'|'.join(GPU_PRESETS)}|target-config file>:<GPUs per node>[x<nodes>]' "
        "(e.g. gpu:h200:8)"
    )


@functools.cache
def resolve(spec: str) -> Target:
    """The devices and memory of ``--compile-for spec`` (cached: one topology per spec)."""
    platform, topology = parse(spec)
    if platform == "local":
        return _local(spec)
    if platform == "gpu":
        return _gpu(spec, topology)
    return _tpu(spec, topology)


def _local(spec: str) -> Target:
    devices = tuple(jax.devices())
    stats = devices[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        memory, source = int(stats["bytes_limit"]), f"{devices[0].device_kind} bytes_limit"
    else:  # CPU devices share the host's memory
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // len(devices)
        source = f"host RAM / {len(devices)} devices"
    return Target(spec, devices, memory, source, chips=len(devices))


@contextlib.contextmanager
def _quiet_libtpu_start():
    """Away from a TPU VM (no Google PCI device), libtpu's start-up logs (from C++, on
    fd 2) only say that there is no TPU metadata here: dropped; and its lock on
    /tmp/libtpu_lockfile (one process per TPU host) guards no chip: lifted, so compiles
    may run side by side (ALLOW_MULTIPLE_LIBTPU_LOAD). On a TPU VM both stay."""
    from dspark_jax.cli import google_pci_device

    if google_pci_device():
        yield
        return
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "wb") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _tpu(spec: str, topology: str) -> Target:
    generation = topology.split(":")[0]
    try:
        from jax._src import xla_bridge

        if xla_bridge.get_tpu_library_path() is None:
            raise ImportError
    except ImportError:
        raise ConfigError(f"--compile-for {spec} needs libtpu, from {TPU_EXTRA}") from None
    from jax.experimental import topologies

    kwargs = {"chip_config_name": "megacore"} if generation in MEGACORE else {}
    try:
        with _quiet_libtpu_start():
            devices = topologies.get_topology_desc(
                topology_name=topology, platform="tpu", **kwargs
            ).devices
    except Exception as e:  # libtpu's own message says what is wrong with the name
        raise ConfigError(f"--compile-for {spec}: libtpu refused the topology: {e}") from None
    kind = devices[0].device_kind
    if kind != DEVICE_KINDS[generation]:
        raise ConfigError(
            f"--compile-for {spec}: libtpu made {kind!r} devices, expected "
            f"{DEVICE_KINDS[generation]!r}"
        )
    chips = len({tuple(d.coords) for d in devices})
    per_chip = len(devices) // chips
    memory = HBM_PER_CHIP[generation] // per_chip
    source = f"{generation} HBM per chip (docs/tpu.md)" + (
        f" / {per_chip} devices" if per_chip > 1 else ""
    )
    return Target(spec, tuple(devices), memory, source, chips=chips)


# docs/tpu.md, "GPU targets": XLA's GpuTargetConfigProto of a GPU, from NVIDIA's published
# specifications (H100/H200 SXM: the same GH100 with 132 SMs; CUDA C++ Programming Guide,
# compute capability 9.0 limits). Memory in the datasheets' units (GB = 10^9 bytes).
_GH100 = {
    "threads_per_block_limit": 1024,
    "threads_per_warp": 32,
    "shared_memory_per_block": 48 * 1024,
    "shared_memory_per_core": 228 * 1024,
    "threads_per_core_limit": 2048,
    "core_count": 132,
    "fpus_per_core": 128,
    "block_dim_limit_x": 2**31 - 1,
    "block_dim_limit_y": 65535,
    "block_dim_limit_z": 65535,
    "l2_cache_size": 50 * 2**20,
    "clock_rate_ghz": 1.98,
    "shared_memory_per_block_optin": 227 * 1024,
    "registers_per_core_limit": 65536,
    "registers_per_block_limit": 65536,
}
GPU_PRESETS = {
    "h100": {**_GH100, "memory_bandwidth": 3_350 * 10**9, "device_memory_size": 80 * 10**9,
             "name": "NVIDIA H100 80GB HBM3"},
    "h200": {**_GH100, "memory_bandwidth": 4_800 * 10**9, "device_memory_size": 141 * 10**9,
             "name": "NVIDIA H200"},
}  # fmt: skip
CUDA_EXTRA = "the cuda extra: pip install -e '.[cuda]' (jax[cuda12]==0.10.2)"


def gpu_target_config(preset: str) -> str:
    """A preset as GpuTargetConfigProto text (CUDA 12 / cuDNN 9, as the cuda extra)."""
    info = dict(GPU_PRESETS[preset])
    name = info.pop("name")
    fields = "\n".join(f"  {k}: {v}" for k, v in info.items())
    return (
        f"gpu_device_info {{\n{fields}\n  cuda_compute_capability {{\n    major: 9\n  }}\n}}\n"
        'platform_name: "CUDA"\n'
        "dnn_version_info {\n  major: 9\n  minor: 8\n}\n"
        "runtime_version {\n  major: 12\n  minor: 8\n}\n"
        f'device_description_str: "{name}"\n'
    )


def cuda_plugin_installed() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ImportError:  # no jax_plugins package at all
        return False


def _gpu(spec: str, topology: str) -> Target:
    """Compile-only CUDA devices from a target config (jax's deviceless AOT path:
    ``get_topology_desc(platform="cuda", target_config=..., topology="1x<nodes>x<gpus>")``,
    as jax's tests/aot_test.py does), no GPU needed."""
    name, per_node, nodes = GPU_TARGET.match(topology).groups()
    nodes = int(nodes or 1)
    if name in GPU_PRESETS:
        config = gpu_target_config(name)
    else:
        try:
            config = Path(name).read_text()
        except OSError as e:
            raise ConfigError(
                f"--compile-for {spec}: {name!r} is neither a GPU preset "
                f"({', '.join(GPU_PRESETS)}) nor a readable target-config file ({e.strerror})"
            ) from None
    size = re.search(r"device_memory_size:\s*(\d+)", config)
    if size is None:
        raise ConfigError(f"--compile-for {spec}: the target config has no device_memory_size")
    if not cuda_plugin_installed():
        raise ConfigError(f"--compile-for {spec} needs the CUDA plugin, from {CUDA_EXTRA}")
    from jax.experimental import topologies

    try:
        devices = topologies.get_topology_desc(
            platform="cuda", target_config=config, topology=f"1x{nodes}x{per_node}"
        ).devices
    except Exception as e:  # the plugin's own message
        raise ConfigError(f"--compile-for {spec}: the CUDA plugin refused it: {e}") from None
    memory = int(size.group(1))
    source = f"{devices[0].device_kind} device_memory_size ({name})"
    return Target(spec, tuple(devices), memory, source, chips=len(devices))
