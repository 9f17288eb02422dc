"""
Store information about a forward batch.

The following is the flow of data structures for a batch:

ScheduleBatch -> ModelWorkerBatch -> ForwardBatch

- ScheduleBatch is managed by `scheduler.py::Scheduler`.
  It contains high-level scheduling data. Most of the data is on the CPU.
- ModelWorkerBatch is managed by `tp_worker.py::TpModelWorker`.
  It is a subset of `ScheduleBatch` that only contains data related to the model forward on TPU.
  It will be transformed from CPU scheduler to TPU model runner.
- ForwardBatch is managed by `model_runner.py::ModelRunner`.
  It contains low-level tensor data. Most of the data consists of TPU tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import IntEnum, auto
from functools import total_ordering
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from jax.tree_util import register_pytree_node_class

from sgl_jax.srt.configs.model_config import need_attention_mask
from sgl_jax.srt.eplb.expert_location import (
    ExpertLocationMetadata,
    get_global_expert_location_metadata,
)
from sgl_jax.srt.speculative.spec_info import SpeculativeAlgorithm
from sgl_jax.srt.utils.jax_utils import device_array

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from sgl_jax.srt.layers.attention.base_attn_backend import AttentionBackend
    from sgl_jax.srt.managers.schedule_batch import ModelWorkerBatch
    from sgl_jax.srt.model_executor.model_runner import ModelRunner
    from sgl_jax.srt.speculative.eagle_info import EagleDraftInput, EagleVerifyInput


class ForwardMode(IntEnum):
    # Extend a sequence. The KV cache of the beginning part of the sequence is already computed (e.g., system prompt).
    # It is also called "prefill" in common terminology.
    EXTEND = auto()
    # Decode one token.
    DECODE = auto()
    # Contains both EXTEND and DECODE when doing chunked prefill.
    MIXED = auto()
    # No sequence to forward. For data parallel attention, some workers will be IDLE if no sequence are allocated.
    IDLE = auto()

    # Used in speculative decoding: verify a batch in the target model.
    TARGET_VERIFY = auto()
    # Used in speculative decoding: extend a batch in the draft model.
    DRAFT_EXTEND = auto()

    # A dummy first batch to start the pipeline for overlap scheduler.
    # It is now used for triggering the sampling_info_done event for the first prefill batch.
    DUMMY_FIRST = auto()

    def is_prefill(self):
        return self.is_extend()

    def is_extend(self):
        return (
            self == ForwardMode.EXTEND
            or self == ForwardMode.MIXED
            or self == ForwardMode.DRAFT_EXTEND
            or self == ForwardMode.TARGET_VERIFY
        )

    def is_decode(self):
        return self == ForwardMode.DECODE

    def is_mixed(self):
        return self == ForwardMode.MIXED

    def is_idle(self):
        return self == ForwardMode.IDLE

    def is_target_verify(self):
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend(self):
        return self == ForwardMode.DRAFT_EXTEND

    def is_extend_or_draft_extend_or_mixed(self):
        return (
            self == ForwardMode.EXTEND
            or self == ForwardMode.DRAFT_EXTEND
            or self == ForwardMode.MIXED
        )

    def is_cuda_graph(self):
        return (
            self == ForwardMode.DECODE
            or self == ForwardMode.TARGET_VERIFY
            or self == ForwardMode.IDLE
        )

    def is_dummy_first(self):
        return self == ForwardMode.DUMMY_FIRST

    def is_decode_or_idle(self):
        return self == ForwardMode.DECODE or self == ForwardMode.IDLE


@total_ordering
class CaptureHiddenMode(IntEnum):
    # Do not capture anything.
    NULL = 0
    # Capture a hidden state of the last token.
    LAST = 1
    # Capture hidden states of all tokens.
    FULL = 2

    def need_capture(self):
        return self != CaptureHiddenMode.NULL

    def is_full(self):
        return self == CaptureHiddenMode.FULL

    def is_last(self):
        return self == CaptureHiddenMode.LAST

    def __lt__(self, other):
        return self.value < other.value

    def parse(mode: int):
        if mode == 0:
            return CaptureHiddenMode.NULL
        elif mode == 1:
            return CaptureHiddenMode.LAST
        elif mode == 2:
            return CaptureHiddenMode.FULL
        else:
            raise ValueError(f"Unknown CaptureHiddenMode: {mode}")


@register_pytree_node_class
@dataclass
class ForwardBatch:
    """Store all inputs of a forward pass."""

    # The batch id
    bid: int
    # The forward mode
    forward_mode: ForwardMode
    # The batch size
    batch_size: int
    # The input ids [total_tokens]
    input_ids: jax.Array
    # The indices of requests in the req_to_token_pool
    req_pool_indices: jax.Array
    # The sequence length for each request [batch_size]
    seq_lens: jax.Array
    # decode token position in kv cache
    out_cache_loc: jax.Array
    # Position information [total_tokens]
    positions: jax.Array = None

    attn_backend: AttentionBackend = None

    cache_loc: jax.Array = None

    # For extend
    extend_prefix_lens: jax.Array | None = None
    extend_seq_lens: jax.Array | None = None

    # For LoRA
    lora_ids: list[str] | None = None
    lora_scalings: jax.Array = None
    lora_token_indices: jax.Array = None
    lora_ranks: jax.Array = None

    # For EPLB
    expert_location_metadata: ExpertLocationMetadata | None = None

    trace_request_ids: list[str] | None = None
    trace_request_objects: list | None = None

    spec_info: EagleVerifyInput | EagleDraftInput | None = None
    spec_algorithm: SpeculativeAlgorithm = None
    capture_hidden_mode: CaptureHiddenMode = None

    # Encoder-Decoder specific fields
    attention_mask: jax.Array | None = None
    deterministic: bool = True
    # Multimodal cached vision embeddings (prefill only)
    input_embedding: jax.Array | None = None
    # MRoPE positions [3, total_tokens] for Qwen2.5-VL
    mrope_positions: jax.Array | None = None

    ## for deepstack
    apply_for_deepstack: bool = False
    deepstack_visual_embedding: jax.Array | None = None

    # Recurrent state indices [batch_size]
    recurrent_indices: jax.Array | None = None
    # Recurrent CoW src slots [batch_size] (0 = no clone)
    recurrent_cow_src_indices: jax.Array | None = None
    # Recurrent track metadata [batch_size] (extra-buffer snapshot at track
    # boundaries). Populated on extend batches that cross a track boundary; None
    # otherwise.
    recurrent_track_indices: jax.Array | None = None
    recurrent_track_mask: jax.Array | None = None

    def tree_flatten(self):
        children = (
            self.input_ids,
            self.req_pool_indices,
            self.seq_lens,
            self.out_cache_loc,
            self.positions,
            self.attn_backend,
            self.cache_loc,
            self.extend_prefix_lens,
            self.extend_seq_lens,
            self.lora_scalings,
            self.lora_token_indices,
            self.lora_ranks,
            self.spec_info,
            self.expert_location_metadata,
            self.attention_mask,
            self.input_embedding,
            self.mrope_positions,
            self.apply_for_deepstack,
            self.deepstack_visual_embedding,
            self.recurrent_indices,
            self.recurrent_cow_src_indices,
            self.recurrent_track_indices,
            self.recurrent_track_mask,
        )

        aux_data = {
            "forward_mode": self.forward_mode,
            "batch_size": self.batch_size,
            "spec_algorithm": self.spec_algorithm,
            "capture_hidden_mode": self.capture_hidden_mode,
            "deterministic": self.deterministic,
        }
        return (children, aux_data)

    @classmethod
    def tree_unflatten(cls, aux_data, children):
        obj = cls.__new__(cls)

        # bid is intentionally not in aux_data (would break jit cache); only
        # used by precision_tracer outside jit, so a sentinel is fine after a
        # pytree round-trip (e.g. compilation_manager padding path).
        obj.bid = 0
        obj.forward_mode = aux_data["forward_mode"]
        obj.batch_size = aux_data["batch_size"]
        obj.spec_algorithm = aux_data["spec_algorithm"]
        obj.capture_hidden_mode = aux_data["capture_hidden_mode"]
        obj.deterministic = aux_data.get("deterministic", True)
        obj.trace_request_ids = None
        obj.trace_request_objects = None

        obj.input_ids = children[0]
        obj.req_pool_indices = children[1]
        obj.seq_lens = children[2]
        obj.out_cache_loc = children[3]
        obj.positions = children[4]
        obj.attn_backend = children[5]
        obj.cache_loc = children[6]
        obj.extend_prefix_lens = children[7]
        obj.extend_seq_lens = children[8]
        obj.lora_scalings = children[9]
        obj.lora_token_indices = children[10]
        obj.lora_ranks = children[11]
        obj.spec_info = children[12]
        obj.expert_location_metadata = children[13]
        obj.attention_mask = children[14]
        obj.input_embedding = children[15]
        obj.mrope_positions = children[16]

        obj.apply_for_deepstack = children[17]
        obj.deepstack_visual_embedding = children[18]
        obj.recurrent_indices = children[19]
        obj.recurrent_cow_src_indices = children[20]
        obj.recurrent_track_indices = children[21]
        obj.recurrent_track_mask = children[22]
        return obj

    def __repr__(self) -> str:
        jax_array_fields = []

        for field_name in [
            "input_ids",
            "req_pool_indices",
            "seq_lens",
            "out_cache_loc",
            "positions",
            "cache_loc",
            "extend_prefix_lens",
            "extend_seq_lens",
            "lora_scalings",
            "lora_token_indices",
            "lora_ranks",
            "mrope_positions",
            "expert_location_metadata",
        ]:
            value = getattr(self, field_name, None)
            if value is not None and isinstance(value, jax.Array):
                jax_array_fields.append(f"{field_name}={value.shape}")

        jax_arrays_str = ", ".join(jax_array_fields)
        return f"ForwardBatch(forward_mode={self.forward_mode}, batch_size={self.batch_size}, {jax_arrays_str})"

    def get_token_valid_mask(
        self,
        num_tokens: int,
        out_sharding: NamedSharding | None = None,
    ) -> jax.Array | None:
        """Return a per-token validity mask for padded batches.

        Prefer using `out_cache_loc` when available because it aligns with the
        token dimension in both decode and extend: padded tokens are marked as
        `-1` in `out_cache_loc`.

        If ``out_sharding`` is provided, the mask is resharded to it before
        return (caller's responsibility to construct a 1D sharding compatible
        with their downstream broadcast operands).
        """
        if self.out_cache_loc is not None and self.out_cache_loc.shape == (num_tokens,):
            mask = self.out_cache_loc > 0
        elif (
            self.seq_lens is not None
            and self.seq_lens.ndim == 1
            and num_tokens == self.seq_lens.shape[0]
        ):
            mask = self.seq_lens > 0
        else:
            return None

        if out_sharding is not None:
            mask = jax.sharding.reshard(mask, out_sharding)
        return mask

    @classmethod
    def init_new(
        cls,
        batch: ModelWorkerBatch,
        model_runner: ModelRunner,
    ):
        (
            input_ids,
            seq_lens,
            out_cache_loc,
            positions,
            req_pool_indices,
            cache_loc,
            extend_prefix_lens,
            extend_seq_lens,
        ) = device_array(
            (
                batch.input_ids,
                batch.seq_lens,
                batch.out_cache_loc,
                batch.positions,
                batch.req_pool_indices,
                batch.cache_loc,
                batch.extend_prefix_lens,
                batch.extend_seq_lens,
            ),
            sharding=(NamedSharding(model_runner.mesh, PartitionSpec("data"))),
        )
        mrope_positions = None
        if batch.mrope_positions is not None:
            (mrope_positions,) = device_array(
                (batch.mrope_positions,),
                sharding=(NamedSharding(model_runner.mesh, PartitionSpec(None, None))),
            )
        input_embedding = None
        if batch.input_embedding is not None:
            (input_embedding,) = device_array(
                (batch.input_embedding,),
                sharding=(NamedSharding(model_runner.mesh, PartitionSpec(None, None))),
            )
        if input_embedding is not None:
            input_embedding = input_embedding.astype(jnp.bfloat16)

        if batch.lora_scalings is not None:
            (
                lora_scalings,
                lora_token_indices,
                lora_ranks,
            ) = device_array(
                (
                    batch.lora_scalings,
                    batch.lora_token_indices,
                    batch.lora_ranks,
                ),
                sharding=(NamedSharding(model_runner.mesh, PartitionSpec("data"))),
            )
        else:
            (lora_scalings, lora_token_indices, lora_ranks) = (
                batch.lora_scalings,
                batch.lora_token_indices,
                batch.lora_ranks,
            )

        deepstack_visual_embedding = None
        if batch.apply_for_deepstack:
            (deepstack_visual_embedding,) = device_array(
                (batch.deepstack_visual_embedding,),
                sharding=(NamedSharding(model_runner.mesh, PartitionSpec(None, None))),
            )
        if deepstack_visual_embedding is not None:
            deepstack_visual_embedding = deepstack_visual_embedding.astype(jnp.bfloat16)

        expert_location_metadata = get_global_expert_location_metadata()

        recurrent_indices = None
        if batch.recurrent_indices is not None:
            (recurrent_indices,) = device_array(
                (batch.recurrent_indices,),
                sharding=(NamedSharding(model_runner.mesh, PartitionSpec("data"))),
            )

        recurrent_cow_src_indices = None
        if batch.recurrent_cow_src_indices is not None:
            (recurrent_cow_src_indices,) = device_array(
                (batch.recurrent_cow_src_indices,),
                sharding=(NamedSharding(model_runner.mesh, PartitionSpec("data"))),
            )

        recurrent_track_indices = None
        if batch.recurrent_track_indices is not None:
            (recurrent_track_indices,) = device_array(
                (batch.recurrent_track_indices,),
                sharding=(NamedSharding(model_runner.mesh, PartitionSpec("data"))),
            )

        recurrent_track_mask = None
        if batch.recurrent_track_mask is not None:
            (recurrent_track_mask,) = device_array(
                (batch.recurrent_track_mask,),
                sharding=(NamedSharding(model_runner.mesh, PartitionSpec("data"))),
            )

        obj = cls(
            bid=batch.bid,
            forward_mode=batch.forward_mode,
            batch_size=len(batch.seq_lens),
            input_ids=input_ids,
            seq_lens=seq_lens,
            out_cache_loc=out_cache_loc,
            positions=positions,
            mrope_positions=mrope_positions,
            req_pool_indices=req_pool_indices,
            cache_loc=cache_loc,
            extend_prefix_lens=extend_prefix_lens,
            extend_seq_lens=extend_seq_lens,
            lora_ids=batch.lora_ids,
            lora_scalings=lora_scalings,
            lora_token_indices=lora_token_indices,
            lora_ranks=lora_ranks,
            attn_backend=model_runner.attn_backend,
            spec_info=batch.spec_info_padded,
            spec_algorithm=batch.spec_algorithm,
            capture_hidden_mode=batch.capture_hidden_mode,
            input_embedding=input_embedding,
            apply_for_deepstack=batch.apply_for_deepstack,
            deepstack_visual_embedding=deepstack_visual_embedding,
            expert_location_metadata=expert_location_metadata,
            recurrent_indices=recurrent_indices,
            recurrent_cow_src_indices=recurrent_cow_src_indices,
            recurrent_track_indices=recurrent_track_indices,
            recurrent_track_mask=recurrent_track_mask,
        )

        # Auto-generate attention mask for Encoder-only models (e.g. UMT5Encoder, BERT)
        is_embedding = getattr(model_runner.model_config, "is_embedding", False)
        architectures = getattr(model_runner.model_config.hf_config, "architectures", [])

        needs_mask = need_attention_mask(architectures, is_embedding)

        if needs_mask:
            hf_config = model_runner.model_config.hf_config
            pad_token_id = getattr(hf_config, "pad_token_id", 0)
            if pad_token_id is None:
                pad_token_id = 0

            # Generate mask: 1 for valid tokens, 0 for padding
            obj.attention_mask = (obj.input_ids != pad_token_id).astype(jnp.int32)

        return obj
