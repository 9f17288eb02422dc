"""speculators 0.9.0's Python config object for a DSparkConfig (eager attention): how the
reference sees our drafter, for the parity tests and the benchmarks' reference runs.
Imports neither JAX nor Flax (bench/train_step.py's reference process measures its own
peak RSS); speculators is imported only when called."""

from __future__ import annotations

from dspark_jax.config import DSparkConfig


def reference_config(cfg: DSparkConfig, transformer_layer_config=None, verifier: str | None = None):
    """``transformer_layer_config``: the reference's own decoder config (e.g. from its
    ``create_transformer_layer_config``) instead of ours; ``verifier``: the verifier path
    the reference resolves its final-norm convention from (None: the plain one)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dspark import DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    if transformer_layer_config is None:
        tl = dict(cfg.transformer_layer_dict())
        tl.pop("model_type"), tl.pop("architectures")
        tl_config = Qwen3Config(**tl)
    else:
        tl_config = transformer_layer_config
    tl_config._attn_implementation = "eager"  # flex attention needs a GPU
    return DSparkSpeculatorConfig(
        transformer_layer_config=tl_config,
        draft_vocab_size=cfg.draft_vocab_size,
        block_size=cfg.block_size,
        aux_hidden_state_layer_ids=list(cfg.aux_hidden_state_layer_ids),
        mask_token_id=cfg.mask_token_id,
        sample_from_anchor=cfg.sample_from_anchor,
        sliding_window_non_causal=cfg.sliding_window_non_causal,
        markov_rank=cfg.markov_rank,
        markov_head_type=cfg.markov_head_type,
        enable_confidence_head=cfg.enable_confidence_head,
        confidence_head_with_markov=cfg.confidence_head_with_markov,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=cfg.speculative_tokens)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=[]),
        ),
    )
