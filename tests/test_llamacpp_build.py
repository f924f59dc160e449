"""The llama.cpp peer is built for the CPU it runs on: native, or on a CPU with AMX (whose ggml kernels crashed on
quantized models) every other extension the CPU has, AMX alone off; and the features a build compiled in are read
back from its own system_info line."""
from __future__ import annotations

import pytest

from eaglex.llamacpp_build import cmake_flags, compiled_features, cpu_flags

EPYC = "fpu sse4_2 avx f16c fma avx2 bmi2 avx512f avx512dq avx512bw avx512vl avx512vbmi avx512_vnni avx512_bf16"
SAPPHIRE = EPYC + " avx_vnni amx_tile amx_int8 amx_bf16"
AVX2_ONLY = "fpu sse4_2 avx f16c fma avx2 bmi2"


@pytest.mark.parametrize("flags, machine, expected", [
    (EPYC, "x86_64", ["-DGGML_NATIVE=ON"]),                       # AVX-512 + VNNI, no AMX: native
    (AVX2_ONLY, "x86_64", ["-DGGML_NATIVE=ON"]),
    ("", "x86_64", ["-DGGML_NATIVE=ON"]),                         # nothing to go by: as users build it
    (SAPPHIRE, "aarch64", ["-DGGML_NATIVE=ON"]),                  # not x86: the AMX flags mean nothing
    (SAPPHIRE, "x86_64", ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX_VNNI=ON", "-DGGML_AVX2=ON",
                          "-DGGML_BMI2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON",
                          "-DGGML_AVX512_BF16=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AMX_TILE=OFF",
                          "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]),
    ("avx avx2 fma f16c amx_tile", "x86_64", ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX_VNNI=OFF",
                                              "-DGGML_AVX2=ON", "-DGGML_BMI2=OFF", "-DGGML_AVX512=OFF",
                                              "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF",
                                              "-DGGML_AVX512_BF16=OFF", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                                              "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]),
])
def test_build_flags_for_a_cpu(flags, machine, expected):
    assert cmake_flags(cpu_flags(f"processor\t: 0\nflags\t\t: {flags}\n"), machine) == expected


def test_cpu_flags_read_every_flags_line():
    assert cpu_flags("flags : a b\nbogus : c\nflags : b d\n") == {"a", "b", "d"}
    assert cpu_flags("") == set()


def test_compiled_features_from_system_info():
    log = ("main: loading model\n"
           "system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | "
           "AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | "
           "AVX512_BF16 = 1 | AMX_INT8 = 0 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |\n")
    assert compiled_features(log) == ["SSE3", "SSSE3", "AVX", "AVX2", "F16C", "FMA", "BMI2", "AVX512",
                                      "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "LLAMAFILE", "OPENMP", "REPACK"]
    assert compiled_features("no such line\n") == []
