"""Serve eaglex engines with NVIDIA Triton Inference Server (Python backend, decoupled streaming).

- repository.py: `eaglex triton` writes the model repository (config.pbtxt + a model.py that imports model.py here).
- model.py: the TritonPythonModel (imports triton_python_backend_utils: only importable inside Triton's stub).
- request.py / textstream.py: request validation and streamed detokenization (pure; unit-tested without Triton).
- loader.py: the model's parameters -> runtime.engine.open_engine (the engine's method and tuned tree).
- tools/triton_server.py and tools/triton_front.py (outside the package): the supervised tritonserver and its HTTP
  front (`make serve`, tests).
"""
from .repository import write_repository  # noqa: F401
