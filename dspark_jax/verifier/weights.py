"""The verifier's parameters: names, shapes, logical axes, and loading from safetensors.

Parameters are a flat dict ``{name: array}`` in torch's layout (``[out, in]``), so nothing
is transposed on load. The embedding keeps its HF name without the model prefix; the
decoder layers are stacked by kind (``VerifierConfig.layer_stacks``: same sliding window,
RoPE and MoE-ness): ``stacks.{j}.self_attn.q_proj.weight`` is ``[L_j, out, in]``, slice
``l`` being HF's ``layers.{i}.self_attn.q_proj.weight`` for the stack's ``l``-th layer
``i``. The forward then scans over a stack instead of unrolling every layer, so its
compile time does not grow with the depth; stacking happens here, once, while reading
(stacking inside the step would copy every weight on every chip). Qwen3-MoE experts are stacked per layer as
transformers 5 fuses them: ``layers.i.mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows
first) and ``layers.i.mlp.experts.down_proj`` [E, H, I]; Hub checkpoints that store one
tensor per expert (``experts.{e}.gate_proj.weight``) are stacked while reading.

:func:`load_params` reads only what each device holds: every parameter is built with
``jax.make_array_from_callback`` whose callback slices a memory-mapped safetensors tensor,
so a process touches the bytes of its own shards only; the layer axis is never sharded, so a
device's shard of a stacked parameter is its slice of every layer's tensor.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

import dspark_jax.verifier.mxfp4 as mxfp4
from dspark_jax import hf_folder
from dspark_jax.data.files import DataError, SafetensorsFile
from dspark_jax.parallel import logical_spec
from dspark_jax.verifier.config import LayerKind, VerifierConfig


class VerifierCheckpointError(DataError):
    """A verifier tensor is missing or has the wrong shape."""


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names (dspark_jax.parallel.LOGICAL_RULES)
    layers: tuple[int, ...] = ()  # stacked parameters: the decoder layer of each slice


def layer_key(name: str, layer: int) -> str:
    """The HF name (without the model prefix) of one layer's slice of a stacked parameter:
    ``stacks.1.mlp.up_proj.weight``, layer 7 -> ``layers.7.mlp.up_proj.weight``."""
    return f"layers.{layer}.{name.split('.', 2)[2]}"


def _layer_specs(cfg: VerifierConfig, kind: LayerKind) -> dict[str, tuple[tuple, tuple]]:
    """One decoder layer's parameters (name after ``layers.{i}.``): shape, logical axes."""
    h, d, moe = cfg.hidden_size, cfg.head_dim, kind.moe
    nq, nkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    a = "self_attn."
    if kind.mixer == "kda":
        layer = _kda_specs(cfg)
    elif kind.mixer == "gdn":
        layer = _gdn_specs(cfg)
    elif cfg.mla:
        layer = _mla_specs(cfg)
    else:
        gated = 2 if cfg.attn_output_gate else 1  # Qwen3-Next: each head's q, then its gate
        layer = {
            a + "q_proj.weight": ((gated * nq, h), ("heads", "embed")),
            a + "k_proj.weight": ((nkv, h), ("kv_heads", "embed")),
            a + "v_proj.weight": ((nkv, h), ("kv_heads", "embed")),
            a + "o_proj.weight": ((h, nq), ("embed", "heads")),
        }
    layer["input_layernorm.weight"] = ((h,), ("norm",))
    layer["post_attention_layernorm.weight"] = ((h,), ("norm",))
    if cfg.attn_res_block is not None:  # Kimi-K3: a norm and a scorer per attention residual
        layer |= _attn_res_specs(cfg, "self_attention_res") | _attn_res_specs(cfg, "mlp_res")
    if cfg.mla_output_gate and cfg.mla and kind.mixer == "attention":
        layer[a + "g_proj.weight"] = ((cfg.num_attention_heads * cfg.v_head_dim, h),
                                      ("heads", "embed"))  # fmt: skip
    if cfg.qkv_bias and kind.mixer == "attention":
        layer[a + "q_proj.bias"] = ((nq,), ("heads",))
        layer[a + "k_proj.bias"] = ((nkv,), ("kv_heads",))
        layer[a + "v_proj.bias"] = ((nkv,), ("kv_heads",))
    if cfg.o_bias:
        layer[a + "o_proj.bias"] = ((h,), ("norm",))
    if cfg.attn_sinks and kind.mixer == "attention":
        layer[a + "sinks"] = ((cfg.num_attention_heads,), (None,))
    if cfg.qk_norm and kind.mixer == "attention":
        layer[a + "q_norm.weight"] = ((d,), ("norm",))
        layer[a + "k_norm.weight"] = ((d,), ("norm",))
    if cfg.gemma_norms:
        layer["pre_feedforward_layernorm.weight"] = ((h,), ("norm",))
        layer["post_feedforward_layernorm.weight"] = ((h,), ("norm",))
    m = "mlp."
    if moe and cfg.router == "topk_softmax":  # gpt-oss: its own layout (see VerifierConfig)
        e, mi = cfg.num_experts, cfg.moe_intermediate_size
        layer[m + "router.weight"] = ((e, h), (None, "embed"))
        layer[m + "router.bias"] = ((e,), (None,))
        layer[m + "experts.gate_up_proj"] = ((e, h, 2 * mi), ("experts", "embed", "mlp"))
        layer[m + "experts.gate_up_proj_bias"] = ((e, 2 * mi), ("experts", "mlp"))
        layer[m + "experts.down_proj"] = ((e, mi, h), ("experts", "mlp", "embed"))
        layer[m + "experts.down_proj_bias"] = ((e, h), ("experts", "norm"))
    elif moe:
        e, mi = cfg.num_experts, cfg.moe_intermediate_size
        layer[m + "gate.weight"] = ((e, h), (None, "embed"))
        if cfg.router == "sigmoid":  # DeepSeek-V3: the choice's bias (fp32, as transformers)
            layer[m + "gate.e_score_correction_bias"] = ((e,), (None,))
        if cfg.shared_width:  # DeepSeek's shared_experts, Qwen3-Next's gated shared_expert
            si = cfg.shared_width
            sh = m + ("shared_expert." if cfg.shared_expert_gate else "shared_experts.")
            if cfg.shared_expert_gate:
                layer[m + "shared_expert_gate.weight"] = ((1, h), (None, "embed"))
            layer[sh + "gate_proj.weight"] = ((si, h), ("mlp", "embed"))
            layer[sh + "up_proj.weight"] = ((si, h), ("mlp", "embed"))
            layer[sh + "down_proj.weight"] = ((h, si), ("embed", "mlp"))
        eh = h
        if cfg.latent_moe is not None:  # Kimi-K3: routed experts in a narrower latent
            eh = cfg.latent_moe
            layer[m + "routed_expert_down_proj.weight"] = ((eh, h), (None, "embed"))
            layer[m + "routed_expert_up_proj.weight"] = ((h, eh), ("embed", None))
            if cfg.latent_moe_norm:
                layer[m + "routed_expert_norm.weight"] = ((eh,), ("norm",))
        # fsdp splits the experts (whole ones per device) when it divides E, else H
        layer[m + "experts.gate_up_proj"] = ((e, 2 * mi, eh), ("experts", "mlp", "embed"))
        layer[m + "experts.down_proj"] = ((e, eh, mi), ("experts", "embed", "mlp"))
    else:
        inter = cfg.intermediate_size
        layer[m + "gate_proj.weight"] = ((inter, h), ("mlp", "embed"))
        layer[m + "up_proj.weight"] = ((inter, h), ("mlp", "embed"))
        layer[m + "down_proj.weight"] = ((h, inter), ("embed", "mlp"))
        if cfg.mlp_bias:
            layer[m + "gate_proj.bias"] = ((inter,), ("mlp",))
            layer[m + "up_proj.bias"] = ((inter,), ("mlp",))
            layer[m + "down_proj.bias"] = ((h,), ("norm",))
    return layer


