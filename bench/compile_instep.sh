#!/usr/bin/env bash
# --hidden-states-backend jax compiled for slices (bench/README.md, "In-step verifier"):
# a Qwen3-8B-shaped verifier (configs/qwen3_8b_shape, config.json only) + a 1-layer
# drafter, 8192 tokens, 1 row per chip. Needs the tpu extra (the gpu row: the CUDA plugin).
#
#   bash bench/compile_instep.sh [row-prefix]
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-bench/results/compile_instep}
mkdir -p "$OUT"
ROWS=(
  "v5p-8 tpu:v5p:2x2x1 fsdp=4 4"
  "v6e-8 tpu:v6e:2x4 fsdp=8 8"
  "h200-8 gpu:h200:8 fsdp=8 8"
)
for row in "${ROWS[@]}"; do
  read -r name target mesh rows <<<"$row"
  [[ $name == "${1:-}"* ]] || continue
  cmd=("$PYTHON" -m dspark_jax.train --verifier-name-or-path configs/qwen3_8b_shape/verifier
       --target-layer-ids 2 18 33 --mask-token-id 151643 --total-seq-len 8192 --num-layers 1
       --max-anchors 512 --hidden-states-backend jax --data-path "$OUT/no-data"
       --save-path "$OUT/ckpt-$name" --dry-run --compile-for "$target" --mesh "$mesh"
       --rows-per-step "$rows")
  {
    echo "# $(date -u +%FT%TZ) ${cmd[*]}"
    /usr/bin/time -v "${cmd[@]}"
    echo "# rc=$? $(date -u +%FT%TZ)"
  } >"$OUT/$name.log" 2>&1
  grep -E '^\[compile\]|^error' "$OUT/$name.log"
done
