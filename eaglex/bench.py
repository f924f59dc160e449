"""Side-by-side speed benchmark (`eaglex bench`, `make bench`): speed is reported as ratios measured in one
process, with baseline and speculative runs interleaved prompt by prompt so that the drifting load of a shared
machine hits every candidate alike, and every speculative output is checked against vanilla.

Also measures a cost model on the backend at hand: t(N) of a target forward over N new tokens after P cached ones,
and a draft step, and the speedup that model predicts for the τ actually measured (S = τ·t(1) / cycle cost), so a
gap between prediction and measurement shows runtime overhead.

Threads: each section runs under the thread policy of runtime/threads.py (ORT rows: ORT's pool on the cores, torch
on one thread; torch rows and transformers peers: torch on the cores); every row states its threads.

Peers: transformers (greedy, prompt lookup, assisted) on the target folder, llama.cpp on the GGUF file the
target came from (eaglex/llamacpp_peer.py, eaglex/llamacpp_server.py), and vLLM's CPU build, vanilla and its own
EAGLE-3 with the head (eaglex/vllm_peer.py, in a venv of its own). Every peer's tokens are compared with eaglex
vanilla; a mismatch fails the run only for rows that must be identical (not llama.cpp's or vLLM's: other kernels
and quantized weights, reported in a note under the table). The llama.cpp and vLLM rows run interleaved with
every engine's vanilla, their e2e speedup is against the first's; a second table gives each eaglex row over each
such peer row, anchored on its engine's vanilla run beside the peer (`anchor`), so that drift between the bench's
sections does not enter a cross-system ratio.

Devices: every row states where it ran (`device`, with the dtype). On a GPU the per-cycle split comes from CUDA
events around each forward (runtime/generate.py), so "other" is the time the GPU waited for the host, and the cost
model synchronises around every timed call.
"""
from __future__ import annotations

import os
import platform
import random
import time

import torch

from eaglex.base.fsio import write_json
from eaglex.bench_row import Row, anchored_table, peer_label
from eaglex.llamacpp_peer import run_llamacpp_peers
from eaglex.llamacpp_server import run_server_peers
from eaglex.runtime.cost import DEFAULT_SIZES, CostSampler, interp
from eaglex.runtime.generate import SpeculativeGenerator, VanillaGenerator
from eaglex.runtime.threads import set_threads
from eaglex.runtime.types import TreeConfig
from eaglex.vllm_peer import run_vllm_peers

# peers that run beside eaglex vanilla (`alongside`): their rows are the anchored table's columns, never its rows
ALONGSIDE_PEERS = ("llama.cpp", "vLLM")


def machine() -> dict:
    out = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "load_average": [round(x, 2) for x in os.getloadavg()],
           "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        out["cuda"] = torch.version.cuda
    return out


def run_backend(name: str, backend, trees: list[TreeConfig], prompts: list[list[int]], max_new_tokens: int,
                method: str, sampler: CostSampler | None = None) -> list[Row]:
    """Vanilla and every tree on one backend, interleaved per prompt (in a seeded random order); outputs checked
    against vanilla. With a `sampler`, one cost-model round follows every prompt, so that the prediction sees the
    same load as the runs."""
    vanilla = VanillaGenerator(backend)
    specs = [SpeculativeGenerator(backend, t) for t in trees]
    base = Row(name, "vanilla", "-")
    rows = [Row(name, method, str(t)) for t in trees]
    vanilla.generate(prompts[0], 8)                      # warm-up: allocations, lazy inits, caches
    for s in specs:
        s.generate(prompts[0], 8)
    order = random.Random(0)
    for p in prompts:
        # vanilla and every tree once, in a fresh seeded order per prompt: no candidate always runs first or last
        gens = [(base, vanilla)] + list(zip(rows, specs))
        order.shuffle(gens)
        results = {id(row): gen.generate(p, max_new_tokens) for row, gen in gens}
        v = results[id(base)]
        base.add(v, v)
        for row in rows:
            r = results[id(row)]
            row.identical &= r.output_ids == v.output_ids
            row.add(r, v)
        if sampler is not None:
            sampler.round()
    return [base, *rows]


