#!/usr/bin/env bash
# eaglex's kernel library (kernels/) -> OUT/libeaglex_kernels.so (default build/kernels), with this machine's C++
# compiler and CMake; then its self-test (every ISA path this CPU runs equals the portable one, rows independent).
# ONNX Runtime's C API headers are fetched once into build/ort-headers/ from the npm registry: the package below
# carries Microsoft's headers (MIT, copied with them as LICENSE), C API version 29; the library asks ONNX Runtime
# for version 17, so onnxruntime >= 1.17 loads it.
# When it cannot build (no compiler, CMake or npm), it says why in one line and exits 1: engines then run on
# ONNX Runtime's stock ops. EAGLEX_ASAN=1: an AddressSanitizer build (its self-test runs under ASan).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build/kernels}
HEADERS=build/ort-headers
PKG=com.github.asus4.onnxruntime@0.4.9
SUB='package/Plugins/iOS~/onnxruntime.xcframework/ios-arm64_x86_64-simulator/onnxruntime.framework/Headers'
LOG=$OUT.log

skip() { echo "eaglex kernels: not built ($1): engines run on ONNX Runtime's stock ops" >&2; exit 1; }

command -v cmake >/dev/null || skip "no cmake"
command -v "${CXX:-c++}" >/dev/null || skip "no C++ compiler"
if [ ! -f "$HEADERS/onnxruntime_c_api.h" ]; then
  command -v npm >/dev/null || skip "no npm to fetch ONNX Runtime's C headers ($PKG)"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent "$PKG" >/dev/null 2>&1) || skip "npm pack $PKG failed"
  tar -xzf "$tmp"/*.tgz -C "$tmp" "$SUB" package/LICENSE 2>/dev/null || skip "$PKG has no headers at $SUB"
  mkdir -p "$(dirname "$HEADERS")" && rm -rf "$HEADERS.tmp" && mkdir "$HEADERS.tmp" &&
    cp "$tmp/$SUB"/*.h "$HEADERS.tmp/" && cp "$tmp/package/LICENSE" "$HEADERS.tmp/LICENSE" &&
    echo "$PKG" > "$HEADERS.tmp/SOURCE" && mv "$HEADERS.tmp" "$HEADERS" || skip "could not unpack the headers"
fi
mkdir -p "$(dirname "$OUT")"
asan=$([ -n "${EAGLEX_ASAN:-}" ] && echo ON || echo OFF)
{ cmake -S kernels -B "$OUT" -DORT_INCLUDE_DIR="$PWD/$HEADERS" -DEAGLEX_ASAN="$asan" &&
  cmake --build "$OUT" -j"$(nproc)"; } >"$LOG" 2>&1 || skip "the build failed: see $LOG"
if ! { "$OUT/eaglex_linear_test" && "$OUT/eaglex_attention_test"; } >>"$LOG" 2>&1; then
  rm -f "$OUT/libeaglex_kernels.so"
  skip "its self-test failed: see $LOG"
fi
echo "eaglex kernels: $OUT/libeaglex_kernels.so (linear $(tail -2 "$LOG" | head -1); attention $(tail -1 "$LOG"))"
