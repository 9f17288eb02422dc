#  Copyright 2023 Google LLC
#
#  Licensed under the Apache License, Version 2.0 (the "License");
#  you may not use this file except in compliance with the License.
#  You may obtain a copy of the License at
#
#       https://www.apache.org/licenses/LICENSE-2.0
#
#  Unless required by applicable law or agreed to in writing, software
#  distributed under the License is distributed on an "AS IS" BASIS,
#  WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
#  See the License for the specific language governing permissions and
#  limitations under the License.

"""Embedding Layers."""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes
from flax.typing import PromoteDtypeFn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sgl_jax.srt.utils.profiling_utils import named_scope


class Embed(nnx.Module):
    """A parameterized function from integers [0, n) to d-dimensional vectors.

    Attributes:
      num_embeddings: number of embeddings.
      features: number of feature dimensions for each embedding.
      dtype: the dtype of the embedding vectors (default: float32).
      param_dtype: the dtype of the embedding parameters.
      promote_dtype: the dtype promotion function.
      kernel_axes: the axes of kernel weights.
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        dtype: jnp.dtype | None = None,
        param_dtype: jnp.dtype = jnp.bfloat16,
        promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
        kernel_axes: tuple[str | None, ...] = (None, "tensor"),
        mesh: jax.sharding.Mesh | None = None,
    ):
        """
        Sets up the embedding parameters for the model.

        This method initializes the embedding parameters with logical partitioning.
        The embedding is represented as a parameter with the specified shape and data type.

        Args:
            num_embeddings: Number of embeddings in the vocabulary.
            features: Number of feature dimensions for each embedding.
            dtype: Data type for computations (forward pass, attend operations).
                   If None, uses the same dtype as the embedding parameter.
            param_dtype: Data type for storing the embedding parameters in memory.
                        Controls memory usage and precision of stored weights.
            promote_dtype: Function to handle dtype promotion during mixed-precision
                          computations between query/embedding tensors.
        """
        out_sharding = NamedSharding(mesh, P(*kernel_axes)) if mesh is not None else None
        self.embedding = nnx.Param(
            jax.random.normal(
                jax.random.PRNGKey(0),
                (num_embeddings, features),
                dtype=param_dtype,
                out_sharding=out_sharding,
            ),
        )
        self.kernel_axes = kernel_axes
        self.num_embeddings = num_embeddings
        self.features = features
        self.dtype = dtype or self.embedding.value.dtype
        self.promote_dtype = promote_dtype
        self.mesh = mesh

    @named_scope
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Embeds the inputs along the last dimension.

        Args:
          inputs: input data, all dimensions are considered batch dimensions.

        Returns:
          Output which is embedded input data.  The output shape follows the input,
          with an additional `features` dimension appended.
        """
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError("Input type must be an integer or unsigned integer.")
        # Use take because fancy indexing numpy arrays with JAX indices does not
        # work correctly.
        (embedding,) = self.promote_dtype((self.embedding.value,), dtype=self.dtype, inexact=False)
        if self.num_embeddings == 1:
            return jnp.broadcast_to(embedding, inputs.shape + (self.features,))

        output_pspec = P("data", *([None] * (inputs.ndim - 1)), self.kernel_axes[-1])
        output_sharding = NamedSharding(self.mesh, output_pspec)
        output = embedding.at[inputs].get(out_sharding=output_sharding)
        return output

    def attend(self, query: jax.Array) -> jax.Array:
        """Attend over the embedding using a query array.

        Args:
          query: array with last dimension equal the feature depth `features` of the
            embedding.

        Returns:
          An array with final dim `num_embeddings` corresponding to the batched
          inner-product of the array of query vectors against each embedding.
          Commonly used for weight-sharing between embeddings and logit transform
          in NLP models.
        """
        query, embedding = self.promote_dtype((query, self.embedding.value), dtype=self.dtype)
        return jnp.dot(query, embedding.T)


