"""Which transformers attention implementation computes the verifier vLLM serves.

transformers 5.19 loads most decoders with ``sdpa``, and its ``sdpa_attention_forward``
ignores two attention keyword arguments some families pass: ``softcap`` (Gemma 2's
``attn_logit_softcapping``) and ``s_aux`` (learnable attention sinks, gpt-oss and
relatives). vLLM 0.33.0 computes both, so hidden states from an sdpa forward of such a
verifier are those of another model. :func:`choose` picks ``eager`` (which computes
every feature) for a config with such a feature, keeps transformers' default otherwise,
and refuses an ``--attn-implementation`` that would drop a feature the config has.

Features every implementation computes (sliding windows: a mask for eager / sdpa /
flex, ``window_size`` for flash; ``query_pre_attn_scalar`` and MLA's scale: the
``scaling`` argument) need no choice; docs/formats.md lists them all.
"""

from __future__ import annotations

import dataclasses

EAGER = "eager"


@dataclasses.dataclass(frozen=True)
class AttentionFeature:
    name: str  # as errors and docs/formats.md name it
    model_types: frozenset[str]  # families whose transformers attention passes it
    field: str | None  # config field that turns it on (set, not null); None: always on
    honoured_by: tuple[str, ...]  # implementations that compute it
    cuda_only: tuple[str, ...] = ()  # of those, the ones that compute it on CUDA only

    def present(self, config) -> bool:
        if getattr(config, "model_type", None) not in self.model_types:
            return False
        return self.field is None or getattr(config, self.field, None) is not None


# Flash kernels are left out: whether one honours ``softcap`` / ``s_aux`` depends on the
# kernel installed (transformers drops the argument silently when it does not).
FEATURES = (
    AttentionFeature(
        name="attention logit soft-capping (attn_logit_softcapping)",
        model_types=frozenset({"gemma2", "vaultgemma"}),
        field="attn_logit_softcapping",
        honoured_by=(EAGER, "flex_attention"),
    ),
    AttentionFeature(
        name="attention sinks (learnable per-head sink logits)",
        model_types=frozenset(
            {"gpt_oss", "granite_swa", "granitemoe_swa", "mimo_v2_flash", "deepseek_v4", "hy_v4"}
        ),
        field=None,
        honoured_by=(EAGER, "flex_attention"),
        cuda_only=("flex_attention",),
    ),
)


def text_config(config):
    return getattr(config, "text_config", None) or config


def features(config) -> list[AttentionFeature]:
    """The features of ``config`` (its text config) that an implementation may drop."""
    text = text_config(config)
    return [f for f in FEATURES if f.present(text)]


def valid_implementations() -> list[str]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return [EAGER, *ALL_ATTENTION_FUNCTIONS.valid_keys()]


def choose(config, requested: str | None, device: str) -> str | None:
    """The ``attn_implementation`` to load ``config`` with on ``device`` ("cpu", "cuda",
    ...): ``requested`` when it computes every feature of the config, ``eager`` when
    nothing is requested and the config has a feature, else None (transformers'
    default, sdpa where the family supports it). Raises ValueError naming the feature a
    requested implementation would drop."""
    found = features(config)
    if requested is None:
        return EAGER if found else None
    valid = valid_implementations()
    if requested not in valid:
        raise ValueError(f"--attn-implementation {requested}: expected one of {', '.join(valid)}")
    on_cuda = device.startswith("cuda")
    for f in found:
        if requested not in f.honoured_by or (requested in f.cuda_only and not on_cuda):
            where = "" if requested not in f.honoured_by else f" on {device}"
            raise ValueError(
                f"--attn-implementation {requested}: does not compute the verifier's {f.name}"
                f"{where}, which vLLM computes; use {EAGER}"
            )
    return requested


def add_flag(parser) -> None:
    """``--attn-implementation`` of the CLIs that run the verifier with transformers."""
    parser.add_argument(
        "--attn-implementation",
        default=None,
        help="transformers attention implementation for the verifier (default: eager when "
        "its config has a feature sdpa drops, e.g. Gemma 2's attention soft-capping or "
        "gpt-oss's sinks; else transformers' default). One that drops a feature of the "
        "config is refused (docs/formats.md)",
    )


def loaded_implementation(model) -> str:
    """The implementation a loaded model runs (what extraction_config.json records)."""
    return str(text_config(model.config)._attn_implementation)
