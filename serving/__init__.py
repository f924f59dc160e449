"""Serving eaglex engines: Triton Inference Server's Python backend under a supervisor, behind an HTTP front that
speaks the OpenAI API and Triton's own (`eaglex serve`).

- repository.py, trtllm_repository.py: model repositories (`eaglex triton`): ours, and TensorRT-LLM's llmapi model.
- model.py: the TritonPythonModel (imports triton_python_backend_utils: only importable inside Triton's stub), with
  loader.py (its engine), triton_request.py (request validation) and textstream.py (streamed detokenization).
- tritonserver.py: the bundled tritonserver, its environment and command line.
- processes.py: process-group and shared-memory housekeeping.
- supervisor.py: the supervision loop; front.py: the public HTTP port (FastAPI on uvicorn), with guard.py (what it
  refuses before parsing, and its value checks), relay.py (the relays to tritonserver, over httpx), v1.py (the OpenAI
  endpoints) and openai.py (the OpenAI API's request models and answers).
- config.py: a deployment's settings; control.py: start, status and stop from outside, by the deployment's folder.
"""
