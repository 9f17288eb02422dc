#!/usr/bin/env bash
# The JAX train step on one NVIDIA GPU, with MFU: bench/train_step.py per preset.
#
#   bash bench/gpu.sh [PRESET ...]          # default: small k3-shape
#
# MFU = model FLOPs per step (train_step.py's analytic count: projections, MLP,
# attention over the visible context, fc, Markov bias, draft + target vocab logits;
# backward 2x forward on trainable paths) / step time / the GPU's dense bf16 peak
# (from nvidia-smi's name: H100/H200 989.4 TFLOP/s, B200 2250, A100 312; override
# with PEAK_TFLOPS). One packed row per step, as one data-parallel rank of the seed
# run (docs/seed_run.md: S 8192, A 1024, block 8 on 4 GPUs).
#
# Environment (all optional):
#   PYTHON        interpreter with jax[cuda] + flax + optax (default: python3)
#   STEPS WARMUP  timed / untimed steps (default 10 / 3)
#   EXTRA         more train_step.py flags, e.g. "--remat --profile"
#   PEAK_TFLOPS   peak bf16 TFLOP/s for MFU
#   OUT           folder for the JSONL log (default: $OUT if set, else bench/results)
#   TIMEOUT       seconds per preset (default 420)
#   ALLOW_CPU=1   run even without a GPU (to check this script; no MFU unless PEAK_TFLOPS)
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
py=${PYTHON:-python3}
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
presets=("$@")
[ ${#presets[@]} -gt 0 ] || presets=(small k3-shape)
out=${OUT:-$repo/bench/results}
mkdir -p "$out"
log="$out/gpu_$(date +%Y%m%d_%H%M%S).jsonl"

if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
fi
"$py" - <<'EOF' | tee -a "$log"
import json, os, sys
import jax, flax, optax
backend = jax.default_backend()
print(json.dumps({"bench": "gpu_env", "backend": backend, "devices": [d.device_kind for d in jax.devices()],
                  "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
                  "python": sys.version.split()[0]}), flush=True)
if backend != "gpu" and os.environ.get("ALLOW_CPU") != "1":
    sys.exit(f"bench/gpu.sh: JAX sees no GPU (backend {backend!r}); install jax[cuda] or set ALLOW_CPU=1")
EOF

status=0
for preset in "${presets[@]}"; do
    # shellcheck disable=SC2086
    timeout "${TIMEOUT:-420}" "$py" bench/train_step.py --impl jax --preset "$preset" \
        --steps "${STEPS:-10}" --warmup "${WARMUP:-3}" \
        ${PEAK_TFLOPS:+--peak-tflops "$PEAK_TFLOPS"} ${EXTRA:-} | tee -a "$log" || status=$?
done
echo "bench/gpu.sh: results in $log" >&2
exit $status
