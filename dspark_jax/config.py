"""DSparkConfig: the drafter's decoder geometry and DSpark fields in one frozen dataclass.

It reads and writes the speculators 0.9.0 ``config.json`` (docs/formats.md, "Exported
drafter folder"): a top-level DSpark section plus ``transformer_layer_config`` (the Qwen3
decoder) and ``speculators_config`` (proposal method, verifier). Validation happens once, at
construction, with messages that name the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

SPECULATORS_VERSION = "0.9.0"
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
LAYER_TYPES = ("full_attention", "sliding_attention")
# The rope types of transformers' ROPE_INIT_FUNCTIONS (plus "default") that a Qwen3 draft
# layer carries (its Qwen3RotaryEmbedding) and vLLM 0.33's get_rope serves.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
# Keys each type reads beyond rope_type / rope_theta: (required, optional). transformers'
# RotaryEmbeddingConfigMixin._validate_*_rope_parameters; short/long_mscale are vLLM's
# longrope scalings (transformers ignores them).
ROPE_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    ),
    "longrope": (
        ("short_factor", "long_factor", "original_max_position_embeddings"),
        ("factor", "attention_factor", "short_mscale", "long_mscale"),
    ),
    "llama3": (
        ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
        (),
    ),
    "proportional": ((), ("factor",)),
}
# Keys any type may carry: partial rotation and the MRoPE layout (Qwen-VL, Qwen3.5).
ROPE_COMMON_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
_ROPE_INT_KEYS = ("original_max_position_embeddings",)
_ROPE_BOOL_KEYS = ("truncate", "mrope_interleaved")
_ROPE_LIST_KEYS = ("short_factor", "long_factor", "mrope_section")
# speculators 0.9.0 models/utils.py: verifiers whose final norm is x * (1 + w), matched
# exactly against the effective (text_config) model_type.
GEMMA_STYLE_FINAL_NORM_MODEL_TYPES = frozenset(
    ("gemma", "gemma2", "gemma3", "gemma3_text", "qwen3_5", "qwen3_5_text", "recurrent_gemma")
)
VERIFIER_NORM_STYLES = ("plain", "gemma")  # x * w, x * (1 + w)


def is_int(x: Any) -> bool:
    """A JSON integer (bool is not one)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_num(x: Any) -> bool:
    """A finite JSON number (bool is not one)."""
    return (is_int(x) or isinstance(x, float)) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """The draft layers' ``rope_parameters`` besides ``rope_theta`` (transformers 5 keys).

    ``params``: ``(key, value)`` pairs sorted by key, lists as tuples (hashable: the
    config is a jit static argument). Validated at construction against the keys
    transformers' ``ROPE_INIT_FUNCTIONS`` read for ``rope_type`` (docs/math.md, "RoPE").
    """

    rope_type: str = "default"
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.params, dict):
            object.__setattr__(self, "params", tuple(self.params.items()))
        items = {k: tuple(v) if isinstance(v, list) else v for k, v in self.params}
        object.__setattr__(self, "params", tuple(sorted(items.items())))
        where = "DSparkConfig.rope_scaling"
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"{where}.rope_type: unknown rope type {self.rope_type!r}, expected one of "
                f"{ROPE_TYPES}"
            )
        required, optional = ROPE_KEYS[self.rope_type]
        known = set(required) | set(optional) | set(ROPE_COMMON_KEYS)
        for key, value in self.params:
            if key not in known:
                # Another model's key (e.g. Mistral 4's llama_4_scaling_beta): transformers'
                # rotary and vLLM's get_rope ignore it, and so does the math here.
                if not isinstance(value, (str, int, float, bool, tuple, type(None))):
                    raise ValueError(
                        f"{where}.{key}: unsupported value {value!r} (not a parameter of "
                        f"rope_type {self.rope_type!r}: {sorted(known)})"
                    )
                continue
            if value is None:
                continue
            if key in _ROPE_BOOL_KEYS:
                ok = isinstance(value, bool)
            elif key in _ROPE_INT_KEYS:
                ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
            elif key == "mrope_section":
                ok = isinstance(value, tuple) and all(
                    isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value
                )
            elif key in _ROPE_LIST_KEYS:
                ok = isinstance(value, tuple) and all(is_num(x) and x > 0 for x in value)
            else:
                ok = is_num(value) and value > 0
            if not ok:
                raise ValueError(f"{where}.{key}: invalid value {value!r} for {self.rope_type!r}")
        missing = [k for k in required if items.get(k) is None]
        if missing:
            raise ValueError(
                f"{where}: rope_type {self.rope_type!r} needs {missing} (transformers and "
                "vLLM both read them)"
            )
        prf = self.get("partial_rotary_factor", 1.0)
        if not 0 < prf <= 1:
            raise ValueError(f"{where}.partial_rotary_factor must be in (0, 1], got {prf}")

    def get(self, key: str, default: Any = None) -> Any:
        value = dict(self.params).get(key)
        return default if value is None else value

    def to_dict(self) -> dict[str, Any]:
        """``rope_parameters`` without ``rope_theta`` (lists as JSON lists)."""
        out: dict[str, Any] = {"rope_type": self.rope_type}
        for k, v in self.params:
            out[k] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RopeScaling:
        """From a ``rope_parameters`` / ``rope_scaling`` dict (``type`` is the legacy
        spelling of ``rope_type``; ``rope_theta`` is not kept here)."""
        d = dict(d)
        rope_type = d.pop("rope_type", None) or d.pop("type", None) or "default"
        d.pop("type", None)
        d.pop("rope_theta", None)
        return cls(rope_type, tuple(d.items()))

    def attention_scaling(self, max_position_embeddings: int) -> float:
        """The factor transformers multiplies cos and sin by (yarn and longrope; 1 otherwise)."""
        if self.rope_type == "yarn":
            return yarn_attention_factor(
                self.get("factor"),
                self.get("attention_factor"),
                self.get("mscale"),
                self.get("mscale_all_dim"),
            )
        if self.rope_type == "longrope":
            original = self.get("original_max_position_embeddings")
            factor = self.get("factor", max_position_embeddings / original)
            return longrope_attention_factor(factor, self.get("attention_factor"), original)
        return 1.0


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(factor, attention_factor=None, mscale=None, mscale_all_dim=None) -> float:
    """transformers' ``_compute_yarn_parameters`` attention factor (vLLM's ``mscale``)."""
    if attention_factor is not None:
        return float(attention_factor)
    if mscale and mscale_all_dim:
        return float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
    return yarn_get_mscale(factor)


