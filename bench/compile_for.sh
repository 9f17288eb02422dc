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
)

for row in "${ROWS[@]}"; do
  read -r name target mesh rows extra <<<"$row"
  [[ $name == "${1:-}"* ]] || continue
  cmd=("$PYTHON" -m dspark_jax.train --config configs/kimi_k3/train.yaml --dry-run
       --compile-for "$target" --mesh "$mesh" --rows-per-step "$rows" ${extra:-})
  {
    echo "# $(date -u +%FT%TZ) ${cmd[*]}"
    /usr/bin/time -v "${cmd[@]}"
    echo "# rc=$? $(date -u +%FT%TZ)"
  } >"$OUT/$name.log" 2>&1
  grep -E '^\[compile\]|^error' "$OUT/$name.log"
done
