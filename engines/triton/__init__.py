"""Serve eaglex engines with NVIDIA Triton Inference Server (Python backend, decoupled streaming).

- repository.py: `eaglex triton` writes the model repository (config.pbtxt + a model.py that imports model.py here).
- model.py: the TritonPythonModel (imports triton_python_backend_utils: only importable inside Triton's stub).
- request.py / textstream.py: request validation and streamed detokenization (pure; unit-tested without Triton).
- loader.py: engine folder -> backend + tokenizer + method/tree.
- server.py: start/stop the tritonserver bundled with nvidia-pytriton on 127.0.0.1 (`make serve`, tests).
"""
from .repository import write_repository  # noqa: F401
