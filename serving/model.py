"""The Triton Python-backend model: `TritonPythonModel` running the eaglex runtime on one engine folder.

The generated repository's `1/model.py` only re-exports this class, so the code lives (and is versioned) with
eaglex; the stub process imports it from the environment Triton runs the stub in (the venv: see
tritonserver.py).

Design:
- Decoupled transaction policy. With `stream` true a request gets one response per verification cycle (the tokens
  that cycle accepted, and the text they complete), then a final response carrying the statistics; with `stream`
  false (the default, as in TensorRT-LLM) exactly one response, which is what `/generate` needs.
- Batching (parameter `max_batch` N > 0, what `eaglex triton` writes by default): one instance, one copy of the
  weights. `execute` only checks and enqueues; one engine thread runs the in-flight batcher
  (runtime/batch.BatchedGenerator, with the engine's batch schedule), which admits waiting requests into free KV
  slots between steps and decodes every active request each step; each request streams through its own sender as
  its cycles complete, and a request alone in flight runs the single-request path. At most `max_queue_size`
  requests wait for a slot; more are refused with UNAVAILABLE (HTTP 503), as Triton's own queue does.
- Without batching (`max_batch` 0): one request at a time per instance, a backend owning one KV cache;
  concurrency comes from `instance_group` count (one stub process each) and Triton's queue in front of them
  (config.pbtxt's dynamic_batching queue policy).
- text_input is raw text by default (TensorRT-LLM's meaning); the model parameter `chat_template` true, or a
  request's parameter of that name, makes it the user's message, wrapped with the tokenizer's chat template.
- Client mistakes become TritonError INVALID_ARG/UNSUPPORTED (HTTP 400) and the instance keeps serving; anything
  else becomes INTERNAL (500) with the traceback in the server log.
- Cancellation (a gRPC stream cancelled, a request timed out in Triton, a client gone mid-stream) is checked once
  per cycle; the generation stops there and frees the instance for the next request.
- Custom metrics on Triton's /metrics endpoint: requests by outcome, output tokens, cycles, accepted draft tokens
  (those of cancelled requests included) and the last finished request's tau (mean tokens per cycle; over a window
  use rate(output tokens) / rate(cycles)); with batching also the requests decoding now, the requests waiting for
  a slot and the KV memory of one slot.
"""
from __future__ import annotations

import json
import os
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from eaglex.base.errors import ModelError

