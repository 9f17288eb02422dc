"""What sglang-jax does with a DSpark drafter folder, rule by rule, and the command that
serves it (``python -m converters check --target sglang-jax``).

sglang-jax (sgl-project/sglang-jax, JAX, serves on TPU) merged DSpark in its #1632. Its
DSpark drafter is a DFlash backbone (``DFlashDraftModel``) plus a vanilla Markov head
(``DSparkDraftModel``), built from the draft folder's config.json read by transformers'
``AutoConfig`` (not the speculators format: no ``speculators_config``, a top-level
``model_type``); the draft has no embedding or LM head of its own (the target's are
used). ``python -m converters export --target sglang-jax`` writes that layout
(:mod:`dspark_jax.convert.sglang_jax_export`).

Every rule names the sglang-jax file and commit it is read from (``RULES``); a message
ends with ``[rule: file@commit]``. Errors: what fails to load or serves the drafter other
than it was trained; warnings: what loads but loses something; notes: the rest. Fields
the server reads with a default (``getattr(config, name, default)``, or a transformers
``Qwen3Config`` default such as head_dim=128 or rope_theta=10000) must be written
explicitly: a missing one serves silently wrong.

numpy + safetensors only, like :mod:`dspark_jax.convert.check`.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from dspark_jax.config import is_int, is_num
from dspark_jax.convert import vllm_rules
from dspark_jax.convert.vllm_rules import Verifier, draft_layer_tensors

REPO = "sgl-project/sglang-jax"
# The commits the rules were read at (the DSpark files at the first commits that hold them).
DSPARK_COMMIT = "8941115b225f617a4559e70cc9a9f34aba35c2e6"
SERVER_ARGS_COMMIT = "ccda285a6dfaa0e49e175cc1bed1e6e25e529216"
DFLASH_MODEL_COMMIT = "fb64c6115db5182765c5ed6fdc18ad362dfe16ec"
DFLASH_UTIL_COMMIT = "e613baf8f3a5391dd97ff4f72d9ef4cfedf99712"
RUNTIME_COMMIT = "cddbf6f1"  # hf_transformers_utils.py, qwen3.py, pyproject (transformers 4.57)
_P = "python/sgl_jax/srt/"
RULES: dict[str, str] = {
    # rule: the sglang-jax file@commit it follows
    "hf-config": f"{_P}hf_transformers_utils.py@{RUNTIME_COMMIT}",
    "architecture": f"{_P}models/dspark.py@{DSPARK_COMMIT[:8]}",
    "markov-head": f"{_P}models/dspark.py@{DSPARK_COMMIT[:8]}",
    "confidence-head": f"{_P}models/dspark.py@{DSPARK_COMMIT[:8]}",
    "weights": f"{_P}models/dspark.py@{DSPARK_COMMIT[:8]}",
    "full-vocab": f"{_P}speculative/dspark_worker.py@{DSPARK_COMMIT[:8]}",
    "verify-width": f"{_P}speculative/dspark_worker.py@{DSPARK_COMMIT[:8]}",
    "sample-from-anchor": f"{_P}server_args.py@{SERVER_ARGS_COMMIT[:8]}",
    "serve-form": f"{_P}server_args.py@{SERVER_ARGS_COMMIT[:8]}",
    "draft-config": f"{_P}speculative/dflash_util.py@{DFLASH_UTIL_COMMIT[:8]}",
    "mask-token": f"{_P}speculative/dflash_util.py@{DFLASH_UTIL_COMMIT[:8]}",
    "aux-layers": f"{_P}models/qwen3.py@{RUNTIME_COMMIT}",
    "layer-config": f"{_P}models/dflash.py@{DFLASH_MODEL_COMMIT[:8]}",
    "rope": f"{_P}models/dflash.py@{DFLASH_MODEL_COMMIT[:8]}",
    "sliding-window": f"{_P}models/dflash.py@{DFLASH_MODEL_COMMIT[:8]}",
    "target-hidden": f"{_P}models/dflash.py@{DFLASH_MODEL_COMMIT[:8]}",
    "weight-shapes": f"{_P}models/dflash.py@{DFLASH_MODEL_COMMIT[:8]}",
}
ARCHITECTURE = "Qwen3DSparkModel"  # dspark.py's EntryClass, what the model registry resolves
FLOAT_DTYPES = ("BF16", "F16", "F32")
# Fields sglang-jax reads with a default (dflash.py getattr, transformers 4.57 Qwen3Config,
# dflash_util._cfg_get): a missing one is served with the default, whatever was trained.
DEFAULTED = {
    "head_dim": "hidden_size // num_attention_heads in dflash.py, 128 in Qwen3Config",
    "rope_theta": "10000 (Qwen3Config)",
    "rms_norm_eps": "1e-6",
    "attention_bias": "false",
    "max_position_embeddings": "32768",
    "target_hidden_size": "hidden_size",
    "markov_rank": "0 (refused)",
    "markov_head_type": "None (refused)",
    "block_size": "16 (dflash_util.DEFAULT_DFLASH_BLOCK_SIZE)",
}


def tag(rule: str) -> str:
    return f"[{rule}: {RULES[rule]}]"


@dataclasses.dataclass(frozen=True)
class Served:
    """The drafter sglang-jax builds from config.json (the fields its DSpark path reads)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    vocab_size: int
    target_hidden_size: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    attention_bias: bool
    block_size: int
    mask_token_id: int

    @property
    def verify_tokens(self) -> int:
        """--speculative-num-draft-tokens: the anchor plus block_size drafted tokens."""
        return self.block_size + 1

    def required_tensors(self) -> dict[str, tuple[int, ...]]:
        """DSparkDraftModel._create_weight_mappings, torch layout ([out, in])."""
        h, nh, nkv, hd, inter = (
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
            self.intermediate_size,
        )
        fc_in = len(self.target_layer_ids) * self.target_hidden_size
        out = {"fc.weight": (h, fc_in), "hidden_norm.weight": (h,), "norm.weight": (h,)}
        out |= draft_layer_tensors(
            self.num_hidden_layers, h, nh, nkv, hd, inter, self.attention_bias
        )
        # VanillaMarkovHead: both factors span config.vocab_size (no draft vocabulary).
        out["markov_head.markov_w1.weight"] = (self.vocab_size, self.markov_rank)
        out["markov_head.markov_w2.weight"] = (self.vocab_size, self.markov_rank)
        return out


