"""Tiny random HF verifiers of every supported family, built locally (no download), and
their hidden states as the extractor hooks them (layer id k = output of k layers, N
before the final norm)."""

from __future__ import annotations

import numpy as np
import torch

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    # large enough to matter: with activations O(1), 1e-6 would hide any bug in how the
    # epsilon enters a norm below fp32's round-off (test_forward's planted epsilon)
    rms_norm_eps=1e-2,
    tie_word_embeddings=False,
)

# DeepSeek-V3's and GLM-4.5's experts: a dense first layer, then 8 sigmoid-routed experts
# in 4 groups (top 2 experts of the 2 best groups), a shared one, routed_scaling_factor.
ROUTED = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    moe_intermediate_size=16,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)

# name -> (model_type, extra config). Windows of 4 keys and documents of 10-14 tokens make
# every sliding layer differ from a full one.
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "llama_bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama_linear": (
        "llama",
        dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    ),
    "llama_dynamic": (
        "llama",
        # max_position_embeddings 12 < the 14-token document: dynamic NTK kicks in for it only
        dict(
            max_position_embeddings=12,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        ),
    ),
    "llama_yarn": (
        "llama",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 10000.0,
            }
        ),
    ),
    "llama3": (
        "llama",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
                "rope_theta": 500000.0,
            }
        ),
    ),
    "llama_longrope": (
        "llama",
        dict(
            max_position_embeddings=48,
            rope_parameters={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.2, 1.5, 2.0],
                "long_factor": [1.5, 2.0, 3.0, 4.0],
                "original_max_position_embeddings": 12,
                "rope_theta": 10000.0,
            },
        ),
    ),
    "mistral": ("mistral", dict(sliding_window=4)),
    "qwen2": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    ),
    "qwen3": ("qwen3", dict()),
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "gemma2": (
        "gemma2",
        dict(
            sliding_window=4,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=30.0,
            hidden_activation="gelu_pytorch_tanh",
        ),
    ),
    "gemma3": (
        "gemma3_text",
        dict(
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=16,
            attn_logit_softcapping=None,  # transformers' Gemma 3 ignores it (config.py)
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
    # DeepSeek-V3 / Kimi-K2: MLA (q and kv latents, decoupled interleaved RoPE, yarn with
    # mscale), a dense first layer, then 8 sigmoid-routed experts in 4 groups (top 2
    # groups, top 2 experts), a shared expert, routed_scaling_factor
    "deepseek_v3": (
        "deepseek_v3",
        dict(
            num_key_value_heads=4,
            head_dim=4,
            q_lora_rank=16,
            kv_lora_rank=12,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
            **ROUTED,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "beta_fast": 32,
                "beta_slow": 1,
                "rope_theta": 10000.0,
            },
        ),
    ),
    # GLM-4.5/4.6: GQA with q/k biases and norms, half of each head rotated, then
    # DeepSeek's routing (8 experts in 4 groups, top 2 of 2 groups) and a shared expert
    "glm4_moe": (
        "glm4_moe",
        dict(
            **ROUTED,
            use_qk_norm=True,
            attention_bias=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        ),
    ),
    # Kimi-Linear: KDA, MLA without RoPE (no q latent), KDA; a dense first layer, then
    # DeepSeek's routing under Kimi's config names (8 experts in 4 groups, top 2 of 2)
    "kimi_linear": (
        "kimi_linear",
        dict(
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=12,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
            num_experts=8,
            num_experts_per_token=2,
            num_expert_group=4,
            topk_group=2,
            moe_intermediate_size=16,
            num_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            moe_renormalize=True,
            linear_attn_config=dict(
                head_dim=8,
                num_heads=4,
                short_conv_kernel_size=4,
                kda_layers=[1, 3],
                full_attn_layers=[2],
            ),
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # Qwen3-Next: Gated DeltaNet (2 key heads of 8 for 4 value heads of 6), gated attention
    # with a quarter of each head rotated, (1 + w) norms; a dense first layer, then 4
    # softmax-routed experts (top 2) and a gated shared expert
    "qwen3_next": (
        "qwen3_next",
        dict(
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=6,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=12,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            layer_types=["linear_attention", "full_attention", "linear_attention"],
        ),
    ),
    # gpt-oss: biased attention with a sink per head, sliding (4 keys) and full layers
    # alternating, yarn (not truncated); 4 biased experts (top 2) with the clamped SwiGLU,
    # its limit low enough that the clamps act on O(1) activations
    "gpt_oss": (
        "gpt_oss",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            swiglu_limit=0.5,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "rope_theta": 10000.0,
            },
        ),
    ),
    # Gemma 3 4B/12B/27B checkpoints: the multimodal wrapper (model_type gemma3, the text
    # model in text_config, its tensors under language_model.model.*) around the above
    "gemma3_multimodal": ("gemma3", dict()),
}
TINY_VISION = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    image_size=28, patch_size=14,
)  # fmt: skip


