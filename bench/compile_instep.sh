#!/usr/bin/env bash
# --hidden-states-backend jax compiled for slices (bench/README.md, "In-step verifier"):
# a Qwen3-8B-shaped verifier (configs/qwen3_8b_shape), a Llama-3.1-70B-shaped one
# (configs/llama31_70b_shape), DeepSeek-V3's, Kimi-Linear-48B-A3B's and Kimi-K3's, config.json only, + a 1-layer drafter, 8192 tokens, 1 row
# per chip (the long-row rows: one row of 256K or 1M tokens split over 8 GPUs); target
# layer ids as speculators' default (2, N // 2, N - 3). Needs the tpu
# extra (the h200 row: the cuda-compile extra).
#
#   bash bench/compile_instep.sh [row-prefix]     # e.g. v5p, v6e, h200, llama70b
#   STAGE=opd bash bench/compile_instep.sh v5p    # the Draft-OPD step (rows named <row>-opd)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-bench/results/compile_instep}
mkdir -p "$OUT"
QWEN="configs/qwen3_8b_shape/verifier 2,18,33 151643"
LLAMA="configs/llama31_70b_shape/verifier 2,40,77 128002"  # <|reserved_special_token_0|>
DSV3="configs/deepseek_v3_shape/verifier 2,30,58 128000"  # speculators' default layers
KIMI_LINEAR="configs/kimi_linear_48b_shape/verifier 2,13,24 163838"
K3="configs/kimi_k3_shape/verifier 2,46,90 163838"  # speculators' default layers
# name, target, mesh, rows per step, tokens per row, verifier. The long-row rows split each
# row over `context` (the verifier's attention gathers a layer's K/V per shard; docs/design.md,
# "In-step verifier under a context split").
ROWS=(
  "v5p-8 tpu:v5p:2x2x1 fsdp=4 4 8192 $QWEN"
  "v6e-8 tpu:v6e:2x4 fsdp=8 8 8192 $QWEN"
  "h200-8 gpu:h200:8 fsdp=8 8 8192 $QWEN"
  "llama70b-v5p-64 tpu:v5p:4x4x2 ${LLAMA70B_MESH:-fsdp=32} 32 8192 $LLAMA"
  "h200-8-256k gpu:h200:8 ${LONG_MESH:-fsdp=1,context=8} 1 262144 $QWEN"
  "h200-8-1m gpu:h200:8 ${LONG_MESH:-fsdp=1,context=8} 1 1048576 $QWEN"
  "dsv3-h200-64 gpu:h200:8x8 ${DSV3_MESH:-fsdp=64} 64 8192 $DSV3"
  "dsv3-v5p-64 tpu:v5p:4x4x2 ${DSV3_MESH:-fsdp=32} 32 8192 $DSV3"
  "kimilinear-v5p-8 tpu:v5p:2x2x1 ${KIMI_LINEAR_MESH:-fsdp=4} 4 8192 $KIMI_LINEAR"
  "kimilinear-h200-8 gpu:h200:8 ${KIMI_LINEAR_MESH:-fsdp=8} 8 8192 $KIMI_LINEAR"
  "kimilinear-h200-8-256k gpu:h200:8 ${KIMI_LINEAR_LONG_MESH:-fsdp=2,context=4} 2 262144 $KIMI_LINEAR"
  "k3-v5p-256 tpu:v5p:4x4x8 ${K3_MESH:-fsdp=32,tensor=4} ${K3_ROWS:-32} 8192 $K3"
)
for row in "${ROWS[@]}"; do
  read -r name target mesh rows seq verifier ids mask <<<"$row"
  [[ $name == "${1:-}"* ]] || continue
  stage=()
  if [ -n "${STAGE:-}" ]; then stage=(--training-stage "$STAGE"); name=$name-$STAGE; fi
  cmd=("$PYTHON" -m dspark_jax.train --verifier-name-or-path "$verifier"
       --target-layer-ids ${ids//,/ } --mask-token-id "$mask" --total-seq-len "$seq" --num-layers 1
       --max-anchors 512 --hidden-states-backend jax --data-path "$OUT/no-data"
       --save-path "$OUT/ckpt-$name" --dry-run --compile-for "$target" --mesh "$mesh"
       --rows-per-step "$rows" "${stage[@]}")
  {
    echo "# $(date -u +%FT%TZ) ${cmd[*]}"
    /usr/bin/time -v "${cmd[@]}"
    echo "# rc=$? $(date -u +%FT%TZ)"
  } >"$OUT/$name.log" 2>&1
  grep -E '^\[compile\]|^error|Elapsed|Maximum resident' "$OUT/$name.log"
done
