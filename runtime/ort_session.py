"""ONNX Runtime sessions for engines: one process-wide thread pool, engine-id checks, plain error messages.

All sessions of a process share one global intra-op pool sized to the physical cores:
with a pool per session, the idle spinning threads of the target's session competed with the draft's next call
and every call got 1.5-3x slower on 2 cores.
"""
from __future__ import annotations

import os
from pathlib import Path

import onnxruntime as ort

from eaglex.models.errors import ModelError

_pool_threads: int | None = None


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
    return so


def open_session(path: Path, engine_id: str, graph: str) -> ort.InferenceSession:
    """A CPU session on the global pool for one engine graph; checks that the graph belongs to the engine."""
    try:
        sess = ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - ORT raises its own types for a truncated or garbled protobuf
        raise ModelError(f"engine file {path} cannot be loaded ({str(e).splitlines()[0][:200]}): it is corrupt; "
                         "rebuild the engine with `eaglex build --force`") from None
    meta = sess.get_modelmeta().custom_metadata_map
    if meta.get("eaglex.engine_id") != engine_id or meta.get("eaglex.graph") != graph:
        raise ModelError(f"engine file {path} belongs to another engine (id {meta.get('eaglex.engine_id')}, graph "
                         f"{meta.get('eaglex.graph')}; this engine is {engine_id}): "
                         "rebuild with `eaglex build --force`")
    return sess