class ParallelLMHead(Embed):
    """Language model head layer for vocabulary prediction.

    Inherits from Embed to enable weight tying with input embeddings.
    Note: This layer's __call__ method is disabled - weights should be used
    directly in the sampling/prediction phase.
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        dtype: jnp.dtype | None = None,
        param_dtype: jnp.dtype = jnp.bfloat16,
        promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
        kernel_axes: tuple[str | None, ...] = ("tensor", None),
        mesh: jax.sharding.Mesh | None = None,
        use_bias: bool = False,
    ):
        """
        Initialize the language model head.

        Args:
            num_embeddings: Size of vocabulary.
            features: Hidden dimension size.
            dtype: Data type for computations. If None, uses param_dtype.
                   Enables mixed precision when different from param_dtype.
            param_dtype: Data type for parameter storage (weights and bias).
            promote_dtype: Function to handle dtype promotion during logits computation.
                          Controls how hidden_states and embedding tensors are promoted.
            use_bias: Whether to include bias parameters. Note: bias is currently
                     not used in logits computation, reserved for future extension.
        """
        super().__init__(
            num_embeddings=num_embeddings,
            features=features,
            dtype=dtype,
            param_dtype=param_dtype,
            promote_dtype=promote_dtype,
            kernel_axes=kernel_axes,
            mesh=mesh,
        )
        if use_bias:
            bias_sharding = NamedSharding(mesh, P(None, "tensor")) if mesh is not None else None
            self.bias = nnx.Param(
                jax.random.normal(
                    jax.random.PRNGKey(0),
                    (self.num_embeddings, self.features),
                    dtype=param_dtype,
                    out_sharding=bias_sharding,
                ),
            )
        else:
            self.bias = None

    def tie_weights(self, embed_tokens: Embed):
        """Tie the weights with word embeddings."""
        self.embedding = embed_tokens.embedding
        return self

    def __call__(self, input_):
        del input_
        raise RuntimeError("LMHead's weights should be used in the sampler.")


class RotaryEmbedding:
    """Rotary Position Embedding (safe to initialize inside JIT if needed)."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: int,
        is_neox_style: bool,
        dtype: jnp.dtype,
        mesh: jax.sharding.Mesh | None = None,
    ):
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        self.dtype = dtype

        inv_freq_np = 1.0 / (base ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim))
        self._inv_freq_np = inv_freq_np  # shape: (rotary_dim // 2,)

    @named_scope
    def __call__(
        self,
        positions: jax.Array,
        query: jax.Array,
        key: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        positions = positions.flatten()  # [num_tokens]

        cos, sin = self._compute_cos_sin(positions)
        cos = cos.astype(self.dtype)
        sin = sin.astype(self.dtype)

        query_shape = query.shape
        num_tokens = positions.shape[0]
        query = query.reshape(num_tokens, -1, self.head_size)
        query_rot = query[..., : self.rotary_dim]
        query_rot = apply_rotary_emb(query_rot, cos, sin, self.is_neox_style)
        if self.rotary_dim < self.head_size:
            query_pass = query[..., self.rotary_dim :]
            query = jnp.concatenate((query_rot, query_pass), axis=-1).reshape(query_shape)
        else:
            query = query_rot.reshape(query_shape)

        key_shape = key.shape
        key = key.reshape(num_tokens, -1, self.head_size)
        key_rot = key[..., : self.rotary_dim]
        key_rot = apply_rotary_emb(key_rot, cos, sin, self.is_neox_style)
        if self.rotary_dim < self.head_size:
            key_pass = key[..., self.rotary_dim :]
            key = jnp.concatenate((key_rot, key_pass), axis=-1).reshape(key_shape)
        else:
            key = key_rot.reshape(key_shape)

        return query, key

    def _compute_cos_sin(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Compute RoPE phases in float32 before casting to the model dtype."""
        inv_freq = jnp.asarray(self._inv_freq_np, dtype=jnp.float32)
        freqs = positions.astype(jnp.float32)[..., None] * inv_freq
        return jnp.cos(freqs), jnp.sin(freqs)

    def _compute_inv_freq(self, base: int | float) -> jax.Array:
        """Compute the inverse frequency."""
        inv_freq = 1.0 / (
            base ** (jnp.arange(0, self.rotary_dim, 2, dtype=jnp.float32) / self.rotary_dim)
        )
        return inv_freq

    def _compute_cos_sin_cache(self) -> jax.Array:
        """Compute the cos and sin cache."""
        inv_freq = self._compute_inv_freq(self.base)
        t = jnp.arange(self.max_position_embeddings, dtype=jnp.float32)
        freqs = jnp.outer(t, inv_freq)
        sin, cos = jnp.sin(freqs), jnp.cos(freqs)
        cache = jnp.concatenate((cos, sin), axis=-1)
        return cache


def apply_interleaved_rope(x: jax.Array, mrope_section: list[int]) -> jax.Array:
    """Apply interleaved MRoPE to 3D rotary embeddings in JAX.
    Reorganizes frequency layout from chunked [TTT...HHH...WWW] to
    interleaved [THTHWHTHW...TT].
    Args:
        x: Input tensor of shape [3, num_tokens, dim].
           x[0] is Time freqs, x[1] is Height freqs, x[2] is Width freqs.
        mrope_section: [t, h, w] section lengths.
           e.g. [16, 24, 24] -> total 64.
    Returns:
        A single tensor of shape [num_tokens, dim] with interleaved frequencies.
    """
    # x shape: [3, num_tokens, dim]
    # mrope_section example: [16, 24, 24] (sum=64)

    # Initialize with Time frequencies (x[0])
    # We will overwrite specific indices with Height and Width frequencies
    x_t = x[0]  # [num_tokens, dim]

    # Height indices: start at 1, end at h*3, step 3
    # Corresponds to x[..., 1::3] in the target layout
    # We take values from x[1] (Height) at the same slice
    h_slice = slice(1, mrope_section[1] * 3, 3)
    x_t = x_t.at[..., h_slice].set(x[1, ..., h_slice])

    # Width indices: start at 2, end at w*3, step 3
    # Corresponds to x[..., 2::3] in the target layout
    # We take values from x[2] (Width) at the same slice
    w_slice = slice(2, mrope_section[2] * 3, 3)
    x_t = x_t.at[..., w_slice].set(x[2, ..., w_slice])

    return x_t


class MRotaryEmbedding(RotaryEmbedding):
    """Rotary Embedding with Multimodal Sections for JAX."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: int,
        is_neox_style: bool,
        dtype: jnp.dtype,
        mrope_section: list[int] | None = None,
        mrope_interleaved: bool = False,
    ) -> None:
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)
        self.mrope_section = mrope_section
        self.mrope_interleaved = mrope_interleaved

        # Validation and Auto-correction Logic adapted from PyTorch implementation
        if self.mrope_section:
            expected_sum = rotary_dim // 2
            actual_sum = sum(self.mrope_section)
            if actual_sum != expected_sum:
                print(
                    f"MRoPE section sum mismatch: expected {expected_sum}, got {actual_sum}. "
                    f"Adjusting mrope_section to match rotary_dim // 2 = {expected_sum}"
                )
                # Auto-correct by scaling the mrope_section proportionally
                if actual_sum > 0:
                    scale_factor = expected_sum / actual_sum
                    self.mrope_section = [
                        max(1, int(section * scale_factor)) for section in self.mrope_section
                    ]
                    # Ensure the sum exactly matches by adjusting the last element
                    current_sum = sum(self.mrope_section)
                    if current_sum != expected_sum:
                        self.mrope_section[-1] += expected_sum - current_sum
                else:
                    # Fallback for zero sum
                    self.mrope_section = [expected_sum // len(self.mrope_section)] * len(
                        self.mrope_section
                    )
                    # Handle remainder
                    remainder = expected_sum % len(self.mrope_section)
                    for i in range(remainder):
                        self.mrope_section[i] += 1

            # Pre-calculate split indices for jnp.split
            # mrope_section is like [16, 24, 24], split indices should be [16, 40]
            self.split_indices = np.cumsum(self.mrope_section)[:-1].tolist()

    def __call__(
        self,
        positions: jax.Array,
        query: jax.Array,
        key: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        """
        Args:
            positions: [num_tokens] (Text only) or
                       [3, num_tokens] (Multimodal T/H/W positions)
            query: [num_tokens, num_heads * head_size]
            key: [num_tokens, num_kv_heads * head_size]
        """
        # Handle Multimodal 3D Positions
        # If positions is 1D ([num_tokens]) or single-row ([1, num_tokens]),
        # expand it to shape [3, num_tokens] by duplicating the row so that
        # downstream multimodal MRoPE logic has three channels (T/H/W).
        if positions.ndim == 1:
            positions = jnp.tile(positions[None, :], (3, 1))  # [3, num_tokens]
        elif positions.ndim == 2 and positions.shape[0] == 1:
            positions = jnp.tile(positions, (3, 1))

        if positions.ndim == 2 and positions.shape[0] == 3:
            return self._forward_mrope(positions, query, key)

        # Fallback to standard RoPE for 1D positions
        return super().__call__(positions, query, key)

    def _forward_mrope(
        self,
        positions: jax.Array,
        query: jax.Array,
        key: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        # positions: [3, num_tokens]
        num_tokens = positions.shape[-1]

        # Compute all three axes in float32, then cast the resulting
        # trigonometric values to the model dtype.
        cos_all, sin_all = self._compute_cos_sin(positions)
        cos_all = cos_all.astype(self.dtype)
        sin_all = sin_all.astype(self.dtype)

        if self.mrope_interleaved:
            # --- Interleaved Mode ---
            # Direct manipulation on the [3, N, D] tensor
            cos = apply_interleaved_rope(cos_all, self.mrope_section)
            sin = apply_interleaved_rope(sin_all, self.mrope_section)
        else:
            # --- Chunked Mode (Existing Logic) ---
            # 2. Split and Select based on mrope_section
            cos_splits = jnp.split(cos_all, self.split_indices, axis=-1)
            sin_splits = jnp.split(sin_all, self.split_indices, axis=-1)

            # Select specific rows for specific sections
            # section 0 uses row 0 (Time), section 1 uses row 1 (Height), section 2 uses row 2 (Width)
            final_cos_list = []
            final_sin_list = []

            for i, split_tensor in enumerate(cos_splits):
                # split_tensor shape: [3, num_tokens, section_dim]
                # We take the i-th row: [num_tokens, section_dim]
                final_cos_list.append(split_tensor[i])

            for i, split_tensor in enumerate(sin_splits):
                final_sin_list.append(split_tensor[i])

            # Concatenate back: [num_tokens, rotary_dim // 2]
            cos = jnp.concatenate(final_cos_list, axis=-1)
            sin = jnp.concatenate(final_sin_list, axis=-1)

        # 3. Apply RoPE
        # Reshape query/key to [num_tokens, num_heads, head_size]
        query_real = query[:num_tokens]
        query_shape = query_real.shape
        query_real = query_real.reshape(num_tokens, -1, self.head_size)
        query_rot = query_real[..., : self.rotary_dim]
        query_pass = query_real[..., self.rotary_dim :]

        query_rot = apply_rotary_emb(query_rot, cos, sin, self.is_neox_style)
        query_real = jnp.concatenate((query_rot, query_pass), axis=-1).reshape(query_shape)
        query = query.at[:num_tokens].set(query_real)

        key_real = key[:num_tokens]
        key_shape = key_real.shape
        key_real = key_real.reshape(num_tokens, -1, self.head_size)
        key_rot = key_real[..., : self.rotary_dim]
        key_pass = key_real[..., self.rotary_dim :]

        key_rot = apply_rotary_emb(key_rot, cos, sin, self.is_neox_style)
        key_real = jnp.concatenate((key_rot, key_pass), axis=-1).reshape(key_shape)
        key = key.at[:num_tokens].set(key_real)

        return query, key


class ProportionalRotaryEmbedding(RotaryEmbedding):
    """Proportional RoPE (Gemma4 full-attention layers).

    Unlike standard partial-rotary which scales inv_freq by ``rotary_dim``,
    proportional keeps the inv_freq denominator as the full ``head_size`` and
    zero-pads the tail so the unrotated dims see cos=1/sin=0.
    Matches HF ``_compute_proportional_rope_parameters``.
    """

    def __init__(
        self,
        head_size: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: jnp.dtype,
        partial_rotary_factor: float = 1.0,
        factor: float = 1.0,
    ):
        super().__init__(
            head_size=head_size,
            rotary_dim=head_size,
            max_position_embeddings=max_position_embeddings,
            base=base,
            is_neox_style=is_neox_style,
            dtype=dtype,
        )
        rope_angles = int(partial_rotary_factor * head_size // 2)
        nope_angles = head_size // 2 - rope_angles
        inv_freq_rotated = 1.0 / (
            base ** (np.arange(0, 2 * rope_angles, 2, dtype=np.float32) / head_size)
        )
        if nope_angles > 0:
            inv_freq = np.concatenate([inv_freq_rotated, np.zeros(nope_angles, dtype=np.float32)])
        else:
            inv_freq = inv_freq_rotated
        self._inv_freq_np = inv_freq / factor


class Llama3RotaryEmbedding(RotaryEmbedding):
    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: int,
        is_neox_style: bool,
        dtype: jnp.dtype,
        scaling_factor: float,
        low_freq_factor: float,
        high_freq_factor: float,
        orig_max_position: int,
    ) -> None:
        self.scaling_factor = scaling_factor
        self.low_freq_factor = low_freq_factor
        self.high_freq_factor = high_freq_factor
        self.orig_max_position = orig_max_position
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_inv_freq(self, base: int | float) -> jax.Array:
        inv_freqs = super()._compute_inv_freq(base)
        low_freq_wavelen = self.orig_max_position / self.low_freq_factor
        high_freq_wavelen = self.orig_max_position / self.high_freq_factor

        wave_len = 2 * math.pi / inv_freqs
        if self.low_freq_factor != self.high_freq_factor:
            smooth = (self.orig_max_position / wave_len - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
        else:
            smooth = 0
        new_freqs = jnp.where(
            wave_len < high_freq_wavelen,
            inv_freqs,
            jnp.where(
                wave_len > low_freq_wavelen,
                inv_freqs / self.scaling_factor,
                (1 - smooth) * inv_freqs / self.scaling_factor + smooth * inv_freqs,
            ),
        )
        return new_freqs


# @partial(jax.jit, static_argnames=["rotary_dim", "head_size", "is_neox_style"])
def rotary_embedding_forward(
    positions: jax.Array,
    query: jax.Array,
    key: jax.Array,
    cos_sin_cache: jax.Array,
    rotary_dim: int,
    head_size: int,
    is_neox_style: bool,
) -> tuple[jax.Array, jax.Array]:
    """Rotary Position Embedding."""
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    cos_sin = cos_sin_cache.take(positions, axis=0)
    cos, sin = jnp.split(cos_sin, 2, axis=-1)

    query_shape = query.shape
    query = query.reshape(num_tokens, -1, head_size)
    query_rot = query[..., :rotary_dim]
    query_pass = query[..., rotary_dim:]
    query_rot = apply_rotary_emb(query_rot, cos, sin, is_neox_style)
    query = jnp.concatenate((query_rot, query_pass), axis=-1).reshape(query_shape)

    key_shape = key.shape
    key = key.reshape(num_tokens, -1, head_size)
    key_rot = key[..., :rotary_dim]
    key_pass = key[..., rotary_dim:]
    key_rot = apply_rotary_emb(key_rot, cos, sin, is_neox_style)
    key = jnp.concatenate((key_rot, key_pass), axis=-1).reshape(key_shape)
    return query, key


# @partial(jax.jit, static_argnames=["is_neox_style"])
def apply_rotary_emb(
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    is_neox_style: bool,
) -> jax.Array:
    """
    Args:
        x: [num_tokens, num_heads, head_size]
        cos: [num_tokens, head_size // 2]
        sin: [num_tokens, head_size // 2]
        is_neox_style: Whether to use the Neox-style or GPT-J-style rotary
            positional embeddings.
    """
    cos = jnp.expand_dims(cos, axis=-2).astype(x.dtype)
    sin = jnp.expand_dims(sin, axis=-2).astype(x.dtype)
    if is_neox_style:
        x1, x2 = jnp.split(x, 2, axis=-1)
    else:
        x1 = x[..., ::2]
        x2 = x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return jnp.concatenate((o1, o2), axis=-1)
    else:
        stacked = jnp.stack((o1, o2), axis=-1)
        return stacked.reshape(*stacked.shape[:-2], -1)


_ROPE_DICT: dict[tuple, RotaryEmbedding] = {}


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: int,
    is_neox_style: bool = True,
    rope_scaling: dict[str, Any] | None = None,
    dtype: jnp.dtype | None = jnp.bfloat16,
    partial_rotary_factor: float = 1.0,
    dual_chunk_attention_config: dict[str, Any] | None = None,
) -> RotaryEmbedding:
    if rope_scaling is not None:
        # Transforms every value that is a list into a tuple for caching calls
        rope_scaling_tuple = {
            k: tuple(v) if isinstance(v, list) else v for k, v in rope_scaling.items()
        }
        rope_scaling_args = tuple(rope_scaling_tuple.items())
    else:
        rope_scaling_args = None

    if dual_chunk_attention_config is not None:
        dual_chunk_attention_tuple = {
            k: tuple(v) if isinstance(v, list) else v
            for k, v in dual_chunk_attention_config.items()
            if k != "sparse_attention_config"
        }
        dual_chunk_attention_args = tuple(dual_chunk_attention_tuple.items())
    else:
        dual_chunk_attention_args = None

    if partial_rotary_factor < 1.0:
        rotary_dim = int(rotary_dim * partial_rotary_factor)
    key = (
        head_size,
        rotary_dim,
        max_position,
        base,
        is_neox_style,
        rope_scaling_args,
        dual_chunk_attention_args,
        dtype,
    )
    if key in _ROPE_DICT:
        return _ROPE_DICT[key]

    if rope_scaling is None:
        rotary_emb = RotaryEmbedding(
            head_size, rotary_dim, max_position, base, is_neox_style, dtype
        )
    else:
        if "rope_type" in rope_scaling:
            scaling_type = rope_scaling["rope_type"]
        elif "type" in rope_scaling:
            scaling_type = rope_scaling["type"]
        else:
            raise ValueError("Unknown RoPE scaling type")

        if scaling_type == "default":
            # HF transformers uses rope_type="default" to mean "no scaling",
            # equivalent to rope_scaling=None.  Fall back to plain RotaryEmbedding.
            rotary_emb = RotaryEmbedding(
                head_size, rotary_dim, max_position, base, is_neox_style, dtype
            )
        elif scaling_type == "proportional":
            rotary_emb = ProportionalRotaryEmbedding(
                head_size,
                max_position,
                base,
                is_neox_style,
                dtype,
                partial_rotary_factor=rope_scaling.get(
                    "partial_rotary_factor", partial_rotary_factor
                ),
                factor=rope_scaling.get("factor", 1.0),
            )
        elif scaling_type == "llama3":
            scaling_factor = rope_scaling["factor"]
            low_freq_factor = rope_scaling["low_freq_factor"]
            high_freq_factor = rope_scaling["high_freq_factor"]
            original_max_position = rope_scaling["original_max_position_embeddings"]
            rotary_emb = Llama3RotaryEmbedding(
                head_size,
                rotary_dim,
                max_position,
                base,
                is_neox_style,
                dtype,
                scaling_factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            )
        elif scaling_type == "yarn":
            scaling_factor = rope_scaling["factor"]
            original_max_position = rope_scaling.get(
                "original_max_position_embeddings", max_position
            )
            beta_fast = rope_scaling.get("beta_fast", 32.0)
            beta_slow = rope_scaling.get("beta_slow", 1.0)
            mscale = rope_scaling.get("mscale", 1.0)
            mscale_all_dim = rope_scaling.get("mscale_all_dim", 0.0)
            rotary_emb = YarnRotaryEmbedding(
                head_size,
                rotary_dim,
                max_position,
                base,
                is_neox_style,
                dtype,
                scaling_factor,
                original_max_position,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
            )
        else:
            raise ValueError(f"Unknown RoPE scaling type {scaling_type}")
    _ROPE_DICT[key] = rotary_emb
    return rotary_emb


def _grok_yarn_get_mscale(scaling_factor: float) -> float:
    """YaRN mscale variant used by Grok (sqrt form)."""
    if scaling_factor <= 1:
        return 1.0
    return math.sqrt(scaling_factor)


# Inverse dim formula to find dim based on number of rotations
def _yarn_find_correction_dim(
    num_rotations: int,
    dim: int,
    base: float = 10000,
    max_position_embeddings: int = 2048,
) -> float:
    return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (
        2 * math.log(base)
    )


def _yarn_find_correction_range(
    low_rot: int,
    high_rot: int,
    dim: int,
    base: int,
    max_position_embeddings: int,
) -> tuple[float, float]:
    low = math.floor(_yarn_find_correction_dim(low_rot, dim, base, max_position_embeddings))
    high = math.ceil(_yarn_find_correction_dim(high_rot, dim, base, max_position_embeddings))
    return max(low, 0), min(high, dim - 1)  # Clamp values just in case


def _deepseek_yarn_get_mscale(scale: float, mscale: float) -> float:
    """Compute mscale factor for DeepSeek-style YaRN (parameterized by mscale coefficient)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


class YarnRotaryEmbedding(RotaryEmbedding):
    """YaRN (Yet another RoPE extensioN) rotary embeddings.

    Blends original and scaled inverse frequencies using a correction range
    derived from beta_fast/beta_slow, and optionally applies an mscale factor
    to cos/sin values (used by DeepSeek V2/V3).
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: int,
        is_neox_style: bool,
        dtype: jnp.dtype,
        scaling_factor: float,
        original_max_position_embeddings: int,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        mscale: float = 1.0,
        mscale_all_dim: float = 0.0,
    ):
        self.scaling_factor = scaling_factor
        self.original_max_position_embeddings = original_max_position_embeddings
        self.beta_fast = beta_fast
        self.beta_slow = beta_slow
        self.yarn_mscale = mscale
        self.yarn_mscale_all_dim = mscale_all_dim

        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

        # Replace inv_freq with YaRN blended version
        self._inv_freq_np = self._compute_yarn_inv_freq()

        # Precompute cos/sin magnitude scaling factor
        m_num = _deepseek_yarn_get_mscale(self.scaling_factor, self.yarn_mscale)
        m_den = _deepseek_yarn_get_mscale(self.scaling_factor, self.yarn_mscale_all_dim)
        self._rope_mscale = m_num / m_den if m_den != 0 else m_num

    def _compute_yarn_inv_freq(self) -> np.ndarray:
        dim = self.rotary_dim
        base = self.base

        freq_extra = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        freq_inter = freq_extra / self.scaling_factor

        low, high = _yarn_find_correction_range(
            self.beta_fast,
            self.beta_slow,
            dim,
            base,
            self.original_max_position_embeddings,
        )
        # Linear ramp mask: 1 in the extrapolation region, 0 in the interpolation region
        max_val = max(high - low, 0.001)
        inv_freq_mask = 1.0 - np.clip((np.arange(dim // 2, dtype=np.float32) - low) / max_val, 0, 1)
        return freq_inter * (1 - inv_freq_mask) + freq_extra * inv_freq_mask

    @named_scope
    def __call__(
        self,
        positions: jax.Array,
        query: jax.Array,
        key: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        positions = positions.flatten()

        cos, sin = self._compute_cos_sin(positions)
        cos = (cos * self._rope_mscale).astype(self.dtype)
        sin = (sin * self._rope_mscale).astype(self.dtype)

        query_shape = query.shape
        num_tokens = positions.shape[0]
        query = query.reshape(num_tokens, -1, self.head_size)
        query_rot = query[..., : self.rotary_dim]
        query_rot = apply_rotary_emb(query_rot, cos, sin, self.is_neox_style)
        if self.rotary_dim < self.head_size:
            query_pass = query[..., self.rotary_dim :]
            query = jnp.concatenate((query_rot, query_pass), axis=-1).reshape(query_shape)
        else:
            query = query_rot.reshape(query_shape)

        key_shape = key.shape
        key = key.reshape(num_tokens, -1, self.head_size)
        key_rot = key[..., : self.rotary_dim]
        key_rot = apply_rotary_emb(key_rot, cos, sin, self.is_neox_style)
        if self.rotary_dim < self.head_size:
            key_pass = key[..., self.rotary_dim :]
            key = jnp.concatenate((key_rot, key_pass), axis=-1).reshape(key_shape)
        else:
            key = key_rot.reshape(key_shape)

        return query, key
