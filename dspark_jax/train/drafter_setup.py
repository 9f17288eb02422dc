"""Which drafter a run trains: its DSparkConfig, vocab maps and starting weights.

The reference's ``train/cli.py::build_draft_model`` without torch or transformers:
the verifier is a local folder whose ``config.json`` (and tokenizer files, for the
mask token) are read as JSON. Three sources, as in the reference:

* ``--from-pretrained``: an Orbax checkpoint (``python -m converters import`` or a
  previous run's ``--save-path``), a speculators folder (imported on the fly), or a
  folder with only ``config.json`` (fresh weights from that config);
* ``--draft-config``: a Qwen3 decoder config (JSON file or folder);
* neither: the decoder derived from the verifier config
  (``create_transformer_layer_config``: ``--num-layers``, sliding window on every
  layer except ``--full-attention-indices``, verifier head geometry, MLP width =
  the verifier's ``intermediate_size`` or 3 x hidden for MoE verifiers without one,
  the verifier's rope parameters as transformers standardizes them: per-layer-type
  rope takes its sliding entry, partial rotary is dropped, MRoPE keeps its sections
  rescaled to the full head and trains text-only, docs/math.md "RoPE").

The verifier's ``config.json`` is read as its transformers config class would fill it
where a Hub config leaves fields to the class: MLA verifiers' ``head_dim`` is
``qk_rope_head_dim`` (``qk_nope_head_dim + qk_rope_head_dim`` for Mistral 4). Where the
reference fails (a class without ``head_dim``, e.g. Phi-3, makes its
``Qwen3Config(head_dim=None)`` raise) ``hidden_size // num_attention_heads`` is used.

The verifier's final-norm convention (``DSparkConfig.verifier_norm_style``) is taken
from its effective model_type as speculators takes it, unless
``--verifier-norm-style`` says otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from dspark_jax import hf_folder
from dspark_jax.checkpoint import load
from dspark_jax.config import DSparkConfig, decoder_fields_from_qwen3, verifier_norm_style
from dspark_jax.data.hs_names import EXTRACTION_CONFIG
from dspark_jax.data.vocab import resolve_vocab_maps
from dspark_jax.train.flags import ConfigError, TrainArgs

log = logging.getLogger(__name__)

# MLA verifiers whose transformers config sets head_dim = qk_rope_head_dim (a Hub
# config.json omits head_dim); mistral4 sets qk_nope_head_dim + qk_rope_head_dim.
ROPE_HEAD_DIM_MODEL_TYPES = frozenset(
    (
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "kimi_k2",
        "kimi_linear",
        "glm_moe_dsa",
        "glm5_next",
        "minicpm3",
        "youtu",
        "hy_v4",
        "axk1",
        "axk2",
    )
)
MROPE_INVERSE_TOLERANCE = 1e-6  # speculators' tolerance on 1 / partial_rotary_factor

# Flags that shape the drafter; with --from-pretrained the checkpoint's config decides
# and a flag that disagrees with it is an error.
MODEL_FLAGS = {
    "block_size": "block_size",
    "mask_token_id": "mask_token_id",
    "target_layer_ids": "aux_hidden_state_layer_ids",
    "draft_vocab_size": "draft_vocab_size",
    "sample_from_anchor": "sample_from_anchor",
    "markov_rank": "markov_rank",
    "markov_head_type": "markov_head_type",
    "enable_confidence_head": "enable_confidence_head",
    "confidence_head_with_markov": "confidence_head_with_markov",
    "sliding_window_non_causal": "sliding_window_non_causal",
}


@dataclasses.dataclass
class DraftSetup:
    cfg: DSparkConfig
    vocab_maps: tuple[np.ndarray, np.ndarray] | None  # (d2t, t2d) for a reduced vocab
    params: nnx.State | None  # starting weights (host arrays); None: fresh init
    source: str  # what the drafter was built from, for logs


def hidden_states_dir(args: TrainArgs) -> Path:
    return Path(args.hidden_states_path or Path(args.data_path) / "hidden_states")


def read_verifier_config(path: str) -> dict[str, Any]:
    """The verifier's (text) config.json as a dict."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"--verifier-name-or-path {path}: not a local model folder with config.json "
            "(dspark_jax does not download; fetch Hub models first, e.g. huggingface-cli download)"
        )
    d = json.loads((folder / "config.json").read_text())
    return hf_folder.text_config(d)