class Findings(vllm_rules.Findings):
    """vLLM's findings, tagged with sglang-jax's rules (``folder_form`` unused here)."""

    rule_tag = staticmethod(tag)


def _explicit(f: Findings, d: dict, name: str, rule: str, ok, want: str):
    """``d[name]``, which must be written (sglang-jax would use a default) and ``ok``."""
    if name not in d or d[name] is None:
        why = f" (sglang-jax then uses {DEFAULTED[name]})" if name in DEFAULTED else ""
        f.err(rule, f"config.json: {name!r} is missing{why}")
        return None
    if not ok(d[name]):
        f.err(rule, f"config.json: {name!r} must be {want}, got {d[name]!r}")
        return None
    return d[name]


def _pos_int(x: Any) -> bool:
    return is_int(x) and x > 0


# ---------------------------------------------------------------- config.json
def _format(d: dict, f: Findings) -> bool:
    """AutoConfig (transformers ~=4.57.1) must read it as a qwen3 config."""
    if "speculators_config" in d or "transformer_layer_config" in d:
        f.err(
            "hf-config",
            "config.json is in the speculators format (speculators_config / "
            "transformer_layer_config): sglang-jax reads the draft with transformers' "
            "AutoConfig and needs a flat qwen3 config; export with --target sglang-jax",
        )
        return False
    if d.get("model_type") != "qwen3":
        f.err(
            "hf-config",
            f"config.json: 'model_type' must be 'qwen3' (the DFlash/DSpark backbone's "
            f"config class), got {d.get('model_type')!r}",
        )
        return False
    arch = d.get("architectures")
    if arch != [ARCHITECTURE]:
        f.warn(
            "architecture",
            f"config.json: 'architectures' is {arch!r}; dspark.py registers "
            f"{ARCHITECTURE!r} (the DSPARK worker builds DSparkDraftModel whatever it says)",
        )
    return True


def _layer_config(d: dict, f: Findings) -> dict | None:
    """DFlashAttention / DFlashMLP / DFlashBackbone fields."""
    geo = {}
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "num_hidden_layers",
        "vocab_size",
    ):
        geo[name] = _explicit(f, d, name, "layer-config", _pos_int, "a positive int")
    geo["head_dim"] = _explicit(f, d, "head_dim", "layer-config", _pos_int, "a positive int")
    _explicit(f, d, "rms_norm_eps", "layer-config", lambda v: is_num(v) and v > 0, "positive")
    _explicit(f, d, "max_position_embeddings", "layer-config", _pos_int, "a positive int")
    geo["attention_bias"] = _explicit(
        f, d, "attention_bias", "layer-config", lambda v: isinstance(v, bool), "true or false"
    )
    act = d.get("hidden_act", "silu")
    if act != "silu":
        f.err("layer-config", f"config.json: 'hidden_act' must be 'silu' (DFlashMLP), got {act!r}")
    if d.get("tie_word_embeddings"):
        f.err("layer-config", "config.json: 'tie_word_embeddings' must be false")
    # RoPE: RotaryEmbedding(base=config.rope_theta), neox style, no scaling.
    _explicit(f, d, "rope_theta", "rope", lambda v: is_num(v) and v > 0, "a positive number")
    for key in ("rope_scaling", "rope_parameters"):
        rope = d.get(key)
        if isinstance(rope, dict):
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type != "default":
                f.err(
                    "rope",
                    f"config.json: {key}.rope_type {rope_type!r} is not served: sglang-jax's "
                    "DFlash attention builds a plain RotaryEmbedding from rope_theta (no "
                    "scaling), so positions would be rotated other than trained",
                )
    layer_types = d.get("layer_types")
    if isinstance(layer_types, list) and "sliding_attention" in layer_types:
        f.err(
            "sliding-window",
            "config.json: 'layer_types' has sliding_attention layers: sglang-jax's DFlash "
            "attention has no sliding window (every layer attends to the whole context), "
            "so those layers would be served as full attention",
        )
    if any(v is None for v in geo.values()):
        return None
    return geo


