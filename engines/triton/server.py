"""Start, wait for and stop a real `tritonserver` on 127.0.0.1: the one `nvidia-pytriton==0.7.0` bundles (2.51.0,
Python backend only, runs on CPU). Used by `make serve` / `make serve-stop` and by the tests.

What the bundled server needs (shared/reference/env.md, Triton section), all done here:
- the Python backend's stub for this interpreter next to libtriton_python.so: a backend folder of symlinks
  (site-packages stays untouched); the bundled libraries are found through LD_LIBRARY_PATH, because the
  symlinked .so files' $ORIGIN rpaths would point into our folder;
- the interpreter's LIBDIR first on LD_LIBRARY_PATH, so the stub loads the libpython matching its stdlib;
- this environment's bin/ first on PATH: the stub derives sys.prefix (hence numpy<2 and eaglex) from it.

Every address is loopback. The server runs in its own session (process group, stubs included): stopping it
signals the server, waits for its exit, then clears anything left in the group, so nothing is left behind.

    python -m eaglex.engines.triton.server start --repo build/triton/model_repository --pid-file build/triton/server.pid
    python -m eaglex.engines.triton.server stop --pid-file build/triton/server.pid
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"
BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")


class TritonUnavailable(RuntimeError):
    """tritonserver is not installed (or not for this interpreter)."""


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
    return root / "python_backend_stubs" / f"{v.major}.{v.minor}" / "triton_python_backend_stub"


def prepare_backends(dest: str | Path) -> Path:
    """`dest/python/` = the bundled Python backend + this interpreter's stub (symlinks); returns `dest`."""
    root = triton_root()
    py = Path(dest) / "python"
    py.mkdir(parents=True, exist_ok=True)
    links = {f: root / "backends" / "python" / f for f in BACKEND_FILES}
    links["triton_python_backend_stub"] = stub_path(root)
    for name, target in links.items():
        link = py / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return Path(dest)


def server_env(base: dict | None = None) -> dict:
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
            verbose: int = 0) -> list[str]:
    return [str(triton_root() / "bin" / "tritonserver"),
            f"--model-repository={Path(repo).resolve()}", f"--backend-directory={Path(backends).resolve()}",
            f"--http-address={HOST}", f"--http-port={http_port}",
            f"--grpc-address={HOST}", f"--grpc-port={grpc_port}",
            f"--metrics-address={HOST}", f"--metrics-port={metrics_port}",
            "--allow-metrics=true", "--allow-gpu-metrics=false",
            f"--exit-timeout-secs={exit_timeout}", f"--log-verbose={verbose}"]


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()       # after "pid (comm) "; comm may hold spaces
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(d.name))
    return out


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


