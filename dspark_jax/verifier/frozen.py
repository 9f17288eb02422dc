"""The frozen verifier tensors the drafter needs, read from an HF safetensors folder.

Only three tensors are read (docs/formats.md, "Verifier tensors"; speculators 0.9.0
``utils/loading.py::load_model_layers``): the input embedding, the output head
(the embedding when the model ties them) and the final norm weight. Names are
resolved against ``model.safetensors.index.json`` (sharded) or the header of
``model.safetensors``: exact key, then suffix, then the reference's aliases
(``tok_embeddings``, ``output``, ``backbone.norm_f``, ...); among suffix matches the
shortest key wins. Other tensors are never read (only the headers of the shards
that hold the three).

Differences from the reference, both to fail loud rather than train wrong:

* suffix matches must start at a key component (``.norm.weight`` matches
  ``model.norm.weight`` but not ``model.layers.0.input_layernorm.weight``, which the
  reference's bare ``endswith("norm.weight")`` alias can pick);
* a missing final norm raises (the reference warns and uses ones); a missing
  ``lm_head`` falls back to the embedding only when ``config.json`` does not say
  ``tie_word_embeddings: false``.

Local folders only; download a Hub model first (``huggingface-cli download``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_jax import hf_folder
from dspark_jax.data.files import DataError, SafetensorsFile

logger = logging.getLogger(__name__)

EMBED = "embed_tokens.weight"
LM_HEAD = "lm_head.weight"
NORM = "model.norm.weight"
# speculators 0.9.0 utils/loading.py _WEIGHT_ALIASES, in its order.
ALIASES: dict[str, list[str]] = {
    EMBED: ["tok_embeddings.weight", "llm.embed.weight", "backbone.embeddings.weight"],
    LM_HEAD: ["output.weight", "llm.unembed.weight"],
    NORM: ["llm.norm.weight", "backbone.norm_f.weight", "norm.weight"],
}


class VerifierWeightsError(DataError):
    """A verifier tensor is missing or malformed."""


@dataclass(frozen=True)
class VerifierTensors:
    """Frozen verifier tensors, dtype as stored (bf16 via ml_dtypes).

    embed_tokens: [Vt, H] (a read-only memory map); lm_head: [Vd, H] (rows ``t2d`` of the verifier head when a
    draft vocabulary is given, else [Vt, H]); norm: [H]. ``keys`` maps each logical
    name to the checkpoint key read; ``tied`` says lm_head came from the embedding.
    """

    embed_tokens: np.ndarray
    lm_head: np.ndarray
    norm: np.ndarray
    keys: dict[str, str]
    tied: bool


def verifier_model_type(folder: str | os.PathLike) -> str | None:
    """The verifier's effective model_type (its ``text_config``'s when it has one, as
    speculators' ``get_verifier_config``), or None without a readable config.json."""
    config = hf_folder.read_config(folder)
    return None if config is None else hf_folder.text_config(config).get("model_type") or None


def candidates(name: str) -> list[str]:
    """The names tried for ``name``, in order (each exactly, then as a suffix)."""
    return [name, *ALIASES.get(name, [])]


def resolve_key(name: str, keys: list[str] | dict[str, str]) -> str | None:
    """The checkpoint key for logical ``name``: exact, then component suffix, then aliases."""
    for c in candidates(name):
        if c in keys:
            return c
        matches = [k for k in keys if k.endswith("." + c)]
        if matches:
            return min(matches, key=len)
    return None


def _tied_in_config(folder: Path) -> bool | None:
    d = hf_folder.read_config(folder)
    if d is None:
        return None
    d = d if "tie_word_embeddings" in d else hf_folder.text_config(d)
    tied = d.get("tie_word_embeddings")
    return None if tied is None else bool(tied)


def load_verifier_tensors(
    path: str | os.PathLike, t2d: np.ndarray | None = None
) -> VerifierTensors:
    """Read embed_tokens, lm_head and the final norm from an HF folder.

    Args:
      path: local folder with ``model.safetensors[.index.json]`` (and config.json).
      t2d: bool [Vt]; when given, ``lm_head`` keeps only those rows ([Vd, H]).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise VerifierWeightsError(
            f"{folder}: not a local model folder (download Hub models first)"
        )
    wmap = hf_folder.weight_map(folder, VerifierWeightsError)

    def missing(name: str) -> VerifierWeightsError:
        tried = ", ".join(f"{c!r} (exact or suffix)" for c in candidates(name))
        return VerifierWeightsError(f"{folder}: no tensor for {name}; tried {tried}")

    keys: dict[str, str] = {}
    for name in (EMBED, LM_HEAD, NORM):
        key = resolve_key(name, wmap)
        if key is not None:
            keys[name] = key
    if EMBED not in keys:
        raise missing(EMBED)
    if NORM not in keys:
        raise missing(NORM)
    tied = LM_HEAD not in keys
    if tied:
        if _tied_in_config(folder) is False:
            raise VerifierWeightsError(
                f"{missing(LM_HEAD)} and config.json says tie_word_embeddings=false"
            )
        logger.info("%s: no lm_head tensor, using the tied embedding", folder)

    files: dict[str, SafetensorsFile] = {}
    out: dict[str, np.ndarray] = {}
    for name, key in keys.items():
        shard = folder / wmap[key]
        if shard not in files:
            if not shard.exists():
                raise VerifierWeightsError(
                    f"{folder}: {key} is mapped to {wmap[key]}, which does not exist"
                )
            files[shard] = SafetensorsFile(shard)
        if key not in files[shard]:
            raise VerifierWeightsError(f"{shard}: index lists {key}, the file does not have it")
        # The embedding as a memory map: its bytes are read where it is used (the in-step
        # trainer hands the drafter the verifier's own device copy and never reads them).
        out[name] = files[shard].view(key) if name == EMBED else files[shard].read(key)
    embed, norm = out[EMBED], out[NORM]
    head = embed if tied else out[LM_HEAD]
    if embed.ndim != 2 or head.ndim != 2 or norm.ndim != 1:
        raise VerifierWeightsError(
            f"{folder}: expected embed [V, H], lm_head [V, H], norm [H]; got "
            f"{embed.shape}, {head.shape}, {norm.shape}"
        )
    if head.shape[1] != embed.shape[1] or norm.shape[0] != embed.shape[1]:
        raise VerifierWeightsError(
            f"{folder}: hidden sizes differ: embed {embed.shape}, lm_head {head.shape}, "
            f"norm {norm.shape}"
        )
    if t2d is not None:
        if t2d.shape != (head.shape[0],):
            raise VerifierWeightsError(
                f"t2d has shape {t2d.shape}, the verifier head has {head.shape[0]} rows"
            )
        head = head[t2d.astype(np.bool_)]
    if tied:
        keys[LM_HEAD] = keys[EMBED]
    return VerifierTensors(embed_tokens=embed, lm_head=head, norm=norm, keys=keys, tied=tied)
