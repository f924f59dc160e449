"""A server process on a loopback port for the benchmarks' peers: started, ready when GET /health answers 200,
stopped; a ModelError naming the log's last line when it exits or is not ready in time."""
from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from eaglex.base.errors import ModelError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, log: Path, name: str, timeout: float, env: dict | None = None) \
        -> subprocess.Popen:
    """`cmd` started with its output in `log`, once http://127.0.0.1:`port`/health answers 200."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    stop(proc)
    lines = log.read_text(errors="replace").strip().splitlines()
    raise ModelError(f"{name} did not start ({lines[-1][:200] if lines else 'no output'}; log {log})")


def stop(proc: subprocess.Popen | None) -> None:
    """Terminate, then kill after 30 s."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
