"""The `eaglex` command line: flags become library calls; every workflow lives in the library.

One module of ~800 lines on purpose: it is the whole flag surface (what `--help` shows), each subcommand a parser and
a short call into the library with no logic of its own, so splitting it would scatter what a user reads in one place.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eaglex.base.errors import ModelError
from eaglex.base.methods import METHODS

TREE_HELP = ("chain:N (N draft tokens in a line), dynamic:TOTAL/DEPTH/TOPK (EAGLE-2: TOTAL nodes verified, DEPTH "
             "levels, TOPK expanded per level; the official code's 60/7/10 is dynamic:60/8/10), cost:DEPTH/TOPK (the "
             "dynamic tree's candidates, of which each cycle verifies as many as the engine's measured cost curve "
             "says pay, up to 63), static (EAGLE-1's "
             "mc_sim_7b_63), or auto (the engine's tuned tree; one never tuned is measured now, for this run only: "
             "`eaglex tune` stores it). Default: the engine's own tree (tuned by `eaglex tune` or `eaglex engine`), "
             "dynamic:16/6/4 for model folders")
SEED_HELP = ("base seed (>= 0). Line i of --prompts samples from its own stream: the line's \"seed\" field if it has "
             "one, else a stream derived from (--seed, i) with numpy's SeedSequence, so identical lines give "
             "independent samples, runs with different --seed share no stream, and a line's output does not depend "
             "on the other lines")
RETIRED = {"--total-tokens": "--tree dynamic:TOTAL/DEPTH/TOPK", "--depth": "--tree chain:N or dynamic:TOTAL/DEPTH/TOPK",
           "--tree-top-k": "--tree dynamic:TOTAL/DEPTH/TOPK"}
DEVICE_HELP = ('where the models run: "auto" (the first visible CUDA GPU, else the CPU; for ONNX Runtime engines a '
               'GPU needs onnxruntime-gpu), "cpu", "cuda" or "cuda:N"')
PROVIDERS_HELP = ("ONNX Runtime engines: execution providers in order of preference, comma-separated (e.g. "
                  "TensorrtExecutionProvider,CUDAExecutionProvider); default: the --device's")
BUNDLE_RETIRED = {"--max-draft-len": "--tree chain:N", "--dynamic-tree-top-k": "--tree dynamic:TOTAL/DEPTH/TOPK",
                  "--max-total-draft-tokens": "--tree dynamic:TOTAL/DEPTH/TOPK"}


def _refuse_retired(args, flags: dict) -> None:
    for flag, new in flags.items():
        if getattr(args, "retired_" + flag[2:].replace("-", "_"), None) is not None:
            raise ModelError(f"{flag} is gone: trees are spelled in one flag, {new}")


def _tree(text: str | None):
    """A TreeConfig, the string "auto", or None (not given); a ModelError for a bad spelling."""
    from eaglex.runtime.types import TreeConfig
    if text is None:
        return None
    try:
        return TreeConfig.parse(text) or "auto"
    except ValueError as e:
        raise ModelError(str(e)) from None


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--engine", type=Path, help="engine folder (`eaglex build`), TensorRT-LLM bundle, folder with "
                                               "target/ and draft/, or a Hugging Face model folder")
    g.add_argument("--target", type=Path, help="Hugging Face model folder of the target, or a Llama-family .gguf file "
                                               "(instead of --engine)")
    g.add_argument("--draft", type=Path, help="EAGLE head folder (official EAGLE-3 or EAGLE-1/2 layout)")
    g.add_argument("--draft-kind", choices=("eagle3", "eagle1"), help="force the head kind instead of detecting it")
    g.add_argument("--method", choices=METHODS,
                   help="eagle3: EAGLE-3 head + tree; eagle2: EAGLE-1/2 head + tree; eagle1: EAGLE-1/2 head + "
                        "static tree; vanilla: no drafting (default: what the engine or head implies)")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="weights and KV cache of --target models (engines have their own)")
    g.add_argument("--tree", metavar="TREE", help=TREE_HELP)
    g.add_argument("--threads", type=int, default=0, help="cores to use (0: all physical cores)")
    g.add_argument("--device", default="auto", help=DEVICE_HELP)
    g.add_argument("--providers", help=PROVIDERS_HELP)
    for flag in RETIRED:
        g.add_argument(flag, dest="retired_" + flag[2:].replace("-", "_"), help=argparse.SUPPRESS)
    s = p.add_argument_group("sampling")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0, help="0 = off")
    s.add_argument("--seed", type=int, default=0, help=SEED_HELP)
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to text prompts")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglex", description="Lossless EAGLE speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with speculative (or vanilla) decoding")
    _model_args(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one text prompt (needs a tokenizer in the target folder)")
    src.add_argument("--prompts", type=Path,
                     help='JSONL: {"prompt": "..."} or {"input_ids": [...]} per line, optionally with "seed"')
    gen.add_argument("--out", type=Path, help="write one JSON line per prompt here instead of printing text")
    gen.add_argument("--batch", type=int, default=1,
                     help="decode up to N prompts at once (in-flight batching, one model copy); same outputs")

    chk = sub.add_parser("check", help="compare speculative with vanilla on the same backend; exit 1 on mismatch")
    _model_args(chk)
    chk.add_argument("--prompts", type=Path, required=True)
    chk.add_argument("--samples", type=int, default=300,
                     help="with --temperature: generations per prompt for the chi-square distribution check, after "
                          "the token-for-token one (0: skip it)")
    chk.add_argument("--batch", type=int, default=1,
                     help="also decode the prompts up to N at a time through the in-flight batcher (the engine's "
                          "batch schedule) and compare each with the prompt decoded alone by vanilla")

    tun = sub.add_parser("tune", help="measure the fastest tree (and batch schedule) on this machine and store it in "
                                      "an engine folder: what every entry point then runs")
    tun.add_argument("--engine", type=Path, required=True, help="engine folder (`eaglex build`)")
    tun.add_argument("--prompts", type=Path, required=True, help="JSONL prompts to measure on (see generate)")
    tun.add_argument("--num-prompts", type=int, default=0, help="use only the first N prompts (0 = all)")
    tun.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to text prompts")
    tun.add_argument("--force", action="store_true", help="measure again, even if the engine was tuned")
    tun.add_argument("--threads", type=int, default=0, help="cores to use (0: all physical cores)")
    tun.add_argument("--device", default="auto", help=DEVICE_HELP)
    tun.add_argument("--providers", help=PROVIDERS_HELP)

    eng = sub.add_parser("engine", help="what `make engine` runs: build a preset's engine, tune, check, demo")
    eng.add_argument("--model", default="smollm2-135m",
                     help="preset name (default smollm2-135m; tiny, llama3-8b, llama3-70b, vicuna-13b, ...)")
    eng.add_argument("--model-dir", type=Path, help="local folder of the target (else HF cache, else download)")
    eng.add_argument("--draft-dir", type=Path, help="local folder of the EAGLE head (else HF cache, else download)")
    eng.add_argument("--backend", choices=("onnxruntime", "torch", "tensorrt-llm"), help="default: the preset's")
    eng.add_argument("--out", type=Path, help="engine folder (default: engines/MODEL)")
    eng.add_argument("--force", action="store_true", help="rebuild and retune even if the engine exists")
    eng.add_argument("--max-new-tokens", type=int, default=48, help="tokens per prompt in the check (default 48)")
    eng.add_argument("--demo-tokens", type=int, default=128, help="tokens of the demo answer (default 128)")
    eng.add_argument("--threads", type=int, default=0, help="cores to use (0: all physical cores)")
    eng.add_argument("--device", default="auto", help=DEVICE_HELP)
    eng.add_argument("--providers", help=PROVIDERS_HELP)

    ben = sub.add_parser("bench", help="side-by-side speed table + JSON: vanilla vs speculative per engine, peers")
    ben.add_argument("--target", type=Path, help="HF target folder (torch backend rows and transformers peers)")
    ben.add_argument("--draft", type=Path, help="EAGLE head folder for the torch backend rows")
    ben.add_argument("--engine", type=Path, action="append", default=[], help="engine folder (repeatable)")
    ben.add_argument("--draft-lm", type=Path, help="small draft LM folder for transformers assisted generation")
    ben.add_argument("--prompts", type=Path, required=True, help="JSONL prompts (see generate)")
    ben.add_argument("--num-prompts", type=int, default=0, help="use only the first N prompts (0 = all)")
    ben.add_argument("--trees", default="auto,chain:4,dynamic:16/6/4",
                     help="comma list of trees (see generate --tree); auto = the engine's own tree")
    ben.add_argument("--max-new-tokens", type=int, default=64)
    ben.add_argument("--threads", type=int, default=0, help="cores for every row (0: all physical cores)")
    ben.add_argument("--device", default="auto", help=DEVICE_HELP + " (every row, the transformers peers too)")
    ben.add_argument("--providers", help=PROVIDERS_HELP)
    ben.add_argument("--no-torch", action="store_true", help="skip the torch backend rows")
    ben.add_argument("--no-peers", action="store_true", help="skip the transformers peers")
    ben.add_argument("--llamacpp", default="auto", metavar="auto|off|FILE.gguf",
                     help="llama.cpp peers (llama-cpp-python) on the GGUF file the target was converted from: greedy "
                          "with the file itself and with F32 and Q8_0 copies of its weights (written once, beside the "
                          "target folder), and prompt lookup on F32, on the cores of the eaglex rows. auto (default): "
                          "when llama_cpp is installed and the target folder (--target, else the first --engine's) "
                          "came from a GGUF file that is found (given as --target FILE.gguf, beside the folder, or in "
                          "a preset's pip package); FILE.gguf: that file (checked against the target's); off: none. "
                          "These rows report whether their tokens equal eaglex vanilla but never fail the run")
    ben.add_argument("--llamacpp-server", default="auto", metavar="auto|off|DIR",
                     help="llama.cpp's own EAGLE-3 (llama-server, with and without the --draft head written by "
                          "`eaglex export --to llama.cpp`) on the --llamacpp GGUF file and its F32 and Q8_0 copies, "
                          "interleaved with eaglex vanilla on the same cores; DIR holds llama-server and "
                          "llama-quantize (built by tools/build_llamacpp.sh); auto (default): build/llama.cpp/bin, "
                          "else PATH; off: none. Reported, never failing the run")
    ben.add_argument("--llamacpp-drafts", metavar="N/P,...",
                     help="llama.cpp EAGLE-3 draft settings swept per target (--spec-draft-n-max N / "
                          "--spec-draft-p-min P, on the first 4 prompts against its vanilla); the fastest is "
                          "benched (default: n-max 2, 4, 8 x p-min 0, 0.5, 0.75; one setting: no sweep)")
    ben.add_argument("--vllm", metavar="PYTHON",
                     help="vLLM peers: the python of vLLM's CPU venv (`make vllm-venv`: build/vllm-venv/bin/python), "
                          "running vLLM vanilla and vLLM's EAGLE-3 with the --draft head on a float32 copy of the "
                          "target folder (--target, else the first --engine's), interleaved with eaglex vanilla on "
                          "the same cores. Left out with one line when it is not there or vLLM does not start; "
                          "reported, never failing the run (default: none)")
    ben.add_argument("--vllm-ks", metavar="K,...",
                     help="vLLM EAGLE-3 num_speculative_tokens swept on the first 4 prompts against vLLM vanilla; "
                          "the fastest is benched (default: 1,2,3,4; one value: no sweep)")
    ben.add_argument("--batch-sizes", metavar="B,...",
                     help="also decode every prompt through in-flight batching (generate --batch B) at these sizes, "
                          "vanilla and the engine's batch schedule, beside batch tuning's figures, e.g. 1,4,16 "
                          "(engines with a head; JSON 'batched'; default: none)")
    ben.add_argument("--out", type=Path, default=Path("bench.json"), help="JSON results file")
    ben.add_argument("--plot", type=Path, help="also draw the table as a PNG here: tokens/s per row and the "
                                               "anchored ratios over llama.cpp (needs matplotlib: pip install -e "
                                               "'.[bench]')")

    bld = sub.add_parser("build", help="export a target (+ EAGLE head) to an engine folder and check it")
    bld.add_argument("--target", type=Path, required=True, help="Hugging Face model folder of the target")
    bld.add_argument("--draft", type=Path, help="EAGLE head folder (omit for a vanilla-only engine)")
    bld.add_argument("--backend", choices=("onnxruntime", "tensorrt-llm"), default="onnxruntime",
                     help="onnxruntime: ONNX engine run here; tensorrt-llm: a bundle for TensorRT-LLM's LLM API "
                          "(PyTorch backend, EAGLE-3) on GPU machines")
    bld.add_argument("--out", type=Path, required=True, help="engine folder to write, e.g. engines/NAME")
    bld.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    bld.add_argument("--force", action="store_true", help="replace an existing engine folder")
    bld.add_argument("--kernels", choices=("auto", "eaglex", "linear", "stock"), default="auto",
                     help="onnxruntime: eaglex's batch-invariant kernels: its linear layers (LinearF32, int8 LinearQ8, "
                          "int4 LinearQ4) and one TreeAttention node a layer (eaglex), its linear layers only "
                          "(linear), or ONNX Runtime's stock ops (stock); auto: linear where the kernel library is "
                          "built here (`make setup`; TreeAttention is faster at one row but not yet at many rows over "
                          "long contexts), else stock. The manifest records it")
    q = bld.add_argument_group("quantization")
    q.add_argument("--quant", choices=("fp8", "int8", "int4", "w8a8"),
                   help="fp8: FP8 Q/DQ from calibrated scales (onnxruntime; exact with chain trees, one request at "
                        "a time) or the ModelOpt FP8 checkpoint (tensorrt-llm); int8 / int4: MatMulNBits with int8 "
                        "activations and row-independent attention, the quantized CPU path closest to float "
                        "(onnxruntime; exact with any tree and in batches); w8a8: SmoothQuant int8 weights and "
                        "per-row int8 activations on the integer GEMM: the fastest CPU engine (a few rows verified at "
                        "about one row's cost), lower quality than int8; exact as int8")
    q.add_argument("--calibrated", type=Path, help="FP8 checkpoint written by `eaglex calibrate` (for --quant fp8)")
    q.add_argument("--quant-draft", action="store_true",
                   help="quantize the draft graphs too (onnxruntime); alone: int8 draft, float target (cheaper "
                        "drafting, output unchanged: the float target decides every token)")
    q.add_argument("--calibrated-draft", type=Path, help="FP8 draft from `eaglex calibrate --quant-draft`")
    q.add_argument("--calibration-data", default="auto",
                   help="w8a8: text its activation ranges are measured on (as `eaglex calibrate --data`: auto, "
                        "builtin-chat, builtin, hf:NAME, or a JSONL of prompts / input_ids; default auto)")
    tl = bld.add_argument_group("tensorrt-llm")
    tl.add_argument("--tp", type=int, default=1, help="tensor parallel size (GPUs per pipeline stage)")
    tl.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    tl.add_argument("--tree", default="chain:3", metavar="TREE",
                    help="the bundle's speculation: chain:N (max_draft_len N) or dynamic:TOTAL/DEPTH/TOPK "
                         "(TensorRT-LLM's dynamic tree: max_total_draft_tokens TOTAL-1, max_draft_len DEPTH, "
                         "dynamic_tree_max_topK TOPK)")
    for flag in BUNDLE_RETIRED:
        tl.add_argument(flag, dest="retired_" + flag[2:].replace("-", "_"), help=argparse.SUPPRESS)

    cal = sub.add_parser("calibrate", help="FP8 post-training quantization with NVIDIA ModelOpt + quality report")
    cal.add_argument("--target", type=Path, required=True, help="Hugging Face model folder of the target")
    cal.add_argument("--out", type=Path, required=True, help="folder for ModelOpt's unified FP8 HF checkpoint")
    cal.add_argument("--quant", choices=("fp8",), default="fp8")
    cal.add_argument("--kv-cache", choices=("fp8",), help="also calibrate FP8 k/v cache scales")
    cal.add_argument("--data", default="auto",
                     help="auto (builtin-chat for a tokenizer with a chat template, else builtin) | builtin-chat (a "
                          "built-in chat instruction set through the chat template) | builtin (held-out Python "
                          "standard-library corpus) | hf:NAME[:SPLIT] (a Hugging Face dataset; needs the hub) | "
                          'FILE.jsonl of {"prompt": ...} / {"input_ids": [...]} lines (the last fifth is held out)')
    cal.add_argument("--samples", type=int, default=32, help="calibration windows")
    cal.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    cal.add_argument("--eval-samples", type=int, default=8, help="held-out windows for the quality report")
    cal.add_argument("--batch-size", type=int, default=4)
    cal.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16",
                     help="load, calibrate and export in this dtype (TensorRT-LLM serves bfloat16/float16)")
    cal.add_argument("--device", default="auto",
                     help="auto (every visible GPU, overflow offloaded to RAM; else the CPU) | cpu | cuda | cuda:N")
    cal.add_argument("--draft", type=Path, help="EAGLE head folder (with --quant-draft)")
    cal.add_argument("--quant-draft", action="store_true", help="also quantize the EAGLE head (default: float)")
    cal.add_argument("--draft-out", type=Path, help="FP8 head folder (default: OUT-draft)")
    cal.add_argument("--force", action="store_true", help="replace existing output folders")

    tri = sub.add_parser("triton", help="write a Triton Inference Server model repository serving an engine")
    tri.add_argument("--engine", type=Path, required=True,
                     help="engine folder (or a folder with target/ and draft/ model folders, or a TensorRT-LLM "
                          "bundle with --backend tensorrt-llm)")
    tri.add_argument("--out", type=Path, required=True, help="model repository to write into")
    tri.add_argument("--backend", choices=("eaglex", "tensorrt-llm"), default="eaglex",
                     help="eaglex: the eaglex runtime in Triton's Python backend; tensorrt-llm: TensorRT-LLM's own "
                          "llmapi model (model.yaml with the bundle's speculative config) for a bundle")
    tri.add_argument("--name", help="model name in the repository (default: eaglex, or tensorrt_llm)")
    tri.add_argument("--template", type=Path,
                     help="tensorrt-llm: a copy of TensorRT-LLM's llmapi model folder (default: the container's)")
    tri.add_argument("--max-batch-size", type=int, default=0, help="tensorrt-llm: Triton's max_batch_size")
    tri.add_argument("--decoupled", action="store_true", help="tensorrt-llm: decoupled (streaming) model")
    tri.add_argument("--instances", type=int, default=1,
                     help="model instances (with --max-batch 0: one request each at a time)")
    tri.add_argument("--max-batch", type=int, default=None,
                     help="requests one instance decodes together by in-flight batching (default: 16 with one "
                          "instance; 0: one request at a time per instance, the default with --instances > 1)")
    tri.add_argument("--max-queue-size", type=int, default=64, help="requests waiting beyond this are refused")
    tri.add_argument("--max-context", type=int, default=0,
                     help="longest prompt + new tokens per request (0: the model's context; with batching, as much "
                          "as fits in half the memory available at load: every slot holds that much KV)")
    tri.add_argument("--threads", type=int, default=0,
                     help="intra-op threads per instance (0: the backend's default)")
    tri.add_argument("--vanilla", action="store_true", help="serve without drafting (for comparisons)")
    tri.add_argument("--chat", action="store_true",
                     help="text_input is the user's message, wrapped with the tokenizer's chat template (default: "
                          "raw text, as TensorRT-LLM clients send; a request's chat_template parameter overrides)")
    tri.add_argument("--copy", action="store_true", help="copy the engine into the repository (portable)")
    tri.add_argument("--force", action="store_true", help="replace the model folder if it exists")

    srv = sub.add_parser("serve", help="serve an engine on 127.0.0.1: the OpenAI API and Triton's, supervised")
    srv_sub = srv.add_subparsers(dest="action", required=True)
    for action, text in (("start", "start in the background; returns once the model is ready"),
                         ("run", "run in the foreground (systemd, containers); Ctrl-C or SIGTERM stops it")):
        p = srv_sub.add_parser(action, help=text, description=text)
        src = p.add_mutually_exclusive_group(required=True)
        src.add_argument("--engine", type=Path, help="engine folder (`eaglex build`, `make engine`) or a folder with "
                                                     "target/ and draft/: written as DIR/model_repository")
        src.add_argument("--repo", type=Path, help="serve this Triton model repository as it is (`eaglex triton`)")
        p.add_argument("--dir", type=Path, default=Path("build/serve"),
                       help="the deployment's folder: repository, settings, pid, state, logs (default build/serve)")
        p.add_argument("--name", default="eaglex", help="the model's name (OpenAI's `model`; default eaglex)")
        p.add_argument("--http-port", type=int, default=8000,
                       help="public HTTP port: OpenAI API (/v1) and Triton's HTTP API (/v2); 0 picks a free one")
        p.add_argument("--grpc-port", type=int, default=8001, help="Triton's gRPC port (0: a free one)")
        p.add_argument("--metrics-port", type=int, default=8002, help="Prometheus metrics (0: a free one)")
        p.add_argument("--max-batch", type=int, default=16,
                       help="requests decoded together by in-flight batching (default 16; 0: one at a time)")
        p.add_argument("--instances", type=int, default=1,
                       help="model instances, each one request at a time (with --max-batch 0; default 1)")
        p.add_argument("--max-queue-size", type=int, default=64,
                       help="requests that may wait for a batch slot; more are refused with 503 (default 64)")
        p.add_argument("--max-context", type=int, default=0,
                       help="longest prompt + new tokens per request (0: the model's, or what fits in half the "
                            "memory available with batching)")
        p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: the backend's default)")
        p.add_argument("--vanilla", action="store_true", help="serve without drafting (for comparisons)")
        p.add_argument("--chat", action="store_true",
                       help="Triton's text_input is the user's message, wrapped with the chat template (the OpenAI "
                            "API's /v1/chat/completions always applies it; /v1/completions never does)")
        p.add_argument("--open-admin-api", action="store_true",
                       help="leave Triton's shared-memory, model-repository, logging and trace APIs open to any "
                            "client (default: restricted to a key in DIR/admin-key)")
        p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every request but the health "
                                         "checks (default: the environment's EAGLEX_API_KEY, else none)")
        p.add_argument("--timeout", type=float, default=300, help="seconds to wait for the model to be ready")
        p.add_argument("--exit-timeout", type=int, default=30, help="seconds Triton may take to finish at stop")
        p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted")
        p.add_argument("--max-json-depth", type=int, default=64, help="deepest JSON nesting accepted")
    for action, text in (("status", "is the server of --dir ready? (exit 0 ready, 1 not ready, 3 not running)"),
                         ("stop", "stop the server of --dir and say what happened while it ran")):
        p = srv_sub.add_parser(action, help=text, description=text)
        p.add_argument("--dir", type=Path, default=Path("build/serve"), help="the deployment's folder")

    imp = sub.add_parser("import", help="convert a Llama-family GGUF file into a Hugging Face target folder")
    imp.add_argument("--gguf", type=Path, required=True, help="the .gguf file (F32, F16, BF16, Q8_0, Q4_x, ...)")
    imp.add_argument("--out", type=Path, required=True, help="folder to write (config, safetensors, tokenizer)")
    imp.add_argument("--force", action="store_true", help="replace an existing folder")

    exp = sub.add_parser("export", help="write an EAGLE-3 head for another runtime: llama.cpp (a GGUF file)")
    exp.add_argument("--to", choices=("llama.cpp",), required=True,
                     help="llama.cpp: a GGUF draft for `llama-server -m TARGET.gguf -md OUT --spec-type "
                          "draft-eagle3`")
    exp.add_argument("--draft", type=Path, required=True, help="EAGLE-3 head folder (e.g. from train-draft)")
    exp.add_argument("--target", dest="target_gguf", type=Path, required=True, metavar="TARGET.gguf",
                     help="the target's GGUF file, as llama.cpp will load it (its tokenizer is copied)")
    exp.add_argument("--out", type=Path, required=True, help="the .gguf file to write")
    exp.add_argument("--dtype", choices=("F32", "F16"), default="F32",
                     help="the head's matrices (norms stay F32; llama-quantize makes smaller ones)")
    exp.add_argument("--force", action="store_true", help="replace an existing file")

    trn = sub.add_parser("train-draft", help="train an EAGLE head for a target on its own continuations of prompts")
    trn.add_argument("--target", type=Path, required=True, help="Hugging Face model folder of the target")
    trn.add_argument("--data", required=True,
                     help='JSONL: {"prompt": "..."} or {"input_ids": [...]} per line, the last 8 held out for τ; or '
                          'builtin-chat: the built-in chat instructions in the target\'s chat template (chat models); '
                          'self-instruct:N: N instructions the target writes itself from its chat template (chat '
                          'models, no dataset needed; resumable), 8 more held out')
    trn.add_argument("--out", type=Path, required=True, help="head folder to write (checkpoints/ inside: resumable)")
    trn.add_argument("--method", choices=("eagle3", "eagle1"), default="eagle3",
                     help="eagle3: training-time test, reduced vocabulary; eagle1: EAGLE-1/2 feature regression")
    trn.add_argument("--steps", type=int, default=1000, help="optimiser steps")
    trn.add_argument("--init", type=Path, metavar="HEAD_DIR",
                     help="continue training this head (one of ours, or an official EAGLE checkpoint for this target; "
                          "of the --method kind) instead of fresh weights; its shape and draft vocabulary are kept")
    trn.add_argument("--lr", type=float, help="peak learning rate (default 2e-3, sized for fresh weights; lower, "
                                              "e.g. 3e-4, to fine-tune with --init)")
    trn.add_argument("--device", default="auto", help=DEVICE_HELP + " (generation, training and the τ report)")
    return parser


# ------------------------------------------------------------------------------------------------------- helpers

def open_from_args(args):
    """The Engine the model flags name (runtime/engine.py decides what a folder means)."""
    from eaglex.runtime.engine import open_engine, open_models
    from eaglex.runtime.threads import set_threads

    _refuse_retired(args, RETIRED)
    args.tree = _tree(args.tree)
    if args.engine is not None and (args.target or args.draft):
        raise ModelError("give either --engine or --target/--draft, not both")
    tree = None if args.tree in (None, "auto") else args.tree
    from eaglex.runtime.engine import layout
    # before anything opens a session: ONNX Runtime's process-wide pool is sized once
    set_threads(args.threads or None, onnxruntime=args.engine is not None and layout(args.engine) == "engine")
    if args.engine is not None:
        if layout(args.engine) == "bundle":            # judged by TensorRT-LLM's rules before anything runs it
            from eaglex.engines.trtllm import installed_problems, validate_bundle
            problems = installed_problems(validate_bundle(args.engine)["llm_api_options"])
            if problems:
                raise ModelError(f"the installed TensorRT-LLM rejects {args.engine}'s options: {'; '.join(problems)}")
        engine = open_engine(args.engine, method=args.method, tree=tree, dtype=args.dtype,
                             draft_kind=args.draft_kind, device=args.device, providers=args.providers)
    elif args.target is not None:
        if args.providers:
            raise ModelError("--providers applies to ONNX Runtime engines (--engine DIR)")
        engine = open_models(args.target, args.draft, method=args.method, tree=tree, dtype=args.dtype,
                             draft_kind=args.draft_kind, device=args.device)
    else:
        raise ModelError("give --engine DIR, or --target DIR (and --draft DIR)")
    if args.max_new_tokens < 0:
        raise ModelError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    return engine


def sampling_from_args(args):
    from eaglex.runtime.types import SamplingConfig
    try:
        return SamplingConfig(args.temperature, args.top_p, args.top_k, args.seed)
    except ValueError as e:
        raise ModelError(str(e)) from None


def prompts_from_args(args, engine) -> tuple[list[list[int]], list[int | None]]:
    """(token ids, per-line seeds) of --prompt / --prompts."""
    from eaglex.base.prompts import encode, read_records, record_seed
    if getattr(args, "prompt", None) is not None:
        return [encode({"prompt": args.prompt}, engine.tokenizer, args.chat, "--prompt")], [None]
    records = read_records(args.prompts)
    return ([encode(r, engine.tokenizer, args.chat, where) for where, r in records],
            [record_seed(r, where) for where, r in records])


def resolve_auto(args, engine, prompts) -> None:
    """--tree auto: the engine's tuned tree, measured now if it never was; a reading command never writes the
    engine (`eaglex tune` does)."""
    if args.tree == "auto" and engine.method != "vanilla":
        from eaglex.engines.tune import tune_engine
        tune_engine(engine, prompts, log=lambda line: print(f"--tree auto: {line}", file=sys.stderr), store=False)


# ------------------------------------------------------------------------------------------------------ commands

def cmd_generate(args) -> int:
    engine = open_from_args(args)
    prompts, seeds = prompts_from_args(args, engine)
    resolve_auto(args, engine, prompts)
    if args.batch < 1:
        raise ModelError(f"--batch must be >= 1, got {args.batch}")
    results = engine.generate(prompts, sampling_from_args(args), args.max_new_tokens, seeds, batch=args.batch)
    tok = engine.tokenizer
    if args.out:
        args.out.write_text("".join(json.dumps(r.to_json()) + "\n" for r in results))
        return 0
    kept = getattr(engine, "kept_tree", None)          # a TensorRT-LLM bundle has none
    how = engine.method + (f" {engine.tree}" if engine.tree is not None else
                           f", tuned: faster than {kept}" if kept is not None else "")
    for r in results:
        print(tok.decode(r.output_ids) if tok is not None else " ".join(map(str, r.output_ids)))
        tps = len(r.output_ids) / r.seconds if r.seconds else 0.0
        print(f"[{how}] {len(r.output_ids)} "
              f"tokens in {r.seconds:.3f} s ({tps:.1f} tokens/s), tau {r.tau:.2f} over {r.cycles} cycles, "
              f"stop: {r.stop_reason}", file=sys.stderr)
    return 0


def cmd_check(args) -> int:
    from eaglex.runtime.equivalence import (
        check_distribution,
        check_identical,
        format_batched,
        format_distribution,
        format_identical,
    )

    engine = open_from_args(args)
    kept = getattr(engine, "kept_tree", None)          # set where tuning chose vanilla; a bundle has none
    if engine.method == "vanilla" and kept is None:
        raise ModelError("check compares speculative with vanilla decoding: give a draft head")
    prompts, _ = prompts_from_args(args, engine)
    resolve_auto(args, engine, prompts)
    if getattr(engine, "kept_tree", None) is not None:
        # tuning chose vanilla for this engine; what is left to check is the head, whose output must still match
        head = engine.speculative()
        print(f"check: this engine runs vanilla by default (tuning measured it faster here); checking its head "
              f"({head.method}, tree {head.tree}) against vanilla", file=sys.stderr)
        engine = head
    sampling = sampling_from_args(args)
    if args.batch < 1:
        raise ModelError(f"--batch must be >= 1, got {args.batch}")
    if args.samples < 0:
        raise ModelError(f"--samples must be >= 0, got {args.samples}")
    if args.batch > 1 and engine.layout == "bundle":
        raise ModelError("check --batch needs an ONNX Runtime or PyTorch engine; drop --batch for a TensorRT-LLM bundle")
    if engine.layout == "bundle":
        if not sampling.greedy:
            raise ModelError("check on a TensorRT-LLM bundle compares greedy decoding only; drop --temperature")
        rows = engine.check(prompts, args.max_new_tokens)
        bad = sum(not r["identical"] for r in rows)
        print(f"{len(rows) - bad}/{len(rows)} identical to vanilla (tensorrt-llm, EAGLE-3)")
        return 1 if bad else 0
    rows = check_identical(engine.backend, engine.tree, prompts, args.max_new_tokens, sampling)
    weights = ((engine.manifest or {}).get("quant") or {}).get("method") or engine.backend.dtype
    weights += " + int8 draft" if (engine.manifest or {}).get("draft_quant") else ""
    how = "greedy" if sampling.greedy else (f"sampled: temperature {sampling.temperature}, top-p {sampling.top_p}, "
                                            f"top-k {sampling.top_k}, seed {sampling.seed}")
    print(format_identical(rows, f"{engine.method}, tree {engine.tree}, {weights}, {how}"))
    ok = all(r.identical for r in rows)
    if args.batch > 1:
        batched = engine.generate(prompts, sampling, args.max_new_tokens, batch=args.batch)
        how = (f"up to {args.batch} at a time, batch schedule {engine.batch_schedule()}"
               if engine.batch_exact(max(map(len, prompts)) + args.max_new_tokens) else
               "one at a time: this engine's exactness rules keep requests apart")
        text, batch_ok = format_batched(rows, batched, how)
        print(text)
        ok = ok and batch_ok
    if not sampling.greedy and args.samples > 0:
        text, dist_ok = format_distribution(check_distribution(engine.backend, engine.tree, sampling, prompts,
                                                               samples=args.samples))
        print(text)
        ok = ok and dist_ok
    return 0 if ok else 1


def cmd_tune(args) -> int:
    from eaglex.base.prompts import read_prompts
    from eaglex.engines.tune import tune_engine
    from eaglex.runtime.engine import layout, open_engine
    from eaglex.runtime.threads import set_threads

    if layout(args.engine) != "engine":
        raise ModelError(f"{args.engine} is not an engine folder (`eaglex build`): tuning is stored in its manifest")
    set_threads(args.threads or None, onnxruntime=True)          # before the engine's sessions open
    engine = open_engine(args.engine, device=args.device, providers=args.providers)
    if engine.draft_kind is None:
        raise ModelError(f"{args.engine} has no draft head: there is no tree to tune")
    prompts = read_prompts(args.prompts, engine.tokenizer, args.chat)
    tune_engine(engine, prompts[: args.num_prompts] if args.num_prompts else prompts, force=args.force)
    return 0


def cmd_engine(args) -> int:
    from eaglex.make_engine import make_engine
    from eaglex.runtime.threads import set_threads

    set_threads(args.threads or None, onnxruntime=(args.backend or "onnxruntime") == "onnxruntime")
    return make_engine(args.model, args.backend, args.model_dir, args.draft_dir, args.out, args.force,
                       args.max_new_tokens, device=args.device, providers=args.providers,
                       demo_tokens=args.demo_tokens)


def cmd_bench(args) -> int:
    from eaglex import bench
    from eaglex.base.prompts import load_tokenizer, read_prompts
    from eaglex.runtime.engine import open_engine, open_models

    trees = [_tree(t) for t in filter(None, (t.strip() for t in args.trees.split(",")))]
    trees = [None if t == "auto" else t for t in trees]
    from eaglex.runtime.device import resolve_device

    device = resolve_device(args.device)                      # torch rows and the transformers peers
    engines = [("torch", open_models(args.target, args.draft, device=device))] if args.target and not args.no_torch \
        else []
    if args.engine:      # ONNX Runtime's process-wide pool, sized once before its first session
        from eaglex.runtime.threads import set_threads
        set_threads(args.threads or None, onnxruntime=True)
    engines += [(f"ort:{e.name}", open_engine(e, device=args.device, providers=args.providers))
                for e in args.engine]
    if not engines:
        raise ModelError("give --target (torch rows) and/or --engine DIR")
    prompts = read_prompts(args.prompts, load_tokenizer(args.target) or engines[0][1].tokenizer)
    prompts = prompts[: args.num_prompts] if args.num_prompts else prompts
    sizes = _batch_sizes(args.batch_sizes)
    llamacpp, server = _llamacpp_from_args(args, engines)
    vllm = _vllm_from_args(args, engines)
    rows = bench.run(engines, prompts, trees, args.max_new_tokens, args.target, args.draft_lm, not args.no_peers,
                     args.threads or None, args.out, device=device, llamacpp=llamacpp, llamacpp_server=server,
                     batch_sizes=sizes, vllm=vllm)
    if args.plot:
        try:
            from eaglex.bench_plot import plot_file
            plot_file(args.out, args.plot)
            print(f"wrote {args.plot}")
        except ImportError:
            print("no plot: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
    # llama.cpp rows report their agreement with vanilla without failing the run (identical_enforced false)
    return 0 if all(r["identical_to_vanilla"] or not r["identical_enforced"] for r in rows) else 1


def _batch_sizes(text: str | None) -> tuple[int, ...]:
    """--batch-sizes "1,4,16" -> (1, 4, 16), ascending; a bad spelling is one ModelError line."""
    if not text:
        return ()
    try:
        sizes = sorted({int(b) for b in text.split(",") if b.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise ModelError(f"--batch-sizes takes request counts >= 1, e.g. 1,4,16; got {text!r}")
    return tuple(sizes)


def _bench_target(args, engines) -> Path | None:
    """The peers' target folder: --target, else the folder the first engine was built from (its manifest's source
    path)."""
    if args.target is not None:
        return args.target
    manifest = next((e.manifest for _, e in engines if e.manifest), None) or {}
    path = manifest.get("sources", {}).get("target", {}).get("path")
    return Path(path) if path else None


def _vllm_from_args(args, engines):
    """bench --vllm / --vllm-ks as a VllmConfig, or None (with one line saying why, when --vllm was given)."""
    from eaglex.vllm_peer import VllmConfig, find_python, parse_ks, vllm_target
    ks = parse_ks(getattr(args, "vllm_ks", None))             # a bad spelling fails before anything runs
    python = find_python(getattr(args, "vllm", None))
    if python is None:
        return None
    target = _bench_target(args, engines)
    if target is None or not (Path(target) / "config.json").is_file():
        print(f"vLLM peers: skipped (no Hugging Face target folder: {target or 'none'}; pass --target)",
              file=sys.stderr)
        return None
    if args.draft is None:
        print("vLLM EAGLE-3: skipped (pass --draft HEAD, the EAGLE-3 head folder); vLLM vanilla only", file=sys.stderr)
    return VllmConfig(python=python, target=vllm_target(Path(target)), head=args.draft, ks=ks)


def _llamacpp_from_args(args, engines):
    """bench --llamacpp / --llamacpp-server as (LlamaCppConfig or None, ServerPeerConfig or None). The target
    folder: see _bench_target."""
    from eaglex.llamacpp_peer import cache_dir, find_source, resolve
    from eaglex.llamacpp_server import ServerPeerConfig, find_bin, parse_drafts
    target = _bench_target(args, engines)
    hint = getattr(args, "gguf_sources", {}).get("target")
    binding = resolve(args.llamacpp, target, hint)
    drafts = parse_drafts(args.llamacpp_drafts)                 # a bad spelling fails before anything runs
    bin_dir = find_bin(args.llamacpp_server)
    if bin_dir is None:
        return binding, None
    if args.llamacpp == "off":
        if args.llamacpp_server != "auto":
            print("llama.cpp EAGLE-3 peers: skipped (--llamacpp off: they run on its GGUF file; give --llamacpp "
                  "auto or FILE.gguf)", file=sys.stderr)
        return binding, None
    if args.draft is None:
        print("llama.cpp EAGLE-3 peers: skipped (pass --draft HEAD, the EAGLE-3 head folder)", file=sys.stderr)
        return binding, None
    source = binding.source if binding is not None else find_source(
        args.llamacpp, target, hint, lambda why: print(f"llama.cpp EAGLE-3 peers: skipped ({why})", file=sys.stderr))
    if source is None:
        return binding, None
    return binding, ServerPeerConfig(bin_dir=bin_dir, source=source, head=args.draft, cache_dir=cache_dir(target),
                                     drafts=drafts)


def cmd_build(args) -> int:
    from eaglex.engines.build import build_engine, summary

    if args.backend == "tensorrt-llm":
        from eaglex.engines import trtllm
        _refuse_retired(args, BUNDLE_RETIRED)
        args.tree = _tree(args.tree)
        if args.quant not in (None, "fp8") or args.quant_draft:
            raise ModelError("TensorRT-LLM bundles take --quant fp8 (target only); int8, int4, w8a8 and "
                             "--quant-draft are for onnxruntime engines")
        if args.tree == "auto" or args.tree.kind in ("static", "cost"):
            raise ModelError("TensorRT-LLM bundles take --tree chain:N or dynamic:TOTAL/DEPTH/TOPK")
        dynamic = args.tree.kind == "dynamic"
        cfg = trtllm.TrtllmConfig(quant=args.quant, tp=args.tp, pp=args.pp, max_draft_len=args.tree.depth,
                                  dynamic_tree_top_k=args.tree.top_k if dynamic else 0,
                                  max_total_draft_tokens=args.tree.total_tokens - 1 if dynamic else 0)
        print(trtllm.summary(trtllm.build_trtllm_bundle(args.target, args.draft, args.out, cfg, args.calibrated,
                                                        args.force), args.out))
        return 0
    if args.quant is None and (args.calibrated or args.calibrated_draft):
        raise ModelError("--calibrated/--calibrated-draft need --quant fp8")
    if args.quant == "fp8" and args.calibrated is None:   # fail before the (long) float build
        raise ModelError("--quant fp8 needs calibrated scales: run `eaglex calibrate --target DIR --out CAL` and "
                         "pass --calibrated CAL")
    manifest = build_engine(args.target, args.draft, args.out, args.backend, args.dtype, args.force,
                            kernels=args.kernels)
    if args.quant is not None:
        from eaglex.engines.quantize import quality_warning, quantize_engine
        manifest = quantize_engine(args.out, args.quant, args.calibrated, draft=args.quant_draft,
                                   calibrated_draft_dir=args.calibrated_draft, data=args.calibration_data)
    if args.quant is None and args.quant_draft:
        from eaglex.engines.quantize import quantize_draft
        manifest = quantize_draft(args.out)
    print(summary(manifest, args.out))
    if manifest.get("draft_quant"):
        from eaglex.engines.quantize import draft_quant_line
        print(draft_quant_line(manifest))
    if args.quant is not None:
        q = manifest["quant"]
        text = q["parity"].get("text")
        print(f"  quantized {args.quant}: {q['bytes_before'] / 1024 ** 2:.1f} -> {q['bytes_after'] / 1024 ** 2:.1f} MB;"
              f" target logits vs float on random ids: rel. error {q['parity']['logits_rel_error']:.2e}, "
              f"top-1 agreement {q['parity']['top1_agreement']:.2%}"
              + (f"; on real text (the float model's answers to {text['prompts']} chat prompts, {text['tokens']} "
                 f"tokens): top-1 agreement {text['top1_agreement']:.2%}" if text else ""))
        warning = quality_warning(manifest)
        if warning:
            print(warning, file=sys.stderr)
        rules = manifest.get("exactness")
        if rules == {}:
            print("  rows computed independently of the call at any context (eaglex's kernels): exact against this "
                  "engine's vanilla decoding with any tree and in batches")
        elif rules and rules.get("row_independent_keys"):
            print(f"  rows computed independently of the call (up to {rules['row_independent_keys']} keys per call): "
                  "exact against this engine's vanilla decoding with any tree and in batches")
        elif rules:
            print(f"  exact against this engine's vanilla decoding with chain trees (tree {manifest['tree']} until "
                  "tuned), one request at a time: quantized activations turn last-bit float differences into "
                  "flipped tokens otherwise")
    return 0


def cmd_calibrate(args) -> int:
    from eaglex.calibration.fp8 import CalibrateConfig, calibrate, format_report

    cfg = CalibrateConfig(quant=args.quant, kv_cache=args.kv_cache, data=args.data, samples=args.samples,
                          seq_len=args.seq_len, eval_samples=args.eval_samples, batch_size=args.batch_size,
                          dtype=args.dtype, quant_draft=args.quant_draft, device=args.device)
    print(format_report(calibrate(args.target, args.out, cfg, args.draft, args.draft_out, args.force)))
    return 0


def cmd_triton(args) -> int:
    if args.backend == "tensorrt-llm":
        if args.chat:       # TensorRT-LLM's llmapi model takes text_input as it is
            raise ModelError("--chat applies to --backend eaglex only")
        from eaglex.serving.trtllm_repository import write_llmapi_repository
        model = write_llmapi_repository(args.engine, args.out, args.name or "tensorrt_llm", args.template,
                                        args.max_batch_size, args.decoupled, args.force)
        print(f"wrote {model} (TensorRT-LLM llmapi model for {args.engine.resolve()})")
        return 0
    from eaglex.serving.repository import write_repository

    max_batch = args.max_batch if args.max_batch is not None else 16 if args.instances == 1 else 0
    model = write_repository(args.engine, args.out, args.name or "eaglex", args.instances, args.max_queue_size,
                             args.threads, "vanilla" if args.vanilla else "default", args.copy, args.force,
                             max_batch=max_batch, chat_template=args.chat, max_context=args.max_context)
    how = f"batching up to {max_batch} requests" if max_batch else f"{args.instances} instance(s)"
    how += ", chat template on text_input" if args.chat else ""
    print(f"wrote {model} (engine {args.engine.resolve()}, {how}); serve it with\n"
          f"  eaglex serve start --repo {args.out}   (docs/triton.md)")
    return 0


def cmd_serve(args) -> int:
    import asyncio
    import os
    import time

    from eaglex.serving import control
    from eaglex.serving.config import API_KEY_ENV, ServeConfig
    from eaglex.serving.repository import write_repository
    from eaglex.serving.supervisor import Supervisor
    from eaglex.serving.tritonserver import TritonUnavailable, triton_root

    if args.action == "status":
        r = control.running(args.dir)
        if r is None:
            print(f"no server is running from {args.dir}")
            return 3
        print(control.describe(*r))
        return 0 if r[1].get("ready") else 1
    if args.action == "stop":
        st = control.stop(args.dir)
        if not st:
            print(f"no server is running from {args.dir}")
            return 0
        print(control.summary(st))
        return 0 if not (st.get("stopped") or {}).get("left") else 1
    if (r := control.running(args.dir)) is not None:      # before the repository is rewritten under it
        raise ModelError(f"a server is already running from {args.dir} (supervisor pid {r[0]}, ready "
                         f"{r[1].get('ready')}): use it, or stop it first (eaglex serve stop --dir {args.dir})")
    try:
        triton_root()
    except TritonUnavailable as e:
        raise ModelError(str(e)) from None
    repo = args.repo
    if args.engine is not None:
        repo = args.dir / "model_repository"
        write_repository(args.engine, repo, args.name, args.instances, args.max_queue_size,
                         args.threads, "vanilla" if args.vanilla else "default", force=True,
                         max_batch=args.max_batch, chat_template=args.chat, max_context=args.max_context)
    elif not args.repo.is_dir():
        raise ModelError(f"{args.repo} is not a model repository folder")
    config = ServeConfig(str(repo.resolve()), str(args.dir.resolve()), args.http_port, args.grpc_port,
                         args.metrics_port, args.exit_timeout, args.timeout, args.open_admin_api,
                         args.max_body_bytes, args.max_json_depth)
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    if args.action == "run":
        config.folder.mkdir(parents=True, exist_ok=True)
        config.save()
        return asyncio.run(Supervisor(config, api_key).run())
    t0 = time.monotonic()
    try:
        served = control.start(config, api_key)
    except RuntimeError as e:
        print(f"eaglex serve: {e}", file=sys.stderr)
        return 1
    print(f"ready in {time.monotonic() - t0:.1f} s")
    print(control.describe(served.pid, served.state()))
    return 0


def cmd_import(args) -> int:
    from eaglex.models.gguf import convert_gguf
    print(f"wrote {convert_gguf(args.gguf, args.out, overwrite=args.force)}")
    return 0


def cmd_export(args) -> int:
    from eaglex.export.llamacpp import write_eagle3_gguf
    if args.out.exists() and not args.force:
        raise ModelError(f"{args.out} already exists: pass --force to replace it")
    out = write_eagle3_gguf(args.draft, args.target_gguf, args.out, args.dtype)
    print(f"wrote {out}; run it with\n  llama-server -m {args.target_gguf} -md {out} --spec-type draft-eagle3")
    return 0


def cmd_train_draft(args) -> int:
    from eaglex.runtime.device import resolve_device
    from eaglex.training.train_draft import TrainDraftConfig, train_draft

    cfg = TrainDraftConfig(method=args.method, steps=args.steps, init=args.init and str(args.init), lr=args.lr)
    report = train_draft(args.target, args.data, args.out, cfg, device=resolve_device(args.device))
    best = max(report["tau"], key=lambda r: r["tau"])
    start = f" from {args.init}" if args.init else ""
    print(f"wrote {args.out} ({args.method}{start}, {args.steps} steps, loss {report['first_loss']:.3f} -> "
          f"{report['final_loss']:.3f}); best tau {best['tau']:.2f} ({best['shape']})")
    return 0


def _gguf_targets(args) -> None:
    """A .gguf file wherever a target folder is taken: converted once (cached) to a Hugging Face folder."""
    from eaglex.models.gguf import is_gguf_path, resolve_target
    for name in ("target", "engine"):
        value = getattr(args, name, None)
        if isinstance(value, Path) and is_gguf_path(value):
            setattr(args, name, resolve_target(value))
            vars(args).setdefault("gguf_sources", {})[name] = value     # bench --llamacpp auto runs the file itself


COMMANDS = {"generate": cmd_generate, "check": cmd_check, "tune": cmd_tune, "engine": cmd_engine, "bench": cmd_bench,
            "build": cmd_build, "calibrate": cmd_calibrate, "triton": cmd_triton, "train-draft": cmd_train_draft,
            "import": cmd_import, "serve": cmd_serve, "export": cmd_export}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _gguf_targets(args)
        return COMMANDS[args.command](args)
    except ModelError as e:
        print(f"eaglex: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
