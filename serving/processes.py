"""Process-group and shared-memory housekeeping for a tritonserver and its Python-backend stubs, read from /proc:
which processes are alive, which stubs serve which model, which /dev/shm files they map; stopping a group (SIGTERM,
then SIGKILL for what is left) and removing the shared-memory files a dead server or stub leaves behind.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

from .tritonserver import STUB


def proc_stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()            # after "pid (comm) "; comm may hold spaces


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    fields = proc_stat(pid)
    return fields is not None and fields[0] != "Z"


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            fields = proc_stat(int(d.name))
            if fields is not None and fields[0] != "Z" and int(fields[2]) == pgid:
                out.append(int(d.name))
    return out


def cmdline(pid: int) -> list[str]:
    try:
        return [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]
    except OSError:
        return []


def stubs(pgid: int) -> dict[int, dict]:
    """The Python-backend stub processes of a server's group: pid -> {model, instance, shm}. A stub's command line
    is `stub <repo>/<model>/<version>/model.py <shm region> <size> <growth> <server pid> <backend dir> <ipc>
    <instance name> ...`."""
    out = {}
    for pid in group_pids(pgid):
        argv = cmdline(pid)
        if argv and Path(argv[0]).name == STUB and len(argv) >= 3:
            out[pid] = {"model": Path(argv[1]).parent.parent.name, "shm": argv[2],
                        "instance": argv[8] if len(argv) > 8 else "?"}
    return out


def shm_files(pid: int) -> set[str]:
    """Names of the /dev/shm files a process maps."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    return {line.rsplit("/dev/shm/", 1)[1].split()[0] for line in text.splitlines() if "/dev/shm/" in line}


def remove_shm(names) -> list[str]:
    """Remove these /dev/shm files where they still exist; returns the ones removed."""
    removed = []
    for name in sorted(set(names)):
        if not name or "/" in name:
            continue
        try:
            os.unlink(f"/dev/shm/{name}")
            removed.append(name)
        except OSError:
            pass
    return removed


def stop_group(pgid: int, timeout: float, proc: subprocess.Popen | None = None) -> bool:
    """Stop a server whose pid (and process group) is `pgid`; True when it exited within `timeout` without SIGKILL.
    SIGTERM goes to the server alone (it stops its stubs itself); whatever is left in the group afterwards is
    killed."""
    def running() -> bool:
        return proc.poll() is None if proc is not None else alive(pgid)

    try:
        os.kill(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    clean = not running()
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        if not group_pids(pgid):
            break
        if sig == signal.SIGKILL or running():
            clean = clean and sig != signal.SIGKILL
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        end = time.monotonic() + wait
        while group_pids(pgid) and time.monotonic() < end:
            time.sleep(0.05)
    if proc is not None:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    return clean


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):                         # not Linux: no parent-death signal
    _prctl = None


def die_with_parent() -> None:
    """In the child before exec: SIGTERM when the supervisor goes away (even by SIGKILL)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
