"""What one deployment is: `ServeConfig`, the settings of a supervised server, saved in its folder (`serve.json`)
so that `eaglex serve start` can hand them to the background supervisor and `status`/`stop` find everything from
the folder alone. The folder holds the pid file, the state the supervisor keeps current, the logs, the admin key and
the backend links; the model repository is usually `model_repository/` inside it."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from eaglex.base.errors import ModelError
from eaglex.base.fsio import write_json

CONFIG, PID, STATE = "serve.json", "server.pid", "supervisor.json"
SUPERVISOR_LOG, SERVER_LOG, ADMIN_KEY = "supervisor.log", "tritonserver.log", "admin-key"
API_KEY_ENV = "EAGLEX_API_KEY"      # how the bearer key reaches the supervisor: never on a command line


@dataclass(frozen=True)
class ServeConfig:
    repo: str                       # the Triton model repository served
    dir: str                        # the deployment's folder (see the module docstring)
    http_port: int = 8000           # the public port: the front (0: a free port)
    grpc_port: int = 8001           # tritonserver's gRPC port (0: a free port)
    metrics_port: int = 8002        # tritonserver's Prometheus metrics (0: a free port)
    exit_timeout: int = 30          # tritonserver's --exit-timeout-secs
    ready_timeout: float = 300.0    # seconds to wait for every model to be ready
    open_admin: bool = False        # leave Triton's administrative APIs open to any client
    max_body: int = 1 << 20         # largest request body the front accepts
    max_depth: int = 64             # deepest JSON nesting the front accepts
    verbose: int = 0                # tritonserver's --log-verbose

    def __post_init__(self):
        for name, lo in (("http_port", 0), ("grpc_port", 0), ("metrics_port", 0), ("exit_timeout", 1),
                         ("max_body", 1), ("max_depth", 1)):
            if getattr(self, name) < lo:
                raise ModelError(f"{name.replace('_', ' ')} must be >= {lo}, got {getattr(self, name)}")
        for name in ("http_port", "grpc_port", "metrics_port"):
            if getattr(self, name) > 65535:
                raise ModelError(f"{name.replace('_', ' ')} must be <= 65535, got {getattr(self, name)}")

    @property
    def folder(self) -> Path:
        return Path(self.dir).resolve()

    def path(self, name: str) -> Path:
        return self.folder / name

    def save(self) -> Path:
        write_json(self.path(CONFIG), dataclasses.asdict(self))
        return self.path(CONFIG)

    @classmethod
    def load(cls, path) -> ServeConfig:
        data = read_json(path)
        if data is None:
            raise ModelError(f"{path}: not a deployment's settings (written by eaglex serve start)")
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


def read_json(path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