def _attn_res_specs(cfg: VerifierConfig, name: str) -> dict[str, tuple[tuple, tuple]]:
    """One attention residual's RMSNorm and its hidden -> 1 scorer (sibling tensors
    ``{name}_norm.weight``, ``{name}_proj.weight``, as the K3 release names them)."""
    h = cfg.hidden_size
    return {name + "_norm.weight": ((h,), ("norm",)), name + "_proj.weight": ((1, h), (None, None))}


def _mla_specs(cfg: VerifierConfig) -> dict[str, tuple[tuple, tuple]]:
    """Multi-head latent attention's projections (transformers' DeepseekV3Attention)."""
    h, nh, a = cfg.hidden_size, cfg.num_attention_heads, "self_attn."
    qk, r, kv = cfg.qk_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    out = {}
    if cfg.q_lora_rank is None:
        out[a + "q_proj.weight"] = ((nh * qk, h), ("heads", "embed"))
    else:
        q = cfg.q_lora_rank
        out[a + "q_a_proj.weight"] = ((q, h), (None, "embed"))
        out[a + "q_a_layernorm.weight"] = ((q,), ("norm",))
        out[a + "q_b_proj.weight"] = ((nh * qk, q), ("heads", None))
    out[a + "kv_a_proj_with_mqa.weight"] = ((kv + r, h), (None, "embed"))
    out[a + "kv_a_layernorm.weight"] = ((kv,), ("norm",))
    out[a + "kv_b_proj.weight"] = (
        (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), kv),
        ("heads", None),
    )
    out[a + "o_proj.weight"] = ((h, nh * cfg.v_head_dim), ("embed", "heads"))
    return out


