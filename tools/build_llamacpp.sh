#!/usr/bin/env bash
# Builds llama.cpp's llama-server and llama-quantize from the source vendored in the llama-cpp-python sdist, into
# $OUT/bin (default build/llama.cpp), reused when present. Prints one line and exits 1 when it cannot build.
# Usage: tools/build_llamacpp.sh [OUT] [PYTHON]
set -u
OUT=${1:-build/llama.cpp}
PY=${2:-.venv/bin/python}
SDIST=llama-cpp-python==0.3.36
fail() { echo "llama.cpp: $1: the llama.cpp rows are left out" >&2; exit 1; }
# Built for this CPU as its users build it: native, or where ggml's AMX kernels would be compiled in (they crashed
# on quantized models), every other extension of the CPU and AMX off (eaglex/llamacpp_build.py).
FLAGS=$("$PY" -m eaglex.llamacpp_build) || fail "could not choose the build flags"
if [ -x "$OUT/bin/llama-server" ] && [ -x "$OUT/bin/llama-quantize" ] && [ "$(cat "$OUT/bin/flags" 2>/dev/null)" = "$FLAGS" ]; then
	echo "llama.cpp: using the cached build in $OUT/bin ($FLAGS)"; exit 0
fi
command -v cmake >/dev/null || fail "cmake is not installed"
mkdir -p "$OUT/src"
if [ ! -d "$OUT/src/vendor/llama.cpp" ]; then
	"$PY" -m pip download -q --no-deps --no-binary=:all: -d "$OUT/sdist" "$SDIST" || fail "could not download the $SDIST sdist"
	tar -xzf "$OUT"/sdist/llama_cpp_python-*.tar.gz -C "$OUT/src" --strip-components=1 || fail "could not unpack the sdist"
fi
rm -rf "$OUT/cmake/CMakeCache.txt"           # flags of an earlier build must not linger in the cache
# shellcheck disable=SC2086
nice -n 19 cmake -S "$OUT/src/vendor/llama.cpp" -B "$OUT/cmake" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF $FLAGS \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF \
	>"$OUT/cmake.log" 2>&1 \
	|| fail "cmake configure failed (see $OUT/cmake.log)"
echo "llama.cpp: building llama-server and llama-quantize ($FLAGS; about 15 minutes on 2 cores, once; progress below)"
nice -n 19 cmake --build "$OUT/cmake" --config Release -j "${JOBS:-2}" --target llama-server llama-quantize \
	|| fail "the build failed"
mkdir -p "$OUT/bin" && cp "$OUT"/cmake/bin/llama-server "$OUT"/cmake/bin/llama-quantize "$OUT/bin/" \
	|| fail "the build finished without llama-server and llama-quantize"
echo "$FLAGS" > "$OUT/bin/flags"
echo "llama.cpp: built $OUT/bin/llama-server and $OUT/bin/llama-quantize"
