"""A supervised server seen from outside, by its folder: `start` (in the background, returns once ready),
`running`, `stop` and the one-paragraph `describe` / `summary` that `eaglex serve status|stop` print. Everything is
found from the folder: its settings (serve.json), the pid file the supervisor writes and the state it keeps current.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .config import ADMIN_KEY, API_KEY_ENV, CONFIG, PID, SERVER_LOG, STATE, SUPERVISOR_LOG, ServeConfig, read_json
from .processes import alive, cmdline, describe_exit, group_pids, remove_shm, stop_group
from .tritonserver import HOST, http, triton_root


def running(folder) -> tuple[int, dict] | None:
    """(supervisor pid, its state) of the server running from `folder`; None when none is (a stale pid file is
    removed)."""
    pid_file = Path(folder) / PID
    info = read_json(pid_file)
    pid = (info or {}).get("pid")
    state = read_json(Path(folder) / STATE) or {}
    if isinstance(pid, int) and alive(pid) and state.get("supervisor_pid") == pid \
            and any("eaglex" in a for a in cmdline(pid)):
        return pid, state
    pid_file.unlink(missing_ok=True)
    return None


def _wait_gone(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return not alive(pid)


class Served:
    """A supervised server running from a folder (what `start` leaves running), seen from outside."""

    def __init__(self, folder, proc: subprocess.Popen | None = None):
        self.folder, self.proc = Path(folder).resolve(), proc
        self.pid = (read_json(self.folder / PID) or {}).get("pid")
        st = self.state()
        self.http_port, self.grpc_port, self.metrics_port = st["http_port"], st["grpc_port"], st["metrics_port"]
        self.url = f"http://{HOST}:{self.http_port}"
        self.log_path = self.folder / SERVER_LOG

    def state(self) -> dict:
        return read_json(self.folder / STATE) or {}

    @property
    def server_pid(self) -> int | None:
        return self.state().get("server_pid")

    @property
    def internal_url(self) -> str:
        return f"http://{HOST}:{self.state()['internal_http_port']}"

    def admin_key(self) -> str:
        return (self.folder / ADMIN_KEY).read_text().strip()

    def ready(self) -> bool:
        return http("GET", f"{self.url}/v2/health/ready", timeout=5)[0] == 200

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)

    def stop(self, timeout: float = 60.0) -> dict:
        st = stop(self.folder, timeout)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)             # reap it (start() made it our child)
            except subprocess.TimeoutExpired:
                pass
        return st


def start(config: ServeConfig, api_key: str | None = None) -> Served:
    """Save `config` in its folder, run the supervisor in the background (its own session) and wait until every
    model is ready. RuntimeError with the logs' tails when it does not get there."""
    folder = config.folder
    if (r := running(folder)) is not None:
        raise RuntimeError(f"a server is already running from {folder} (supervisor pid {r[0]}, state "
                           f"{r[1].get('state')}): stop it first (eaglex serve stop --dir {folder})")
    triton_root()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / STATE).unlink(missing_ok=True)
    sup_log, log = folder / SUPERVISOR_LOG, folder / SERVER_LOG
    env = dict(os.environ)
    env.pop(API_KEY_ENV, None)
    if api_key:
        env[API_KEY_ENV] = api_key
    cmd = [sys.executable, "-m", "eaglex.serving.supervisor", str(config.save())]
    with open(sup_log, "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env, cwd=folder)
    deadline = time.monotonic() + config.ready_timeout + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the supervisor exited ({describe_exit(proc.returncode)}) before the server was "
                               f"ready:\n{tail(sup_log)}\n--- {log}:\n{tail(log)}")
        st = read_json(folder / STATE) or {}
        if st.get("supervisor_pid") == proc.pid and st.get("state") == "ready" and st.get("ready"):
            return Served(folder, proc)
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _wait_gone(proc.pid, config.exit_timeout + 10)
    raise RuntimeError(f"the server was not ready after {config.ready_timeout:.0f} s:\n{tail(sup_log)}\n"
                       f"--- {log}:\n{tail(log)}")


