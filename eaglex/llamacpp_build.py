"""How llama.cpp is built for the peer rows of `eaglex bench`: for the CPU it runs on, as its users build it.

A user who builds llama.cpp gets GGML_NATIVE=ON (-march=native): every vector extension of the CPU, AVX-512 and
VNNI included. One kernel family is known to crash on quantized models (ggml's AMX kernels, seen on a CPU with
AMX); on such a CPU the build spells out every other extension the CPU has and leaves AMX alone out, instead of
falling back to an AVX2-only build that no user runs. `python -m eaglex.llamacpp_build` prints the cmake flags
for this machine (tools/build_llamacpp.sh and the Makefile's llama-cpp-python build read them).

What a build compiled in is read back from llama.cpp itself: its servers log a `system_info` line with every
feature flag (`compiled_features`), which the bench stores beside each llama.cpp row.
"""
from __future__ import annotations

import platform
import re
import sys
from pathlib import Path

AMX = ("amx_tile", "amx_int8", "amx_bf16")
# /proc/cpuinfo flag -> ggml's cmake option, in the order ggml's CMakeLists declares them
GGML_OPTIONS = (
    ("avx", "GGML_AVX"), ("avx_vnni", "GGML_AVX_VNNI"), ("avx2", "GGML_AVX2"), ("bmi2", "GGML_BMI2"),
    ("avx512f", "GGML_AVX512"), ("avx512vbmi", "GGML_AVX512_VBMI"), ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"), ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"),
)


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo's text (read when not given; empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    return {f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


def cmake_flags(flags: set[str], machine: str | None = None) -> list[str]:
    """ggml's cmake flags for a CPU with these /proc/cpuinfo `flags`: native, unless the CPU has AMX, whose
    kernels crash on quantized models; then native off with every other x86 extension the CPU has on and AMX off.
    Not x86-64 (or no flags to go by): native, as users build it."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64") or not flags & set(AMX):
        return ["-DGGML_NATIVE=ON"]
    out = ["-DGGML_NATIVE=OFF"]
    out += [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in GGML_OPTIONS]
    out += [f"-DGGML_{a.upper()}=OFF" for a in AMX]
    return out


_FEATURE = re.compile(r"\b([A-Z][A-Z0-9_]+) = 1\b")


def compiled_features(log: str) -> list[str]:
    """The CPU features a llama.cpp build compiled in, from its `system_info:` log line (llama-server prints it at
    start: `system_info: n_threads = 2 ... | CPU : SSE3 = 1 | AVX = 1 | ... |`); [] when the log has none."""
    for line in log.splitlines():
        if "system_info:" in line:
            cpu = line.split("CPU :", 1)[1] if "CPU :" in line else line
            return _FEATURE.findall(cpu)
    return []


if __name__ == "__main__":
    print(" ".join(cmake_flags(cpu_flags())))
    sys.exit(0)
