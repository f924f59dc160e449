"""Run the tritonserver that `nvidia-pytriton==0.7.0` bundles (2.51.0, Python backend only, CPU) under a supervisor,
on 127.0.0.1. `make serve` / `make serve-stop` and the tests use it.

    python tools/triton_server.py start --repo build/triton/model_repository --pid-file build/triton/server.pid
    python tools/triton_server.py status --pid-file build/triton/server.pid
    python tools/triton_server.py stop --pid-file build/triton/server.pid
    python tools/triton_server.py run --repo ...      # the same supervisor in the foreground (systemd, containers)

`start` launches `run` in the background and returns once the model is ready. One supervisor process:
- runs tritonserver (its own process group; it gets SIGTERM if the supervisor dies) in explicit model-control mode,
  with the administrative APIs (shared memory, model repository, logging, trace) restricted, on HTTP and gRPC, to
  requests carrying the `triton-admin-key` header whose value it writes to `<workdir>/admin-key` (mode 0600), unless
  `--open-admin-api` is given;
- serves the public HTTP port itself with the front guard (triton_front.py): size and JSON-depth limits before
  Triton's parser, type and range checks of generate requests, readiness from the real state, admin APIs refused;
  tritonserver's HTTP port is an internal loopback port;
- watches tritonserver and each model's Python-backend stub processes. When tritonserver dies it is restarted (with
  a backoff when it keeps dying); when a stub dies its model is reloaded through Triton's model-control API
  (unload + load), or tritonserver is restarted when the unload cannot finish (requests already waited on the dead
  stub: Triton 2.51 then never completes the unload). The HTTP requests that were inside a dead stub, which Triton
  never answers, are ended by the front with a 503 (or an error event in a stream). Shared-memory files of a dead
  server or stub are removed;
- on SIGTERM/SIGINT stops tritonserver (gracefully when it is healthy, quickly when it is not), removes leftovers and
  writes what happened to its state file (`stop` prints it).

What the bundled server needs (the stub next to the backend, LIBDIR and the venv first on the paths) is set up here.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import importlib.util
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_front import ADMIN_HEADER, Front  # noqa: E402

HOST = "127.0.0.1"
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


# --- processes -------------------------------------------------------------------------------------------------------
def _stat(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()            # after "pid (comm) "; comm may hold spaces


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            fields = _stat(int(d.name))
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


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the supervisor goes away (even by SIGKILL)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


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


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def read_json(path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


# --- the supervisor ----------------------------------------------------------------------------------------------------
class Supervisor:
    """One tritonserver and its front, kept serving; see the module docstring. Runs in an asyncio loop (`run`)."""

    TICK = 0.25                 # seconds between checks of the processes
    UNLOAD_WAIT = 15.0          # after a reload: an old instance still unloading then is stuck for good
    PROBE_EVERY, PROBE_FAILS = 5.0, 6    # a server that does not answer /v2/health/live 6 times in a row: restart

    def __init__(self, repo, workdir, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                 exit_timeout: int = 30, log=None, state_file=None, pid_file=None, open_admin: bool = False,
                 max_body: int = 1 << 20, max_depth: int = 64, ready_timeout: float = 300.0, verbose: int = 0):
        self.repo, self.workdir = Path(repo).resolve(), Path(workdir).resolve()
        self.http_port = http_port
        self.grpc_port, self.metrics_port = grpc_port or free_port(), metrics_port or free_port()
        self.internal_port = 0
        self.exit_timeout, self.ready_timeout, self.verbose = exit_timeout, ready_timeout, verbose
        self.log_path = Path(log) if log else self.workdir / "tritonserver.log"
        self.state_file = Path(state_file) if state_file else self.workdir / "supervisor.json"
        self.pid_file = Path(pid_file) if pid_file else None
        self.admin_open = open_admin
        self.admin_key = secrets.token_urlsafe(24)
        self.max_body, self.max_depth = max_body, max_depth

        self.proc: subprocess.Popen | None = None
        self.state, self.detail = "starting", "tritonserver is starting"
        self.models: dict[str, dict] = {}        # name -> {"ready": bool, "reason": str, "inputs": {...}}
        self.tracked: dict[int, dict] = {}       # stub pid -> {model, instance, shm}
        self.shm: set[str] = set()               # /dev/shm files of the current server and its stubs
        self.restarts = self.reloads = 0
        self.events: list[dict] = []
        self.unhealthy: dict[str, str] = {}      # model -> Triton's message, reported by the front
        self.stuck: set[str] = set()             # models with an old instance Triton cannot finish unloading
        self.probe_failures = 0
        self.stopping = False
        self.wake: asyncio.Event | None = None
        self.stop_event: asyncio.Event | None = None
        self.front: Front | None = None

    # --- what the front asks ------------------------------------------------------------------------------------
    def upstream(self):
        if self.state != "ready" or self.proc is None or self.proc.poll() is not None:
            return None
        return HOST, self.internal_port

    def health(self) -> tuple[bool, bool, str]:
        """(live, ready, reason). live: every process of the deployment is up (false from the moment one is found
        dead until it has been replaced); ready: live and every model can serve."""
        if self.state != "ready":
            return False, False, self.detail
        if self.proc is None or self.proc.poll() is not None:
            return False, False, "tritonserver is not running; the supervisor restarts it"
        down = [f"model {m}: {info['reason']}" for m, info in self.models.items() if not info["ready"]]
        if down:
            return False, False, "; ".join(down)
        return True, True, ""

    def model_ready(self, name: str) -> tuple[bool | None, str]:
        """(ready, reason) of one model; ready None for a model the supervisor does not know (Triton answers)."""
        if self.state != "ready" or self.proc is None or self.proc.poll() is not None:
            return (False, self.health()[2]) if name in self.models or not self.models else (None, "")
        info = self.models.get(name)
        if info is None:
            return None, ""
        return info["ready"], (f"model {name} is not ready: {info['reason']}" if not info["ready"] else "")

    def inputs(self, name: str) -> dict | None:
        info = self.models.get(name)
        return info["inputs"] if info else None

    def on_unhealthy(self, model: str | None, message: str) -> None:
        self.unhealthy[model or "?"] = message
        if self.wake is not None:
            self.wake.set()

    # --- bookkeeping --------------------------------------------------------------------------------------------
    def log(self, message: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} triton supervisor: {message}", flush=True)

    def event(self, message: str) -> None:
        self.log(message)
        self.events.append({"time": round(time.time(), 3), "event": message})
        del self.events[:-50]
        self.save()

    def set_state(self, state: str, detail: str = "") -> None:
        self.state, self.detail = state, detail
        self.save()

    def save(self, **extra) -> None:
        live, ready, reason = self.health()
        data = {"supervisor_pid": os.getpid(), "state": self.state, "detail": self.detail, "live": live,
                "ready": ready, "reason": reason, "url": f"http://{HOST}:{self.http_port}",
                "http_port": self.http_port, "grpc_port": self.grpc_port, "metrics_port": self.metrics_port,
                "internal_http_port": self.internal_port,
                "server_pid": self.proc.pid if self.proc and self.proc.poll() is None else None,
                "models": {m: {"ready": i["ready"], "reason": i["reason"]} for m, i in self.models.items()},
                "restarts": self.restarts, "reloads": self.reloads, "admin_api": "open" if self.admin_open else
                f"restricted ({ADMIN_HEADER} header, key in {self.workdir / 'admin-key'})",
                "log": str(self.log_path), "workdir": str(self.workdir), "shm": sorted(self.shm), "events": self.events,
                "refused": self.front.refused if self.front else {}}
        data.update(extra)
        try:
            write_json(self.state_file, data)
        except OSError as e:
            self.log(f"could not write {self.state_file}: {e}")

    # --- tritonserver ---------------------------------------------------------------------------------------------
    def _internal(self, path: str) -> str:
        return f"http://{HOST}:{self.internal_port}{path}"

    async def _call(self, method: str, path: str, timeout: float = 5.0, body: bytes | None = None):
        headers = {ADMIN_HEADER: self.admin_key}
        if body is not None:
            headers["Content-Type"] = "application/json"
        return await asyncio.to_thread(http, method, self._internal(path), headers, body, timeout)

    def _spawn(self) -> None:
        self.internal_port = free_port()
        backends = prepare_backends(self.workdir / "backends")
        cmd = command(self.repo, backends, self.internal_port, self.grpc_port, self.metrics_port, self.exit_timeout,
                      None if self.admin_open else self.admin_key, self.verbose)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=server_env(), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        self.tracked, self.shm, self.probe_failures, self.unhealthy, self.stuck = {}, set(), 0, {}, set()
        self.log(f"tritonserver pid {self.proc.pid} started (internal HTTP port {self.internal_port})")

    async def _wait_ready(self) -> str | None:
        """None once tritonserver and all its models are ready, else why not."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.ready_timeout:
            if self.stopping:
                return "stop requested"
            if self.proc.poll() is not None:
                return f"tritonserver {describe_exit(self.proc.returncode)} before it was ready"
            status, _ = await self._call("GET", "/v2/health/ready", timeout=2.0)
            if status == 200:
                return None
            self._record_shm()
            await asyncio.sleep(0.25)
        return f"tritonserver was not ready after {self.ready_timeout:.0f} s"

    async def _discover(self, exclude: set[int] = frozenset()) -> None:
        """The models Triton serves (and their input types) and the stub processes serving them (but `exclude`:
        the old instances of a reloaded model, which exit on their own)."""
        status, data = await self._call("POST", "/v2/repository/index", body=b"{}")
        index = json.loads(data) if status == 200 else []
        models = {}
        for entry in index:
            name = entry.get("name")
            if not name or entry.get("state") != "READY":
                continue
            status, data = await self._call("GET", f"/v2/models/{name}/config")
            cfg = json.loads(data) if status == 200 else {}
            inputs = {i["name"]: i.get("data_type", "") for i in cfg.get("input", [])}
            models[name] = {"ready": True, "reason": "", "inputs": inputs}
        self.models = models
        self.tracked = {p: s for p, s in stubs(self.proc.pid).items() if p not in exclude}
        self._record_shm()

    def _record_shm(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.shm |= shm_files(self.proc.pid)
        self.shm |= {s["shm"] for s in stubs(self.proc.pid).values()}

    async def _start_server(self, first: bool) -> bool:
        """Start tritonserver and wait until it serves; retried with a backoff unless `first` (then False)."""
        attempt = 0
        while not self.stopping:
            attempt += 1
            t0 = time.monotonic()
            self.set_state("starting" if first else "restarting", "tritonserver is starting" if first else
                           self.detail)
            self._spawn()
            why = await self._wait_ready()
            if why is None:
                await self._discover()
                self.set_state("ready")
                self.event(f"tritonserver pid {self.proc.pid} ready in {time.monotonic() - t0:.1f} s, models "
                           f"{sorted(self.models) or 'none'}")
                return True
            await self._stop_server(3.0)
            if first or self.stopping:
                if not self.stopping:
                    self.event(f"tritonserver did not start: {why}")
                return False
            wait = min(2.0 ** attempt, 30.0)
            self.event(f"tritonserver did not start ({why}); trying again in {wait:.0f} s")
            self.set_state("restarting", f"tritonserver keeps failing to start: {why}")
            try:
                await asyncio.wait_for(self.stop_event.wait(), wait)
            except asyncio.TimeoutError:
                pass
        return False

    async def _stop_server(self, grace: float) -> dict:
        """Stop tritonserver (SIGTERM, `grace` seconds, then SIGKILL), kill what is left of its group and remove its
        shared-memory files. Returns what happened."""
        if self.proc is None:
            return {}
        self._record_shm()
        pid, t0 = self.proc.pid, time.monotonic()
        was_running = self.proc.poll() is None
        clean = await asyncio.to_thread(stop_group, pid, grace, self.proc)
        removed = remove_shm(self.shm)
        left = group_pids(pid)
        self.shm = set()
        return {"server_pid": pid, "seconds": round(time.monotonic() - t0, 2),
                "how": (("exited cleanly" if self.proc.returncode == 0 else describe_exit(self.proc.returncode))
                        if clean else "killed (it did not exit in time)") if was_running else
                "was not running (" + describe_exit(self.proc.returncode) + ")",
                "exit": describe_exit(self.proc.returncode), "shm_removed": removed, "left": left}

    async def _restart(self, reason: str) -> None:
        self.restarts += 1
        self.set_state("restarting", reason)
        self.event(f"restarting tritonserver: {reason}")
        for info in self.models.values():
            info.update(ready=False, reason="tritonserver is restarting")
        grace = 3.0
        result = await self._stop_server(grace)
        if result.get("shm_removed"):
            self.log(f"removed {len(result['shm_removed'])} shared-memory file(s) of the old server")
        await self._start_server(first=False)

    async def _reload(self, model: str, reason: str, dead_shm: set[str], stranded: list = ()) -> None:
        """Reload one model through the model-control API (unload, then load at once: the new instances start while
        the old ones unload); restart tritonserver when that fails. `stranded`: the front's requests that may be
        inside the dead stub, ended once the old version's live stubs are gone (_watch_unload)."""
        self.reloads += 1
        t0 = time.monotonic()
        self.models.setdefault(model, {"inputs": None})
        self.models[model].update(ready=False, reason=f"reloading ({reason})")
        self.event(f"model {model}: {reason}; reloading it")
        old = {p for p, s in stubs(self.proc.pid).items() if s["model"] == model}
        for action, timeout in (("unload", 10.0), ("load", self.ready_timeout)):
            status, data = await self._call("POST", f"/v2/repository/models/{model}/{action}", timeout, b"{}")
            if self.proc.poll() is not None:
                return await self._restart(f"tritonserver {describe_exit(self.proc.returncode)}")
            if status != 200:
                return await self._restart(f"could not {action} model {model}: "
                                           f"{data.decode(errors='replace')[:300] or 'no answer'}")
        await self._discover(exclude=old)
        self.unhealthy.pop(model, None)         # reports about the old instances
        self.event(f"model {model} reloaded in {time.monotonic() - t0:.1f} s")
        asyncio.ensure_future(self._watch_unload(model, self.proc.pid, dead_shm, old, stranded))

    async def _watch_unload(self, model: str, server_pid: int, dead_shm: set[str], old: set[int],
                            stranded: list = ()) -> None:
        """Triton 2.51 never finishes unloading a model version with an instance whose stub died after a request had
        reached it: that stub's shared memory stays, the version's other stubs (with their copy of the model) stay,
        and tritonserver would wait its whole exit timeout at stop. Note it (the stop is then quick, and the
        leftovers are removed afterwards), and end those other stubs once they are idle to free their memory. The
        requests of `stranded` still unanswered then were inside the dead stub: the front ends them."""
        def same_server() -> bool:
            return self.proc is not None and self.proc.pid == server_pid and self.proc.poll() is None

        await asyncio.sleep(self.UNLOAD_WAIT)
        if not same_server() or not [n for n in dead_shm if Path(f"/dev/shm/{n}").exists()]:
            return
        self.stuck.add(model)
        self.event(f"model {model}: the old version did not finish unloading (a request had reached its dead "
                   "backend process); tritonserver keeps its shared memory until it stops")
        cpu: dict[int, int] = {}
        while same_server() and not self.stopping:
            left = {p for p in old if alive(p) and Path(cmdline(p)[0] if cmdline(p) else "").name == STUB}
            if not left:
                self._cut(model, stranded)
                return
            for pid in left:
                fields = _stat(pid)
                used = int(fields[11]) + int(fields[12]) if fields else -1      # utime + stime, clock ticks
                if cpu.get(pid) == used:                                       # idle for the last 2 s
                    os.kill(pid, signal.SIGKILL)
                    self.event(f"model {model}: ended idle stub pid {pid} of the old version to free its memory")
                cpu[pid] = used
            await asyncio.sleep(2.0)

    async def _probe(self) -> None:
        """Count consecutive failures of tritonserver's liveness endpoint (a hung server)."""
        while not self.stopping:
            await asyncio.sleep(self.PROBE_EVERY)
            if self.state != "ready" or self.proc is None or self.proc.poll() is not None:
                self.probe_failures = 0
                continue
            status, _ = await self._call("GET", "/v2/health/live", timeout=self.PROBE_EVERY)
            self.probe_failures = 0 if status == 200 else self.probe_failures + 1
            if self.probe_failures >= self.PROBE_FAILS:
                self.wake.set()

    async def _tick(self, n: int) -> None:
        if self.state != "ready":
            return
        if self.proc.poll() is not None:
            return await self._restart(f"tritonserver {describe_exit(self.proc.returncode)}")
        if self.probe_failures >= self.PROBE_FAILS:
            return await self._restart(f"tritonserver did not answer /v2/health/live "
                                       f"{self.probe_failures} times in a row")
        if n % 8 == 0:
            self._record_shm()
        live = stubs(self.proc.pid)
        dead: dict[str, list[str]] = {}
        for pid, info in self.tracked.items():
            if pid not in live:
                dead.setdefault(info["model"], []).append(f"{info['instance']} (pid {pid})")
        for model, message in list(self.unhealthy.items()):
            if model not in dead and model in self.models and self.models[model]["ready"]:
                dead[model] = [f"of which Triton says: {message.strip()[:200]}"]
        self.unhealthy.clear()
        self.shm |= {s["shm"] for p, s in live.items() if p not in self.tracked}
        if dead and not self.stopping:          # one model per tick: a reload or restart changes the picture
            model, what = next(iter(dead.items()))
            dead_shm = {s["shm"] for p, s in self.tracked.items() if s["model"] == model and p not in live}
            # Triton never answers the requests inside a dead stub. With no live stub of the model left (one
            # instance: in-flight batching) every request relayed to it now is one of them; otherwise they are known
            # only once the old version's live stubs have finished theirs (_watch_unload).
            stranded = self.front.pending(model) if self.front is not None else []
            if not any(s["model"] == model and p in live for p, s in self.tracked.items()):
                if self._cut(model, stranded):     # requests were inside it: its version never finishes unloading,
                    self.stuck.add(model)          # so a stop need not wait Triton's exit timeout (see _watch_unload)
                stranded = []
            await self._reload(model, f"backend process {', '.join(what)} died", dead_shm, stranded)

    def _cut(self, model: str, requests: list) -> int:
        """End the front's `requests` of `model` that are still unanswered (inside a dead stub: Triton never will);
        how many were."""
        n = self.front.cut(requests, f"model {model}: its backend process died under this request; the supervisor "
                                     "is reloading it, retry shortly") if requests else 0
        if n:
            self.event(f"model {model}: ended {n} request(s) that were inside the dead backend process")
        return n

    # --- the whole life ---------------------------------------------------------------------------------------------
    async def run(self) -> int:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.wake, self.stop_event = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        key_file = self.workdir / "admin-key"
        key_file.unlink(missing_ok=True)
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.admin_key + "\n")
        try:
            self.front = await Front(self, HOST, self.http_port, self.max_body, self.max_depth).start()
        except OSError as e:
            self.set_state("failed", f"cannot listen on {HOST}:{self.http_port}: {e}")
            self.log(self.detail)
            key_file.unlink(missing_ok=True)
            return 1
        self.http_port = self.front.port
        if self.pid_file is not None:
            self.pid_file.parent.mkdir(parents=True, exist_ok=True)
            write_json(self.pid_file, {"pid": os.getpid(), "state_file": str(self.state_file.resolve())})
        self.log(f"front on http://{HOST}:{self.http_port}, gRPC {HOST}:{self.grpc_port}, metrics "
                 f"{HOST}:{self.metrics_port}; admin APIs {'open' if self.admin_open else 'restricted'}")
        code = 0
        try:
            if not await self._start_server(first=True):
                code = 0 if self.stopping else 1
                if code:
                    self.set_state("failed", f"tritonserver did not start; see {self.log_path}")
            else:
                probe = asyncio.ensure_future(self._probe())
                n = 0
                while not self.stopping:
                    n += 1
                    await self._tick(n)
                    try:
                        await asyncio.wait_for(self.wake.wait(), self.TICK)
                    except asyncio.TimeoutError:
                        pass
                    self.wake.clear()
                probe.cancel()
        finally:
            await self._shutdown(code)
        return code

    def request_stop(self) -> None:
        if not self.stopping:
            self.log("stop requested")
        self.stopping = True
        self.stop_event.set()
        self.wake.set()

    async def _shutdown(self, code: int) -> None:
        t0, detail = time.monotonic(), self.detail
        healthy = self.state == "ready" and self.health()[1] and not self.stuck
        self.set_state("stopping", "stopping")
        if self.front is not None and self.front.server is not None:
            self.front.server.close()
        # healthy: let Triton finish in-flight requests and unload; otherwise (a dead stub, a server that does not
        # answer) waiting for Triton's exit timeout would only make the stop slow
        grace = float(self.exit_timeout) + 2.0 if healthy else 3.0
        result = await self._stop_server(grace)
        if self.stuck and result.get("how", "").startswith("killed"):
            result["how"] = (f"was killed after {grace:.0f} s, as planned: an old instance of "
                             f"{', '.join(sorted(self.stuck))} could not be unloaded, so Triton would have waited its "
                             "whole exit timeout")
        if self.front is not None:
            await self.front.close(drain=0.5)
        result.update(seconds=round(time.monotonic() - t0, 2), restarts=self.restarts, reloads=self.reloads,
                      exit_code=code)
        self.set_state("stopped" if code == 0 else "failed", detail if code else "stopped")
        self.save(stopped=result)
        (self.workdir / "admin-key").unlink(missing_ok=True)
        if self.pid_file is not None:
            info = read_json(self.pid_file)
            if info and info.get("pid") == os.getpid():
                self.pid_file.unlink(missing_ok=True)
        if result.get("server_pid"):
            self.log(f"stopped in {result['seconds']} s: tritonserver pid {result['server_pid']} {result['how']}; "
                     f"{len(result['shm_removed'])} shared-memory file(s) removed; {self.restarts} restart(s), "
                     f"{self.reloads} model reload(s) during this run")


