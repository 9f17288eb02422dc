import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.nn as nn
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import register_pytree_node_class

from sgl_jax.srt.layers.embeddings import Embed
from sgl_jax.srt.utils.jax_utils import device_array
from sgl_jax.srt.utils.profiling_utils import named_scope

if TYPE_CHECKING:
    from sgl_jax.srt.managers.schedule_batch import ModelWorkerBatch
    from sgl_jax.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardMode,
    )


@register_pytree_node_class
@dataclasses.dataclass
class LogitsProcessorOutput:
    ## Part 1: This part will be assigned in python/sglang/srt/layers/logits_processor.py::LogitsProcessor
    # The logits of the next tokens.       shape: [#seq, vocab_size]
    next_token_logits: jax.Array
    # Used by speculative decoding (EAGLE)
    # The last hidden layers
    hidden_states: jax.Array | None = None

    ## Part 2: This part will be assigned in python/sglang/srt/layers/sampler.py::Sampler
    # The logprobs of the next tokens.                              shape: [#seq]
    next_token_logprobs: jax.Array | None = None
    # The logprobs and ids of the top-k tokens in output positions. shape: [#seq, k]
    next_token_top_logprobs_val: jax.Array | None = None
    next_token_top_logprobs_idx: jax.Array = None
    # The logprobs and ids of the requested token ids in output positions. shape: [#seq, n] (n is the number of requested token ids)
    next_token_token_ids_logprobs_val: jax.Array | None = None
    next_token_token_ids_logprobs_idx: jax.Array | None = None

    ## Part 3: Prefill-only. This part will be assigned in python/sglang/srt/layers/logits_processor.py::LogitsProcessor
    # The logprobs of input tokens.        shape: [#token]
    input_token_logprobs: jax.Array | None = None
    # The logprobs and ids of the top-k tokens in input positions.  shape: [#seq, #token, k]
    input_top_logprobs_val: jax.Array | None = None
    input_top_logprobs_idx: jax.Array | None = None
    # The logprobs and ids of the requested token ids in input positions. shape: [#seq, n] (n is the number of requested token ids)
    input_token_ids_logprobs_val: jax.Array | None = None
    input_token_ids_logprobs_idx: jax.Array | None = None

    def tree_flatten(self):
        children = (
            self.next_token_logits,
            self.hidden_states,
            self.next_token_logprobs,
            self.input_token_logprobs,
            self.next_token_top_logprobs_val,
            self.next_token_top_logprobs_idx,
            self.next_token_token_ids_logprobs_val,
            self.next_token_token_ids_logprobs_idx,
            self.input_top_logprobs_val,
            self.input_top_logprobs_idx,
            self.input_token_ids_logprobs_val,
            self.input_token_ids_logprobs_idx,
        )

        aux_data = {}
        return (children, aux_data)

    @classmethod
    def tree_unflatten(cls, aux_data, children):
        obj = cls.__new__(cls)

        obj.next_token_logits = children[0]
        obj.hidden_states = children[1]
        obj.next_token_logprobs = children[2]
        obj.input_token_logprobs = children[3]

        obj.next_token_top_logprobs_val = children[4]
        obj.next_token_top_logprobs_idx = children[5]
        obj.next_token_token_ids_logprobs_val = children[6]
        obj.next_token_token_ids_logprobs_idx = children[7]
        obj.input_top_logprobs_val = children[8]
        obj.input_top_logprobs_idx = children[9]
        obj.input_token_ids_logprobs_val = children[10]
        obj.input_token_ids_logprobs_idx = children[11]

        return obj