def build(name: str, folder, seed: int = 0, **shape):
    """Save a random model of family ``name`` (``shape`` overriding COMMON) to ``folder``;
    returns the torch model (fp32, eager attention, which applies soft-capping)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = FAMILIES[name]
    torch.manual_seed(seed)
    if model_type == "gemma3":  # the multimodal wrapper: Gemma 3's text model + a vision tower
        from transformers import Gemma3ForConditionalGeneration

        text_type, text = FAMILIES["gemma3"]
        cfg = AutoConfig.for_model(
            model_type, text_config={**COMMON, **text, **shape}, vision_config=TINY_VISION,
            mm_tokens_per_image=4,
        )  # fmt: skip
        assert cfg.text_config.model_type == text_type
        model = Gemma3ForConditionalGeneration._from_config(cfg, attn_implementation="eager")
        model = model.eval()
    else:
        cfg = AutoConfig.for_model(model_type, **{**COMMON, **extra, **shape})
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    gemma = model_type.startswith("gemma")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if p.ndim >= 2:  # O(1) activations through every layer
                p.copy_(r / p.shape[-1] ** 0.5 if "embed" not in pname else r)
            elif "norm" in pname:  # far from the init so a flipped norm style shows
                zero_centred = gemma or (model_type == "qwen3_next" and "linear_attn" not in pname)
                p.copy_((0.0 if zero_centred else 1.0) + 0.3 * r)
            else:
                p.copy_(0.3 * r)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # DeepSeek's routing bias
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
        for pname, p in model.named_parameters():
            if pname.endswith("A_log"):  # decay rates 0.02-0.2, so the linear state carries
                p.copy_(torch.empty(p.shape).uniform_(0.02, 0.2, generator=g).log())
    model.save_pretrained(folder)
    return model


@torch.no_grad()
def hf_hidden_states(model, input_ids, layer_ids) -> np.ndarray:
    """One document's forward -> [T, len(layer_ids), H] fp32, hooked like launch/hf_extract."""
    decoder = getattr(model.model, "language_model", model.model)  # a multimodal wrapper's text
    layers = decoder.layers
    store = {}
    handles = []
    for k in layer_ids:
        if k == 0:
            handles.append(
                layers[0].register_forward_pre_hook(
                    lambda _m, a, kw, k=k: store.__setitem__(k, a[0] if a else kw["hidden_states"]),
                    with_kwargs=True,
                )
            )
        else:
            handles.append(
                layers[k - 1].register_forward_hook(
                    lambda _m, _a, out, k=k: store.__setitem__(
                        k, out[0] if isinstance(out, (tuple, list)) else out
                    )
                )
            )
    try:
        decoder(input_ids=torch.as_tensor(input_ids)[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return torch.stack([store[k][0] for k in layer_ids], dim=1).float().numpy()
