"""eaglex's kernel library (kernels/, C++): batch-invariant linear layers as ONNX Runtime custom ops of the
`eaglex` domain (LinearQ8, LinearF32). Where it is, whether it loads here, which ISA path it takes, and its
registration on session options.

Built by `make setup` (tools/build_kernels.sh) into build/kernels/, or shipped in the wheel next to this module.
EAGLEX_KERNELS_LIB names another copy; EAGLEX_ISA=avx512|avx2|portable forces a path (every path gives the same
bits; the default is the fastest this CPU runs).
"""
from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path

from eaglex.base.errors import ModelError
from eaglex.base.kernel_ops import DOMAIN, VERSION

__all__ = ["DOMAIN", "VERSION", "library_path", "available", "isa", "require", "register"]
LIBRARY = "libeaglex_kernels.so"
_HERE = Path(__file__).resolve().parent
SEARCH = (_HERE / LIBRARY, _HERE.parent / "build" / "kernels" / LIBRARY)
FIX = "build it with `make setup` (needs g++, CMake and npm), or rebuild the engine with `eaglex build --kernels stock`"


def library_path() -> Path | None:
    """The kernel library this process uses: EAGLEX_KERNELS_LIB, else the wheel's copy, else the repository's
    build/kernels/; None when there is none."""
    named = os.environ.get("EAGLEX_KERNELS_LIB")
    if named:
        return Path(named) if Path(named).is_file() else None
    return next((p for p in SEARCH if p.is_file()), None)


@lru_cache(maxsize=None)
def _load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.eaglex_kernels_isa.restype = ctypes.c_char_p
    lib.eaglex_kernels_version.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether a library of this VERSION loads here."""
    path = library_path()
    if path is None:
        return False
    try:
        return _load(str(path)).eaglex_kernels_version() == VERSION
    except (OSError, AttributeError):
        return False


def isa() -> str:
    """The ISA path sessions created now take ("avx512", "avx2", "portable"); ModelError for a bad EAGLEX_ISA."""
    require()
    text = _load(str(library_path())).eaglex_kernels_isa().decode()
    if text.startswith("error: "):
        raise ModelError(f"{text[7:]} (EAGLEX_ISA={os.environ.get('EAGLEX_ISA')!r})")
    return text


def require(what: str = "this engine uses eaglex's kernels") -> None:
    """ModelError in one line, naming the fix, unless the library loads here."""
    if available():
        return
    path = library_path()
    found = f"{path} is version {_version(path)}, not {VERSION}" if path else "the kernel library is not built here"
    raise ModelError(f"{what}, and {found}: {FIX}")


def _version(path: Path) -> str:
    try:
        return str(_load(str(path)).eaglex_kernels_version())
    except (OSError, AttributeError):
        return "unreadable"


def register(so) -> bool:
    """Register the library's ops on onnxruntime SessionOptions `so` when it is available; True if registered."""
    if not available():
        return False
    isa()                                            # a bad EAGLEX_ISA: one line here, not ORT's traceback
    so.register_custom_ops_library(str(library_path()))
    return True