def _dspark_fields(d: dict, geo: dict, f: Findings) -> Served | None:
    rank = _explicit(f, d, "markov_rank", "markov-head", _pos_int, "a positive int")
    head = d.get("markov_head_type")
    if head != "vanilla":
        f.err(
            "markov-head",
            f"config.json: 'markov_head_type' must be 'vanilla' (DSparkDraftModel: 'DSPARK "
            f"stage1 requires markov_rank > 0 and a vanilla Markov head'), got {head!r}",
        )
    sfa = d.get("sample_from_anchor")
    if sfa is not True:
        f.err(
            "sample-from-anchor",
            f"config.json: 'sample_from_anchor' must be true: --speculative-algorithm DSPARK "
            f"forces sampling from the anchor, so a drafter trained otherwise drafts from the "
            f"wrong slots (got {sfa!r})",
        )
    vd = d.get("draft_vocab_size")
    if vd is not None and vd != geo["vocab_size"]:
        f.err(
            "full-vocab",
            f"config.json: draft_vocab_size={vd} != vocab_size={geo['vocab_size']}: sglang-jax's "
            "Markov head and draft logits span the target's full vocabulary (it uses the "
            "target's lm_head, no d2t); retrain with the full vocabulary",
        )
    ths = _explicit(f, d, "target_hidden_size", "target-hidden", _pos_int, "a positive int")
    block = _explicit(f, d, "block_size", "verify-width", lambda v: is_int(v) and v > 1, "> 1")
    sub = d.get("dflash_config")
    if not isinstance(sub, dict):
        f.err(
            "draft-config",
            f"config.json: 'dflash_config' must be an object holding target_layer_ids, "
            f"mask_token_id and block_size, got {sub!r}",
        )
        sub = {}
    ids = sub.get("target_layer_ids", d.get("target_layer_ids"))
    if not isinstance(ids, list) or not ids or not all(is_int(i) and i >= -1 for i in ids):
        f.err(
            "aux-layers",
            f"config.json: dflash_config.target_layer_ids must be a non-empty list of ints "
            f">= -1 (without it sglang-jax captures default layers), got {ids!r}",
        )
        ids = None
    elif len(set(ids)) != len(ids) or ids != sorted(ids):
        f.err(
            "aux-layers",
            f"config.json: dflash_config.target_layer_ids {ids} must be distinct and ascending: "
            "sglang-jax concatenates the captured layers in layer order",
        )
    sub_block = sub.get("block_size")
    if block is not None and sub_block is not None and sub_block != block:
        f.err(
            "draft-config",
            f"config.json: dflash_config.block_size={sub_block} != block_size={block} (the "
            "server sizes the verify width from the first, the worker checks the second)",
        )
    mask = sub.get("mask_token_id", d.get("mask_token_id"))
    if not is_int(mask) or not 0 <= mask < geo["vocab_size"]:
        f.err(
            "mask-token",
            f"config.json: dflash_config.mask_token_id must be an int in [0, vocab_size="
            f"{geo['vocab_size']}) (else sglang-jax looks up '<|MASK|>' in the tokenizer), "
            f"got {mask!r}",
        )
    conf = d.get("enable_confidence_head")
    if conf:
        f.note(
            "confidence-head",
            "the confidence head is ignored: sglang-jax's DSpark stage 1 verifies every "
            "drafted token (no adaptive verification)",
        )
    if f.errors:
        return None
    return Served(
        **geo,
        target_hidden_size=ths,
        target_layer_ids=tuple(ids),
        markov_rank=rank,
        block_size=block,
        mask_token_id=mask,
    )