from .loader import load
from .textstream import TextStream
from .triton_request import Limits, RequestError, parse, tokenize


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
                         for o in ("success", "invalid", "cancelled", "failed", "rejected")}
        labels = {"model": model}
        self.tokens = family("eaglex_output_tokens_total", "tokens generated", counter).Metric(labels=labels)
        self.cycles = family("eaglex_cycles_total", "draft-then-verify cycles (target verifications)",
                             counter).Metric(labels=labels)
        self.accepted = family("eaglex_accepted_draft_tokens_total", "drafted tokens the target accepted",
                               counter).Metric(labels=labels)
        self.tau = family("eaglex_tau", "tau (mean tokens per cycle) of the last finished request",
                          gauge).Metric(labels=labels)
        self.active = self.waiting = self.slot_bytes = None

    def batching(self, model: str) -> None:
        """The batching gauges (only for a batching model)."""
        gauge, labels = pb_utils.MetricFamily.GAUGE, {"model": model}

        def metric(name, doc):
            self.families.append(pb_utils.MetricFamily(name=name, description=doc, kind=gauge))
            return self.families[-1].Metric(labels=labels)
        self.active = metric("eaglex_active_requests", "requests decoding now (the in-flight batch)")
        self.waiting = metric("eaglex_queue_depth", "requests waiting for a batch slot")
        self.slot_bytes = metric("eaglex_kv_slot_bytes", "KV cache memory of one batch slot (target + draft)")

    def close(self) -> None:
        """Metrics first, families last: the order Triton requires."""
        self.requests = self.tokens = self.cycles = self.accepted = self.tau = None
        self.active = self.waiting = self.slot_bytes = None
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
        max_batch = int(params.get("max_batch") or 0)
        context = serving_context(self.engine, int(params.get("max_context") or 0), max_batch)
        self.limits = Limits.from_parameters(params, spec.vocab_size, context, self.engine.tokenizer)
        self.metrics = _Metrics(self.name)
        self.batching = None
        how = "one request at a time"
        if max_batch > 0:
            self.metrics.batching(self.name)
            self.batching = _Batching(self, max_batch, int(params.get("max_queue_size") or 64), context)
            b = self.batching
            how = (f"batching up to {max_batch} requests (schedule {b.schedule}), context {context} tokens, KV "
                   f"{b.slot_bytes / 2 ** 20:.1f} MiB per slot, at most {b.max_queue} waiting")
            if not getattr(self.engine.backend, "batch_exact", True):
                how = (f"one request at a time (this engine's exactness rules keep requests apart), at most "
                       f"{b.max_queue} waiting")
        e = self.engine
        running = f"method {e.method}, tree {e.tree}" if getattr(e, "kept_tree", None) is None else \
            f"method vanilla: tuning measured it faster than the head's best tree {e.kept_tree}"
        pb_utils.Logger.log_info(
            f"eaglex: {args['model_instance_name']} loaded {engine_dir} ({e.layout}, {running}) in "
            f"{time.perf_counter() - t0:.1f} s; {how}; chat "
            f"template on text_input {'on' if self.limits.chat_template else 'off'} by default")

    def execute(self, requests):
        # Decoupled: responses go through each request's sender; execute returns None.
        for request in requests:
            if self.batching is not None:
                self.batching.enqueue(request)
            else:
                self._serve(request)
        return None

    def finalize(self):
        if self.batching is not None:
            self.batching.close()
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

    def _tokenize(self, text: str, chat: bool) -> list[int]:
        return tokenize(self.engine.tokenizer, text, chat)

    def _hooks(self, req, request, sender):
        """-> (text stream, ended, on_tokens, stop): end_id, stop words, cancellation and a vanished client end the
        request through the generator's stop hook, so the result keeps its statistics (tau, cycles)."""
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
        return text, ended, on_tokens, stop

    def _generate(self, req, request, sender) -> None:
        """Runs the request alone on this instance."""
        text, ended, on_tokens, stop = self._hooks(req, request, sender)
        result = None
        try:
            try:
                result = self.engine.generator(req.sampling).generate(req.input_ids, req.max_tokens, on_tokens, stop)
            except ValueError as e:              # the runtime's own input checks
                raise RequestError(str(e)) from None
            self._final(req, result, text, ended, sender)
        finally:
            self._count(result)

    def _final(self, req, result, text, ended: list[str], sender) -> None:
        """The last response (raises _Abort for a cancelled request)."""
        if ended and ended[0] == "cancelled":
            raise _Abort()
        stats = {"tau": result.tau, "cycles": result.cycles,
                 "accepted": sum(result.accept_lengths) - len(result.accept_lengths),
                 "reason": ended[0] if ended else result.stop_reason, "prompt_tokens": len(req.input_ids)}
        rest = text.finish()
        out = self._outputs(rest if req.stream else text.text, None if req.stream else text.ids, stats)
        self._send(sender, out, final=True)
        self.metrics.tau.set(result.tau)

    def _count(self, result) -> None:
        """tokens and cycles count whatever became of the request (finished, cancelled, failed mid-way)"""
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
                    pb_utils.Tensor("finish_reason", np.array([[stats["reason"].encode()]], dtype=np.object_)),
                    pb_utils.Tensor("prompt_tokens", np.array([[stats["prompt_tokens"]]], dtype=np.int32))]
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


QUEUE_CHECK_S = 0.2          # how often requests waiting for a slot are asked whether they were cancelled