def longrope_attention_factor(factor: float, attention_factor, original: int) -> float:
    """transformers' ``_compute_longrope_parameters`` attention factor."""
    if attention_factor is not None:
        return float(attention_factor)
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


def verifier_norm_style(model_type: str | None) -> str:
    """speculators' ``uses_gemma_style_final_norm`` for a verifier's effective model_type."""
    gemma = str(model_type or "").lower() in GEMMA_STYLE_FINAL_NORM_MODEL_TYPES
    return "gemma" if gemma else "plain"


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    # Qwen3 decoder geometry of the draft layers.
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    vocab_size: int  # verifier vocabulary (Vt): embedding rows, Markov W1 rows
    layer_types: tuple[str, ...] | None = None  # None: every layer full attention
    sliding_window: int | None = None
    rope_theta: float = 1_000_000.0
    # rope_type and its parameters (a dict is accepted); positions stay per document.
    rope_scaling: RopeScaling = RopeScaling()
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    # Read by dynamic and longrope RoPE (and yarn/longrope defaults); vLLM's draft layers
    # read it from config.json.
    max_position_embeddings: int = 32768
    # DSpark / DFlash fields.
    block_size: int = 8
    mask_token_id: int | None = None
    aux_hidden_state_layer_ids: tuple[int, ...] = (1,)
    draft_vocab_size: int | None = None  # None: the verifier vocabulary
    target_hidden_size: int | None = None  # verifier hidden size; None: hidden_size
    sample_from_anchor: bool = True
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    sliding_window_non_causal: bool = False
    # The verifier's final norm convention for the training targets: "plain" x * w, or
    # "gemma" x * (1 + w) (speculators' GEMMA_STYLE_FINAL_NORM_MODEL_TYPES).
    verifier_norm_style: str = "plain"
    # Soft cap on the training targets' verifier logits, cap * tanh(t / cap): None is
    # speculators' raw lm_head(norm(h)); a Gemma 2 verifier's final_logit_softcapping
    # gives the logits vLLM serves (--verifier-logit-softcapping served; docs/math.md §3).
    verifier_logit_softcapping: float | None = None
    # Recorded in config.json for serving; not used by the math.
    verifier_name_or_path: str | None = None
    verifier_architectures: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Normalise list-valued fields so the config stays hashable (jit static arg).
        for name in ("layer_types", "aux_hidden_state_layer_ids", "verifier_architectures"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        if self.draft_vocab_size is None:
            object.__setattr__(self, "draft_vocab_size", self.vocab_size)
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        self._validate()

    def _validate(self) -> None:
        positive = (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_hidden_layers",
            "vocab_size",
            "block_size",
            "draft_vocab_size",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DSparkConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "DSparkConfig.num_attention_heads must be a multiple of num_key_value_heads, "
                f"got {self.num_attention_heads} and {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"DSparkConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"DSparkConfig.draft_vocab_size ({self.draft_vocab_size}) must not exceed "
                f"vocab_size ({self.vocab_size})"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"DSparkConfig.layer_types has {len(self.layer_types)} entries, expected "
                    f"num_hidden_layers={self.num_hidden_layers}"
                )
            for t in self.layer_types:
                if t not in LAYER_TYPES:
                    raise ValueError(
                        f"DSparkConfig.layer_types: unknown layer type {t!r}, "
                        f"expected one of {LAYER_TYPES}"
                    )
            if "sliding_attention" in self.layer_types and (
                self.sliding_window is None or self.sliding_window <= 0
            ):
                raise ValueError(
                    "DSparkConfig.sliding_window must be a positive int when layer_types "
                    f"has sliding_attention layers, got {self.sliding_window!r}"
                )
        if not self.aux_hidden_state_layer_ids:
            raise ValueError("DSparkConfig.aux_hidden_state_layer_ids must not be empty")
        if any(i < 0 for i in self.aux_hidden_state_layer_ids) or len(
            set(self.aux_hidden_state_layer_ids)
        ) != len(self.aux_hidden_state_layer_ids):
            raise ValueError(
                "DSparkConfig.aux_hidden_state_layer_ids must be distinct non-negative ints, "
                f"got {list(self.aux_hidden_state_layer_ids)}"
            )
        if list(self.aux_hidden_state_layer_ids) != sorted(self.aux_hidden_state_layer_ids):
            # vLLM captures and concatenates aux layers in ascending order whatever the
            # config says, so another order would feed fc its columns permuted.
            raise ValueError(
                "DSparkConfig.aux_hidden_state_layer_ids must be ascending (vLLM concatenates "
                f"the layers in ascending order), got {list(self.aux_hidden_state_layer_ids)}"
            )
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"DSparkConfig.mask_token_id must be in [0, vocab_size={self.vocab_size}), "
                f"got {self.mask_token_id}"
            )
        if self.markov_rank < 0:
            raise ValueError(f"DSparkConfig.markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"DSparkConfig.markov_head_type: unknown head type {self.markov_head_type!r}, "
                f"expected one of {MARKOV_HEAD_TYPES}"
            )
        if (
            self.enable_confidence_head
            and self.confidence_head_with_markov
            and not self.markov_rank
        ):
            raise ValueError(
                "DSparkConfig.confidence_head_with_markov=True requires markov_rank > 0 "
                "(or set confidence_head_with_markov=False)"
            )
        if self.block_size < 2 and not self.sample_from_anchor:
            raise ValueError(
                "DSparkConfig.block_size must be >= 2 when sample_from_anchor=False "
                f"(slot 0 is untrained), got {self.block_size}"
            )
        if self.verifier_norm_style not in VERIFIER_NORM_STYLES:
            raise ValueError(
                f"DSparkConfig.verifier_norm_style: unknown style {self.verifier_norm_style!r}, "
                f"expected one of {VERIFIER_NORM_STYLES}"
            )
        cap = self.verifier_logit_softcapping
        if cap is not None and (not is_num(cap) or cap <= 0):
            raise ValueError(
                f"DSparkConfig.verifier_logit_softcapping must be null or a positive number, "
                f"got {cap!r}"
            )
        if not is_num(self.rope_theta) or self.rope_theta <= 0:
            raise ValueError(f"DSparkConfig.rope_theta must be positive, got {self.rope_theta!r}")
        self._validate_rope()

    def _validate_rope(self) -> None:
        """What the Qwen3 draft layers (transformers) and vLLM's get_rope can both carry."""
        rope, hd = self.rope_scaling, self.head_dim
        where = "DSparkConfig.rope_scaling"
        prf = rope.get("partial_rotary_factor", 1.0)
        section = rope.get("mrope_section")
        if prf < 1 and section is not None:
            raise ValueError(
                f"{where}: MRoPE with partial_rotary_factor={prf} < 1: the Qwen3 draft layers "
                f"rotate all head_dim={hd} dims (speculators 0.9.0 trains them so) and vLLM would "
                f"rotate only {int(hd * prf)}; scale mrope_section by 1/partial_rotary_factor and "
                "set partial_rotary_factor to 1.0 (what --draft-mrope-full-head-hack does)"
            )
        if prf < 1 and rope.rope_type != "proportional":
            raise ValueError(
                f"{where}: partial_rotary_factor={prf} < 1 with rope_type {rope.rope_type!r}: "
                f"the Qwen3 draft layers rotate all head_dim={hd} dims; remove it or set 1.0"
            )
        if section is not None and 2 * sum(section) != hd:
            raise ValueError(
                f"{where}.mrope_section {list(section)}: 2 * sum must equal head_dim={hd} "
                "(vLLM's MRotaryEmbedding splits the rotary dims by it)"
            )
        if rope.rope_type == "longrope":
            for key in ("short_factor", "long_factor"):
                n = len(rope.get(key))
                if n != hd // 2:
                    raise ValueError(
                        f"{where}.{key} has {n} entries, expected head_dim // 2 = {hd // 2} (one "
                        "per rotated frequency; a verifier with partial rotary needs a "
                        "--draft-config with factors for the full head)"
                    )

    # ----------------------------------------------------------------- derived
    @property
    def num_aux_layers(self) -> int:
        return len(self.aux_hidden_state_layer_ids)

    @property
    def verifier_hidden_size(self) -> int:
        return self.target_hidden_size or self.hidden_size

    @property
    def uses_draft_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    @property
    def speculative_tokens(self) -> int:
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window of layer ``layer`` (None: full attention)."""
        if self.layer_types is not None and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_causal_in_block(self, layer: int) -> bool:
        """Full layers are bidirectional inside a block; sliding ones causal unless told."""
        return self.layer_sliding_window(layer) is not None and not self.sliding_window_non_causal

    def replace(self, **changes: Any) -> DSparkConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------ speculators format
    def transformer_layer_dict(self) -> dict[str, Any]:
        """The Qwen3 decoder config as speculators stores it (transformers 5 keys)."""
        layer_types = list(self.layer_types or ("full_attention",) * self.num_hidden_layers)
        return {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": layer_types,
            "sliding_window": self.sliding_window,
            "use_sliding_window": "sliding_attention" in layer_types,
            "max_window_layers": self.num_hidden_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {**self.rope_scaling.to_dict(), "rope_theta": self.rope_theta},
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
        }

    def to_speculators_dict(self) -> dict[str, Any]:
        """config.json of docs/formats.md, "config.json" (no top-level model_type, on purpose)."""
        return {
            "architectures": ["DSparkDraftModel"],
            "speculators_model_type": "dspark",
            "speculators_version": SPECULATORS_VERSION,
            "aux_hidden_state_layer_ids": list(self.aux_hidden_state_layer_ids),
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "draft_vocab_size": self.draft_vocab_size,
            "sample_from_anchor": self.sample_from_anchor,
            "markov_rank": self.markov_rank,
            "markov_head_type": self.markov_head_type,
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "sliding_window_non_causal": self.sliding_window_non_causal,
            "target_hidden_size": self.target_hidden_size,
            # dspark-jax's record of the training targets' verifier norm (readers ignore it).
            "verifier_norm_style": self.verifier_norm_style,
            **(
                {"verifier_logit_softcapping": self.verifier_logit_softcapping}
                if self.verifier_logit_softcapping is not None
                else {}
            ),
            "tie_word_embeddings": False,
            "dtype": "bfloat16",
            "speculators_config": {
                "algorithm": "dspark",
                "default_proposal_method": "greedy",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": self.speculative_tokens,
                        "accept_tolerance": 0.0,
                        "verifier_accept_k": 1,
                    }
                ],
                "verifier": {
                    "name_or_path": self.verifier_name_or_path,
                    "architectures": list(self.verifier_architectures),
                },
            },
            "transformer_layer_config": self.transformer_layer_dict(),
        }

    @classmethod
    def from_speculators_dict(cls, d: dict[str, Any], source: str = "config.json") -> DSparkConfig:
        """Inverse of :meth:`to_speculators_dict`; ``source`` names the file in errors."""
        algo = d.get("speculators_model_type")
        if algo not in ("dspark", "dflash"):
            raise ValueError(
                f"{source}: speculators_model_type must be 'dspark' (or 'dflash' for a warm "
                f"start), got {algo!r}"
            )
        tl = d.get("transformer_layer_config")
        if not isinstance(tl, dict):
            raise ValueError(f"{source}: transformer_layer_config must be an object, got {tl!r}")
        check_field_types(d, source)
        decoder = decoder_fields_from_qwen3(tl, source=f"{source}: transformer_layer_config")
        verifier = (d.get("speculators_config") or {}).get("verifier") or {}
        dspark = algo == "dspark"
        for required in ("aux_hidden_state_layer_ids", "draft_vocab_size"):
            if d.get(required) is None:
                raise ValueError(f"{source}: missing required field {required!r}")
        return cls(
            **decoder,
            block_size=int(d.get("block_size", 8)),
            mask_token_id=d.get("mask_token_id"),
            aux_hidden_state_layer_ids=tuple(d["aux_hidden_state_layer_ids"]),
            draft_vocab_size=int(d["draft_vocab_size"]),
            target_hidden_size=d.get("target_hidden_size"),
            # Like vLLM: a missing sample_from_anchor means False (the DFlash convention).
            sample_from_anchor=bool(d.get("sample_from_anchor", False)),
            markov_rank=int(d.get("markov_rank", 256)) if dspark else 0,
            markov_head_type=d.get("markov_head_type", "vanilla"),
            enable_confidence_head=bool(d.get("enable_confidence_head", True)) and dspark,
            confidence_head_with_markov=bool(d.get("confidence_head_with_markov", True)),
            sliding_window_non_causal=bool(d.get("sliding_window_non_causal", False)),
            # Absent in folders speculators wrote: it decides from the verifier at load time.
            verifier_norm_style=d.get("verifier_norm_style") or "plain",
            verifier_logit_softcapping=d.get("verifier_logit_softcapping"),
            verifier_name_or_path=verifier.get("name_or_path"),
            verifier_architectures=tuple(verifier.get("architectures") or ()),
        )

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_speculators_dict(), indent=2) + "\n")

    @classmethod
    def load_json(cls, path: str | Path) -> DSparkConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no such config file") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_speculators_dict(d, source=str(path))


# JSON types of the config.json fields this class reads: int() and bool() would turn
# 3.5 into 3 and "false" into True, a drafter other than the one the file describes.
TOP_LEVEL_TYPES = {
    "block_size": "int",
    "draft_vocab_size": "int",
    "markov_rank": "int",
    "mask_token_id": "int|null",
    "target_hidden_size": "int|null",
    "aux_hidden_state_layer_ids": "list[int]",
    "sample_from_anchor": "bool",
    "enable_confidence_head": "bool",
    "confidence_head_with_markov": "bool",
    "sliding_window_non_causal": "bool",
    "markov_head_type": "str",
    "verifier_logit_softcapping": "number|null",
}
LAYER_TYPES_JSON = {
    "hidden_size": "int",
    "num_attention_heads": "int",
    "num_hidden_layers": "int",
    "vocab_size": "int",
    "intermediate_size": "int|null",
    "num_key_value_heads": "int|null",
    "head_dim": "int|null",
    "max_position_embeddings": "int|null",
    "sliding_window": "int|null",
    "rms_norm_eps": "number",
    "rope_theta": "number",
    "attention_bias": "bool",
    "use_sliding_window": "bool",
    "layer_types": "list[str]|null",
}

KIND_WORDS = {
    "int": "an int",
    "int|null": "an int or null",
    "number": "a number",
    "number|null": "a number or null",
    "bool": "true or false",
    "str": "a string",
    "list[int]": "a list of ints",
    "list[str]|null": "a list of strings or null",
}


def _json_type_ok(value: Any, kind: str) -> bool:
    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if kind.endswith("|null") and value is None:
        return True
    kind = kind.removesuffix("|null")
    if kind == "int":
        return is_int(value)
    if kind == "number":
        return is_int(value) or isinstance(value, float)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "list[int]":
        return isinstance(value, list) and all(is_int(x) for x in value)
    return isinstance(value, list) and all(isinstance(x, str) for x in value)  # list[str]


def check_field_types(d: dict[str, Any], source: str = "config.json") -> None:
    """Raise naming the first field of a speculators config dict with the wrong JSON type."""
    tl = d.get("transformer_layer_config") or {}
    rope = tl.get("rope_parameters") if isinstance(tl.get("rope_parameters"), dict) else {}
    fields = [(d, name, name, kind) for name, kind in TOP_LEVEL_TYPES.items()]
    fields += [(tl, name, f"transformer_layer_config.{name}", kind)
               for name, kind in LAYER_TYPES_JSON.items()]  # fmt: skip
    fields.append((rope, "rope_theta", "transformer_layer_config.rope_parameters.rope_theta",
                   "number"))  # fmt: skip
    for where, name, label, kind in fields:
        if name in where and not _json_type_ok(where[name], kind):
            raise ValueError(f"{source}: {label} must be {KIND_WORDS[kind]}, got {where[name]!r}")


def decoder_fields_from_qwen3(tl: dict[str, Any], source: str = "draft config") -> dict[str, Any]:
    """The decoder-geometry fields of DSparkConfig from an HF Qwen3-style config dict.

    Accepts transformers 4 (``rope_theta`` + ``rope_scaling``) and 5 (``rope_parameters``)
    spellings; per-layer-type rope takes its ``sliding_attention`` entry, as speculators'
    ``flatten_rope_parameters`` does.
    """
    for required in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        if required not in tl:
            raise ValueError(f"{source}: missing required field {required!r}")
    hidden = int(tl["hidden_size"])
    heads = int(tl["num_attention_heads"])
    rope = tl.get("rope_parameters") or tl.get("rope_scaling") or {}
    if "sliding_attention" in rope:  # per-layer-type rope (speculators takes the sliding one)
        rope = rope["sliding_attention"]
    theta = rope.get("rope_theta", tl.get("rope_theta", 10000.0))
    max_positions = int(tl.get("max_position_embeddings") or 32768)
    try:
        scaling = rope_scaling_from_dict(rope, max_positions)
    except ValueError as e:
        raise ValueError(f"{source}: rope_parameters: {e}") from None
    layer_types = tl.get("layer_types")
    sliding_window = tl.get("sliding_window")
    if layer_types is None and tl.get("use_sliding_window") and sliding_window:
        raise ValueError(
            f"{source}: use_sliding_window without layer_types is ambiguous; list layer_types"
        )
    return dict(
        hidden_size=hidden,
        intermediate_size=int(tl.get("intermediate_size", 3 * hidden)),
        num_attention_heads=heads,
        num_key_value_heads=int(tl.get("num_key_value_heads") or heads),
        head_dim=int(tl.get("head_dim") or hidden // heads),
        num_hidden_layers=int(tl["num_hidden_layers"]),
        vocab_size=int(tl["vocab_size"]),
        layer_types=tuple(layer_types) if layer_types is not None else None,
        sliding_window=sliding_window
        if layer_types and "sliding_attention" in layer_types
        else None,
        rope_theta=float(theta),
        rope_scaling=scaling,
        rms_norm_eps=float(tl.get("rms_norm_eps", 1e-6)),
        attention_bias=bool(tl.get("attention_bias", False)),
        max_position_embeddings=max_positions,
    )


def rope_scaling_from_dict(rope: dict[str, Any], max_position_embeddings: int) -> RopeScaling:
    """A ``rope_parameters`` dict as transformers standardizes it, with the keys vLLM
    0.33's ``get_rope`` needs to compute the same function (transformers' is unchanged):

    * llama3/yarn/longrope without ``original_max_position_embeddings``: transformers
      defaults it to max_position_embeddings (``standardize_rope_params``);
    * yarn with ``factor: null``: transformers uses max_position_embeddings /
      original_max_position_embeddings, vLLM indexes ``factor``;
    * longrope: transformers scales cos/sin by ``attention_factor`` (or one derived from
      ``factor``), vLLM by ``short_mscale``/``long_mscale`` (or one derived from
      max_position_embeddings): written out when the two differ.
    """
    params = dict(rope)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    params.pop("rope_theta", None)
    if rope_type in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings", max_position_embeddings)
    original = params.get("original_max_position_embeddings")
    if rope_type == "yarn" and params.get("factor") is None and original:
        params["factor"] = max_position_embeddings / original
    scaling = RopeScaling(rope_type, tuple(params.items()))
    if rope_type == "longrope":
        ours = scaling.attention_scaling(max_position_embeddings)
        vllm = longrope_attention_factor(max_position_embeddings / original, None, original)
        if ours != vllm:
            for key in ("short_mscale", "long_mscale"):
                if params.get(key) is None:
                    params[key] = ours
            scaling = RopeScaling(rope_type, tuple(params.items()))
    return scaling