def resolve_target_layer_ids(args: TrainArgs, verifier: dict[str, Any]) -> list[int]:
    n = int(verifier["num_hidden_layers"])
    ids = args.target_layer_ids
    explicit = ids is not None
    if ids is None:
        record = hidden_states_dir(args) / EXTRACTION_CONFIG
        if record.exists():
            layer_ids = json.loads(record.read_text()).get("layer_ids")
            if layer_ids:
                ids = list(layer_ids[:-1])  # the last slot is the verifier's last layer
                log.info("--target-layer-ids not set: using %s from %s", ids, record)
    if ids is None:
        ids = [2, n // 2, n - 3]
        log.warning(
            "--target-layer-ids is not explicitly set. Setting target layers to %s. If custom "
            "target layers were used when extracting hidden states, please set them explicitly.",
            ids,
        )
    what = "target_layer_ids" if explicit else f"Default target layer ids {ids}"
    check_target_layer_ids(ids, n, what)
    return list(ids)


def check_target_layer_ids(ids, n: int, what: str = "target_layer_ids") -> None:
    """Refuse aux layer ids vLLM would not serve as trained (docs/formats.md, "What vLLM
    0.33 requires"): it captures only layers 0..n and concatenates them ascending."""
    ids = list(ids)
    if not ids or min(ids) < 0 or max(ids) > n or len(set(ids)) != len(ids):
        raise ConfigError(
            f"{what} must be distinct and within [0, {n}] for a verifier with {n} hidden "
            f"layers, got {ids}"
        )
    if ids != sorted(ids):
        raise ConfigError(
            f"{what} must be ascending (vLLM concatenates the aux layers in ascending order), "
            f"got {ids}; pass them sorted and extract the hidden states in that order"
        )


def verifier_head_dim(verifier: dict[str, Any]) -> int | None:
    """``head_dim`` as the verifier's transformers config class sets it."""
    model_type = str(verifier.get("model_type") or "")
    if model_type in ROPE_HEAD_DIM_MODEL_TYPES and verifier.get("qk_rope_head_dim"):
        return int(verifier["qk_rope_head_dim"])
    if model_type == "mistral4" and verifier.get("qk_rope_head_dim"):
        return int(verifier["qk_rope_head_dim"]) + int(verifier.get("qk_nope_head_dim") or 0)
    head_dim = verifier.get("head_dim")
    return int(head_dim) if head_dim else None


def verifier_rope_parameters(verifier: dict[str, Any]) -> dict[str, Any]:
    """The verifier's ``rope_parameters`` as transformers 5 standardizes its config.json
    (``convert_rope_params_to_dict``): ``rope_scaling`` wins over ``rope_parameters``,
    top-level ``rope_theta`` / ``partial_rotary_factor`` / ``original_max_position_embeddings``
    move in, ``type`` becomes ``rope_type``; per-layer-type dicts stay nested."""
    rope = verifier.get("rope_scaling") or verifier.get("rope_parameters") or {}
    rope = json.loads(json.dumps(rope))  # a deep copy
    model_type = str(verifier.get("model_type") or "")
    theta = verifier.get("rope_theta", 10000.0)
    if model_type in ("gemma3", "gemma3_text") and "sliding_attention" not in rope:
        # Gemma3TextConfig: rope_scaling is the full-attention rope; sliding layers use
        # rope_local_base_freq.
        full = {"rope_type": "default", **rope, "rope_theta": theta}
        local = verifier.get("rope_local_base_freq", 10000.0)
        return {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        }
    if "sliding_attention" in rope or "full_attention" in rope:
        for sub in rope.values():
            if isinstance(sub, dict):
                sub.setdefault("rope_theta", theta)
                sub.setdefault("rope_type", sub.get("type", "default"))
        return rope
    rope.setdefault("rope_theta", theta)
    if verifier.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", verifier["partial_rotary_factor"])
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] == "mrope":  # the Qwen2-VL family's legacy name of MRoPE
        rope["rope_type"] = "default"
    if model_type == "phi3" and rope["rope_type"] in ("su", "yarn"):
        rope["rope_type"] = "longrope"
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        if verifier.get("original_max_position_embeddings") is not None:
            rope["original_max_position_embeddings"] = verifier["original_max_position_embeddings"]
        else:
            rope.setdefault(
                "original_max_position_embeddings", verifier.get("max_position_embeddings")
            )
    return rope


