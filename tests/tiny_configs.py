"""The tiny drafter config shared by the parity and converter tests."""

from __future__ import annotations

from dspark_jax.config import DSparkConfig

VT, H = 64, 32


def base_config(**kw) -> DSparkConfig:
    fields = dict(
        hidden_size=H,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=2,
        vocab_size=VT,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=6,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        block_size=4,
        mask_token_id=VT - 1,
        aux_hidden_state_layer_ids=(1, 3),
        markov_rank=8,
    )
    fields.update(kw)
    return DSparkConfig(**fields)
