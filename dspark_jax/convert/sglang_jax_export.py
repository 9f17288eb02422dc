"""``python -m converters export --target sglang-jax``: a drafter folder sglang-jax serves.

sglang-jax reads the draft's config.json with transformers' ``AutoConfig`` (a flat
qwen3 config with ``dflash_config``), not the speculators format vLLM reads, and names
the captured verifier layers differently: its ``target_layer_ids`` entry ``t`` is the
residual stream before decoder layer ``t + 1`` (``qwen3.py`` ``set_dflash_layers_to_capture``),
dspark-jax's layer id ``k`` the stream after ``k`` layers (docs/formats.md), so ``t = k - 1``.
The tensors are the speculators ones (same keys, torch layout). The folder is first
exported and checked as for vLLM, then rewritten and checked against
:mod:`dspark_jax.convert.sglang_jax_rules`, and only then renamed into place.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from dspark_jax.convert.check import CheckError, CheckReport, check_folder
from dspark_jax.convert.export import (
    ExportError,
    card_serve_commands,
    check_destination,
    export_checkpoint,
)
from dspark_jax.convert.sglang_jax_rules import ARCHITECTURE
from dspark_jax.hf_folder import CONFIG_FILE

CARD_FILE = "README.md"


class ReducedVocabError(ExportError):
    """A drafter trained with a reduced draft vocabulary (sglang-jax has none)."""


def sglang_jax_config(d: dict[str, Any]) -> dict[str, Any]:
    """A speculators DSpark config.json (as export writes it) -> sglang-jax's layout.

    Every field sglang-jax reads with a default is written (sglang_jax_rules.DEFAULTED).
    Raises :class:`ReducedVocabError` for a reduced draft vocabulary: sglang-jax drafts
    over the target's full vocabulary with the target's lm_head, which is not the
    drafter that was trained (its argmax ranged over the draft vocabulary only).
    """
    tl = d["transformer_layer_config"]
    vt, vd = tl["vocab_size"], d.get("draft_vocab_size") or tl["vocab_size"]
    if vd != vt:
        raise ReducedVocabError(
            f"sglang-jax drafts over the full target vocabulary (its Markov head and the "
            f"target's lm_head span all {vt} ids, no d2t), but this drafter was trained "
            f"with draft_vocab_size={vd}: expanding it is not exact; retrain with the full "
            "vocabulary (no --draft-vocab-size) to serve it on sglang-jax"
        )
    rope = dict(tl.get("rope_parameters") or {})
    theta = rope.pop("rope_theta")
    block = d["block_size"]
    target_ids = [k - 1 for k in d["aux_hidden_state_layer_ids"]]
    out = {
        "model_type": "qwen3",
        "architectures": [ARCHITECTURE],
        **{
            k: tl[k]
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "num_hidden_layers",
                "max_position_embeddings",
                "rms_norm_eps",
                "attention_bias",
                "hidden_act",
                "vocab_size",
            )
        },
        "layer_types": tl.get("layer_types"),
        "rope_theta": theta,
        "rope_scaling": rope if rope.get("rope_type", "default") != "default" else None,
        "tie_word_embeddings": False,
        "torch_dtype": d.get("dtype", "bfloat16"),
        "target_hidden_size": d.get("target_hidden_size") or tl["hidden_size"],
        "block_size": block,
        "markov_rank": d["markov_rank"],
        "markov_head_type": d["markov_head_type"],
        "sample_from_anchor": d["sample_from_anchor"],
        "enable_confidence_head": d.get("enable_confidence_head", False),
        "mask_token_id": d["mask_token_id"],
        "target_layer_ids": target_ids,
        "dflash_config": {
            "block_size": block,
            "target_layer_ids": target_ids,
            "mask_token_id": d["mask_token_id"],
        },
        # dspark-jax's record (sglang-jax ignores it): where the drafter came from.
        "dspark_speculators_config": {
            "aux_hidden_state_layer_ids": d["aux_hidden_state_layer_ids"],
            "verifier": d["speculators_config"]["verifier"],
        },
    }
    return out


def _retarget_card(text: str, commands: tuple[str, ...]) -> str:
    """The model card with the deployment block (vLLM's commands) replaced by sglang-jax's."""
    head, sep, tail = text.partition("## Deployment\n")
    if sep:
        fence_open = tail.index("```bash\n") + len("```bash\n")
        fence_close = tail.index("```", fence_open)
        tail = tail[:fence_open] + "".join(c + "\n" for c in commands) + tail[fence_close:]
    lines = [
        ln for ln in (head + sep + tail).splitlines() if "vLLM's adaptive verification" not in ln
    ]
    return "\n".join(lines).replace("served by vLLM 0.33", "served by sglang-jax (DSPARK)") + "\n"


def export_sglang_jax(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    verifier_path: str | os.PathLike | None = None,
    target: str = "sglang-jax",
    **kwargs,
) -> tuple[CheckReport, int]:
    """Export one checkpoint step for sglang-jax (keyword arguments: ``export_checkpoint``).

    A failed check raises :class:`CheckError`, a reduced draft vocabulary
    :class:`ReducedVocabError`; either way nothing is written at ``out_dir``.
    """
    if target != "sglang-jax":
        raise ValueError(f"export_sglang_jax writes target sglang-jax, got {target!r}")
    out_dir = Path(out_dir)
    check_destination(out_dir, overwrite, protect=(Path(ckpt_dir),))
    stage = out_dir.parent / f".{out_dir.name}.sglang-jax-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        _, step = export_checkpoint(
            ckpt_dir, stage, target="vllm", verifier_path=verifier_path, **kwargs
        )
        d = json.loads((stage / CONFIG_FILE).read_text())
        (stage / CONFIG_FILE).write_text(json.dumps(sglang_jax_config(d), indent=2) + "\n")
        report = check_folder(stage, target="sglang-jax", verifier=verifier_path)
        report.folder = out_dir
        if not report.ok:
            raise CheckError(report)
        card = stage / CARD_FILE
        if card.exists():
            card.write_text(_retarget_card(card.read_text(), card_serve_commands(report, out_dir)))
        if out_dir.exists():
            check_destination(out_dir, overwrite)
            shutil.rmtree(out_dir)
        stage.rename(out_dir)
    finally:
        if stage.exists():
            shutil.rmtree(stage)
    return report, step