# --- controlling a supervisor from the outside (make serve / serve-stop, tests) ----------------------------------
def running(pid_file) -> tuple[int, dict] | None:
    """(supervisor pid, its state) of the server a previous `start` left running; None when none is running (a
    stale pid file is removed)."""
    pid_file = Path(pid_file)
    info = read_json(pid_file)
    if info is None:
        if pid_file.exists():
            pid_file.unlink(missing_ok=True)
        return None
    pid = info.get("pid")
    argv = cmdline(pid) if isinstance(pid, int) else []
    if isinstance(pid, int) and alive(pid) and any(a.endswith("triton_server.py") for a in argv) and "run" in argv:
        return pid, read_json(info.get("state_file", "")) or {}
    pid_file.unlink(missing_ok=True)
    return None


def _wait_gone(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return not alive(pid)


class Served:
    """A supervised server started in the background (what `start` leaves running), seen from outside."""

    def __init__(self, pid_file, proc: subprocess.Popen | None = None):
        self.pid_file, self.proc = Path(pid_file), proc
        info = read_json(self.pid_file) or {}
        self.pid = info.get("pid")
        self.state_file = Path(info.get("state_file", ""))
        st = self.state()
        self.http_port, self.grpc_port, self.metrics_port = st["http_port"], st["grpc_port"], st["metrics_port"]
        self.url = f"http://{HOST}:{self.http_port}"
        self.log_path = Path(st["log"])

    def state(self) -> dict:
        return read_json(self.state_file) or {}

    @property
    def server_pid(self) -> int | None:
        return self.state().get("server_pid")

    @property
    def internal_url(self) -> str:
        return f"http://{HOST}:{self.state()['internal_http_port']}"

    def admin_key(self) -> str:
        return (self.state_file.parent / "admin-key").read_text().strip()

    def ready(self) -> bool:
        return http("GET", f"{self.url}/v2/health/ready", timeout=5)[0] == 200

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)

    def stop(self, timeout: float = 60.0) -> dict:
        st = stop(self.pid_file, timeout)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)             # reap it (start() made it our child)
            except subprocess.TimeoutExpired:
                pass
        return st


