"""The Triton Python-backend model: `TritonPythonModel` running the eaglex runtime on one engine folder.

The generated repository's `1/model.py` only re-exports this class, so the code lives (and is versioned) with
eaglex; the stub process imports it from the environment Triton runs the stub in (the venv: see
tools/triton_server.py).

Design:
- Decoupled transaction policy. With `stream` true a request gets one response per verification cycle (the tokens
  that cycle accepted, and the text they complete), then a final response carrying the statistics; with `stream`
  false (the default, as in TensorRT-LLM) exactly one response, which is what `/generate` needs.
- One request at a time per instance: a backend owns one KV cache. Concurrency comes from `instance_group` count
  (one stub process each) and Triton's queue in front of them (config.pbtxt's dynamic_batching queue policy).
- Client mistakes become TritonError INVALID_ARG/UNSUPPORTED (HTTP 400) and the instance keeps serving; anything
  else becomes INTERNAL (500) with the traceback in the server log.
- Cancellation (a gRPC stream cancelled, a request timed out in Triton, a client gone mid-stream) is checked once
  per cycle; the generation stops there and frees the instance for the next request.
- Custom metrics on Triton's /metrics endpoint: requests by outcome, output tokens, cycles, accepted draft tokens
  (those of cancelled requests included) and the last finished request's tau (mean tokens per cycle; over a window
  use rate(output tokens) / rate(cycles)).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from .loader import load
from .request import Limits, RequestError, parse
from .textstream import TextStream


class _Abort(Exception):
    """The request was cancelled or its client is gone: stop decoding, send nothing more (or a CANCELLED error)."""


class _Metrics:
    def __init__(self, model: str):
        # The families must outlive their metrics (Triton refuses to update a metric whose family was collected).
        self.families = []

        def family(name, doc, kind):
            self.families.append(pb_utils.MetricFamily(name=name, description=doc, kind=kind))
            return self.families[-1]
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        requests = family("eaglex_requests_total", "eaglex requests by outcome", counter)
        self.requests = {o: requests.Metric(labels={"model": model, "outcome": o})
                         for o in ("success", "invalid", "cancelled", "failed")}
        labels = {"model": model}
        self.tokens = family("eaglex_output_tokens_total", "tokens generated", counter).Metric(labels=labels)
        self.cycles = family("eaglex_cycles_total", "draft-then-verify cycles (target verifications)",
                             counter).Metric(labels=labels)
        self.accepted = family("eaglex_accepted_draft_tokens_total", "drafted tokens the target accepted",
                               counter).Metric(labels=labels)
        self.tau = family("eaglex_tau", "tau (mean tokens per cycle) of the last finished request",
                          gauge).Metric(labels=labels)

    def close(self) -> None:
        """Metrics first, families last: the order Triton requires."""
        self.requests = self.tokens = self.cycles = self.accepted = self.tau = None
        self.families.clear()


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.name = args["model_name"]
        engine_dir = Path(params["engine_dir"])
        if not engine_dir.is_absolute():     # an engine copied into the repository: relative to the version folder
            engine_dir = Path(args["model_repository"]) / args["model_version"] / engine_dir
        threads = int(params.get("threads") or 0)
        # `tree`: one spelling (chain:3, dynamic:16/6/4); the per-field parameters of older repositories are
        # refused by the loader with that advice
        tree = params.get("tree") or {k: params[k] for k in ("kind", "total_tokens", "depth", "top_k") if params.get(k)}
        t0 = time.perf_counter()
        self.engine = load(engine_dir, params.get("method") or "default", tree, threads=threads)
        spec = self.engine.spec
        self.limits = Limits(spec.vocab_size, spec.max_context, int(params.get("max_input_bytes") or 65536),
                             int(params.get("default_max_tokens") or 128), self.engine.tokenizer is not None)
        self.metrics = _Metrics(self.name)
        pb_utils.Logger.log_info(
            f"eaglex: {args['model_instance_name']} loaded {engine_dir} ({self.engine.layout}, method "
            f"{self.engine.method}, tree {self.engine.tree}) in {time.perf_counter() - t0:.1f} s")

    def execute(self, requests):
        # Decoupled: responses go through each request's sender; execute returns None.
        for request in requests:
            self._serve(request)
        return None

    def finalize(self):
        self.metrics.close()
        self.engine = None

    # --- one request ------------------------------------------------------------------------------------------
    def _serve(self, request) -> None:
        sender = request.get_response_sender()
        outcome = "failed"
        try:
            if request.is_cancelled():
                raise _Abort()
            arrays = {t.name(): t.as_numpy() for t in request.inputs()}
            req = parse(arrays, request.parameters(), self.limits, self._tokenize)
            self._generate(req, request, sender)
            outcome = "success"
        except RequestError as e:
            outcome = "invalid"
            self._fail(sender, e.code, str(e))
        except _Abort:
            outcome = "cancelled"
            self._fail(sender, "CANCELLED", "the request was cancelled")
        except Exception as e:  # noqa: BLE001 - one bad request must not take the instance down
            import traceback
            pb_utils.Logger.log_error(f"eaglex: request failed: {traceback.format_exc()}")
            self._fail(sender, "INTERNAL", f"eaglex failed on this request: {type(e).__name__}: {e}")
        finally:
            self.metrics.requests[outcome].increment(1)

    def _tokenize(self, text: str) -> list[int]:
        return list(self.engine.tokenizer(text)["input_ids"])

    def _generate(self, req, request, sender) -> None:
        """Runs the request; end_id, stop words, cancellation and a vanished client end it through the generator's
        stop hook, so the result keeps its statistics (tau, cycles) whatever ended it."""
        text = TextStream(self.engine.tokenizer, req.stop_words)
        ended: list[str] = []                # why the hook stopped the generation, if it did

        def on_tokens(ids: list[int]) -> None:
            if req.end_id is not None and req.end_id in ids:      # end_id stops after itself, like an EOS id
                ids = ids[:ids.index(req.end_id) + 1]
                ended.append("end_id")
            delta = text.push(ids)
            if text.stopped:
                ended.append("stop_word")
            if req.stream:
                try:
                    self._send(sender, self._outputs(delta, ids))
                except _Abort:
                    ended.append("cancelled")

        def stop() -> bool:
            if not ended and request.is_cancelled():
                ended.append("cancelled")
            return bool(ended)

        result = None
        try:
            try:
                result = self.engine.generator(req.sampling).generate(req.input_ids, req.max_tokens, on_tokens, stop)
            except ValueError as e:              # the runtime's own input checks
                raise RequestError(str(e)) from None
            if ended and ended[0] == "cancelled":
                raise _Abort()
            stats = {"tau": result.tau, "cycles": result.cycles,
                     "accepted": sum(result.accept_lengths) - len(result.accept_lengths),
                     "reason": ended[0] if ended else result.stop_reason}
            rest = text.finish()
            out = self._outputs(rest if req.stream else text.text, None if req.stream else text.ids, stats)
            self._send(sender, out, final=True)
            self.metrics.tau.set(result.tau)
        finally:
            # tokens and cycles count whatever became of the request (finished, cancelled, failed mid-way)
            if result is not None:
                m = self.metrics
                m.tokens.increment(len(result.output_ids))
                m.cycles.increment(result.cycles)
                m.accepted.increment(sum(result.accept_lengths) - len(result.accept_lengths))

    def _outputs(self, delta: str, ids, stats: dict | None = None) -> list:
        """Output tensors with the leading batch dimension (max_batch_size 1)."""
        out = []
        if self.engine.tokenizer is not None:
            out.append(pb_utils.Tensor("text_output", np.array([[delta.encode("utf-8")]], dtype=np.object_)))
        if ids is not None:
            out.append(pb_utils.Tensor("output_ids", np.array([ids], dtype=np.int32).reshape(1, -1)))
        if stats is not None:
            out += [pb_utils.Tensor("tau", np.array([[stats["tau"]]], dtype=np.float32)),
                    pb_utils.Tensor("cycles", np.array([[stats["cycles"]]], dtype=np.int32)),
                    pb_utils.Tensor("total_accepted_draft_tokens", np.array([[stats["accepted"]]], dtype=np.int32)),
                    pb_utils.Tensor("finish_reason", np.array([[stats["reason"].encode()]], dtype=np.object_))]
        return out

    @staticmethod
    def _send(sender, tensors: list, final: bool = False) -> None:
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        try:
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)
        except Exception as e:  # noqa: BLE001 - the stream is gone (client disconnected, request cancelled)
            pb_utils.Logger.log_warn(f"eaglex: send failed: {e}")
            raise _Abort() from e

    @staticmethod
    def _fail(sender, code: str, message: str) -> None:
        err = pb_utils.TritonError(message, getattr(pb_utils.TritonError, code, pb_utils.TritonError.INTERNAL))
        try:
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=err),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as e:  # noqa: BLE001 - nobody left to tell (the request was cancelled, its client gone)
            pb_utils.Logger.log_warn(f"eaglex: could not send the {code} error ({message}): {e}")