def _verifier_rules(s: Served, v: Verifier | None, f: Findings) -> None:
    if v is None:
        f.note(
            "full-vocab",
            f"no --verifier: its vocabulary is taken to be vocab_size ({s.vocab_size}); "
            "captured layer range and hidden size are not checked",
        )
        return
    if v.vocab_size != s.vocab_size:
        f.err(
            "full-vocab",
            f"config.json: vocab_size={s.vocab_size} but the verifier ({v.source}) has "
            f"{v.vocab_size}: DSparkWorker refuses it ('DSPARK draft and target must have the "
            "same vocabulary size')",
        )
    n = v.num_hidden_layers
    beyond = [t for t in s.target_layer_ids if t + 1 > n - 1]
    if beyond:
        f.err(
            "aux-layers",
            f"config.json: dflash_config.target_layer_ids {list(s.target_layer_ids)} include "
            f"{beyond}: sglang-jax captures the residual stream before decoder layer t + 1, "
            f"so t <= {n - 2} for the verifier's {n} layers ({v.source}); the last layer's "
            "output (dspark-jax layer id N) is never captured",
        )
    if s.target_hidden_size != v.hidden_size:
        f.err(
            "target-hidden",
            f"config.json: fc takes {len(s.target_layer_ids)} x target_hidden_size="
            f"{s.target_hidden_size} features, but the verifier ({v.source}) has hidden size "
            f"{v.hidden_size}",
        )


def _tensors(s: Served, headers: dict[str, tuple[tuple, str, Path]], f: Findings) -> None:
    required = s.required_tensors()
    missing = sorted(set(required) - set(headers))
    if missing:
        f.err(
            "weights",
            f"missing tensors {missing}: DSparkDraftModel.load_weights raises 'DSPARK "
            "checkpoint is missing required weights'",
        )
    for key, want in required.items():
        if key not in headers:
            continue
        shape, dtype, _ = headers[key]
        if shape != want:
            f.err(
                "weight-shapes",
                f"tensor {key!r} has shape {list(shape)}, sglang-jax's parameter is {list(want)}",
            )
        if dtype not in FLOAT_DTYPES:
            f.err("weights", f"tensor {key!r} has dtype {dtype}, expected BF16/F16/F32")
    extra = sorted(set(headers) - set(required))
    conf = [k for k in extra if k.startswith("confidence_head.")]
    other = [k for k in extra if not k.startswith("confidence_head.")]
    if other:
        f.warn(
            "weights",
            f"tensors {other} are not loaded (sglang-jax maps only the backbone and the "
            "Markov head; the draft uses the target's embedding and lm_head)",
        )
    if conf:
        f.note("confidence-head", f"tensors {conf} are not loaded")
    if f.errors:
        return
    for key in required:
        with safe_open(headers[key][2], "np") as fh:
            value = fh.get_tensor(key)
        if not np.isfinite(value.astype(np.float32)).all():
            f.errors.append(f"tensor {key!r} has non-finite values (NaN/inf)")


# ---------------------------------------------------------------- entry points
def check(
    d: dict,
    headers: dict[str, tuple[tuple, str, Path]],
    *,
    verifier: Verifier | None = None,
    tensor_parallel_size: int = 1,
) -> Findings:
    """Every rule of ``RULES`` on one folder's config dict and tensor headers."""
    f = Findings()
    if not _format(d, f):
        return f
    geo = _layer_config(d, f)
    if geo is None:
        return f
    s = _dspark_fields(d, geo, f)
    if s is None:
        return f
    f.served = s
    _verifier_rules(s, verifier, f)
    if tensor_parallel_size > 1 and s.num_attention_heads % tensor_parallel_size:
        f.err(
            "layer-config",
            f"config.json: num_attention_heads={s.num_attention_heads} is not divisible by "
            f"--tp-size {tensor_parallel_size} (heads are sharded over 'tensor')",
        )
    if not headers:
        f.err("weights", "no weights: no model.safetensors (or index) in the folder")
        return f
    _tensors(s, headers, f)
    return f


def serve_command(
    folder: str | Path,
    s: Served,
    *,
    verifier: str | None = None,
    tensor_parallel_size: int = 1,
) -> str:
    """The sglang-jax launch command for this folder ([serve-form: server_args.py]).

    DSPARK requires --speculative-num-steps 1, --speculative-eagle-topk 1 and no grammar
    backend (the default is llguidance); it forces --speculative-sample-from-anchor.
    --speculative-num-draft-tokens is the verify width, block_size + 1, given explicitly
    (the server infers the same only when the flag is absent).
    """
    q = shlex.quote
    model = q(verifier) if verifier else "<verifier>"
    tp = f" --tp-size {tensor_parallel_size}" if tensor_parallel_size > 1 else ""
    return (
        f"python -m sgl_jax.launch_server --model-path {model} --speculative-algorithm DSPARK "
        f"--speculative-draft-model-path {q(str(folder))} --speculative-num-steps 1 "
        f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {s.verify_tokens} "
        f"--grammar-backend none{tp}"
    )