def run_hf_peers(target_dir, prompts: list[list[int]], max_new_tokens: int, draft_lm_dir=None,
                 reference: list[list[int]] | None = None, device: str = "cpu", dtype: str = "float32",
                 model=None, draft_lm=None) -> list[Row]:
    """Hugging Face transformers on the same target and prompts: plain greedy, assisted generation with a small
    draft LM, and prompt lookup, on `device` in `dtype` (or on the loaded `model` / `draft_lm` as they are).
    Outputs are checked against `reference` (eaglex vanilla) when given."""
    from transformers import AutoModelForCausalLM

    from eaglex.models.target import DTYPES

    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()

    target = model if model is not None else load(target_dir)
    device = target.device
    eos = target.generation_config.eos_token_id
    peers = {"hf greedy": {}, "hf prompt-lookup": {"prompt_lookup_num_tokens": 10}}
    if draft_lm is not None or draft_lm_dir is not None:
        peers["hf assisted"] = {"assistant_model": draft_lm if draft_lm is not None else load(draft_lm_dir)}
    rows = {name: Row("transformers", name, "-", device=f"{device} {str(target.dtype).replace('torch.', '')}")
            for name in peers}

    def run(p, kw):
        t = time.perf_counter()
        with torch.no_grad():
            out = target.generate(torch.tensor([p], device=device), do_sample=False, max_new_tokens=max_new_tokens,
                                  pad_token_id=eos, **kw)
        return out[0, len(p):].tolist(), time.perf_counter() - t

    for kw in peers.values():
        run(prompts[0], kw)                                  # warm-up
    for i, p in enumerate(prompts):
        results = {name: run(p, kw) for name, kw in peers.items()}
        base_s = results["hf greedy"][1]
        for name, (ids, sec) in results.items():
            r = rows[name]
            r.tokens += len(ids)
            r.seconds += sec
            r.baseline_seconds += base_s
            if reference is not None:
                r.identical &= ids == reference[i]
    return list(rows.values())


