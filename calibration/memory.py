"""How much memory a calibration needs, what this machine has, and where the target's weights go.

Placement rules (`plan`), for weights of W bytes in the calibration dtype (bfloat16 unless asked otherwise):
- CPU: the weights are read tensor by tensor into process memory (no memory map, so the bfloat16 pages are freed
  as ModelOpt's export turns them into FP8) and the peak stays near one copy: CPU_PEAK_RATIO x W plus the
  interpreter and libraries (HOST_BASE). Measured: 1.13 x W above the process baseline on a seeded 589 MiB target
  (tests/test_calibration_memory.py checks <= 1.3 x).
- GPUs: the weights are spread over the visible GPUs with a device map, using GPU_WEIGHT_FRACTION of each GPU's
  free memory (the rest is for activations, the CUDA context and the reference logits); what does not fit is
  offloaded to CPU RAM (slow, but bounded by the offloaded part). The host holds one checkpoint shard at a time
  while loading.
Anything that cannot fit is refused before a byte of weights is read, with one line saying what is needed.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from eaglex.base.errors import ModelError

GIB = 1024 ** 3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ST_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
                  "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
CPU_PEAK_RATIO = 1.3          # peak host RAM of a CPU calibration above the baseline, per byte of weights
HOST_BASE = 2 * GIB           # interpreter + torch + transformers + ModelOpt, and slack
GPU_WEIGHT_FRACTION = 0.90    # of each GPU's free memory given to weights when spreading them


@dataclass(frozen=True)
class Machine:
    """What this machine has free: per-GPU (free, total) bytes and available RAM."""
    gpus: tuple[tuple[int, int], ...]
    ram_available: int
    gpu_names: tuple[str, ...] = ()

    @property
    def gpu_free(self) -> int:
        return sum(f for f, _ in self.gpus)

    def describe(self) -> str:
        gpus = (f"{len(self.gpus)} GPU(s) with {gb(self.gpu_free)} GB free" if self.gpus else "no CUDA GPU")
        return f"{gpus} and {gb(self.ram_available)} GB of available RAM"


@dataclass(frozen=True)
class Placement:
    """Where the calibration runs: kind "cpu" or "gpu"; for GPUs the device map arguments of from_pretrained."""
    kind: str
    device_map: dict | str | None = None
    max_memory: dict = field(default_factory=dict)
    offloaded: int = 0            # bytes of weights offloaded to CPU RAM (GPU placement only)
    note: str = ""


def gb(n: float) -> str:
    return f"{n / 1e9:.1f}"


def probe() -> Machine:
    """Free memory of every visible CUDA GPU (torch.cuda.mem_get_info) and MemAvailable of /proc/meminfo."""
    gpus, names = [], []
    try:
        import torch
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                free, total = torch.cuda.mem_get_info(i)
                gpus.append((int(free), int(total)))
                names.append(torch.cuda.get_device_name(i))
    except Exception:  # noqa: BLE001 - a broken CUDA setup counts as no GPU
        gpus, names = [], []
    return Machine(tuple(gpus), ram_available(), tuple(names))


def ram_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


# ------------------------------------------------------------------------------------------------ weight sizes

def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (names, dtypes, shapes), read without touching the tensors."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def checkpoint_params(folder) -> dict[str, int]:
    """{safetensors dtype: number of values} over a folder's *.safetensors (headers only)."""
    out: dict[str, int] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        for name, info in safetensors_header(f).items():
            if name == "__metadata__":
                continue
            n = 1
            for d in info["shape"]:
                n *= d
            out[info["dtype"]] = out.get(info["dtype"], 0) + n
    return out