def draft_rope_parameters(
    args: TrainArgs, verifier: dict[str, Any], head_dim: int
) -> dict[str, Any]:
    """``create_transformer_layer_config``'s rope of the draft layers (transformers 5)."""
    rope = verifier_rope_parameters(verifier)
    if "rope_theta" not in rope:  # per-layer-type: the draft uses one rope
        sub = rope.get("sliding_attention") or rope.get("full_attention") or {}
        rope = dict(sub) if isinstance(sub, dict) else {}
        rope.setdefault("rope_type", "default")
        rope.setdefault("rope_theta", 10000.0)
    if "mrope_section" in rope:
        prf = float(rope.get("partial_rotary_factor", 1.0))
        if prf < 1.0 and not args.draft_mrope_full_head_hack:
            raise ConfigError(
                f"verifier {args.verifier_name_or_path}: MRoPE with partial_rotary_factor={prf} "
                "and --no-draft-mrope-full-head-hack: speculators 0.9.0 trains these draft "
                f"layers with full-head RoPE, and vLLM would rotate only {int(head_dim * prf)} "
                f"of {head_dim} dims; drop --no-draft-mrope-full-head-hack (the default "
                "rescales mrope_section to the full head)"
            )
        if prf < 1.0:
            inv = 1.0 / prf
            if abs(inv - round(inv)) > MROPE_INVERSE_TOLERANCE:
                raise ConfigError(
                    "mrope_full_head_hack cannot rescale mrope_section because "
                    f"1/partial_rotary_factor={inv} is not an integer."
                )
            old = list(rope["mrope_section"])
            section = [int(x) * round(inv) for x in old]
            if 2 * sum(section) != head_dim:
                raise ConfigError(
                    f"mrope_full_head_hack rescaling produced inconsistent mrope_section "
                    f"{section}: 2*sum={2 * sum(section)} but head_dim={head_dim}."
                )
            rope["mrope_section"], rope["partial_rotary_factor"] = section, 1.0
            log.warning(
                "MRoPE full-head hack applied: partial_rotary_factor %s -> 1.0, mrope_section "
                "%s -> %s. The drafter trains on text positions (MRoPE with t = h = w).",
                prf,
                old,
                section,
            )
    rope.pop("type", None)
    rope.pop("mrope_interleaved", None)
    if "mrope_section" not in rope:
        rope.pop("partial_rotary_factor", None)
    return rope