def _kda_specs(cfg: VerifierConfig) -> dict[str, tuple[tuple, tuple]]:
    """Kimi Delta Attention's parameters under the Hub's names (what transformers 5.19
    saves: one depthwise convolution per q, k, v; the forget gate's at the attention's
    level)."""
    h, nh, d, a = cfg.hidden_size, cfg.linear_heads, cfg.linear_v_dim, "self_attn."
    inner = nh * d
    out = {a + f"{x}_proj.weight": ((inner, h), ("heads", "embed")) for x in "qkv"}
    out |= {a + f"{x}_conv1d.weight": ((inner, 1, cfg.linear_conv), ("heads", None, None))
            for x in "qkv"}  # fmt: skip
    out[a + "f_a_proj.weight"] = ((d, h), (None, "embed"))
    out[a + "f_b_proj.weight"] = ((inner, d), ("heads", None))
    out[a + "dt_bias"] = ((inner,), ("heads",))
    out[a + "A_log"] = ((1, 1, nh, 1), (None, None, "heads", None))
    out[a + "b_proj.weight"] = ((nh, h), ("heads", "embed"))
    if cfg.kda_full_rank_gate:  # Kimi-K3: one [inner, h] output gate
        out[a + "g_proj.weight"] = ((inner, h), ("heads", "embed"))
    else:
        out[a + "g_a_proj.weight"] = ((d, h), (None, "embed"))
        out[a + "g_b_proj.weight"] = ((inner, d), ("heads", None))
    out[a + "o_norm.weight"] = ((d,), ("norm",))
    out[a + "o_proj.weight"] = ((h, inner), ("embed", "heads"))
    return out


def _gdn_specs(cfg: VerifierConfig) -> dict[str, tuple[tuple, tuple]]:
    """Qwen3-Next's Gated DeltaNet (``linear_attn.``): q, k, v and the output gate z from
    one projection, grouped per key head ([q, k, v..., z...] per group); b and a from
    another; one convolution over [q; k; v]; a forget rate and bias per value head."""
    h, a = cfg.hidden_size, "linear_attn."
    kd, vd = cfg.linear_k_heads * cfg.linear_k_dim, cfg.linear_heads * cfg.linear_v_dim
    return {
        a + "in_proj_qkvz.weight": ((2 * kd + 2 * vd, h), ("heads", "embed")),
        a + "in_proj_ba.weight": ((2 * cfg.linear_heads, h), ("heads", "embed")),
        a + "conv1d.weight": ((2 * kd + vd, 1, cfg.linear_conv), (None, None, None)),
        a + "dt_bias": ((cfg.linear_heads,), (None,)),
        a + "A_log": ((cfg.linear_heads,), (None,)),
        a + "norm.weight": ((cfg.linear_v_dim,), ("norm",)),
        a + "out_proj.weight": ((h, vd), ("embed", "heads")),
    }


# Parameters transformers keeps in fp32 whatever the model's dtype.
FP32_PARAMS = ("e_score_correction_bias",)


def held_dtype(name: str, dtype):
    """The dtype parameter ``name`` is held in when the others are in ``dtype``."""
    return jnp.float32 if name.endswith(FP32_PARAMS) else dtype


