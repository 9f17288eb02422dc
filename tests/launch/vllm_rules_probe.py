"""Run by tests/launch/test_vllm_rules.py with the Python of a separate vLLM 0.33.0
environment (never imported by the test suite): vLLM's own functions for the rules our
launchers copy, on every case of a JSON file, one JSON line of answers.

    python vllm_rules_probe.py CASES.json

* ``dtype``: ``vllm/config/model.py`` ``_get_and_verify_dtype`` (``--dtype``; ``auto``
  through ``_resolve_auto_dtype`` and ``ModelArchConfigConvertorBase.get_torch_dtype``)
  on the folder's config.json (and safetensors headers), with ``current_platform`` a
  GPU of the case's compute capability (``CudaPlatform.supported_dtypes`` copied: its
  module needs libcuda.so.1).
* ``mla``: ``ModelConfig.use_mla`` (``vllm/config/model.py``) over
  ``ModelArchConfigConvertorBase.is_deepseek_mla``
  (``vllm/transformers_utils/model_arch_config_convertor.py``) on the config.json.
* ``aux``: ``EagleModelMixin._set_aux_hidden_state_layers``
  (``vllm/model_executor/models/interfaces.py``): the order vLLM captures the aux layers
  of ``eagle_aux_hidden_state_layer_ids`` in.
* ``dspark``: the draft config vLLM builds from an exported folder:
  ``vllm/transformers_utils/config.py`` ``get_config`` (``SpeculatorsConfig.from_pretrained``
  -> ``update_dspark`` in ``configs/speculators/algos.py``, then ``patch_rope_parameters``),
  ``maybe_override_with_speculators`` (the speculative config and verifier of
  ``vllm serve <folder>``) and, per draft layer, ``qwen3_dflash._resolve_layer_attention``
  (sliding window, causal inside the block). The model classes that read the config need a
  GPU: their getattr defaults are copied here, each citing its line.
"""

from __future__ import annotations

import json
import os
import sys


def dtype_cases(cases: list[dict]) -> list[str]:
    import torch
    import vllm.config.model as model_mod
    from transformers import AutoConfig
    from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum

    out = []
    for case in cases:
        major, minor = case["capability"]

        class Gpu(Platform):  # a GPU of this capability
            _enum = PlatformEnum.CUDA

            @classmethod
            def get_device_capability(cls, device_id: int = 0):
                return DeviceCapability(major, minor)

            @classmethod
            def get_device_name(cls, device_id: int = 0) -> str:
                return "gpu"

            @property
            def supported_dtypes(self) -> list[torch.dtype]:
                # CudaPlatform.supported_dtypes (vllm/platforms/cuda.py:257), copied: its
                # module needs libcuda.so.1 to import
                if self.has_device_capability(80):
                    return [torch.bfloat16, torch.float16, torch.float32]
                if self.has_device_capability(60):
                    return [torch.float16, torch.float32]
                return [torch.float32]

        model_mod.current_platform = Gpu()
        config = AutoConfig.from_pretrained(case["folder"])
        try:
            dtype = model_mod._get_and_verify_dtype(
                case["folder"], config, case["requested"], is_pooling_model=False
            )
            out.append(str(dtype).removeprefix("torch."))
        except ValueError as e:
            out.append(f"error: {e}")
    return out


def mla_cases(cases: list[dict]) -> list[bool]:
    import vllm.envs as envs
    from transformers import PretrainedConfig
    from vllm.config.model import ModelConfig
    from vllm.transformers_utils.config import get_hf_text_config
    from vllm.transformers_utils.model_arch_config_convertor import (
        ModelArchConfigConvertorBase,
    )

    def config_of(d: dict) -> PretrainedConfig:
        d = dict(d)
        text = d.pop("text_config", None)
        cfg = PretrainedConfig(**d)
        cfg.model_type = d.get("model_type")  # a plain PretrainedConfig has none
        if text is not None:
            cfg.text_config = config_of(text)
        return cfg

    out = []
    for case in cases:
        hf = config_of(case["config"])
        text = get_hf_text_config(hf)
        convertor = ModelArchConfigConvertorBase(hf, text)

        class Model:  # the attributes ModelConfig.use_mla reads, from vLLM's functions
            hf_text_config = text
            is_deepseek_mla = convertor.is_deepseek_mla()

            @staticmethod
            def using_transformers_backend() -> bool:
                return False

        os.environ["VLLM_MLA_DISABLE"] = case.get("disable", "0")
        envs.disable_envs_cache() if hasattr(envs, "disable_envs_cache") else None
        out.append(bool(ModelConfig.use_mla.fget(Model())))
    return out