def weights_bytes(folder, dtype: str) -> int:
    """Bytes the folder's floating-point weights take once loaded in `dtype` (integer tensors as stored). Falls back
    to the size of pytorch_model*.bin files for checkpoints without safetensors."""
    params = checkpoint_params(folder)
    if not params:
        bins = sorted(Path(folder).glob("pytorch_model*.bin"))
        if not bins:
            raise ModelError(f"{folder} holds no weights (*.safetensors or pytorch_model*.bin)")
        return sum(f.stat().st_size for f in bins)   # stored dtype; an estimate
    total = 0
    for dt, n in params.items():
        floating = dt.startswith(("F", "BF"))
        total += n * (DTYPE_BYTES[dtype] if floating else ST_DTYPE_BYTES.get(dt, 4))
    return total


# -------------------------------------------------------------------------------------------------- placement

def cpu_need(weight_bytes: int) -> int:
    return int(weight_bytes * CPU_PEAK_RATIO) + HOST_BASE


def plan(weight_bytes: int, device: str, machine: Machine, dtype: str = "bfloat16") -> Placement:
    """Where a calibration of `weight_bytes` of weights runs on `machine`, or a one-line ModelError naming the need.
    device: "auto" (the GPUs when there are any, else the CPU), "cpu", "cuda" (all visible GPUs) or "cuda:N"."""
    w = gb(weight_bytes)
    if device == "cpu" or (device == "auto" and not machine.gpus):
        need = cpu_need(weight_bytes)
        if machine.ram_available < need:
            where = "" if machine.gpus or device == "cpu" else " (no CUDA GPU here)"
            raise ModelError(f"calibrating on the CPU{where} needs about {gb(need)} GB of RAM ({CPU_PEAK_RATIO} x the "
                             f"{w} GB of {dtype} weights + {gb(HOST_BASE)} GB); this machine has "
                             f"{gb(machine.ram_available)} GB available")
        return Placement("cpu", note=f"CPU, {w} GB of {dtype} weights in RAM")
    if device.startswith("cuda:"):
        try:
            index = int(device.split(":", 1)[1])
        except ValueError:
            raise ModelError(f"--device {device!r}: use auto, cpu, cuda or cuda:N") from None
        if index >= len(machine.gpus):
            raise ModelError(f"--device {device}: this machine has {len(machine.gpus)} CUDA GPU(s)")
        cap = int(machine.gpus[index][0] * GPU_WEIGHT_FRACTION)
        if weight_bytes > cap:
            raise ModelError(f"calibrating on {device} needs {w} GB of {dtype} weights on it; it has "
                             f"{gb(machine.gpus[index][0])} GB free (use --device cuda to spread the weights over "
                             "every visible GPU)")
        return Placement("gpu", device_map={"": index}, note=f"{device}, {w} GB of {dtype} weights")
    if device not in ("auto", "cuda"):
        raise ModelError(f"--device {device!r}: use auto, cpu, cuda or cuda:N")
    if not machine.gpus:
        raise ModelError("--device cuda: this machine has no CUDA GPU")
    caps = [int(free * GPU_WEIGHT_FRACTION) for free, _ in machine.gpus]
    if weight_bytes <= caps[0]:
        return Placement("gpu", device_map={"": 0}, note=f"cuda:0, {w} GB of {dtype} weights")
    max_memory: dict = {i: c for i, c in enumerate(caps)}
    offload = max(0, weight_bytes - sum(caps))
    if offload:
        host = machine.ram_available - HOST_BASE
        if offload > host:
            raise ModelError(f"calibrating needs {w} GB of {dtype} weights on GPUs (or offloaded to RAM): "
                             f"{len(caps)} GPU(s) take {gb(sum(caps))} GB ({int(GPU_WEIGHT_FRACTION * 100)} % of "
                             f"{gb(machine.gpu_free)} GB free) and {gb(max(host, 0))} GB of RAM is left for the other "
                             f"{gb(offload)} GB")
        max_memory["cpu"] = host
    return Placement("gpu", device_map="auto", max_memory=max_memory, offloaded=offload,
                     note=f"{len(caps)} GPU(s), {w} GB of {dtype} weights"
                          + (f", {gb(offload)} GB offloaded to CPU RAM (slow)" if offload else ""))