@register_pytree_node_class
@dataclasses.dataclass
class LogitsMetadata:
    forward_mode: "ForwardMode"
    capture_hidden_mode: "CaptureHiddenMode" = None

    extend_return_logprob: bool = False
    extend_return_top_logprob: bool = False
    extend_token_ids_logprob: bool = False
    extend_seq_lens: jax.Array | None = None
    accept_lens: jax.Array | None = None
    logits_indices: jax.Array | None = None
    extend_seq_lens_cpu: list[int] | None = None
    extend_logprob_start_lens_cpu: list[int] | None = None
    extend_logprob_pruned_lens_cpu: list[int] | None = None
    top_logprobs_nums: list[int] | None = None
    extend_input_logprob_token_ids_device: jax.Array | None = None
    input_logprob_indices_device: jax.Array | None = None
    token_ids_logprobs: list[list[int]] | None = None

    # logits and logprobs post processing
    temp_scaled_logprobs: bool = False
    temperature: jax.Array = None
    top_p_normalized_logprobs: bool = False
    top_p: jax.Array = None

    def tree_flatten(self):
        children = (
            self.extend_seq_lens,
            self.accept_lens,
            self.logits_indices,
            self.extend_input_logprob_token_ids_device,
            self.input_logprob_indices_device,
            self.temperature,
            self.top_p,
        )
        has_padded_input_logprob_indices = self.input_logprob_indices_device is not None

        aux_data = {
            "forward_mode": self.forward_mode,
            "capture_hidden_mode": self.capture_hidden_mode,
            "extend_return_logprob": self.extend_return_logprob,
            "extend_return_top_logprob": self.extend_return_top_logprob,
            "extend_token_ids_logprob": self.extend_token_ids_logprob,
            "extend_seq_lens_cpu": (
                None if has_padded_input_logprob_indices else self.extend_seq_lens_cpu
            ),
            "extend_logprob_start_lens_cpu": (
                None if has_padded_input_logprob_indices else self.extend_logprob_start_lens_cpu
            ),
            "extend_logprob_pruned_lens_cpu": (
                None if has_padded_input_logprob_indices else self.extend_logprob_pruned_lens_cpu
            ),
            "top_logprobs_nums": self.top_logprobs_nums,
            "token_ids_logprobs": self.token_ids_logprobs,
            "temp_scaled_logprobs": self.temp_scaled_logprobs,
            "top_p_normalized_logprobs": self.top_p_normalized_logprobs,
        }

        return (children, aux_data)

    @classmethod
    def tree_unflatten(cls, aux_data, children):
        obj = cls.__new__(cls)

        obj.extend_seq_lens = children[0]
        obj.accept_lens = children[1]
        obj.logits_indices = children[2]
        obj.extend_input_logprob_token_ids_device = children[3]
        obj.input_logprob_indices_device = children[4]
        obj.temperature = children[5]
        obj.top_p = children[6]

        obj.forward_mode = aux_data["forward_mode"]
        obj.capture_hidden_mode = aux_data["capture_hidden_mode"]
        obj.extend_return_logprob = aux_data["extend_return_logprob"]
        obj.extend_return_top_logprob = aux_data["extend_return_top_logprob"]
        obj.extend_token_ids_logprob = aux_data["extend_token_ids_logprob"]
        obj.extend_seq_lens_cpu = aux_data["extend_seq_lens_cpu"]
        obj.extend_logprob_start_lens_cpu = aux_data["extend_logprob_start_lens_cpu"]
        obj.extend_logprob_pruned_lens_cpu = aux_data["extend_logprob_pruned_lens_cpu"]
        obj.top_logprobs_nums = aux_data["top_logprobs_nums"]
        obj.token_ids_logprobs = aux_data["token_ids_logprobs"]
        obj.temp_scaled_logprobs = aux_data["temp_scaled_logprobs"]
        obj.top_p_normalized_logprobs = aux_data["top_p_normalized_logprobs"]

        return obj

    @classmethod
    def from_model_worker_batch(cls, batch: "ModelWorkerBatch", mesh: Mesh = None):
        if batch.forward_mode.is_extend() and batch.return_logprob:
            extend_seq_lens_cpu = batch.extend_seq_lens.tolist()

            extend_return_top_logprob = any(x > 0 for x in batch.top_logprobs_nums)
            extend_token_ids_logprob = any(x is not None for x in batch.token_ids_logprobs)
            extend_return_logprob = False
            extend_logprob_pruned_lens_cpu = []
            for extend_len, start_len in zip(
                extend_seq_lens_cpu,
                batch.extend_logprob_start_lens,
            ):
                if extend_len - start_len > 0:
                    extend_return_logprob = True
                extend_logprob_pruned_lens_cpu.append(extend_len - start_len)
        else:
            extend_return_logprob = extend_return_top_logprob = extend_token_ids_logprob = False
            extend_logprob_pruned_lens_cpu = extend_seq_lens_cpu = None

        sharding = NamedSharding(mesh, P("data"))
        (
            extend_seq_lens_device,
            logits_indices_device,
            extend_input_logprob_token_ids_device,
            input_logprob_indices_device,
        ) = device_array(
            (
                batch.extend_seq_lens,
                batch.logits_indices,
                batch.extend_input_logprob_token_ids,
                batch.input_logprob_indices,
            ),
            sharding=sharding,
        )

        return cls(
            forward_mode=batch.forward_mode,
            capture_hidden_mode=batch.capture_hidden_mode,
            extend_return_logprob=extend_return_logprob,
            extend_return_top_logprob=extend_return_top_logprob,
            extend_token_ids_logprob=extend_token_ids_logprob,
            extend_seq_lens=extend_seq_lens_device,
            logits_indices=logits_indices_device,
            accept_lens=(
                device_array(batch.spec_info_padded.accept_length, sharding=sharding)
                if batch.forward_mode.is_draft_extend()
                and batch.spec_info_padded is not None
                and hasattr(batch.spec_info_padded, "accept_length")
                and batch.spec_info_padded.accept_length is not None
                else None
            ),
            extend_seq_lens_cpu=extend_seq_lens_cpu,
            extend_logprob_start_lens_cpu=(
                batch.extend_logprob_start_lens.tolist()
                if batch.return_logprob and batch.extend_logprob_start_lens is not None
                else None
            ),
            extend_logprob_pruned_lens_cpu=extend_logprob_pruned_lens_cpu,
            top_logprobs_nums=batch.top_logprobs_nums,
            token_ids_logprobs=batch.token_ids_logprobs,
            extend_input_logprob_token_ids_device=extend_input_logprob_token_ids_device,
            input_logprob_indices_device=input_logprob_indices_device,
        )