class _Job:
    """One request in the batching model: its Triton request and sender, parsed form, text stream and hooks."""

    def __init__(self, model: TritonPythonModel, request, sender, req):
        self.request, self.sender, self.req = request, sender, req
        self.text, self.ended, self.on_tokens, self.stop = model._hooks(req, request, sender)
        self.handle = None              # its runtime.request.Request once submitted


KV_SHARE = 0.5      # of the memory available at load that the batch slots may take by default


def serving_context(engine, asked: int, max_batch: int) -> int:
    """Longest prompt + new tokens a request may have. `asked` (model parameter max_context; 0: not set) is capped
    at the model's context. Unset with batching: the model's context, or less where every slot holding that much KV
    would take more than KV_SHARE of the memory available now (slots are allocated up front, one per request)."""
    model = engine.spec.max_context
    if asked < 0:
        raise ModelError(f"model parameter max_context must be >= 0, got {asked}")
    if asked or max_batch <= 0:
        return min(asked or model, model)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    fits = int(available * KV_SHARE) // (engine.kv_bytes_per_token() * max_batch)
    if fits < min(model, 256):
        raise ModelError(f"{max_batch} batch slots leave {fits} tokens of context each in the memory available: "
                         "lower max_batch, or set max_context")
    return min(model, fits)


