"""Run by tests/converters/test_vllm_load.py with the Python of a separate vLLM 0.33.0
environment (never imported by the test suite): build vLLM's own Qwen3DSparkForCausalLM
for each drafter folder on CPU, as ``vllm serve <verifier> --spec-method dspark
--spec-model <folder>`` resolves it, run its ``load_weights`` on the folder's tensors and
report, as one JSON line, whether it loaded and how every parameter compares with the
file.

    VLLM_TARGET_DEVICE=cpu VLLM_USE_V2_MODEL_RUNNER=1 python vllm_load.py CASES.json
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import load_file


def expected(name: str, file: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The file's tensor(s) behind vLLM parameter ``name`` (stacked as vLLM stacks them)."""
    key = name.removeprefix("model.")
    if name == "draft_id_to_target_id":
        return file.get("d2t")
    for fused, parts in (
        ("self_attn.qkv_proj.", ("q_proj", "k_proj", "v_proj")),
        ("mlp.gate_up_proj.", ("gate_proj", "up_proj")),
    ):
        if fused in key:
            pieces = [file.get(key.replace(fused.split(".")[1], p)) for p in parts]
            return None if any(p is None for p in pieces) else torch.cat(pieces)
    return file.get(key)


def load(case: dict) -> dict:
    from vllm.config import (
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    target = ModelConfig(
        model=case["verifier"], skip_tokenizer_init=True, dtype="float32", max_model_len=256
    )
    parallel = ParallelConfig()
    spec = SpeculativeConfig(
        model=case["folder"],
        method="dspark",
        num_speculative_tokens=case["spec_tokens"],
        target_model_config=target,
        target_parallel_config=parallel,
    )
    config = VllmConfig(model_config=target, speculative_config=spec, parallel_config=parallel)
    file = load_file(f"{case['folder']}/model.safetensors")
    with set_current_vllm_config(config):
        model = Qwen3DSparkForCausalLM(vllm_config=config)
        try:
            model.load_weights(iter(file.items()))
        except (ValueError, AssertionError, RuntimeError) as e:
            return {"loaded": False, "error": f"{type(e).__name__}: {e}"}
    mismatches, compared = [], 0
    for name, param in model.named_parameters():
        want = expected(name, file)
        if want is None:
            continue  # shared from the verifier (embed_tokens, lm_head) or unused
        compared += 1
        got = param.detach()
        if got.shape[1:] == want.shape[1:] and got.shape[0] > want.shape[0]:
            got = got[: want.shape[0]]  # ParallelLMHead pads its rows (vocab) to a multiple of 64
        if tuple(got.shape) != tuple(want.shape) or not torch.equal(
            got.to(torch.float64), want.to(torch.float64)
        ):
            mismatches.append(name)
    head = model.model.confidence_head
    return {
        "loaded": True,
        "compared": compared,
        "mismatches": mismatches,
        "confidence_dtype": None if head is None else str(head.proj.weight.dtype),
        "causal": [layer.self_attn.causal for layer in model.model.layers],
        "sample_from_anchor": model.config.sample_from_anchor,
        "target_layer_ids": list(model.config.target_layer_ids),
        "num_speculative_tokens": spec.num_speculative_tokens,
    }


def main() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    cases = json.loads(open(sys.argv[1]).read())
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{cases['port']}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
    out = {name: load(case) for name, case in cases["cases"].items()}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