class LogitsProcessor(nnx.Module):
    """Logits processor for the model."""

    def __init__(self, vocab_size: int, mesh: Mesh, soft_cap: float | None = None):
        self.vocab_size = vocab_size
        self.soft_cap = soft_cap
        self.mesh = mesh

    def _select_hidden_states(self, hidden_states: jax.Array, indices: jax.Array) -> jax.Array:
        # Sequence parallelism may shard the token axis over both data and
        # tensor. Gather indices are DP-local, so restore the full token rows
        # within each data shard before entering shard_map.
        hidden_states = jax.sharding.reshard(
            hidden_states, NamedSharding(self.mesh, P("data", None))
        )

        def select_local_fn(local_states, local_indices):
            return local_states[local_indices]

        return jax.shard_map(
            select_local_fn,
            mesh=self.mesh,
            in_specs=(P("data", None), P("data")),
            out_specs=P("data", None),
        )(hidden_states, indices)

    def _select_logits(self, logits: jax.Array, indices: jax.Array) -> jax.Array:
        # Mirrors `_select_hidden_states` for the post-LM-head logits path.
        # `logits` comes out of `_get_logits` with sharding P("data", "tensor")
        # (batch on data axis, vocab on tensor axis). On jax 0.8.x explicit
        # sharding mode, plain `logits[indices]` raises a ShardingTypeError
        # because the gather output sharding can't be inferred unambiguously.
        # `shard_map` makes each DP shard do a local gather on its own slice,
        # matching tpu-inference's `_select_from_array_fn` pattern.
        def select_local_fn(local_logits, local_indices):
            return local_logits[local_indices]

        return jax.shard_map(
            select_local_fn,
            mesh=self.mesh,
            in_specs=(P("data", "tensor"), P("data")),
            out_specs=P("data", "tensor"),
        )(logits, indices)

    def _select_input_token_logprobs(
        self, input_logprobs: jax.Array, token_ids: jax.Array | None
    ) -> jax.Array:
        # Keep the public input_token_logprobs API scalar-per-token. Returning
        # full vocab rows here makes host memory scale as tokens * vocab_size.
        # By the time we reach this function, extend_return_logprob is True
        # (gated in __call__), so at least one req has extend_len - start_len
        # > 0. Both the padded path (np.zeros over total_token_size in
        # get_model_worker_batch) and the non-padded chunk concat produce a
        # non-None token_ids in that case. A None here means an upstream
        # regression dropped the gather ids — fail loudly rather than
        # silently returning None to the user.
        assert token_ids is not None, (
            "extend_input_logprob_token_ids_device must be populated when "
            "extend_return_logprob=True; got None"
        )
        token_ids = token_ids.reshape((-1,))
        row_ids = np.arange(input_logprobs.shape[0], dtype=np.int64)
        out_sharding = NamedSharding(self.mesh, P(None))
        selected = input_logprobs.at[(row_ids, token_ids)].get(out_sharding=out_sharding)
        return selected.reshape((input_logprobs.shape[0],))

    @named_scope
    def __call__(
        self,
        hidden_states: jax.Array,
        lm_head: Embed,
        logits_metadata: LogitsMetadata,
        aux_hidden_states: jax.Array | None = None,
    ) -> LogitsProcessorOutput:
        if (
            logits_metadata.forward_mode.is_decode_or_idle()
            or logits_metadata.forward_mode.is_target_verify()
        ):
            pruned_states = hidden_states
            if aux_hidden_states is not None:
                aux_pruned_states = [hidden for hidden in aux_hidden_states]
            sample_indices = None
            input_logprob_indices = None
        elif logits_metadata.forward_mode.is_extend() and not logits_metadata.extend_return_logprob:
            last_index = logits_metadata.logits_indices
            if (
                logits_metadata.forward_mode.is_draft_extend()
                and logits_metadata.accept_lens is not None
            ):
                # if accpet_lens is [1, 1, 2, 1, 1]
                #    extend_seq_lens is [4,4,4,4,4]
                #    last_index should be [1, 5, 9, 13, 17] - 1 = [0,4,8,12,16]
                last_index = last_index - (
                    logits_metadata.extend_seq_lens - logits_metadata.accept_lens
                )
            pruned_states = self._select_hidden_states(hidden_states, last_index)
            if aux_hidden_states is not None:
                aux_pruned_states = [
                    self._select_hidden_states(hidden, last_index) for hidden in aux_hidden_states
                ]

            sample_indices = None
            input_logprob_indices = None
        else:
            # Input logprobs are required.
            # Find 3 different indices.
            # 1. pruned_states: hidden states that we want logprobs from.
            # 2. sample_indices: Indices that have sampled tokens.
            # 3. input_logprob_indices: Indices that have input logprob tokens.
            if logits_metadata.input_logprob_indices_device is not None:
                pruned_states = hidden_states
                sample_indices = logits_metadata.logits_indices
                input_logprob_indices = logits_metadata.input_logprob_indices_device
            else:
                sample_index_pt = -1
                sample_indices = []
                input_logprob_indices_pt = 0
                input_logprob_indices = []
                pt, pruned_states = 0, []

                for extend_logprob_start_len, extend_len in zip(
                    logits_metadata.extend_logprob_start_lens_cpu,
                    logits_metadata.extend_seq_lens_cpu,
                ):
                    start_len = extend_logprob_start_len
                    pruned_states.append(hidden_states[pt + start_len : pt + extend_len])
                    pt += extend_len
                    sample_index_pt += extend_len - start_len
                    sample_indices.append(sample_index_pt)
                    input_logprob_indices.extend(
                        [
                            input_logprob_indices_pt + i
                            for i in range(extend_len - extend_logprob_start_len)
                        ]
                    )
                    input_logprob_indices_pt += extend_len - start_len

                pruned_states = jnp.concat(pruned_states)
                sample_indices = device_array(
                    np.array(
                        sample_indices,
                        dtype=np.int64,
                    ),
                )
                input_logprob_indices = device_array(
                    np.array(input_logprob_indices, dtype=np.int64),
                )

        # Compute logits for both input and sampled tokens.
        logits = self._get_logits(pruned_states, lm_head)
        sampled_logits = (
            self._select_logits(logits, sample_indices) if sample_indices is not None else logits
        )

        hidden_states_to_store: jax.Array | None = None
        if logits_metadata.capture_hidden_mode.need_capture():
            if logits_metadata.capture_hidden_mode.is_full():
                if aux_hidden_states is not None and len(aux_hidden_states) > 0:
                    hidden_states_to_store = jnp.concat(aux_hidden_states, axis=-1)
                else:
                    hidden_states_to_store = hidden_states
            elif logits_metadata.capture_hidden_mode.is_last():
                # Get the last token hidden states. If sample_indices is None,
                # pruned states only contain the last tokens already.
                if aux_hidden_states is not None:
                    aux_pruned_states = jnp.concat(aux_pruned_states, axis=-1)

                    hidden_states_to_store = (
                        self._select_hidden_states(aux_pruned_states, sample_indices)
                        if sample_indices is not None
                        else aux_pruned_states
                    )

                else:
                    hidden_states_to_store = (
                        self._select_hidden_states(pruned_states, sample_indices)
                        if sample_indices is not None
                        else pruned_states
                    )
                    assert True, f"hidden_states_to_store {hidden_states_to_store[:100]}"
            else:
                raise AssertionError("This branch should not be reached")

        if not logits_metadata.extend_return_logprob:
            # Decode mode or extend mode without return_logprob.
            return LogitsProcessorOutput(
                next_token_logits=sampled_logits,
                hidden_states=hidden_states_to_store,
            )
        else:
            input_logprobs = self._select_logits(logits, input_logprob_indices)

            del hidden_states, logits

            # Normalize the logprob w/o temperature, top-p
            if logits_metadata.temp_scaled_logprobs or logits_metadata.top_p_normalized_logprobs:
                pruned_lens = device_array(
                    np.array(
                        logits_metadata.extend_logprob_pruned_lens_cpu,
                    ),
                )
                if logits_metadata.temp_scaled_logprobs:
                    logits_metadata.temperature = jnp.repeat(
                        logits_metadata.temperature.reshape(-1),
                        pruned_lens,
                    ).reshape(-1, 1)
                if logits_metadata.top_p_normalized_logprobs:
                    logits_metadata.top_p = jnp.repeat(
                        logits_metadata.top_p,
                        pruned_lens,
                    )
            input_logprobs = self.compute_temp_top_p_normalized_logprobs(
                input_logprobs, logits_metadata
            )

            # Get the logprob of top-k tokens. Shared impl lives in sampler;
            # local import avoids a top-level cycle (sampler imports this module).
            if logits_metadata.extend_return_top_logprob:
                from sgl_jax.srt.layers.sampler import get_top_logprobs

                input_top_logprobs_val, input_top_logprobs_idx = get_top_logprobs(
                    input_logprobs, logits_metadata.top_logprobs_nums, self.mesh
                )
            else:
                input_top_logprobs_val = input_top_logprobs_idx = None

            # Pass full input_logprobs through; host gathers per-req
            # `token_ids` columns in tp_worker (ragged, can't be done on device).
            if logits_metadata.extend_token_ids_logprob:
                input_token_ids_logprobs_val = input_logprobs
                input_token_ids_logprobs_idx = None
            else:
                input_token_ids_logprobs_val = input_token_ids_logprobs_idx = None

            input_token_logprobs = self._select_input_token_logprobs(
                input_logprobs,
                logits_metadata.extend_input_logprob_token_ids_device,
            )

            return LogitsProcessorOutput(
                next_token_logits=sampled_logits,
                input_token_logprobs=input_token_logprobs,
                input_top_logprobs_val=input_top_logprobs_val,
                input_top_logprobs_idx=input_top_logprobs_idx,
                hidden_states=hidden_states_to_store,
                input_token_ids_logprobs_val=input_token_ids_logprobs_val,
                input_token_ids_logprobs_idx=input_token_ids_logprobs_idx,
            )

    def compute_temp_top_p_normalized_logprobs(
        self, last_logits: jax.Array, logits_metadata: LogitsMetadata
    ) -> jax.Array:
        """
        compute logprobs for the output token from the given logits.

        Returns:
            jax.Array: logprobs from logits
        """
        # Scale logits if temperature scaling is enabled
        if logits_metadata.temp_scaled_logprobs:
            last_logits = last_logits / logits_metadata.temperature

        # Normalize logprobs if top_p normalization is enabled
        # NOTE: only normalize logprobs when top_p is set and not equal to 1.0
        if logits_metadata.top_p_normalized_logprobs and (logits_metadata.top_p != 1.0).any():
            from sgl_jax.srt.layers.sampler import top_p_normalize_probs_jax

            probs = nn.softmax(last_logits, axis=-1)
            del last_logits
            probs = top_p_normalize_probs_jax(probs, logits_metadata.top_p, self.mesh)
            return jnp.log(probs)
        else:
            return nn.log_softmax(last_logits, axis=-1)

    def _get_logits(
        self,
        hidden_states: jax.Array,
        lm_head: Embed,
    ) -> jax.Array:
        """Get logits from hidden_states.

        If sampled_logits_only is True, it means hidden_states only contain the
        last position (e.g., extend without input logprobs). The caller should
        guarantee the given hidden_states follow this constraint.
        """
        hidden_states, embedding = lm_head.promote_dtype(
            (hidden_states, lm_head.embedding.value),
            dtype=lm_head.dtype,
        )
        hidden_states = jax.sharding.reshard(
            hidden_states,
            NamedSharding(self.mesh, P("data", None)),
        )

        logits = jnp.dot(
            hidden_states, embedding.T, out_sharding=NamedSharding(self.mesh, P("data", "tensor"))
        )

        logits = logits[:, : self.vocab_size] if logits.ndim > 1 else logits[: self.vocab_size]

        if self.soft_cap:
            logits = self.soft_cap * jnp.tanh(logits / self.soft_cap)

        return logits