def start(repo, pid_file, workdir=None, log=None, http_port: int = 8000, grpc_port: int = 8001,
          metrics_port: int = 8002, exit_timeout: int = 30, timeout: float = 300.0, open_admin: bool = False,
          max_body: int = 1 << 20, max_depth: int = 64, supervisor_log=None) -> Served:
    """Launch `run` in the background (its own session) and wait until every model is ready. RuntimeError with
    the logs' tails when it does not get there."""
    pid_file = Path(pid_file)
    if (r := running(pid_file)) is not None:
        raise RuntimeError(f"already running (supervisor pid {r[0]}, state {r[1].get('state')}): "
                           "stop it first (make serve-stop)")
    triton_root()
    workdir = Path(workdir or pid_file.parent)
    workdir.mkdir(parents=True, exist_ok=True)
    state_file = workdir / "supervisor.json"
    state_file.unlink(missing_ok=True)
    sup_log = Path(supervisor_log) if supervisor_log else workdir / "supervisor.log"
    log = Path(log) if log else workdir / "tritonserver.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "run", "--repo", str(repo), "--workdir", str(workdir),
           "--log", str(log), "--pid-file", str(pid_file), "--state-file", str(state_file),
           "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
           "--exit-timeout", str(exit_timeout), "--timeout", str(timeout), "--max-body-bytes", str(max_body),
           "--max-json-depth", str(max_depth)] + (["--open-admin-api"] if open_admin else [])
    with open(sup_log, "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + timeout + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the supervisor exited ({describe_exit(proc.returncode)}) before the server was "
                               f"ready:\n{tail(sup_log)}\n--- {log}:\n{tail(log)}")
        st = read_json(state_file) or {}
        if st.get("supervisor_pid") == proc.pid and st.get("state") == "ready" and st.get("ready"):
            return Served(pid_file, proc)
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _wait_gone(proc.pid, exit_timeout + 10)
    raise RuntimeError(f"the server was not ready after {timeout:.0f} s:\n{tail(sup_log)}\n--- {log}:\n{tail(log)}")


