"""The libraries vLLM's CPU build wants preloaded (LD_PRELOAD), found in one place for the bench and `make vllm-venv`.

vLLM's CPU worker runs its kernels under Intel OpenMP and allocates through tcmalloc; without them preloaded its
speculative decoding is slow or refuses to start. libiomp5.so comes from the `intel-openmp` wheel (in the venv's
lib/), libtcmalloc_minimal.so.4 from the distribution (Debian: libtcmalloc-minimal4).

Standard library only, so that the Makefile can run it as a script before eaglex is installed:
`python eaglex/vllm_env.py VENV/bin/python` prints the LD_PRELOAD value; `--tcmalloc` prints tcmalloc's path and
exits 1 when it is missing.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

IOMP = "libiomp5.so"
TCMALLOC = "libtcmalloc_minimal.so.4"
SYSTEM_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64",
                   "/usr/lib", "/usr/local/lib")


def venv_root(python: str | os.PathLike) -> Path:
    """The venv of `python` (VENV/bin/python): not resolved, as a venv's python is a link to the base interpreter."""
    return Path(os.path.abspath(python)).parent.parent


def find_iomp(python: str | os.PathLike) -> Path | None:
    """libiomp5.so of the venv of `python`: intel-openmp installs it into VENV/lib/ (else anywhere below lib/)."""
    lib = venv_root(python) / "lib"
    if (lib / IOMP).is_file():
        return lib / IOMP
    return next((p for p in sorted(lib.glob(f"**/{IOMP}")) if p.is_file()), None)


def find_tcmalloc(lib_dirs: tuple[str, ...] | None = None) -> Path | None:
    """The system's libtcmalloc_minimal.so.4: in the usual library folders, else where ldconfig knows it.
    `lib_dirs` given: only those folders (the tests' fake system)."""
    for d in lib_dirs if lib_dirs is not None else SYSTEM_LIB_DIRS:
        if (Path(d) / TCMALLOC).is_file():
            return Path(d) / TCMALLOC
    if lib_dirs is not None:
        return None
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():               # "\tlibtcmalloc_minimal.so.4 (libc6,x86-64) => /usr/lib/..."
        name, _, path = line.strip().partition(" => ")
        if name.split(" ")[0] == TCMALLOC and Path(path).is_file():
            return Path(path)
    return None


def preloads(python: str | os.PathLike, lib_dirs: tuple[str, ...] | None = None) -> list[Path]:
    """What to preload for vLLM run by `python`: Intel OpenMP, then tcmalloc, each only where found."""
    return [p for p in (find_iomp(python), find_tcmalloc(lib_dirs)) if p is not None]


def ld_preload(paths: list[Path], existing: str | None = None) -> str:
    """The LD_PRELOAD value: `paths` first, then what was already preloaded (`existing`), without repeats."""
    items = [str(p) for p in paths] + [s for s in (existing or "").replace(" ", ":").split(":") if s]
    return ":".join(dict.fromkeys(items))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--tcmalloc"]:
        found = find_tcmalloc()
        print(found or "")
        return 0 if found else 1
    if len(argv) != 1:
        print("usage: vllm_env.py VENV/bin/python | --tcmalloc", file=sys.stderr)
        return 2
    print(ld_preload(preloads(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
