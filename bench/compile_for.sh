#!/usr/bin/env bash
# The Kimi-K3 compile table (bench/README.md, "Compile for a slice"): the seed run
# (configs/kimi_k3/train.yaml) compiled for TPU slices from this machine, one row at a
# time (each takes minutes and a few GiB of RAM). Needs the tpu extra.
#
#   bash bench/compile_for.sh                 # every row below
#   bash bench/compile_for.sh v5p-8_fsdp4_r4  # the rows whose name starts with this
#
# One log per row in $OUT (default bench/results/compile_for): the command, the
# [compile] report, /usr/bin/time -v (wall time, peak RSS) and the exit status.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-bench/results/compile_for}
mkdir -p "$OUT"

# name target mesh rows-per-step [extra flags]
ROWS=(
  "v5p-8_fsdp4_r4 tpu:v5p:2x2x1 fsdp=4 4"
  "v5p-8_fsdp4_r8 tpu:v5p:2x2x1 fsdp=4 8"
  "v5p-8_fsdp4_r4_chunk256 tpu:v5p:2x2x1 fsdp=4 4 --loss-chunk-tokens 256"
  "v5p-8_fsdp4_r4_remat tpu:v5p:2x2x1 fsdp=4 4 --gradient-checkpointing"
  "v5p-128_seed_d8f8_r64 tpu:v5p:4x4x4 data=8,fsdp=8 64"
  "v6e-8_fsdp8_r8 tpu:v6e:2x4 fsdp=8 8"
  "v6e-8_fsdp8_r8_remat tpu:v6e:2x4 fsdp=8 8 --gradient-checkpointing"
  "v5e-16_fsdp16_r16_remat tpu:v5e:4x4 fsdp=16 16 --gradient-checkpointing"
  "v5p-16_fsdp8_r16 tpu:v5p:2x2x2 fsdp=8 16"
  # issue 29: 256K-token rows, each over 2 chips (context), 4 rows per step
  "v5p-16_fsdp4_ctx2_s256k_remat tpu:v5p:2x2x2 fsdp=4,context=2 4 --gradient-checkpointing --total-seq-len 262144"
  "v5p-16_fsdp2_ctx4_s512k_remat tpu:v5p:2x2x2 fsdp=2,context=4 2 --gradient-checkpointing --total-seq-len 524288"
  "v5p-16_ctx8_s1m_remat tpu:v5p:2x2x2 context=8 1 --gradient-checkpointing --total-seq-len 1048576 --on-missing raise K3_FILES"
  "v6e-16_fsdp4_ctx4_s256k_remat tpu:v6e:4x4 fsdp=4,context=4 4 --gradient-checkpointing --total-seq-len 262144 --on-missing raise K3_FILES"
  # a Qwen3-8B-shaped drafter (QWEN3_8B below: hidden 4096, vocab 151936, 5 layers) at 128K
  "q8b-v6e-8_fsdp2_ctx4_s128k_remat tpu:v6e:2x4 fsdp=2,context=4 2 --gradient-checkpointing QWEN3_8B"
  "q8b-h200-8_fsdp2_ctx4_s128k_remat gpu:h200:8 fsdp=2,context=4 2 --gradient-checkpointing QWEN3_8B"
)
# The rows marked K3_FILES read the seed's hidden states from files (a row split over
# processes reads its tokens' hidden states from files only): the seed config without
# its online-extraction keys (Mooncake, vLLM endpoint, --on-missing generate).
K3_FILES=$OUT/k3_files.yaml
grep -vE '^ *(hidden_states_backend|mooncake_[a-z_]+|vllm_endpoint|on_missing|request_timeout|max_retries|generation_validation_retries|max_consecutive_generation_failures):' \
  configs/kimi_k3/train.yaml >"$K3_FILES"
# The rows marked QWEN3_8B replace the seed config by these flags (config.json only).
QWEN3_8B=(--verifier-name-or-path configs/qwen3_8b_shape/verifier --target-layer-ids 2 18 33
          --mask-token-id 151643 --num-layers 5 --total-seq-len 131072
          --data-path "$OUT/no-data" --save-path "$OUT/no-checkpoints")

for row in "${ROWS[@]}"; do
  read -r name target mesh rows extra <<<"$row"
  [[ $name == "${1:-}"* ]] || continue
  base=(--config configs/kimi_k3/train.yaml)
  if [[ ${extra:-} == *QWEN3_8B ]]; then base=("${QWEN3_8B[@]}"); extra=${extra%QWEN3_8B}; fi
  if [[ ${extra:-} == *K3_FILES ]]; then base=(--config "$K3_FILES"); extra=${extra%K3_FILES}; fi
  cmd=("$PYTHON" -m dspark_jax.train "${base[@]}" --dry-run
       --compile-for "$target" --mesh "$mesh" --rows-per-step "$rows" ${extra:-})
  {
    echo "# $(date -u +%FT%TZ) ${cmd[*]}"
    /usr/bin/time -v "${cmd[@]}"
    echo "# rc=$? $(date -u +%FT%TZ)"
  } >"$OUT/$name.log" 2>&1
  grep -E '^\[compile\]|^error' "$OUT/$name.log"
done
