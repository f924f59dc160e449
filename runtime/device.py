"""Where a backend runs, and the few moves between host and device the decode loop makes.

Entry points (the CLI, the Triton model, tools) resolve a device name once with `resolve_device` and pass the
result down; nothing else picks a device. The loop itself keeps the tree algebra and the accept decision on the
host (runtime/tree.py, verify.py: tens of nodes, numpy) and the models, caches and draft candidate pools on the
device, so a cycle on a GPU reads the device back twice: once for the drafted tree (`host`), once for the target's
argmax at every node. On the CPU both are no-ops.
"""
from __future__ import annotations

import torch

from eaglex.base.errors import ModelError

DEVICE_HELP = ('"auto" (the first visible CUDA GPU, else the CPU), "cpu", "cuda" or "cuda:N"')


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """A device name from a flag -> torch.device; a ModelError when this machine cannot run on it."""
    if isinstance(name, torch.device):
        name = str(name)
    text = (name or "auto").strip().lower()
    if text == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise ModelError(f"device must be {DEVICE_HELP}, got {name!r}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ModelError(f"device must be {DEVICE_HELP}, got {name!r}")
    if not torch.cuda.is_available():
        why = "this PyTorch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ModelError(f"device {text}: {why}; use --device cpu")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ModelError(f"device {text}: only {torch.cuda.device_count()} CUDA GPU(s) are visible")
    return torch.device("cuda", index)


def describe(device: torch.device) -> str:
    """One line naming the device, for reports: 'cpu' or 'cuda:0 (NVIDIA H200)'."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def device_of(backend) -> str:
    """Where a backend computes: "cpu" or "cuda:N" (a PyTorch backend's device, an ONNX Runtime backend's first
    execution provider's)."""
    kv = getattr(backend, "kv_device", None)
    if kv is not None:
        return "cpu" if kv[0] == "cpu" else f"{kv[0]}:{kv[1]}"
    return str(getattr(backend, "device", "cpu"))


def host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors on the CPU, read back with one synchronisation (copies queued first, then one wait)."""
    if all(t.device.type == "cpu" for t in tensors):
        return tensors
    out = tuple(t if t.device.type == "cpu" else t.to("cpu", non_blocking=True) for t in tensors)
    dev = next(t.device for t in tensors if t.device.type != "cpu")
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()
    return out


def to_device(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """`t` on `device`; host-to-device copies are queued without waiting (the driver stages pageable memory)."""
    if t is None or t.device == device:
        return t
    return t.to(device, non_blocking=True)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timing); nothing to wait for on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
