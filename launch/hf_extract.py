"""Hidden-state extraction with HuggingFace transformers (CPU or GPU).

Layer id ``k`` is the residual stream after ``k`` decoder layers (vLLM's
``eagle_aux_hidden_state_layer_ids`` convention): ``k = 0`` is the input of decoder
layer 0 (the embeddings), ``k >= 1`` the output of decoder layer ``k - 1``; so
``k = N`` is the last decoder layer's output *before* the final norm. They are
captured with forward hooks on the decoder layers, never read from
``output_hidden_states`` (whose last entry is post-norm).

``dtype="auto"`` is the dtype vLLM 0.33.0 would serve the verifier in on a GPU of
``compute_capability`` (:mod:`launch.vllm_dtype`), so hf files match vLLM's.
``compute_dtype`` is the dtype the forward runs in (default: the stored ``dtype``);
``"auto"`` computes in float32 on a CPU, where bf16 matmuls without AVX512-BF16 are
several times slower than fp32 ones, and in the stored dtype on a GPU. The files
always hold ``dtype`` (the forward's output rounded once); extraction_config.json
records both.

Rows of a batch are right-padded; with causal attention the real positions never
see the padding, but a batched forward may differ from a one-row forward in the
last bits (different kernel shapes). ``batch_size=1`` reproduces a direct forward
exactly.

The attention implementation is chosen per config (:mod:`launch.attn_implementation`):
eager where sdpa would drop a feature vLLM computes (Gemma 2's attention soft-capping,
attention sinks), transformers' default otherwise; ``attn_implementation`` overrides
and :attr:`HFExtractor.attn_implementation` says what the forward runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from launch import attn_implementation as attn_impl
from launch.hs_files import dtype_name, resolve_layer_ids
from launch.vllm_dtype import serving_dtype, target_capability


def _text_config(config):
    return getattr(config, "text_config", None) or config


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layer stack of a causal LM (``model.model.layers`` for Llama/Qwen)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if layers is None and hasattr(decoder, "language_model"):
        layers = decoder.language_model.layers
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


def check_loading_info(model: str, info: dict) -> None:
    """Refuse a verifier folder whose weights do not cover the model: transformers
    initialises missing tensors at random and only warns, which would write hidden
    states of a random model."""
    problems = []
    for what in ("missing_keys", "mismatched_keys"):
        keys = sorted(str(k) for k in info.get(what) or ())
        if keys:
            more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
            problems.append(f"{what.replace('_', ' ')} {', '.join(keys[:5])}{more}")
    if problems:
        raise ValueError(
            f"{model}: the verifier's weights do not match its config.json "
            f"({'; '.join(problems)}); transformers would initialise them at random"
        )


def add_hf_forward_flags(parser) -> None:
    """``--compute-dtype`` and ``--attn-implementation`` of the CLIs that run an
    :class:`HFExtractor`."""
    parser.add_argument(
        "--compute-dtype",
        default="auto",
        help="dtype the hf forward runs in; files store --dtype (auto: float32 on a CPU, "
        "--dtype on a GPU)",
    )
    attn_impl.add_flag(parser)


class HFExtractor:
    @classmethod
    def from_args(cls, args) -> HFExtractor:
        """The extractor the CLIs' shared flags ask for (extract_hidden_states and
        serve_hidden_states), ``--threads`` applied to this process."""
        if args.threads:
            torch.set_num_threads(args.threads)
        return cls(
            args.model,
            args.target_layer_ids,
            include_last_layer=args.include_last_layer,
            dtype=args.dtype,
            compute_dtype=args.compute_dtype,
            compute_capability=args.compute_capability,
            device=args.device,
            trust_remote_code=args.trust_remote_code,
            attn_implementation=args.attn_implementation,
        )

    def __init__(
        self,
        model: str,
        target_layer_ids: Sequence[int] | None,
        *,
        include_last_layer: bool = True,
        dtype: str = "auto",
        compute_dtype: str | None = None,
        compute_capability: str | None = None,
        device: str = "auto",
        trust_remote_code: bool = False,
        attn_implementation: str | None = None,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM

        full = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        config = _text_config(full)
        self.num_hidden_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.layer_ids = resolve_layer_ids(
            target_layer_ids, self.num_hidden_layers, include_last_layer
        )
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = serving_dtype(dtype, full, model, target_capability(compute_capability))
        compute = compute_dtype or dtype
        if compute == "auto":
            compute = "float32" if torch.device(device).type == "cpu" else dtype
        if not isinstance(getattr(torch, compute, None), torch.dtype):
            raise ValueError(f"--compute-dtype {compute_dtype}: not a torch dtype name")
        kwargs = {
            "dtype": getattr(torch, compute),
            "trust_remote_code": trust_remote_code,
        }
        attn = attn_impl.choose(full, attn_implementation, device)
        if attn is not None:
            kwargs["attn_implementation"] = attn
        loaded, info = AutoModelForCausalLM.from_pretrained(
            model, output_loading_info=True, **kwargs
        )
        check_loading_info(model, info)
        if compute == "float32":  # transformers keeps dequantized MXFP4 experts in bf16
            loaded = loaded.float()  # (exact in fp32) whatever dtype is asked
        self.model = loaded.to(device).eval()
        self.device = torch.device(device)
        self.layers = decoder_layers(self.model)
        if len(self.layers) != self.num_hidden_layers:
            raise ValueError(
                f"{model}: config says {self.num_hidden_layers} layers, the model "
                f"has {len(self.layers)}"
            )
        self.decoder = self.model.get_decoder()
        self.attn_implementation = attn_impl.loaded_implementation(self.model)
        self.compute_dtype = next(self.model.parameters()).dtype
        self.dtype = getattr(torch, dtype)  # what extract() returns and files store
        self.model_name = model

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def compute_dtype_name(self) -> str:
        return dtype_name(self.compute_dtype)

    def _register(self, store: dict[int, torch.Tensor]) -> list:
        handles = []
        for k in set(self.layer_ids):
            if k == 0:

                def pre(_mod, args, kwargs, k=k):
                    store[k] = args[0] if args else kwargs["hidden_states"]

                handles.append(self.layers[0].register_forward_pre_hook(pre, with_kwargs=True))
            else:

                def post(_mod, _args, output, k=k):
                    store[k] = output[0] if isinstance(output, (tuple, list)) else output

                handles.append(self.layers[k - 1].register_forward_hook(post))
        return handles

    @torch.inference_mode()
    def extract(self, rows: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Hidden states ``[T_i, len(layer_ids), H]`` (``self.dtype``, on CPU) per row."""
        if not rows:
            return []
        lengths = [len(r) for r in rows]
        if min(lengths) == 0:
            raise ValueError("cannot extract hidden states of an empty row")
        T = max(lengths)
        ids = torch.zeros((len(rows), T), dtype=torch.long)
        mask = torch.zeros((len(rows), T), dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
            mask[b, : len(r)] = 1
        store: dict[int, torch.Tensor] = {}
        handles = self._register(store)
        try:
            self.decoder(
                input_ids=ids.to(self.device),
                attention_mask=None if len(rows) == 1 else mask.to(self.device),
                use_cache=False,
            )
        finally:
            for h in handles:
                h.remove()
        stacked = torch.stack([store[k] for k in self.layer_ids], dim=2)  # [B, T, n, H]
        stacked = stacked.to(device="cpu", dtype=self.dtype)
        return [stacked[b, :n].clone() for b, n in enumerate(lengths)]