class _Batching:
    """The engine thread: enqueue() (Triton's execute thread) hands requests over; the thread submits them to the
    in-flight batcher, steps it while anything is queued or decoding, and answers each request as it finishes."""

    def __init__(self, model: TritonPythonModel, max_batch: int, max_queue: int, context: int):
        self.model, self.max_batch, self.max_queue, self.context = model, max_batch, max_queue, context
        engine = model.engine
        self.schedule = engine.batch_schedule().alone(engine.tree)     # alone: the engine's own tree, as generate
        self.gen = engine.batcher(max_batch, self.schedule, context=context)
        self.slot_bytes = engine.kv_bytes_per_token() * (context + self.schedule.max_nodes)
        self.lock = threading.Condition()
        self.inbox: list[_Job] = []
        self.jobs: dict = {}            # batch Request -> _Job
        self.closed = False
        self._gauges = (None, None)
        self._next_check = 0.0
        model.metrics.slot_bytes.set(self.slot_bytes)
        self.thread = threading.Thread(target=self._loop, name="eaglex-engine", daemon=True)
        self.thread.start()

    # --- Triton's thread --------------------------------------------------------------------------------------
    def enqueue(self, request) -> None:
        m = self.model
        sender = request.get_response_sender()
        try:
            if request.is_cancelled():
                raise _Abort()
            arrays = {t.name(): t.as_numpy() for t in request.inputs()}
            job = _Job(m, request, sender, parse(arrays, request.parameters(), m.limits, m._tokenize))
        except RequestError as e:
            return self._refuse(sender, "invalid", e.code, str(e))
        except _Abort:
            return self._refuse(sender, "cancelled", "CANCELLED", "the request was cancelled")
        except Exception as e:  # noqa: BLE001 - one bad request must not take the model down
            pb_utils.Logger.log_error(f"eaglex: request failed: {traceback.format_exc()}")
            return self._refuse(sender, "failed", "INTERNAL", f"eaglex failed on this request: {type(e).__name__}: {e}")
        with self.lock:
            if self.closed:
                return self._refuse(sender, "rejected", "UNAVAILABLE", "the model is unloading")
            if len(self.inbox) + self.gen.queue_depth >= self.max_queue:
                return self._refuse(sender, "rejected", "UNAVAILABLE",
                                    f"Exceeds maximum queue size: {self.max_queue} requests wait for a batch slot")
            self.inbox.append(job)
            self.lock.notify()

    def _refuse(self, sender, outcome: str, code: str, message: str) -> None:
        self.model._fail(sender, code, message)
        self.model.metrics.requests[outcome].increment(1)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.lock.notify()
        self.thread.join(timeout=30)

    # --- the engine thread ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self.inbox and self.gen.idle and not self.closed:
                    self._gauge()
                    self.lock.wait()
                if self.closed:
                    break
                new, self.inbox = self.inbox, []
            try:
                for job in new:
                    self._submit(job)
                self._drop_cancelled()
                finished = self.gen.step()
                for handle in finished:
                    self._finish(self.jobs.pop(handle))
                self._gauge()
            except Exception as e:  # noqa: BLE001 - a failed step: fail what it held, start over with fresh slots
                pb_utils.Logger.log_error(f"eaglex: batch step failed: {traceback.format_exc()}")
                self._reset(f"eaglex failed on this batch: {type(e).__name__}: {e}")
        self._reset("the model is unloading", "UNAVAILABLE")
        for job in self.inbox:
            self._refuse(job.sender, "rejected", "UNAVAILABLE", "the model is unloading")

    def _gauge(self) -> None:
        now = (self.gen.in_flight, self.gen.queue_depth + len(self.inbox))
        if now != self._gauges:
            self._gauges = now
            self.model.metrics.active.set(now[0])
            self.model.metrics.waiting.set(now[1])

    def _submit(self, job: _Job) -> None:
        try:
            job.handle = self.gen.submit(job.req.input_ids, job.req.max_tokens, job.req.sampling, job.on_tokens,
                                         job.stop)
        except ValueError as e:              # the runtime's own input checks
            return self._refuse(job.sender, "invalid", "INVALID_ARG", str(e))
        except Exception as e:  # noqa: BLE001 - this request alone
            pb_utils.Logger.log_error(f"eaglex: request failed: {traceback.format_exc()}")
            return self._refuse(job.sender, "failed", "INTERNAL", f"eaglex failed on this request: {e}")
        self.jobs[job.handle] = job

    def _drop_cancelled(self) -> None:
        """Requests cancelled while they wait for a slot leave the queue (running ones stop at their next cycle).
        Asked at most every QUEUE_CHECK_S: each question is a round trip to the server."""
        queue = self.gen.queue
        if not queue or time.monotonic() < self._next_check:
            return
        self._next_check = time.monotonic() + QUEUE_CHECK_S
        keep = [h for h in queue if not self.jobs[h].request.is_cancelled()]
        if len(keep) != len(queue):
            for h in set(queue) - set(keep):
                job = self.jobs.pop(h)
                self._refuse(job.sender, "cancelled", "CANCELLED", "the request was cancelled")
            queue.clear()
            queue.extend(keep)

    def _finish(self, job: _Job) -> None:
        m, handle = self.model, job.handle
        outcome = "failed"
        try:
            if handle.error is not None:
                raise handle.error
            m._final(job.req, handle.result, job.text, job.ended, job.sender)
            outcome = "success"
        except _Abort:
            outcome = "cancelled"
            m._fail(job.sender, "CANCELLED", "the request was cancelled")
        except Exception as e:  # noqa: BLE001 - this request alone
            pb_utils.Logger.log_error(f"eaglex: request failed: {''.join(traceback.format_exception(e))}")
            m._fail(job.sender, "INTERNAL", f"eaglex failed on this request: {type(e).__name__}: {e}")
        finally:
            m.metrics.requests[outcome].increment(1)
            m._count(handle.result)

    def _reset(self, message: str, code: str = "INTERNAL") -> None:
        """Fail every submitted request (decoding or waiting) and start a fresh batcher."""
        jobs, self.jobs = list(self.jobs.values()), {}
        for job in jobs:
            try:
                self._refuse(job.sender, "failed" if code == "INTERNAL" else "rejected", code, message)
                self.model._count(job.handle.result)
            except Exception:  # noqa: BLE001 - tell the others even if one cannot be told
                pb_utils.Logger.log_warn(f"eaglex: could not fail a request: {traceback.format_exc()}")
        if code == "INTERNAL":
            self.gen = self.model.engine.batcher(self.max_batch, self.schedule, context=self.context)
