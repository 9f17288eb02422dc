"""DSpark's Markov logit-bias head (vanilla, gated, rnn) and confidence head.

Every Markov variant's bias is ``W2 @ feature_k`` with a rank-r feature per slot
(vanilla: W1[prev]; gated: sigmoid(gate) * W1[prev]; rnn: tanh(o_k)). The head
returns that feature and exposes W2 as a [r, Vd] kernel, so the loss can add the
bias inside its vocabulary chunks instead of materialising [Q, Vd] here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import DSparkConfig
from dspark_jax.model.layers import linear, partitioned, torch_default_init


class MarkovHead(nnx.Module):
    def __init__(self, cfg: DSparkConfig, dtype, rngs: nnx.Rngs):
        r, h = cfg.markov_rank, cfg.hidden_size
        self.head_type = cfg.markov_head_type
        self.rank = r
        self.dtype = dtype
        # Init as the reference, which builds its heads after post_init: W1 ~ N(0, 0.01);
        # W2, gate_proj and joint_proj keep torch's Linear default U(+-1/sqrt(fan_in))
        # (weights and biases; kaiming-uniform with a=sqrt(5)).
        self.markov_w1 = nnx.Embed(
            cfg.vocab_size,
            r,
            dtype=dtype,
            param_dtype=jnp.float32,
            embedding_init=partitioned(nnx.initializers.normal(0.01), "vocab", "markov"),
            rngs=rngs,
        )
        self.markov_w2 = nnx.Linear(
            r,
            cfg.draft_vocab_size,
            use_bias=False,
            dtype=dtype,
            param_dtype=jnp.float32,
            kernel_init=partitioned(torch_default_init(r), "markov", "vocab"),
            rngs=rngs,
        )
        if self.head_type == "gated":
            self.gate_proj = linear(
                h + r, r, ("embed", "markov"), use_bias=True, dtype=dtype, rngs=rngs,
                torch_init=True,
            )  # fmt: skip
        elif self.head_type == "rnn":
            self.joint_proj = linear(
                2 * r + h, 3 * r, ("embed", "markov"), use_bias=True, dtype=dtype, rngs=rngs,
                torch_init=True,
            )  # fmt: skip

    def w2_kernel(self) -> jax.Array:
        """W2 as a [r, Vd] kernel in the compute dtype: bias = feature @ w2_kernel."""
        return self.markov_w2.kernel[...].astype(self.dtype)

    def prev_embeddings(self, prev_tokens: jax.Array) -> jax.Array:
        """W1 rows of the previous tokens: [A, B] -> [A, B, r]."""
        return self.markov_w1(prev_tokens)

    def features(self, prev_emb: jax.Array, hidden: jax.Array) -> jax.Array:
        """prev_emb [A, B, r], hidden [A, B, H] (the normed draft hidden) -> [A, B, r]."""
        if self.head_type == "vanilla":
            return prev_emb
        hidden = hidden.astype(prev_emb.dtype)
        if self.head_type == "gated":
            gate = jax.nn.sigmoid(self.gate_proj(jnp.concatenate([hidden, prev_emb], axis=-1)))
            return gate * prev_emb

        # rnn: the state runs left to right over the block's slots.
        def step(state, xs):
            emb_k, hid_k = xs  # [A, r], [A, H]
            return self.step(state, emb_k, hid_k)

        state0 = self.initial_state(prev_emb.shape[0], prev_emb.dtype)
        _, outs = jax.lax.scan(step, state0, (prev_emb.swapaxes(0, 1), hidden.swapaxes(0, 1)))
        return outs.swapaxes(0, 1)

    def initial_state(self, num_blocks: int, dtype) -> jax.Array:
        """The per-block state before slot 0: zeros [A, r] (only the rnn head uses it)."""
        return jnp.zeros((num_blocks, self.rank), dtype)

    def step(
        self, state: jax.Array, prev_emb: jax.Array, hidden: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """One slot of every block, for drafting left to right on the drafter's own tokens.

        state [A, r] (see :meth:`initial_state`), prev_emb [A, r] (W1 row of the token
        the slot conditions on), hidden [A, H] -> (new state, feature [A, r]). Running it
        over slots 0..B-1 gives :meth:`features` for every head type.
        """
        if self.head_type == "vanilla":
            return state, prev_emb
        hidden = hidden.astype(prev_emb.dtype)
        if self.head_type == "gated":
            gate = jax.nn.sigmoid(self.gate_proj(jnp.concatenate([hidden, prev_emb], axis=-1)))
            return state, gate * prev_emb
        z = self.joint_proj(jnp.concatenate([state, prev_emb, hidden], axis=-1))
        gate_raw, cand_raw, out_raw = jnp.split(z, 3, axis=-1)
        gate = jax.nn.sigmoid(gate_raw)
        state = gate * state + (1.0 - gate) * jnp.tanh(cand_raw)
        return state, jnp.tanh(out_raw)


class ConfidenceHead(nnx.Module):
    """Linear [H (+r)] -> 1: a logit of the slot's acceptance probability.

    Initialised as the reference's (built after ``post_init``): torch's Linear default,
    weight and bias U(+-1/sqrt(input_dim)), not the trunk's N(0, 0.02) and zero bias."""

    def __init__(self, input_dim: int, dtype, rngs: nnx.Rngs):
        self.proj = linear(
            input_dim, 1, ("embed", None), use_bias=True, dtype=dtype, rngs=rngs,
            torch_init=True,
        )  # fmt: skip

    def __call__(self, features: jax.Array) -> jax.Array:
        """[..., input_dim] -> [...] (fp32)."""
        return self.proj(features)[..., 0].astype(jnp.float32)