def stop(pid_file, timeout: float = 60.0) -> dict:
    """Stop the supervisor of `pid_file` and wait for it; returns its final state ({} when none was running). A
    supervisor that does not stop in time is killed, and so is a tritonserver it left behind (its shared-memory
    files are removed)."""
    pid_file = Path(pid_file)
    info = read_json(pid_file) or {}
    state_file = info.get("state_file", "")
    r = running(pid_file)
    t0 = time.monotonic()
    if r is not None:
        pid = r[0]
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGCONT)                 # a stopped (SIGSTOP) supervisor would never see the SIGTERM
        if not _wait_gone(pid, timeout):
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, 5)
        pid_file.unlink(missing_ok=True)
    st = read_json(state_file) or {}
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


# --- command line ------------------------------------------------------------------------------------------------
def _summary(st: dict) -> str:
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


def _print_status(pid: int, st: dict) -> None:
    print(f"supervisor pid {pid}: {st.get('state')}{' - ' + st['detail'] if st.get('detail') else ''}\n"
          f"  ready {st.get('ready')}{' (' + st['reason'] + ')' if st.get('reason') else ''}; tritonserver pid "
          f"{st.get('server_pid')}; {st.get('restarts', 0)} restart(s), {st.get('reloads', 0)} model reload(s)\n"
          f"  HTTP    {st.get('url')}   (POST /v2/models/<name>/generate, /generate_stream)\n"
          f"  gRPC    {HOST}:{st.get('grpc_port')}\n"
          f"  metrics http://{HOST}:{st.get('metrics_port')}/metrics\n"
          f"  admin APIs {st.get('admin_api')}\n"
          f"  logs    {st.get('log')} (tritonserver), {Path(st.get('workdir', '.')) / 'supervisor.log'} "
          "(supervisor; stdout with `run`)")


