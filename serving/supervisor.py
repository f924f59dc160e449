"""The supervision loop: one tritonserver and its HTTP front (front.py), kept serving on 127.0.0.1.

`eaglex serve start` runs it in the background (`python -m eaglex.serving.supervisor DIR/serve.json`) and returns once
the models are ready; `eaglex serve run` runs it in the foreground (systemd, containers). The supervisor:
- runs tritonserver (tritonserver.py: its own process group; it gets SIGTERM if the supervisor dies) in explicit
  model-control mode, with the administrative APIs (shared memory, model repository, logging, trace) restricted, on
  HTTP and gRPC, to requests carrying the `triton-admin-key` header whose value it writes to `DIR/admin-key` (mode
  0600), unless the config opens them; tritonserver's HTTP port is an internal loopback port;
- serves the public HTTP port with the front: Triton's generate API behind the guard, and the OpenAI API;
- watches tritonserver and each model's Python-backend stub processes (processes.py). When tritonserver dies it is
  restarted (with a backoff when it keeps dying); when a stub dies its model is reloaded through Triton's
  model-control API (unload + load), or tritonserver is restarted when the unload cannot finish (requests already
  waited on the dead stub: Triton 2.51 then never completes the unload). The requests that were inside a dead stub,
  which Triton never answers, are ended by the front with a 503 (or an error event in a stream). Shared-memory files
  of a dead server or stub are removed;
- on SIGTERM/SIGINT stops tritonserver (gracefully when it is healthy, quickly when it is not), removes leftovers and
  writes what happened to its state file (`eaglex serve stop` prints it).
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from eaglex.base.fsio import write_json

from .config import ADMIN_KEY, API_KEY_ENV, PID, SERVER_LOG, STATE, ServeConfig, read_json
from .front import Front
from .processes import (
    alive,
    cmdline,
    describe_exit,
    die_with_parent,
    group_pids,
    proc_stat,
    remove_shm,
    shm_files,
    stop_group,
    stubs,
)
from .tritonserver import (
    ADMIN_HEADER,
    HOST,
    STUB,
    TritonUnavailable,
    command,
    free_port,
    http,
    prepare_backends,
    server_env,
    triton_root,
)


class Supervisor:
    """One tritonserver and its front, kept serving; see the module docstring. Runs in an asyncio loop (`run`)."""

    TICK = 0.25                 # seconds between checks of the processes
    UNLOAD_WAIT = 15.0          # after a reload: an old instance still unloading then is stuck for good
    PROBE_EVERY, PROBE_FAILS = 5.0, 6    # a server that does not answer /v2/health/live 6 times in a row: restart

    def __init__(self, config: ServeConfig, api_key: str | None = None):
        self.config = config
        self.repo, self.workdir = Path(config.repo).resolve(), config.folder
        self.http_port = config.http_port
        self.grpc_port = config.grpc_port or free_port()
        self.metrics_port = config.metrics_port or free_port()
        self.internal_port = 0
        self.exit_timeout, self.ready_timeout, self.verbose = config.exit_timeout, config.ready_timeout, config.verbose
        self.log_path = config.path(SERVER_LOG)
        self.state_file, self.pid_file = config.path(STATE), config.path(PID)
        self.admin_open = config.open_admin
        self.admin_key = secrets.token_urlsafe(24)
        self.api_key = api_key or None

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
                f"restricted ({ADMIN_HEADER} header, key in {self.config.path(ADMIN_KEY)})",
                "api_key": self.api_key is not None,
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
                                         preexec_fn=die_with_parent)
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
                fields = proc_stat(pid)
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
        key_file = self.config.path(ADMIN_KEY)
        key_file.unlink(missing_ok=True)
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.admin_key + "\n")
        try:
            self.front = await Front(self, HOST, self.http_port, self.config.max_body, self.config.max_depth,
                                     api_key=self.api_key).start()
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
        if self.front is not None:
            self.front.stop_accepting()
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
        self.config.path(ADMIN_KEY).unlink(missing_ok=True)
        if self.pid_file is not None:
            info = read_json(self.pid_file)
            if info and info.get("pid") == os.getpid():
                self.pid_file.unlink(missing_ok=True)
        if result.get("server_pid"):
            self.log(f"stopped in {result['seconds']} s: tritonserver pid {result['server_pid']} {result['how']}; "
                     f"{len(result['shm_removed'])} shared-memory file(s) removed; {self.restarts} restart(s), "
                     f"{self.reloads} model reload(s) during this run")


def main(argv: list[str] | None = None) -> int:
    """`python -m eaglex.serving.supervisor DIR/serve.json`: what `eaglex serve start` runs in the background."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m eaglex.serving.supervisor DIR/serve.json (run by eaglex serve start)", file=sys.stderr)
        return 2
    try:
        triton_root()
    except TritonUnavailable as e:
        print(f"serve: {e}", file=sys.stderr)
        return 1
    config = ServeConfig.load(argv[0])
    return asyncio.run(Supervisor(config, os.environ.pop(API_KEY_ENV, None)).run())


if __name__ == "__main__":
    sys.exit(main())