def stop(folder, timeout: float | None = None) -> dict:
    """Stop the supervisor running from `folder` and wait for it; returns its final state ({} when none was
    running). A supervisor that does not stop in time is killed, and so is a tritonserver it left behind (its
    shared-memory files are removed). `timeout` defaults to the server's exit timeout + 20 s."""
    folder = Path(folder)
    if timeout is None:
        saved = read_json(folder / CONFIG) or {}
        timeout = float(saved.get("exit_timeout", 30)) + 20
    r = running(folder)
    t0 = time.monotonic()
    if r is not None:
        pid = r[0]
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGCONT)                 # a stopped (SIGSTOP) supervisor would never see the SIGTERM
        if not _wait_gone(pid, timeout):
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, 5)
        (folder / PID).unlink(missing_ok=True)
    st = read_json(folder / STATE) or {}
    if st.get("stopped"):
        return st
    server = st.get("server_pid")
    if not server or not alive(server) or "tritonserver" not in " ".join(cmdline(server)[:1]):
        if r is None:
            return {}
        st["stopped"] = {"how": "the supervisor was killed; tritonserver was not running"}
        return st
    clean = stop_group(server, 5.0)
    what = "its supervisor did not stop in time and was killed" if r is not None else "its supervisor was gone"
    st["stopped"] = {"server_pid": server, "seconds": round(time.monotonic() - t0, 2),
                     "how": f"{'exited' if clean else 'was killed'} ({what})",
                     "shm_removed": remove_shm(st.get("shm", [])), "left": group_pids(server),
                     "restarts": st.get("restarts", 0), "reloads": st.get("reloads", 0)}
    return st


def tail(path, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def summary(st: dict) -> str:
    """One line: how a stop went."""
    s = st.get("stopped") or {}
    if not s:
        return "stopped"
    parts = [f"stopped in {s['seconds']} s" if s.get("seconds") is not None else "stopped"]
    if s.get("server_pid"):
        parts.append(f"tritonserver pid {s['server_pid']} {s.get('how')}")
    elif s.get("how"):
        parts.append(s["how"])
    n = len(s.get("shm_removed", []))
    parts.append(f"{n} leftover shared-memory file(s) removed" if n else "no shared-memory files left")
    if s.get("left"):
        parts.append(f"processes still running: {s['left']}")
    parts.append(f"during this run: {s.get('restarts', 0)} server restart(s), {s.get('reloads', 0)} model reload(s)")
    return "; ".join(parts)


def describe(pid: int, st: dict) -> str:
    """What `eaglex serve status` prints about a running server."""
    url = st.get("url")
    return (f"supervisor pid {pid}: {st.get('state')}{' - ' + st['detail'] if st.get('detail') else ''}\n"
            f"  ready {st.get('ready')}{' (' + st['reason'] + ')' if st.get('reason') else ''}; tritonserver pid "
            f"{st.get('server_pid')}; {st.get('restarts', 0)} restart(s), {st.get('reloads', 0)} model reload(s)\n"
            f"  models  {', '.join(sorted(st.get('models') or {})) or 'none'}\n"
            f"  OpenAI  {url}/v1   (GET /models, POST /chat/completions, /completions; API key "
            f"{'required' if st.get('api_key') else 'not required'})\n"
            f"  Triton  {url}   (POST /v2/models/<name>/generate, /generate_stream)\n"
            f"  gRPC    {HOST}:{st.get('grpc_port')}\n"
            f"  metrics http://{HOST}:{st.get('metrics_port')}/metrics\n"
            f"  admin APIs {st.get('admin_api')}\n"
            f"  logs    {st.get('log')} (tritonserver), {Path(st.get('workdir', '.')) / SUPERVISOR_LOG} "
            "(supervisor; stdout with `eaglex serve run`)")