def _cmd_check(args) -> int:
    r = running(args.pid_file)
    if r is not None:
        print(f"the Triton server is already running (supervisor pid {r[0]}, state {r[1].get('state')}, ready "
              f"{r[1].get('ready')}): use it, or stop it first (make serve-stop)", file=sys.stderr)
        return 1
    return 0


def _cmd_start(args) -> int:
    try:
        t0 = time.monotonic()
        served = start(args.repo, args.pid_file, args.workdir, args.log, args.http_port, args.grpc_port,
                       args.metrics_port, args.exit_timeout, args.timeout, args.open_admin_api, args.max_body_bytes,
                       args.max_json_depth)
    except (RuntimeError, TritonUnavailable) as e:
        print(f"serve: {e}", file=sys.stderr)
        return 1
    print(f"ready in {time.monotonic() - t0:.1f} s")
    _print_status(served.pid, served.state())
    return 0


def _cmd_stop(args) -> int:
    st = stop(args.pid_file, args.exit_timeout + 20)
    if not st:
        print(f"no server started with {args.pid_file} is running")
        return 0
    print(_summary(st))
    return 0 if not (st.get("stopped") or {}).get("left") else 1


def _cmd_status(args) -> int:
    r = running(args.pid_file)
    if r is None:
        print(f"no server started with {args.pid_file} is running")
        return 3
    _print_status(*r)
    return 0 if r[1].get("ready") else 1


