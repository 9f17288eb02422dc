#!/usr/bin/env bash
# The Python environment of tests/converters/test_sglang_jax_load.py (marker `sglang_jax`):
# a venv holding third_party/sglang_jax/requirements-cp311.lock (62 wheels pinned by
# sha256, CPython 3.11 on linux x86_64; binary wheels only, so nothing is built), in which
# the vendored sglang-jax subset (third_party/sglang_jax/python, on PYTHONPATH) imports.
# Cached outside the clone, keyed by the lock's sha256, and reused while it imports
# sgl_jax.srt.models.dspark. Prints the venv's python:
#   DSPARK_SGLANG_JAX_PYTHON=$(bash launch/engines/build_sglang_jax_venv.sh | tail -n 1) \
#   DSPARK_SGLANG_JAX_SRC=$PWD/third_party/sglang_jax/python python -m pytest -m sglang_jax
# Measured: ~1 min cold on 2 cores (~200 MB of wheels), ~10 s warm (the import check).
# Environment: DSPARK_SGLANG_JAX_VENV (default ~/.cache/dspark-jax/venv-sglang-jax-<sha>),
# PYTHON (the base interpreter, default python3, else python3.11: it must be 3.11).
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
lock="$root/third_party/sglang_jax/requirements-cp311.lock"
src="$root/third_party/sglang_jax/python"
key=$(sha256sum "$lock" | cut -c1-12)
venv="${DSPARK_SGLANG_JAX_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/dspark-jax/venv-sglang-jax-$key}"
python="$venv/bin/python"

imports() {
  JAX_PLATFORMS=cpu PYTHONPATH="$src" "$python" -c \
    'import sgl_jax.srt.models.dspark, sgl_jax.srt.configs.model_config' >/dev/null 2>&1
}

if ! { [ -x "$python" ] && imports; }; then
  base="${PYTHON:-python3}"
  is311='import sys; sys.exit(sys.version_info[:2] != (3, 11))'
  if ! "$base" -c "$is311" 2>/dev/null; then
    if [ -z "${PYTHON:-}" ] && command -v python3.11 >/dev/null; then
      base=python3.11
    else
      echo "error: $lock pins CPython 3.11 wheels; $base is $("$base" -V 2>&1)" \
        "(set PYTHON to a python3.11)" >&2
      exit 1
    fi
  fi
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$base" -m venv "$venv"
  "$python" -m pip install -q --disable-pip-version-check --only-binary=:all: \
    --require-hashes -r "$lock"
  if ! imports; then
    JAX_PLATFORMS=cpu PYTHONPATH="$src" "$python" -c 'import sgl_jax.srt.models.dspark' >&2 || true
    echo "error: sgl_jax.srt.models.dspark does not import in $venv" >&2
    exit 1
  fi
fi
echo "$python"
