"""The tritonserver that `nvidia-pytriton==0.7.0` bundles (2.51.0, Python backend only, CPU): where it is, the
environment its Python-backend stub needs, and its command line (loopback addresses, explicit model control, the
administrative APIs restricted to a header key). `http` is the small client the supervisor and `eaglex serve` use to
ask it (and the front) questions.
"""
from __future__ import annotations

import importlib.util
import os
import socket
import sys
import sysconfig
import urllib.error
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"
ADMIN_HEADER = "triton-admin-key"
BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
STUB = "triton_python_backend_stub"
ADMIN_APIS = "shared-memory,model-repository,logging,trace"

class TritonUnavailable(RuntimeError):
    """tritonserver is not installed (or not for this interpreter)."""


# --- the bundled tritonserver ----------------------------------------------------------------------------------------
def triton_root() -> Path:
    """pytriton's bundled `tritonserver` folder (bin/, backends/, python_backend_stubs/), found without importing
    pytriton (which would pull in grpc and zmq)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonUnavailable("tritonserver is not installed: pip install -e '.[triton]' "
                                "(nvidia-pytriton==0.7.0 bundles tritonserver 2.51 with the Python backend)")
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise TritonUnavailable(f"{root}/bin/tritonserver is missing: reinstall nvidia-pytriton==0.7.0")
    if not stub_path(root).is_file():
        raise TritonUnavailable(f"nvidia-pytriton has no Python backend stub for Python "
                                f"{sys.version_info.major}.{sys.version_info.minor}")
    return root


def stub_path(root: Path) -> Path:
    v = sys.version_info
    return root / "python_backend_stubs" / f"{v.major}.{v.minor}" / STUB


def prepare_backends(dest: str | Path) -> Path:
    """`dest/python/` = the bundled Python backend + this interpreter's stub (symlinks; site-packages stays
    untouched); returns `dest`."""
    root = triton_root()
    py = Path(dest) / "python"
    py.mkdir(parents=True, exist_ok=True)
    links = {f: root / "backends" / "python" / f for f in BACKEND_FILES}
    links[STUB] = stub_path(root)
    for name, target in links.items():
        link = py / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return Path(dest)


def server_env(base: dict | None = None) -> dict:
    """The interpreter's LIBDIR first on LD_LIBRARY_PATH (the stub must load the libpython matching its stdlib),
    the bundled libraries next (the symlinked .so files' $ORIGIN rpaths point into our folder), and this
    environment's bin/ first on PATH (the stub derives sys.prefix, hence numpy<2 and eaglex, from it)."""
    env = dict(os.environ if base is None else base)
    root = triton_root()
    libs = [sysconfig.get_config_var("LIBDIR"), str(root.parent.parent / "nvidia_pytriton.libs"),
            env.get("LD_LIBRARY_PATH")]
    env["LD_LIBRARY_PATH"] = ":".join(p for p in libs if p)
    env["PATH"] = os.pathsep.join(p for p in (str(Path(sys.executable).parent), env.get("PATH")) if p)
    env.pop("PYTHONHOME", None)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def command(repo, backends, http_port: int, grpc_port: int, metrics_port: int, exit_timeout: int = 30,
            admin_key: str | None = None, verbose: int = 0) -> list[str]:
    """tritonserver's command line. `admin_key` None leaves the administrative APIs open."""
    cmd = [str(triton_root() / "bin" / "tritonserver"),
           f"--model-repository={Path(repo).resolve()}", f"--backend-directory={Path(backends).resolve()}",
           f"--http-address={HOST}", f"--http-port={http_port}",
           f"--grpc-address={HOST}", f"--grpc-port={grpc_port}",
           f"--metrics-address={HOST}", f"--metrics-port={metrics_port}",
           "--allow-metrics=true", "--allow-gpu-metrics=false",
           "--model-control-mode=explicit", "--load-model=*", "--strict-readiness=true", "--exit-on-error=true",
           f"--exit-timeout-secs={exit_timeout}", f"--log-verbose={verbose}"]
    if admin_key is not None:
        cmd += [f"--http-restricted-api={ADMIN_APIS}:{ADMIN_HEADER}={admin_key}",
                f"--grpc-restricted-protocol={ADMIN_APIS}:{ADMIN_HEADER}={admin_key}"]
    return cmd


def http(method: str, url: str, headers: dict | None = None, body: bytes | None = None,
         timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body); status 0 when nothing answered."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError, ValueError):
        return 0, b""