def _cmd_run(args) -> int:
    try:
        triton_root()
    except TritonUnavailable as e:
        print(f"serve: {e}", file=sys.stderr)
        return 1
    sup = Supervisor(args.repo, args.workdir or Path(args.pid_file or args.repo).parent, args.http_port,
                     args.grpc_port, args.metrics_port, args.exit_timeout, args.log, args.state_file, args.pid_file,
                     args.open_admin_api, args.max_body_bytes, args.max_json_depth, args.timeout)
    return asyncio.run(sup.run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/triton_server.py",
                                     description="run the bundled tritonserver on 127.0.0.1 under a supervisor")
    sub = parser.add_subparsers(dest="action", required=True)

    def serve_args(p, pid_required: bool) -> None:
        p.add_argument("--repo", required=True, help="model repository (written by `eaglex triton`)")
        p.add_argument("--pid-file", required=pid_required, help="the supervisor's pid file")
        p.add_argument("--log", help="tritonserver's log (default: <workdir>/tritonserver.log)")
        p.add_argument("--workdir", help="backend links, state, admin key, logs (default: the pid file's folder)")
        p.add_argument("--http-port", type=int, default=8000, help="the public HTTP port (the front)")
        p.add_argument("--grpc-port", type=int, default=8001)
        p.add_argument("--metrics-port", type=int, default=8002)
        p.add_argument("--timeout", type=float, default=300, help="seconds to wait for readiness")
        p.add_argument("--exit-timeout", type=int, default=30, help="Triton's --exit-timeout-secs")
        p.add_argument("--open-admin-api", action="store_true",
                       help="leave the shared-memory, model-repository, logging and trace APIs open to any client")
        p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted")
        p.add_argument("--max-json-depth", type=int, default=64, help="deepest JSON nesting accepted")

    serve_args(sub.add_parser("start", help="start in the background and wait until ready"), True)
    r = sub.add_parser("run", help="run the supervisor in the foreground (for systemd, containers)")
    serve_args(r, False)
    r.add_argument("--state-file", help="where the supervisor writes its state (default: <workdir>/supervisor.json)")
    c = sub.add_parser("check", help="exit 1 when the server of this pid file is running")
    c.add_argument("--pid-file", required=True)
    s = sub.add_parser("status", help="print the state of the server of this pid file (exit 0 when ready)")
    s.add_argument("--pid-file", required=True)
    t = sub.add_parser("stop", help="stop the server a `start` left running")
    t.add_argument("--pid-file", required=True)
    t.add_argument("--exit-timeout", type=int, default=30, help="Triton's exit timeout the server was started with")
    args = parser.parse_args(argv)
    return {"start": _cmd_start, "run": _cmd_run, "check": _cmd_check, "status": _cmd_status,
            "stop": _cmd_stop}[args.action](args)


if __name__ == "__main__":
    sys.exit(main())
