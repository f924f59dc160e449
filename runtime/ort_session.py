"""ONNX Runtime sessions for engines: one process-wide thread pool, execution providers, engine-id checks, plain
error messages.

All sessions of a process share one global intra-op pool sized to the physical cores:
with a pool per session, the idle spinning threads of the target's session competed with the draft's next call
and every call got 1.5-3x slower on 2 cores.

Providers: the CPU by default; on a GPU (`choose_providers("cuda:N")`, or an explicit list such as
TensorrtExecutionProvider,CUDAExecutionProvider) the graphs run on the CUDA or TensorRT execution provider of the
onnxruntime-gpu package, with the CPU provider behind them for any node they do not take.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

import onnxruntime as ort

from eaglex.base.errors import ModelError

from . import kernels

_pool_threads: int | None = None
GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")


def physical_cores() -> int:
    """Cores (not hyper-threads) this process may run on."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for c in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")     # x86 instructions that sum u8 x s8 products in int32


def u8s8_saturates(cpuinfo: str | None = None, machine: str | None = None) -> bool:
    """Whether ONNX Runtime's uint8 x int8 GEMM (MatMulInteger, w8a8 engines) saturates on this CPU: on x86-64
    without VNNI or AMX its kernel adds pairs of products in int16 (VPMADDUBSW), which clips where large activations
    meet large weights: quality drops, and whether rows stay independent of the call (speculation's exactness
    rests on it) is untested there. `cpuinfo`, `machine`: /proc/cpuinfo's text and the architecture, for tests."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64"):
        return False
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False                        # not Linux: no way to tell, say nothing
    flags = {f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    return not flags & set(INT8_DOT_FLAGS)


def use_global_pool(threads: int | None = None) -> int:
    """Create the process-wide pool once (threads = physical cores by default); returns its size.

    ORT allows this once per process; if something else created the pools already, they are reused as they are.
    """
    global _pool_threads
    if _pool_threads is None:
        want = threads or physical_cores()
        try:
            ort.set_global_thread_pool_sizes(want, 1)
        except Exception:  # noqa: BLE001 - "Global thread pools have already been created": keep those
            pass
        _pool_threads = want
    return _pool_threads


def session_options() -> ort.SessionOptions:
    """Options for any session of this process: on the global pool (once that exists ORT refuses sessions with
    their own threads, so the build's parity check uses it too)."""
    use_global_pool()
    so = ort.SessionOptions()
    so.use_per_session_threads = False
    so.log_severity_level = 3
    # FP8 engines (DQ-only weights): fold each weight's DequantizeLinear into a constant at load. Unfolded, the CPU
    # EP dequantizes every weight on every run and its MatMul cannot prepack it: a one-token step then takes MLAS's
    # M=1 kernel and a tree verification the blocked GEMM, the rows differ in the last bit, and the activations'
    # FP8 rounding turns that into whole FP8 steps, so greedy speculative != vanilla at near-ties. Folded, the
    # weights are packed constants as in fp32 engines (M-independent rows; one-token steps 3-4x faster). The
    # numbers stay the checkpoint's: DequantizeLinear is exact and the activation Q/DQ pairs stay; the QDQ passes
    # this turns off (Q/DQ propagation, fusions into int8 kernels) change nothing in FP8 or MatMulNBits graphs.
    so.add_session_config_entry("session.disable_quant_qdq", "1")
    kernels.register(so)                # eaglex's ops, for engines built on them (runtime/kernels.py)
    return so


def choose_providers(device: str | None = "cpu", providers: str | list[str] | None = None) -> list:
    """Execution providers for `device` ("cpu", "cuda", "cuda:N", or "auto": CUDA when onnxruntime-gpu is installed
    and a GPU is visible, else the CPU), or the explicit `providers` (names in order of preference, a list or a
    comma-separated string). GPU providers get the device id; the CPU provider always comes last, as the fallback
    for nodes the others do not take. A ModelError names what this ONNX Runtime lacks."""
    available = ort.get_available_providers()
    text = str(device or "cpu").strip().lower()
    index = int(text.split(":", 1)[1]) if text.startswith("cuda:") and text.split(":", 1)[1].isdigit() else 0
    if providers:
        names = [p.strip() for p in (providers.split(",") if isinstance(providers, str) else providers) if p.strip()]
        missing = [n for n in names if n not in available]
        if missing:
            raise ModelError(f"this ONNX Runtime ({ort.__version__}) has no {', '.join(missing)}; it has "
                             f"{', '.join(available)} (GPU providers come with the onnxruntime-gpu package)")
    elif text == "cpu" or (text == "auto" and not (_gpu_visible() and "CUDAExecutionProvider" in available)):
        names = ["CPUExecutionProvider"]
    elif text in ("auto", "cuda") or text.startswith("cuda:"):
        if "CUDAExecutionProvider" not in available:
            raise ModelError(f"ONNX Runtime engines on {text} need the onnxruntime-gpu package (this one, "
                             f"{ort.__version__}, has {', '.join(available)}); or use --device cpu")
        names = ["CUDAExecutionProvider"]
    else:
        raise ModelError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    out = [(n, {"device_id": index}) if n in GPU_PROVIDERS else n for n in names]
    return out if "CPUExecutionProvider" in names else out + ["CPUExecutionProvider"]


def provider_device(providers: list | None) -> tuple[str, int]:
    """Where the first provider keeps tensors, as IOBinding spells it: ("cuda", id) or ("cpu", 0)."""
    first = (providers or ["CPUExecutionProvider"])[0]
    name, opts = first if isinstance(first, tuple) else (first, {})
    return ("cuda", int(opts.get("device_id", 0))) if name in GPU_PROVIDERS else ("cpu", 0)


def _gpu_visible() -> bool:
    import torch
    return torch.cuda.is_available()


def open_session(path: Path, engine_id: str, graph: str, providers: list | None = None) -> ort.InferenceSession:
    """A session on the global pool for one engine graph (CPU unless `providers` say otherwise, see
    choose_providers); checks that the graph belongs to the engine and that a GPU provider asked for is running."""
    providers = providers or ["CPUExecutionProvider"]
    try:
        sess = ort.InferenceSession(str(path), session_options(), providers=providers)
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001 - ORT raises its own types for a truncated or garbled protobuf
        raise ModelError(f"engine file {path} cannot be loaded ({str(e).splitlines()[0][:200]}): it is corrupt; "
                         "rebuild the engine with `eaglex build --force`") from None
    wanted = [p[0] if isinstance(p, tuple) else p for p in providers]
    lost = [p for p in wanted if p != "CPUExecutionProvider" and p not in sess.get_providers()]
    if lost:
        raise ModelError(f"ONNX Runtime could not start {', '.join(lost)} for {path.name} (it runs "
                         f"{', '.join(sess.get_providers())}): check the CUDA/cuDNN/TensorRT libraries it needs, "
                         "or use --device cpu")
    meta = sess.get_modelmeta().custom_metadata_map
    if meta.get("eaglex.engine_id") != engine_id or meta.get("eaglex.graph") != graph:
        raise ModelError(f"engine file {path} belongs to another engine (id {meta.get('eaglex.engine_id')}, graph "
                         f"{meta.get('eaglex.graph')}; this engine is {engine_id}): "
                         "rebuild with `eaglex build --force`")
    return sess


def outputs(io: ort.IOBinding):
    """The bound outputs of the last run, as ORT's own values: the Python wrapper's get_outputs wraps every one,
    the KV buffers' too (~50 us a step for a 30-layer target), where the callers read the first few."""
    return io._iobinding.get_outputs()