class TritonServer:
    """One tritonserver process (own process group) serving `repo` on loopback ports (0 = pick a free one).

    `exit_timeout`: how long Triton may take to unload on SIGTERM. The Python backend stops instances one after
    the other, about 1 s each for an empty model and 3 s for an eaglex instance on a busy 2-core machine, so keep
    it well above 3 s x instances."""

    def __init__(self, repo, workdir, http_port: int = 0, grpc_port: int = 0, metrics_port: int = 0,
                 exit_timeout: int = 30, log_path=None, verbose: int = 0):
        self.repo, self.workdir = Path(repo), Path(workdir)
        self.http_port, self.grpc_port, self.metrics_port = (p or free_port() for p in
                                                              (http_port, grpc_port, metrics_port))
        self.exit_timeout, self.verbose = exit_timeout, verbose
        self.log_path = Path(log_path) if log_path else self.workdir / "tritonserver.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> "TritonServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        backends = prepare_backends(self.workdir / "backends")
        cmd = command(self.repo, backends, self.http_port, self.grpc_port, self.metrics_port, self.exit_timeout,
                      self.verbose)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=server_env(), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def ready(self) -> bool:
        return _get(f"{self.url}/v2/health/ready") == 200

    def wait_ready(self, timeout: float = 180.0) -> float:
        """Seconds until ready; RuntimeError with the log's tail when the server exits or times out first."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.proc.returncode} before it was ready:\n"
                                   f"{self.log_tail()}")
            if self.ready():
                return time.monotonic() - t0
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"tritonserver was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> int | None:
        """SIGTERM the server, wait past Triton's exit timeout, kill what is left; returns the exit code."""
        if self.proc is None:
            return None
        stop_group(self.proc.pid, self.exit_timeout + 10, self.proc)
        return self.proc.returncode

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def stop_group(pgid: int, timeout: float, proc: subprocess.Popen | None = None) -> bool:
    """Stop the server whose pid (and process group) is `pgid`; True when it stopped without SIGKILL.

    SIGTERM goes to the server alone: it unloads its models and stops their stub processes itself (a stub that
    got the signal too would die under it, and the server would wait out its exit timeout). Whatever is left in
    the group afterwards is killed."""
    def alive() -> bool:
        if proc is not None:
            return proc.poll() is None
        return pgid in group_pids(pgid)

    try:
        os.kill(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline, clean = time.monotonic() + timeout, True
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive():
        clean = False
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        if not group_pids(pgid):
            break
        if sig == signal.SIGKILL:
            clean = False
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        end = time.monotonic() + wait
        while group_pids(pgid) and time.monotonic() < end:
            time.sleep(0.1)
    if proc is not None:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    return clean


# --- `make serve` / `make serve-stop` -------------------------------------------------------------------------------
def _is_tritonserver(pid: int) -> bool:
    try:
        return b"tritonserver" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return False


def _running(pid_file: Path) -> int | None:
    """The pid of the server a previous `start` left running, None when there is none (a stale file is removed)."""
    if not pid_file.is_file():
        return None
    text = pid_file.read_text().split()
    pid = int(text[0]) if text and text[0].isdigit() else 0
    if pid and _is_tritonserver(pid) and group_pids(pid):
        return pid
    pid_file.unlink()
    return None


def _check(args) -> int:
    pid = _running(Path(args.pid_file))
    if pid is not None:
        print(f"tritonserver is already running (pid {pid}): stop it first (make serve-stop)", file=sys.stderr)
        return 1
    return 0


def _start(args) -> int:
    pid_file = Path(args.pid_file)
    if _check(args):
        return 1
    try:
        server = TritonServer(args.repo, args.workdir or pid_file.parent, args.http_port, args.grpc_port,
                              args.metrics_port, args.exit_timeout, args.log).start()
    except TritonUnavailable as e:
        print(f"serve: {e}", file=sys.stderr)
        return 1
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    ports = {"http": server.http_port, "grpc": server.grpc_port, "metrics": server.metrics_port}
    pid_file.write_text(f"{server.pid}\n{json.dumps(ports)}\n")
    try:
        seconds = server.wait_ready(args.timeout)
    except RuntimeError as e:
        server.stop()
        pid_file.unlink(missing_ok=True)
        print(f"serve: {e}", file=sys.stderr)
        return 1
    print(f"tritonserver ready in {seconds:.1f} s (pid {server.pid}, log {server.log_path}):\n"
          f"  HTTP    {server.url}   (POST /v2/models/<name>/generate, /generate_stream)\n"
          f"  gRPC    {HOST}:{server.grpc_port}\n"
          f"  metrics http://{HOST}:{server.metrics_port}/metrics")
    return 0


def _stop(args) -> int:
    pid_file = Path(args.pid_file)
    pid = _running(pid_file)
    if pid is None:
        print(f"no server started with {pid_file} is running")
        return 0
    clean = stop_group(pid, args.exit_timeout + 10)
    pid_file.unlink()
    print(f"tritonserver (pid {pid}) stopped{'' if clean else ' (killed after the exit timeout)'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eaglex.engines.triton.server",
                                     description="start/stop the bundled tritonserver on 127.0.0.1")
    sub = parser.add_subparsers(dest="action", required=True)
    s = sub.add_parser("start", help="start in the background and wait until ready")
    s.add_argument("--repo", required=True, help="model repository (written by `eaglex triton`)")
    s.add_argument("--pid-file", required=True)
    s.add_argument("--log", help="server log (default: <workdir>/tritonserver.log)")
    s.add_argument("--workdir", help="backend folder and log go here (default: the pid file's folder)")
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--metrics-port", type=int, default=8002)
    s.add_argument("--timeout", type=float, default=300, help="seconds to wait for readiness")
    s.add_argument("--exit-timeout", type=int, default=30, help="Triton's --exit-timeout-secs")
    c = sub.add_parser("check", help="exit 1 when the server of this pid file is running")
    c.add_argument("--pid-file", required=True)
    t = sub.add_parser("stop", help="stop the server a `start` left running")
    t.add_argument("--pid-file", required=True)
    t.add_argument("--exit-timeout", type=int, default=30, help="seconds to wait before killing it")
    args = parser.parse_args(argv)
    return {"start": _start, "check": _check, "stop": _stop}[args.action](args)


if __name__ == "__main__":
    sys.exit(main())