def aux_cases(cases: list[list[int]]) -> list[list[int]]:
    from vllm.model_executor.models.interfaces import EagleModelMixin

    class Model(EagleModelMixin):
        start_layer = 0

    out = []
    for ids in cases:
        model = Model()
        model._set_aux_hidden_state_layers(tuple(ids))
        out.append(list(model.aux_hidden_state_layers))
    return out


def _layer_attention(config, num_layers: int) -> list:
    """(sliding window, causal) per draft layer, as Qwen3DSpark's decoder layers build it."""
    import vllm.model_executor.models.qwen3_dflash as qd

    class V2:  # mixed sliding/full layers need Model Runner V2 (the default with Triton)
        use_v2_model_runner = True

    qd.get_current_vllm_config = lambda: V2()
    out = []
    for i in range(num_layers):
        try:
            window, causal = qd._resolve_layer_attention(config, i)
            out.append([window, bool(causal)])
        except (ValueError, NotImplementedError) as e:
            out.append(f"error: {e}")
    return out


def dspark_cases(folders: list[str]) -> list[dict]:
    from vllm.transformers_utils.config import get_config, maybe_override_with_speculators

    out = []
    for folder in folders:
        try:
            c = get_config(folder, trust_remote_code=False)
        except Exception as e:  # vLLM refuses the config: report, do not stop
            out.append({"error": f"{type(e).__name__}: {e}"})
            continue
        try:
            verifier, _, spec = maybe_override_with_speculators(folder, folder, False)
            spec = {"method": spec["method"], "tokens": spec["num_speculative_tokens"]}
        except ValueError as e:
            verifier, spec = f"error: {e}", None
        ans = {
            name: getattr(c, name, None)
            for name in (
                "architectures",
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "num_hidden_layers",
                "vocab_size",
                "max_position_embeddings",
                "rms_norm_eps",
                "hidden_act",
                "target_hidden_size",  # qwen3_dflash.py:91 getattr(..., None)
                "eagle_aux_hidden_state_layer_ids",
                "target_layer_ids",
                "mask_token_id",  # qwen3_dflash.py:454 (no dflash_config in DSpark)
                "markov_rank",
                "markov_head_type",
                "block_size",  # speculative.py:1596 getattr(..., None)
                "sample_from_anchor",
                "dspark_bonus_anchor",
                "rope_parameters",
            )
        }
        # qwen3_dflash.py:345 + :199: head_dim or hidden_size // num_heads
        ans["head_dim"] = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        ans["attention_bias"] = getattr(c, "attention_bias", False)  # qwen3_dflash.py:339
        # qwen3_dspark.py:207 draft vocab; :220-221 the confidence head (default off)
        ans["draft_vocab_size"] = getattr(c, "draft_vocab_size", None) or c.vocab_size
        ans["enable_confidence_head"] = getattr(c, "enable_confidence_head", False)
        ans["confidence_head_with_markov"] = getattr(c, "confidence_head_with_markov", False)
        ans["layers"] = _layer_attention(c, c.num_hidden_layers)
        ans["verifier"], ans["spec"] = verifier, spec
        out.append(ans)
    return out


def main() -> None:
    cases = json.loads(open(sys.argv[1]).read())
    rules = {"dtype": dtype_cases, "mla": mla_cases, "aux": aux_cases, "dspark": dspark_cases}
    print("RESULT " + json.dumps({k: rules[k](v) for k, v in cases.items()}))


if __name__ == "__main__":
    main()
