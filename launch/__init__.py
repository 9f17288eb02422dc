"""PyTorch/vLLM side of dspark-jax: data preparation, hidden-state extraction,
the demo verifier, cluster launchers.

Everything here may import torch, transformers and vLLM; nothing here imports JAX.
Run the tools as modules from the repository root, e.g.
``python -m launch.prepare_data ...`` or ``python -m launch.extract_hidden_states ...``.
"""