def param_specs(cfg: VerifierConfig) -> dict[str, ParamSpec]:
    """Every parameter the forward reads, in torch layout. The decoder layers of one kind
    (``cfg.layer_stacks[j]``) are stacked: ``stacks.{j}.<name in the layer>`` has a leading
    layer axis (logical name ``layers``, never sharded), slice ``l`` holding HF layer
    ``spec.layers[l]``, so the forward scans over them (one compiled layer per kind)."""
    specs = {
        "embed_tokens.weight": ParamSpec((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"))
    }
    if cfg.attn_res_block is not None:  # Kimi-K3's last attention residual, before the norm
        for name, (shape, axes) in _attn_res_specs(cfg, "output_attn_res").items():
            specs[name] = ParamSpec(shape, axes)
    for j, (kind, layers) in enumerate(cfg.layer_stacks):
        for name, (shape, axes) in _layer_specs(cfg, kind).items():
            specs[f"stacks.{j}.{name}"] = ParamSpec(
                (len(layers), *shape), ("layers", *axes), layers
            )
    return specs


# ------------------------------------------------------------------------------- reading


class Checkpoint:
    """The safetensors of a verifier folder: key -> shard, tensors opened lazily."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.weight_map = hf_folder.weight_map(self.folder, VerifierCheckpointError)
        self._files: dict[str, SafetensorsFile] = {}
        self.prefix = self._prefix()

    @property
    def source(self) -> Path:
        """The file that lists the tensors: the index, or the single safetensors file."""
        index = self.folder / hf_folder.INDEX_FILE
        return index if index.exists() else self.folder / hf_folder.SINGLE_FILE

    def _prefix(self) -> str:
        """The text model's key prefix: what precedes ``embed_tokens.weight`` (shortest)."""
        found = [
            k
            for k in self.weight_map
            if k == "embed_tokens.weight" or k.endswith(".embed_tokens.weight")
        ]
        if not found:
            raise VerifierCheckpointError(f"{self.folder}: no tensor named *embed_tokens.weight")
        return min(found, key=len)[: -len("embed_tokens.weight")]

    def __contains__(self, name: str) -> bool:
        return self.prefix + name in self.weight_map

    def file(self, name: str) -> tuple[SafetensorsFile, str]:
        key = self.prefix + name
        shard = self.weight_map[key]
        if shard not in self._files:
            path = self.folder / shard
            if not path.exists():
                raise VerifierCheckpointError(
                    f"{self.folder}: {key} is mapped to {shard}, which does not exist"
                )
            self._files[shard] = SafetensorsFile(path)
        f = self._files[shard]
        if key not in f:
            raise VerifierCheckpointError(f"{f.path}: index lists {key}, the file does not have it")
        return f, key

    def shape(self, name: str) -> tuple[int, ...]:
        f, key = self.file(name)
        return tuple(f.info(key).shape)

    def view(self, name: str) -> np.ndarray:
        f, key = self.file(name)
        return f.view(key)


Reader = Callable[[tuple[slice, ...]], np.ndarray]

# Other names of a layer's module on the Hub: Kimi's sparse blocks are block_sparse_moe
# (transformers 5.19 saves its dense MLPs under that name too).
MODULE_ALIASES = {"mlp.": ("block_sparse_moe.",)}
# Per-expert tensors of the stacked gate_up_proj (gate rows first) and down_proj: HF's
# names, then Mixtral's and Kimi's (w1 gate, w3 up, w2 down).
EXPERT_PARTS = {
    "gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
    "down_proj": (("down_proj",), ("w2",)),
}


def _on_disk(ckpt: Checkpoint, name: str) -> str:
    """``name`` as the checkpoint spells it (MODULE_ALIASES), or ``name`` when absent."""
    if name in ckpt:
        return name
    for ours, others in MODULE_ALIASES.items():
        head, sep, tail = name.partition("." + ours)
        for other in others if sep else ():
            if f"{head}.{other}{tail}" in ckpt:
                return f"{head}.{other}{tail}"
    return name


def _expert_reader(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> Reader:
    """Stacked experts from per-expert tensors (``experts.{e}.gate_proj.weight`` ...),
    plain or packed as compressed-tensors' MXFP4 (``.weight_packed`` and ``.weight_scale``:
    Kimi-K3's experts; verifier/mxfp4.py)."""
    base = name.rsplit("experts.", 1)[0] + "experts."
    bases = [base]
    for ours, others in MODULE_ALIASES.items():  # the module's name on disk
        head, sep, tail = base.partition("." + ours)
        bases += [f"{head}.{other}{tail}" for other in others] if sep else []
    names = EXPERT_PARTS[name.rsplit(".", 1)[1]]
    suffixes = ("weight", mxfp4.PACKED_SUFFIXES[0])
    found = [(b, p) for b in bases for p in names for x in suffixes if f"{b}0.{p[0]}.{x}" in ckpt]
    base, parts = found[0] if found else (base, names[0])
    e_count, rows = shape[0], shape[1] // len(parts)
    views = {
        (e, part): _expert_part(ckpt, name, f"{base}{e}.{part}", (rows, shape[2]))
        for e in range(e_count)
        for part in parts
    }

    def read(index: tuple[slice, ...]) -> np.ndarray:
        """Only the requested experts, and of each part (gate rows [0, I), up rows
        [I, 2I) of gate_up_proj) only the requested rows and columns."""
        es, rs, cs = index
        r0, r1, step = rs.indices(rows * len(parts))
        assert step == 1, index
        out = []
        for e in range(*es.indices(e_count)):
            pieces = []
            for j, part in enumerate(parts):
                lo, hi = max(r0 - j * rows, 0), min(r1 - j * rows, rows)
                if lo < hi:
                    pieces.append(views[e, part](slice(lo, hi), cs))
            out.append(np.concatenate(pieces))
        return np.stack(out)

    return read


def _expert_part(ckpt: Checkpoint, name: str, stem: str, want: tuple[int, int]):
    """A reader ``(rows, cols) -> array`` of one expert's [out, in] weight ``stem``, plain
    (``.weight``) or MXFP4-packed, after checking its shape (and, packed, dtypes)."""
    key = stem + ".weight"
    if key in ckpt:
        if ckpt.shape(key) != want:
            raise VerifierCheckpointError(
                f"{ckpt.file(key)[0].path}: {ckpt.prefix}{key} has shape "
                f"{ckpt.shape(key)}, config.json implies {want}"
            )
        return lambda r, c: ckpt.view(key)[r, c]
    parts = tuple(f"{stem}.{x}" for x in mxfp4.PACKED_SUFFIXES)
    if parts[0] not in ckpt:
        raise VerifierCheckpointError(
            f"{ckpt.source}: no tensor {ckpt.prefix}{name} nor {ckpt.prefix}{key}"
        )
    r, c = want
    if c % mxfp4.BLOCK:
        raise VerifierCheckpointError(
            f"{ckpt.source}: {ckpt.prefix}{key} {want} is MXFP4-packed, but its input width "
            f"{c} is no multiple of {mxfp4.BLOCK}"
        )
    decode = _mxfp4_pair(ckpt, parts, ((r, c // 2), (r, c // mxfp4.BLOCK)), f"{key} {want}")
    return lambda rows, cols: decode(
        lambda packed, scale: mxfp4.read_packed(packed, scale, rows, cols)
    )


def _mxfp4_pair(ckpt: Checkpoint, parts: tuple[str, str], shapes, of: str):
    """Check MXFP4's codes and scales tensors ``parts`` exist as U8 of ``shapes`` (the
    weight ``of``: its name and shape); returns ``decode(f)``, which calls
    ``f(codes, scales)`` on their memory maps and names the scales on a NaN scale."""
    for part, want in zip(parts, shapes, strict=True):
        if part not in ckpt:
            raise VerifierCheckpointError(f"{ckpt.source}: no tensor {ckpt.prefix}{part}")
        f, key = ckpt.file(part)
        if ckpt.shape(part) != want or f.info(key).dtype != "U8":
            raise VerifierCheckpointError(
                f"{f.path}: {key} is {f.info(key).dtype} {ckpt.shape(part)}, MXFP4 of "
                f"{ckpt.prefix}{of} is U8 {want}"
            )

    def decode(f):
        try:
            return f(*(ckpt.view(p) for p in parts))
        except ValueError as e:
            raise VerifierCheckpointError(
                f"{ckpt.file(parts[1])[0].path}: {ckpt.prefix}{parts[1]} holds {e}: the "
                "checkpoint is corrupt"
            ) from None

    return decode


def _mxfp4_reader(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> Reader:
    """Slices of an expert weight stored as MXFP4 blocks and scales (gpt-oss), dequantized."""
    parts = (name + mxfp4.BLOCKS_SUFFIX, name + mxfp4.SCALES_SUFFIX)
    decode = _mxfp4_pair(ckpt, parts, mxfp4.packed_shapes(shape), f"{name} {shape}")
    return lambda index: decode(lambda blocks, scales: mxfp4.read_slice(blocks, scales, index))


def _tensor_reader(ckpt: Checkpoint, cfg: VerifierConfig, name: str, shape: tuple) -> Reader:
    """Slices of one HF tensor, after checking it exists with ``shape``."""
    name = _on_disk(ckpt, name)
    if name not in ckpt and name + mxfp4.BLOCKS_SUFFIX in ckpt and len(shape) == 3:
        return _mxfp4_reader(ckpt, name, shape)
    if name not in ckpt and ".experts." in name:
        return _expert_reader(ckpt, name, shape)
    if name not in ckpt:
        raise VerifierCheckpointError(
            f"{ckpt.source}: missing tensor {ckpt.prefix}{name} (config.json: "
            f"{cfg.model_type}, {cfg.num_hidden_layers} layers)"
        )
    got = ckpt.shape(name)
    heads = math.prod(shape)
    if name.endswith(".A_log") and len(got) == 1 and got != shape and got[0] >= heads:
        # Kimi-K3 stores KDA's per-head rates flat, padded to head_dim: the first num_heads
        # entries are the heads' (sglang-jax's port narrows them the same way)
        return lambda index: np.asarray(ckpt.view(name)[:heads]).reshape(shape)[index]
    if got != shape:
        raise VerifierCheckpointError(
            f"{ckpt.file(name)[0].path}: {ckpt.prefix}{name} has shape {got}, config.json "
            f"implies {shape}"
        )
    return lambda index: np.asarray(ckpt.view(name)[index])


def _stacked_reader(per_layer: list[Reader]) -> Reader:
    """Slices of a stacked parameter: the requested layers, each read from its own tensor."""

    def read(index: tuple[slice, ...]) -> np.ndarray:
        layers, rest = index[0], tuple(index[1:])
        return np.stack([per_layer[i](rest) for i in range(*layers.indices(len(per_layer)))])

    return read


def readers(ckpt: Checkpoint, cfg: VerifierConfig) -> dict[str, tuple[ParamSpec, Reader]]:
    """A slice reader per parameter, after checking every tensor exists with its shape."""
    out = {}
    for name, spec in param_specs(cfg).items():
        if spec.layers:
            per_layer = [
                _tensor_reader(ckpt, cfg, layer_key(name, i), spec.shape[1:]) for i in spec.layers
            ]
            out[name] = (spec, _stacked_reader(per_layer))
        else:
            out[name] = (spec, _tensor_reader(ckpt, cfg, name, spec.shape))
    return out


def param_shardings(cfg: VerifierConfig, mesh: jax.sharding.Mesh) -> dict[str, NamedSharding]:
    """Each parameter's sharding by the trainer's logical-axis rules."""
    return {
        name: NamedSharding(mesh, logical_spec(spec.axes, spec.shape, mesh))
        for name, spec in param_specs(cfg).items()
    }


def load_params(
    folder: str | os.PathLike,
    cfg: VerifierConfig,
    mesh: jax.sharding.Mesh | None = None,
    dtype=jnp.bfloat16,
) -> dict[str, jax.Array]:
    """The verifier's parameters in ``dtype``, sharded over ``mesh`` (one device when None).

    Every tensor is checked (present, shape) before any is read; each device's shard is
    read from the memory-mapped file by its own callback.
    """
    ckpt = Checkpoint(folder)
    table = readers(ckpt, cfg)
    if mesh is None:
        shardings = {n: jax.sharding.SingleDeviceSharding(jax.devices()[0]) for n in table}
    else:
        shardings = param_shardings(cfg, mesh)

    def shard(read: Reader, index: tuple[slice, ...], np_dtype) -> np.ndarray:
        a = read(index)  # a view of the memory map is copied; a stacked shard is new memory
        return a.astype(np_dtype, copy=not a.flags.owndata)

    return {
        name: jax.make_array_from_callback(
            spec.shape,
            shardings[name],
            lambda index, r=read, t=np.dtype(held_dtype(name, dtype)): shard(r, index, t),
        )
        for name, (spec, read) in table.items()
    }


def params_from_numpy(tensors: dict[str, np.ndarray], cfg: VerifierConfig, dtype=jnp.float32):
    """Parameters from in-memory torch-layout arrays keyed by HF names without the model
    prefix (``layers.3.mlp.up_proj.weight``), stacked as :func:`param_specs` says."""

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise KeyError(f"missing tensor {name!r}")
        a = np.asarray(tensors[name])
        if a.shape != shape:
            raise ValueError(f"{name}: shape {a.shape}, expected {shape}")
        return a

    out = {}
    for name, spec in param_specs(cfg).items():
        if spec.layers:
            a = np.stack([get(layer_key(name, i), spec.shape[1:]) for i in spec.layers])
        else:
            a = get(name, spec.shape)
        out[name] = jnp.asarray(a, held_dtype(name, dtype))
    return out