def sizes_for(trees: list[TreeConfig]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(target N, draft N) to time: the defaults plus every tree's verification size and draft width (top_k)."""
    target = set(DEFAULT_SIZES) | {t.max_nodes for t in trees}
    draft = {1, 10} | {t.top_k for t in trees if t.kind in ("dynamic", "cost")}
    return tuple(sorted(target)), tuple(sorted(draft))


def predicted_speedup(cm: dict, tree: TreeConfig, tau: float, nodes: float | None = None) -> float | None:
    """S = τ·t(1) / (t(N_tree) + steps·t_draft(N_step) + t_first), interpolating t(N) between measured sizes;
    N_step = 1 for a chain, top_k for a dynamic or cost tree (each level expands top_k nodes), 10 for a static
    tree. N_tree: the tree's size, or for a cost tree (whose size varies by cycle) `nodes`, the mean measured."""
    if "draft_first_ms" not in cm:
        return None
    t = cm["target_ms"]
    draft = cm.get("draft_ms") or {1: cm["draft_chain_step_ms"], 10: cm["draft_step_ms"]}
    if tree.kind == "chain":
        steps, width = tree.depth - 1, 1                    # the first level comes from the context step
    elif tree.kind == "static":
        steps, width = 4, 10                                # mc_sim_7b_63 expands 4 levels after the first step
    else:
        steps, width = tree.depth - 1, tree.top_k
    size = nodes if tree.kind == "cost" and nodes else tree.max_nodes
    cost = interp(t, size) + steps * interp(draft, width) + cm["draft_first_ms"]
    return round(tau * interp(t, 1) / cost, 3)


def print_table(rows: list[dict]) -> None:
    """e2e: whole requests (prefill included); decode: after the prefill, the part the cost model predicts."""
    head = f"{'engine':<14} {'method':<16} {'tree':<16} {'device':<15} {'threads':<12} {'tok/s':>7} {'e2e':>6} " \
           f"{'decode':>7} " \
           f"{'vs HF':>6} " \
           f"{'pred.':>6} {'m/p':>5} {'tau':>5} {'same':>5} {'draft ms':>9} {'verify ms':>9} {'other ms':>9}"
    print(head)
    print("-" * len(head))
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731

    def same(r):        # "no": a reported mismatch that does not fail the run (identical_enforced false)
        return "yes" if r["identical_to_vanilla"] else "NO" if r.get("identical_enforced", True) else "no"
    for r in rows:
        print(f"{r['engine']:<14} {r['method']:<16} {r['tree']:<16} {r.get('device', ''):<15} {r['threads']:<12} "
              f"{fmt(r['tokens_per_s'], '7.1f')} "
              f"{fmt(r['speedup'], '5.2f')}x {fmt(r.get('decode_speedup'), '6.2f')}x "
              f"{fmt(r.get('vs_hf_greedy'), '5.2f')}x "
              f"{fmt(r.get('predicted_speedup'), '6.2f')} {fmt(r.get('measured_over_predicted'), '5.2f')} "
              f"{fmt(r['tau'], '5.2f')} {same(r):>5} "
              f"{fmt(r.get('draft_ms_per_cycle'), '9.2f')} {fmt(r.get('verify_ms_per_cycle'), '9.2f')} "
              f"{fmt(r.get('other_ms_per_cycle'), '9.2f')}")
    for r in rows:
        if r.get("note") or r.get("build"):
            built = f"built with {r['build']}" if r.get("build") else ""
            print(f"  {r['engine']} {r['method']} ({r['device']}): {'; '.join(filter(None, (r.get('note'), built)))}")


def _vanilla_call(engine, threads: int | None):
    """(prompt, n) -> (ids, seconds): `engine`'s vanilla decoding under its own thread policy, for the peers to
    interleave with their rows (each engine beside llama.cpp, under the same load)."""
    vanilla = VanillaGenerator(engine.backend)

    def call(p, n):
        set_threads(threads, onnxruntime=engine.layout == "engine")
        r = vanilla.generate(p, n)
        return r.output_ids, r.seconds
    return call


def _peer_label(r: dict) -> str:
    """A peer row's column in the anchored table: vLLM's "vLLM" / "vLLM+E3", llama.cpp's by its weights."""
    if r["engine"] == "vLLM":
        return "vLLM+E3" if r["method"] == "eagle3" else "vLLM"
    return peer_label(r)


def anchor(rows: list[dict]) -> None:
    """Cross-system ratios that host drift between the bench's sections does not move: an eaglex row over a peer
    row is (the row over its engine's vanilla, interleaved in the engine's section) x (that vanilla over the peer
    row, interleaved in the peer's run). Adds `vs_llamacpp_anchored` {peer label: ratio} to every eaglex row (the
    name predates the vLLM rows, which are columns too)."""
    peers = [r for r in rows if r.get("alongside_tokens_per_s") and r["tokens_per_s"]]
    vanilla = {r["engine"]: r["tokens_per_s"] for r in rows
               if r["method"] == "vanilla" and r["engine"] not in ALONGSIDE_PEERS}
    for r in rows:
        own = vanilla.get(r["engine"])
        if r["engine"] in ALONGSIDE_PEERS or not own or not r["tokens_per_s"]:
            continue
        got = {_peer_label(p): round(r["tokens_per_s"] / own * p["alongside_tokens_per_s"][r["engine"]]
                                    / p["tokens_per_s"], 3)
               for p in peers if r["engine"] in p["alongside_tokens_per_s"]}
        if got:
            r["vs_llamacpp_anchored"] = got


def print_anchored(rows: list[dict]) -> None:
    """The anchored ratios (see `anchor`) as a table: eaglex rows down, llama.cpp and vLLM rows across."""
    mine, cols = anchored_table(rows)
    if not mine:
        return
    width = max(8, *(len(c) + 1 for c in cols))
    print("\neaglex row / llama.cpp or vLLM row, anchored on the engine's vanilla run beside llama.cpp or vLLM:")
    print(f"{'engine':<22} {'method':<10} {'tree':<28}" + "".join(f"{c:>{width}}" for c in cols))
    for r in mine:
        got = r["vs_llamacpp_anchored"]
        print(f"{r['engine']:<22} {r['method']:<10} {r['tree']:<28}"
              + "".join(f"{got[c]:>{width - 1}.2f}x" if c in got else f"{'-':>{width}}" for c in cols))


def _tuned_label(engine, tree: TreeConfig) -> str:
    """What a tree row says about tuning: the engine's tuned tree, or the head's best tree where tuning measured
    vanilla faster (the engine then runs vanilla by default: its vanilla row is what it serves)."""
    if engine.kept_tree is not None and tree == engine.kept_tree:
        return " (tuned: vanilla faster)"
    return " (tuned)" if tree == engine.tree and engine.layout == "engine" else ""


def run(engines: list, prompts: list[list[int]], trees: list[TreeConfig | None], max_new_tokens: int,
        target_dir=None, draft_lm_dir=None, peers: bool = True, threads: int | None = None, out=None,
        device: str = "cpu", dtype: str = "float32", llamacpp=None, llamacpp_server=None,
        batch_sizes: tuple[int, ...] = (), vllm=None) -> list[dict]:
    """The whole `eaglex bench`: for every engine (open_engine/open_models results, with their names) vanilla and
    every tree (None = the engine's own tree, measured for this run only if it was never tuned; where tuning chose
    vanilla, the head's kept tree, labelled so), interleaved; then the transformers peers on `target_dir`, the
    llama.cpp peers with `llamacpp` (a llamacpp_peer.LlamaCppConfig) and llama.cpp's EAGLE-3 with `llamacpp_server`
    (a llamacpp_server.ServerPeerConfig), vLLM vanilla and EAGLE-3 with `vllm` (a vllm_peer.VllmConfig); with
    `batch_sizes`, each engine with a head also through in-flight batching at those sizes (eaglex/bench_batch.py,
    JSON `batched`). Prints the tables, writes the JSON to `out`, returns the rows."""
    from eaglex.bench_batch import print_batched, run_batched
    from eaglex.engines.tune import tune_engine

    load_start = [round(x, 2) for x in os.getloadavg()]
    rows, cost_models, reference, batched = [], {}, None, []
    for name, engine in engines:
        policy = set_threads(threads, onnxruntime=engine.layout == "engine")
        label = ", ".join(f"{k} {v}" for k, v in policy.items())
        own, labels = [], []
        for t in (trees if engine.draft_kind else []):
            if t is None:
                tune_engine(engine, prompts, store=False)
                t = engine.speculative().tree    # the head's tuned tree, also where tuning chose vanilla
            if t is not None and t not in own:
                own.append(t)
                labels.append(str(t) + _tuned_label(engine, t))
        sizes, draft_sizes = sizes_for(own)
        sampler = CostSampler(engine.backend, sizes=sizes, draft_sizes=draft_sizes)
        for i in range(3):                                   # a warm-up round, then two before the runs
            sampler.round(record=i > 0)
        got = run_backend(name, engine.backend, own, prompts, max_new_tokens, engine.draft_kind or "vanilla",
                          sampler)
        cm = cost_models[name] = sampler.summary()
        for row, tree, text in zip(got[1:], own, labels):
            row.tree = text
            tau = sum(row.accept_lengths) / max(len(row.accept_lengths), 1)
            row.predicted_speedup = predicted_speedup(cm, tree, tau, row.nodes / max(row.cycles, 1))
        quant = ((engine.manifest or {}).get("quant") or {}).get("method")    # weights int8/fp8, activations float
        where = f"{engine.device} {quant or getattr(engine.backend, 'dtype', '')}".strip()
        if (engine.manifest or {}).get("draft_quant"):
            where += " +int8 draft"
        for row in got:
            row.threads, row.device = label, where
        rows += [r.as_dict() for r in got]
        if batch_sizes and engine.draft_kind and engine.layout != "bundle":
            batched += run_batched(name, engine, prompts, tuple(batch_sizes), max_new_tokens)
        if reference is None and (target_dir is not None and peers or llamacpp or llamacpp_server or vllm):
            reference = [VanillaGenerator(engine.backend).generate(p, max_new_tokens).output_ids for p in prompts]
    if target_dir is not None and peers:
        policy = set_threads(threads, onnxruntime=False)
        for r in run_hf_peers(target_dir, prompts, max_new_tokens, draft_lm_dir, reference, device, dtype):
            r.threads = f"torch {policy['torch']}"
            rows.append(r.as_dict())
    if llamacpp is not None or llamacpp_server is not None or vllm is not None:
        from eaglex.runtime.ort_session import physical_cores
        spec, cores = engines[0][1].spec, threads or physical_cores()
        baselines = {name: _vanilla_call(engine, threads) for name, engine in engines}
        if llamacpp is not None:
            got = run_llamacpp_peers(llamacpp, prompts, max_new_tokens, cores, spec.eos_ids, spec.max_context,
                                     reference, baselines=baselines)
            rows += [r.as_dict() for r in got]
        if llamacpp_server is not None:
            got = run_server_peers(llamacpp_server, prompts, max_new_tokens, cores, spec.eos_ids, spec.max_context,
                                   reference, baselines=baselines)
            rows += [r.as_dict() for r in got]
        if vllm is not None:
            got = run_vllm_peers(vllm, prompts, max_new_tokens, cores, spec.eos_ids, spec.max_context, reference,
                                 baselines=baselines)
            rows += [r.as_dict() for r in got]
        anchor(rows)
    hf = next((r for r in rows if r["method"] == "hf greedy"), None)
    for r in rows:
        r["vs_hf_greedy"] = round(r["tokens_per_s"] / hf["tokens_per_s"], 3) if hf and r["tokens_per_s"] else None
    print_table(rows)
    print_anchored(rows)
    print_batched(batched, len(prompts), max_new_tokens)
    if out is not None:
        write_json(out, {"machine": {**machine(), "load_average_at_start": load_start}, "prompts": len(prompts),
                         "max_new_tokens": max_new_tokens, "cost_model": cost_models, "rows": rows,
                         **({"batched": batched} if batched else {})})
        print(f"wrote {out}")
    return rows
