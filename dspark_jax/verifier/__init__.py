"""The frozen verifier's forward in JAX, for hidden states computed inside the training step
(``--hidden-states-backend jax``; docs/design.md, "In-step verifier")."""

from dspark_jax.verifier.config import (
    SUPPORTED,
    UnsupportedVerifierError,
    VerifierConfig,
    load_verifier_config,
    verifier_config,
)
from dspark_jax.verifier.forward import batch_hidden_states, hidden_states
from dspark_jax.verifier.weights import VerifierCheckpointError, load_params, param_specs

__all__ = [
    "SUPPORTED",
    "UnsupportedVerifierError",
    "VerifierCheckpointError",
    "VerifierConfig",
    "batch_hidden_states",
    "hidden_states",
    "load_params",
    "load_verifier_config",
    "param_specs",
    "verifier_config",
]