def derive_decoder(args: TrainArgs, verifier: dict[str, Any]) -> dict[str, Any]:
    """``create_transformer_layer_config``: a Qwen3 decoder dict from the verifier."""
    hidden = int(verifier["hidden_size"])
    heads = int(verifier["num_attention_heads"])
    kv = int(verifier.get("num_key_value_heads") or heads)
    head_dim = verifier_head_dim(verifier)
    act = args.draft_hidden_act or verifier.get("hidden_act") or verifier.get("hidden_activation")
    if act != "silu":
        raise ConfigError(
            f"draft hidden_act {act!r} (from --draft-hidden-act or the verifier): dspark_jax's "
            "draft MLP is SiLU only; pass --draft-hidden-act silu"
        )
    if head_dim and hidden % heads and hidden % head_dim == 0:
        heads = hidden // head_dim
        if heads % kv:
            kv = heads
    if kv and heads % kv:
        raise ConfigError(
            f"Inconsistent draft attention geometry resolved from verifier "
            f"'{args.verifier_name_or_path}': num_attention_heads={heads} is not divisible by "
            f"num_key_value_heads={kv}."
        )
    num_layers = args.num_layers
    full = args.full_attention_indices or []
    if full and (min(full) < 0 or max(full) >= num_layers):
        raise ConfigError(
            "Full attention indices must be valid draft layer ids in range [0, num_layers)."
        )
    if not full:
        log.info(
            "All %d draft layers using sliding window attention (window=%d). To use full "
            "attention on specific layers, pass '--full-attention-indices <layer_ids>'.",
            num_layers,
            args.sliding_window,
        )
    intermediate = verifier.get("intermediate_size")
    if intermediate is None:
        intermediate = 3 * hidden
        log.warning(
            "Verifier config has no dense intermediate_size (likely MoE); using draft "
            "intermediate_size=%d (3 x hidden_size). Pass --draft-config to override.",
            intermediate,
        )
    out = {
        "model_type": "qwen3",
        "vocab_size": int(verifier["vocab_size"]),
        "hidden_size": hidden,
        "intermediate_size": int(intermediate),
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim or hidden // heads,
        "max_position_embeddings": verifier.get("max_position_embeddings"),
        "rms_norm_eps": verifier.get("rms_norm_eps", 1e-6),
        "sliding_window": args.sliding_window,
        "layer_types": [
            "full_attention" if i in full else "sliding_attention" for i in range(num_layers)
        ],
        "rope_parameters": draft_rope_parameters(args, verifier, head_dim or hidden // heads),
    }
    return out


def load_draft_decoder(path: str, verifier: dict[str, Any]) -> dict[str, Any]:
    """``load_draft_transformer_layer_config`` for a local JSON file or folder."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    try:
        d = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"--draft-config {path}: no such file (a JSON file or a folder with config.json)"
        ) from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--draft-config {file}: not valid JSON ({e})") from None
    if "transformer_layer_config" in d:
        d = d["transformer_layer_config"]
    model_type = d.get("model_type")
    if not model_type:
        raise ConfigError(
            "--draft-config must define a 'model_type' ('qwen3' for DFlash-family models); "
            f"none was found in the config loaded from '{path}'."
        )
    if model_type != "qwen3":
        raise ConfigError(
            f"--draft-config {path}: model_type {model_type!r}; dspark_jax builds qwen3 only"
        )
    if int(d["hidden_size"]) != int(verifier["hidden_size"]):
        raise ConfigError(
            f"--draft-config hidden_size ({d['hidden_size']}) must match the verifier "
            f"hidden_size ({verifier['hidden_size']}). Draft/verifier hidden-size mismatch is not "
            "yet supported."
        )
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"--draft-config {path}: hidden_act {d['hidden_act']!r}; dspark_jax's MLP is SiLU only"
        )
    if int(d.get("vocab_size", -1)) != int(verifier["vocab_size"]):
        log.info(
            "Overriding --draft-config vocab_size (%s) with the verifier vocab_size (%s)",
            d.get("vocab_size"),
            verifier["vocab_size"],
        )
        d = {**d, "vocab_size": int(verifier["vocab_size"])}
    return d


def _decoder_fields(decoder: dict[str, Any], source: str) -> dict[str, Any]:
    try:
        return decoder_fields_from_qwen3(decoder, source=source)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _token_id(folder: Path, name: str, tokens: dict[str, int]) -> int | None:
    tc = folder / "tokenizer_config.json"
    if tc.exists():
        value = json.loads(tc.read_text()).get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value in tokens:
            return tokens[value]
    cfg = folder / "config.json"
    if cfg.exists():
        value = json.loads(cfg.read_text()).get(f"{name}_id")
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int):
            return value
    return None


def resolve_mask_token_id(args: TrainArgs, vocab_size: int) -> int:
    """``resolve_mask_token_id``: explicit, the tokenizer's mask token, the first unused
    id (the reference adds ``<|MASK|>`` there), else pad/eos/unk."""
    if args.mask_token_id is not None:
        return int(args.mask_token_id)
    folder = Path(args.verifier_name_or_path)
    tok_file = folder / "tokenizer.json"
    if not tok_file.exists():
        raise ConfigError(
            f"--mask-token-id is not set and {tok_file} does not exist to resolve it from; "
            "pass --mask-token-id"
        )
    tok = json.loads(tok_file.read_text())
    vocab = (tok.get("model") or {}).get("vocab") or {}
    tokens = dict(vocab) if isinstance(vocab, dict) else {t[0]: i for i, t in enumerate(vocab)}
    tokens.update({t["content"]: int(t["id"]) for t in tok.get("added_tokens", [])})
    mask = _token_id(folder, "mask_token", tokens)
    if mask is not None:
        log.info("Using tokenizer mask_token_id=%d", mask)
        return mask
    size = len(tokens)
    if size < vocab_size:
        log.warning(
            "Using the first unused token id as mask_token_id=%d (tokenizer len=%d, "
            "vocab_size=%d), as the reference adds <|MASK|> there",
            size,
            size,
            vocab_size,
        )
        return size
    for name in ("pad_token", "eos_token", "unk_token"):
        tid = _token_id(folder, name, tokens)
        if tid is not None:
            log.warning("Tokenizer has no mask token and no unused ids; using %s_id=%d", name, tid)
            return tid
    raise ConfigError(
        "Could not resolve mask_token_id: no --mask-token-id provided, tokenizer has no "
        "mask_token, no unused embedding slots, and no pad/eos/unk fallback tokens."
    )


def resolve_verifier_norm_style(args: TrainArgs, verifier: dict[str, Any]) -> str:
    """``--verifier-norm-style``, or (``auto``) speculators' choice from the verifier's
    effective model_type (``x * (1 + w)`` for GEMMA_STYLE_FINAL_NORM_MODEL_TYPES)."""
    model_type = verifier.get("model_type")
    derived = verifier_norm_style(model_type)
    choice = args.verifier_norm_style
    if choice == "auto":
        if not model_type:
            log.warning(
                "verifier %s: config.json has no model_type; assuming the plain final-norm "
                "convention (x * w), as speculators does (--verifier-norm-style to override)",
                args.verifier_name_or_path,
            )
        return derived
    if model_type and choice != derived:
        log.warning(
            "--verifier-norm-style %s overrides %s, speculators' choice for model_type %r",
            choice,
            derived,
            model_type,
        )
    return choice


# Families whose vLLM 0.33.0 model caps the logits it serves with the config's
# final_logit_softcapping (LogitsProcessor(soft_cap=...)); others ignore the field.
SERVED_SOFTCAP_MODEL_TYPES = frozenset(
    ("gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4", "gemma4_text")
)


def resolve_verifier_logit_softcapping(args: TrainArgs, verifier: dict[str, Any]) -> float | None:
    """The cap on the target logits: None (``--verifier-logit-softcapping reference``,
    speculators' raw verifier logits) or, with ``served``, the verifier config's
    ``final_logit_softcapping`` where vLLM applies it to the logits it serves."""
    model_type = str(verifier.get("model_type") or "")
    cap = verifier.get("final_logit_softcapping")
    if model_type not in SERVED_SOFTCAP_MODEL_TYPES:
        cap = None  # vLLM serves this family's logits uncapped
    elif cap is not None and (
        isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0
    ):
        raise ConfigError(
            f"verifier {args.verifier_name_or_path}: config.json final_logit_softcapping must "
            f"be null or a positive number, got {cap!r}"
        )
    if args.verifier_logit_softcapping == "served":
        if cap is None:
            log.info(
                "--verifier-logit-softcapping served: vLLM serves verifier %s (model_type %r) "
                "without a logit soft cap, so the served logits are the reference ones",
                args.verifier_name_or_path,
                model_type,
            )
        return None if cap is None else float(cap)
    if cap is not None:
        log.info(
            "verifier %s serves soft-capped logits (final_logit_softcapping %s); the targets "
            "are the uncapped ones, as speculators computes them (--verifier-logit-softcapping "
            "served for the served ones)",
            args.verifier_name_or_path,
            cap,
        )
    return None


def _fresh_config(args: TrainArgs, verifier: dict[str, Any], vocab_maps) -> DSparkConfig:
    if args.draft_config:
        decoder, source = (
            load_draft_decoder(args.draft_config, verifier),
            f"--draft-config {args.draft_config}",
        )
    else:
        decoder, source = derive_decoder(args, verifier), f"verifier {args.verifier_name_or_path}"
    fields = _decoder_fields(decoder, source)
    draft_vocab = len(vocab_maps[0]) if vocab_maps is not None else fields["vocab_size"]
    try:
        return DSparkConfig(
            **fields,
            block_size=args.block_size,
            mask_token_id=resolve_mask_token_id(args, fields["vocab_size"]),
            aux_hidden_state_layer_ids=tuple(resolve_target_layer_ids(args, verifier)),
            draft_vocab_size=draft_vocab,
            sample_from_anchor=args.sample_from_anchor,
            markov_rank=args.markov_rank,
            markov_head_type=args.markov_head_type,
            enable_confidence_head=args.enable_confidence_head,
            confidence_head_with_markov=args.confidence_head_with_markov,
            sliding_window_non_causal=args.sliding_window_non_causal,
            verifier_norm_style=resolve_verifier_norm_style(args, verifier),
            verifier_logit_softcapping=resolve_verifier_logit_softcapping(args, verifier),
            verifier_name_or_path=args.verifier_name_or_path,
            verifier_architectures=tuple(verifier.get("architectures") or ()),
        )
    except ValueError as e:
        raise ConfigError(f"draft config from {source}: {e}") from None


def _vocab_maps(args: TrainArgs, vocab_size: int):
    from dspark_jax.data.vocab import VocabError

    try:
        return resolve_vocab_maps(
            args.data_path,
            draft_vocab_size=args.draft_vocab_size,
            verifier_vocab_size=vocab_size,
            d2t_path=args.d2t_path,
            t2d_path=args.t2d_path,
            token_freq_path=args.token_freq_path,
        )
    except VocabError as e:
        if not (args.compile_for and args.draft_vocab_size and args.d2t_path is None):
            raise ConfigError(str(e)) from None
        # --compile-for needs the maps' shapes only: stand-in maps (the first Vd tokens).
        from dspark_jax.data.vocab import build_vocab_maps

        log.info("--compile-for: no vocab maps (%s); compiling with stand-in maps", e)
        try:
            return build_vocab_maps({}, args.draft_vocab_size, vocab_size)
        except VocabError:
            raise ConfigError(str(e)) from None


def _pretrained(args: TrainArgs) -> DraftSetup:
    path = Path(args.from_pretrained)
    if not path.is_dir():
        raise ConfigError(f"--from-pretrained {path}: not a local folder")
    if load.has_checkpoint_steps(path) or load.has_weights(path):
        try:
            loaded = load.load_drafter(
                path,
                "latest",
                verifier_path=args.verifier_name_or_path,
                d2t_path=args.d2t_path,
                t2d_path=args.t2d_path,
            )
        except load.DrafterLoadError as e:
            raise ConfigError(f"--from-pretrained {e}") from None
        return DraftSetup(loaded.cfg, loaded.vocab_maps, loaded.params, loaded.source)
    if (path / "config.json").exists():
        try:
            cfg = DSparkConfig.load_json(path)
        except ValueError as e:
            raise ConfigError(f"--from-pretrained: {e}") from None
        if not cfg.verifier_name_or_path:
            cfg = cfg.replace(verifier_name_or_path=args.verifier_name_or_path)
        maps = _vocab_maps(args, cfg.vocab_size) if cfg.uses_draft_vocab else None
        return DraftSetup(cfg, maps, None, f"config-only folder {path} (fresh weights)")
    raise ConfigError(
        f"--from-pretrained {path}: neither an Orbax checkpoint, a speculators folder "
        "(config.json + model.safetensors) nor a config.json folder"
    )


def _check_pretrained_flags(args: TrainArgs, cfg: DSparkConfig) -> None:
    for dest, field in MODEL_FLAGS.items():
        if not args.provided(dest):
            continue
        want = args.values[dest]
        have = getattr(cfg, field)
        if dest == "target_layer_ids":
            want = tuple(want)
        if want != have:
            raise ConfigError(
                f"--{dest.replace('_', '-')} {want} conflicts with the --from-pretrained "
                f"drafter's {field}={have}; remove the flag or start from another drafter"
            )


def build_draft(args: TrainArgs) -> DraftSetup:
    """The run's drafter: config, vocab maps and (optional) starting weights."""
    verifier = read_verifier_config(args.verifier_name_or_path)
    if args.from_pretrained:
        setup = _pretrained(args)
        _check_pretrained_flags(args, setup.cfg)
        check_target_layer_ids(
            setup.cfg.aux_hidden_state_layer_ids,
            int(verifier["num_hidden_layers"]),
            "--from-pretrained drafter's aux_hidden_state_layer_ids",
        )
        if setup.cfg.vocab_size != int(verifier["vocab_size"]) or setup.cfg.hidden_size != int(
            verifier["hidden_size"]
        ):
            raise ConfigError(
                f"--from-pretrained drafter (vocab {setup.cfg.vocab_size}, hidden "
                f"{setup.cfg.hidden_size}) does not fit the verifier (vocab "
                f"{verifier['vocab_size']}, hidden {verifier['hidden_size']})"
            )
        if setup.cfg.mask_token_id is None:
            setup.cfg = setup.cfg.replace(
                mask_token_id=resolve_mask_token_id(args, setup.cfg.vocab_size)
            )
        style = resolve_verifier_norm_style(args, verifier)
        if style != setup.cfg.verifier_norm_style:
            log.warning(
                "--from-pretrained drafter records verifier_norm_style=%s; training with %s "
                "(the verifier's)",
                setup.cfg.verifier_norm_style,
                style,
            )
        cap = resolve_verifier_logit_softcapping(args, verifier)
        if cap != setup.cfg.verifier_logit_softcapping:
            log.warning(
                "--from-pretrained drafter records verifier_logit_softcapping=%s; training "
                "with %s (--verifier-logit-softcapping %s)",
                setup.cfg.verifier_logit_softcapping,
                cap,
                args.verifier_logit_softcapping,
            )
        setup.cfg = setup.cfg.replace(
            verifier_name_or_path=args.verifier_name_or_path,
            verifier_norm_style=style,
            verifier_logit_softcapping=cap,
        )
        return setup
    maps = _vocab_maps(args, int(verifier["vocab_size"]))
    cfg = _fresh_config(args, verifier, maps)
    source = "--draft-config " + args.draft_config if args.draft_config else "the verifier config"
    return DraftSetup(cfg, maps, None, source)
