"""Whether vLLM 0.33.0 runs a verifier with MLA attention, and the file-transport refusal.

vLLM's file connector (``ExampleHiddenStatesConnector``, and hs_connectors'
``FP8HiddenStatesConnector`` built on it) refuses MLA verifiers ("MLA verifiers are
unsupported"), but only after the model has loaded; Kimi-K3 and DeepSeek-V3 are MLA,
which is why the seed run streams hidden states through Mooncake. The launchers and
the recipes ask here first and refuse file transport up front.

vLLM's rule (``ModelConfig.use_mla`` and ``is_deepseek_mla``, on the text config):
the model type is one of :data:`MLA_MODEL_TYPES` and ``kv_lora_rank`` is set
(DeepSeek-V4-style compressed configs: ``head_dim``), unless ``is_causal`` is false
or ``VLLM_MLA_DISABLE=1``. Standard library only, so the recipes can run

    python3 -m launch.mla MODEL_DIR     # exit status 1 and a one-line message when MLA
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

MLA_MODEL_TYPES = frozenset(
    {
        "axk1",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "deepseek_v4",
        "deepseek_v41",
        "dots3_note",
        "deepseek_mtp",
        "k3_dspark",
        "glm5_next",
        "glm5_next_text",
        "glm_moe_dsa",
        "glm4_moe_lite",
        "glm4_moe_lite_mtp",
        "kimi_k2",
        "kimi_linear",
        "longcat_flash",
        "pangu_ultra_moe",
        "pangu_ultra_moe_mtp",
        "bailing_hybrid",
        "bailing_hybrid_mtp",
        "bailing_hybrid_v3_mtp",
        "hy_v4",
        "hy_v4_mtp",
    }
)


def _get(config, key: str):
    """A field of a config.json dict or of a transformers config."""
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def uses_mla(config) -> bool:
    """True when vLLM 0.33.0 serves this verifier (config.json dict or transformers
    config) with MLA attention."""
    if os.environ.get("VLLM_MLA_DISABLE", "0") not in ("", "0"):
        return False
    text = _get(config, "text_config") or config
    if _get(text, "is_causal") is False or _get(text, "model_type") not in MLA_MODEL_TYPES:
        return False
    # get_compress_ratios: the legacy list, else one ratio per layer from compress_rates
    compressed = bool(_get(text, "compress_ratios")) or (
        _get(text, "compress_rates") is not None
        and bool(_get(text, "layer_types") or _get(text, "num_nextn_predict_layers"))
    )
    return _get(text, "head_dim" if compressed else "kv_lora_rank") is not None


def file_transport_refusal(config, model: str) -> str | None:
    """The one-line refusal of file transport for an MLA verifier, or None."""
    if not uses_mla(config):
        return None
    text = _get(config, "text_config") or config
    return (
        f"{model} is an MLA verifier (model_type {_get(text, 'model_type')}, kv_lora_rank "
        f"{_get(text, 'kv_lora_rank')}): vLLM's file connector refuses MLA verifiers; use "
        "the Mooncake transport (--hidden-states-backend mooncake; recipes: TRANSPORT=mooncake)"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python3 -m launch.mla MODEL_DIR", file=sys.stderr)
        return 2
    path = Path(argv[0]) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"{path}: unreadable verifier config ({e})", file=sys.stderr)
        return 2
    refusal = file_transport_refusal(config, argv[0])
    if refusal:
        print(refusal)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
