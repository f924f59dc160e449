"""TensorRT-LLM bundles (written by engines/trtllm.py) behind the same generate/check interface as Engine.

TensorRT-LLM drafts and verifies inside its own executor, so a bundle does not run behind eaglex's Backend
protocol: generation hands token-id prompts to `LLM.generate`, once with the bundle's `speculative_config`
(EAGLE-3) and, for `check`, once without (vanilla), and compares the token ids. The two LLMs are never alive
together (a 70B model does not fit twice). Written from TensorRT-LLM's public LLM API; it only runs where
TensorRT-LLM is installed, i.e. on a GPU machine. Elsewhere opening a bundle stops with a ModelError.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eaglex.base.errors import ModelError

from .manifest import read_manifest

# The oldest TensorRT-LLM whose Eagle3DecodingConfig field list is recorded from upstream and accepts a bundle's
# speculative_config (engines/trtllm_upstream.floor; tests/test_trtllm_upstream.py keeps the two equal). 1.0-1.2
# may work but are unverified: no field list of theirs could be recorded.
MIN_TRTLLM = "1.3.0rc27"

NOT_INSTALLED = ("TensorRT-LLM is not installed on this machine; this bundle runs on a GPU machine with "
                 "TensorRT-LLM >= {v} (PyTorch backend; e.g. the NGC container nvcr.io/nvidia/tensorrt-llm/release, "
                 "{gpus} GPU(s), {cc}): run `eaglex generate --engine {b}` there, or `cd {b} && trtllm-serve "
                 "./target --extra_llm_api_options llm_api_options.yaml`")


@dataclass(frozen=True)
class TrtllmResult:
    index: int
    output_ids: list[int]
    seconds: float
    stop_reason: str = ""
    tau = 0.0           # TensorRT-LLM does not report acceptance per request
    cycles = 0

    def to_json(self) -> dict:
        return {"output_ids": self.output_ids, "seconds": round(self.seconds, 4), "backend": "tensorrt-llm"}


def import_trtllm():
    """(LLM, SamplingParams, Eagle3DecodingConfig, KvCacheConfig), or None when TensorRT-LLM is not importable."""
    try:
        from tensorrt_llm import LLM, SamplingParams
        from tensorrt_llm.llmapi import Eagle3DecodingConfig, KvCacheConfig
    except ImportError:
        return None
    return LLM, SamplingParams, Eagle3DecodingConfig, KvCacheConfig


class TrtllmRunner:
    """Loads a bundle (validated against TensorRT-LLM's rules when it was written, and by the CLI before opening);
    `generate(prompts, speculative)` runs one LLM instance and releases it."""

    def __init__(self, bundle):
        self.bundle = Path(bundle).resolve()
        self.manifest = read_manifest(self.bundle)
        if self.manifest.get("backend") != "tensorrt-llm":
            raise ModelError(f"{self.bundle} is not a TensorRT-LLM bundle")
        api = import_trtllm()
        if api is None:
            hw = self.manifest["hardware"]
            raise ModelError(NOT_INSTALLED.format(v=MIN_TRTLLM, gpus=hw["gpus"], cc=f"compute capability "
                                                  f"{hw['compute_capability']}", b=self.bundle))
        self.LLM, self.SamplingParams, self.Eagle3DecodingConfig, self.KvCacheConfig = api
        self.tokenizer_dir = self.bundle / self.manifest["target"]["path"]
        self.draft_kind = "eagle3"
        self.dtype = self.manifest["dtype"]

    def llm_kwargs(self, speculative: bool) -> dict:
        """Keyword arguments of LLM(...) from the bundle's options; paths made absolute (the options file keeps
        them relative to the bundle, so that it stays valid when the bundle is moved)."""
        o = self.manifest["llm_api_options"]
        kwargs = {"model": str(self.bundle / self.manifest["target"]["path"]),
                  "tensor_parallel_size": o["tensor_parallel_size"],
                  "pipeline_parallel_size": o["pipeline_parallel_size"],
                  "kv_cache_config": self.KvCacheConfig(**o.get("kv_cache_config", {}))}
        if o.get("dtype"):                   # the bundle's one dtype (TensorRT-LLM has no float32 kernels)
            kwargs["dtype"] = o["dtype"]
        if speculative:
            spec = {k: v for k, v in o["speculative_config"].items() if k != "decoding_type"}
            spec["speculative_model"] = str((self.bundle / spec["speculative_model"]).resolve())
            kwargs["speculative_config"] = self.Eagle3DecodingConfig(**_supported(self.Eagle3DecodingConfig, spec))
        return kwargs

    def sampling_params(self, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                        seed: int = 0):
        """Greedy unless temperature > 0 (TensorRT-LLM decodes greedily when no sampling field is set)."""
        kw = {"max_tokens": max_new_tokens}
        if temperature > 0:
            kw.update(temperature=temperature, top_p=top_p, top_k=top_k or None, seed=seed, random_seed=seed)
        eos = self.manifest["target"]["eos_ids"]
        if eos:
            kw["end_id"] = eos[0]
            if len(eos) > 1:
                kw["stop_token_ids"] = list(eos[1:])
        return self.SamplingParams(**_supported(self.SamplingParams, kw))

    def generate(self, prompts: list[list[int]], max_new_tokens: int, speculative: bool = True,
                 **sampling) -> list[TrtllmResult]:
        llm = self.LLM(**self.llm_kwargs(speculative))
        try:
            params = self.sampling_params(max_new_tokens, **sampling)
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling_params=params)
            seconds = time.perf_counter() - t0
        finally:
            shutdown = getattr(llm, "shutdown", None)
            if shutdown is not None:
                shutdown()
        return [TrtllmResult(i, list(o.outputs[0].token_ids), seconds / max(len(prompts), 1))
                for i, o in enumerate(outs)]

    def check(self, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
        """Greedy EAGLE-3 against greedy vanilla, token for token, one row per prompt."""
        vanilla = self.generate(prompts, max_new_tokens, speculative=False)
        spec = self.generate(prompts, max_new_tokens, speculative=True)
        rows = []
        for v, s in zip(vanilla, spec):
            div = next((j for j, (a, b) in enumerate(zip(v.output_ids, s.output_ids)) if a != b), None)
            if div is None and len(v.output_ids) != len(s.output_ids):
                div = min(len(v.output_ids), len(s.output_ids))
            rows.append({"index": v.index, "identical": div is None, "divergence": div,
                         "new_tokens": len(s.output_ids), "vanilla_s": v.seconds, "eagle_s": s.seconds})
        return rows


def _supported(cls, kwargs: dict) -> dict:
    """Drop keyword arguments the installed TensorRT-LLM does not know (fields were renamed across versions:
    speculative_model_dir -> speculative_model, random_seed -> seed); say so on stderr."""
    fields = getattr(cls, "model_fields", None)                 # pydantic (LLM API configs)
    if fields is None and dataclasses.is_dataclass(cls):
        fields = {f.name for f in dataclasses.fields(cls)}
    if not fields:
        return kwargs
    out = {}
    for k, v in kwargs.items():
        if k in fields:
            out[k] = v
        elif k == "speculative_model" and "speculative_model_dir" in fields:
            out["speculative_model_dir"] = v
        elif k not in ("seed", "random_seed"):
            print(f"eaglex: TensorRT-LLM's {cls.__name__} has no field {k!r}; ignored", file=sys.stderr)
    if "seed" in kwargs and "seed" not in out and "random_seed" not in out:
        print(f"eaglex: TensorRT-LLM's {cls.__name__} takes no seed; sampling is unseeded", file=sys.stderr)
    return out


class TrtllmEngine:
    """open_engine()'s answer for a bundle: the Engine interface (generate, check, method, tokenizer)."""
    layout = "bundle"
    tree = None

    def __init__(self, bundle, method: str | None = None):
        if method not in (None, "eagle3", "vanilla"):
            raise ModelError(f"a TensorRT-LLM bundle runs EAGLE-3 or vanilla, not {method}")
        self.runner = TrtllmRunner(bundle)
        self.path, self.method = self.runner.bundle, method or "eagle3"
        self.manifest = self.runner.manifest
        self.draft_kind = "eagle3"
        from eaglex.base.prompts import load_tokenizer
        self.tokenizer = load_tokenizer(self.runner.tokenizer_dir)

    def generate(self, prompts, sampling=None, max_new_tokens: int = 128, seeds=None, stop=None, on_tokens=None):
        """TensorRT-LLM runs the batch itself; `stop` and `on_tokens` are not supported there (refused when given)."""
        if stop is not None or on_tokens is not None:
            raise ModelError("TensorRT-LLM bundles do not stream or stop early through eaglex; serve them with "
                             "trtllm-serve or Triton's TensorRT-LLM backend")
        s = {} if sampling is None or sampling.greedy else {
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
            "seed": sampling.seed}
        return self.runner.generate(prompts, max_new_tokens, speculative=self.method != "vanilla", **s)

    def check(self, prompts, max_new_tokens: int) -> list[dict]:
        return self.runner.check(prompts, max_new_tokens)
