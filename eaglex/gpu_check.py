"""The prepared GPU check (run by tools/gpu_check.sh): correctness and speed of the PyTorch backend on one GPU,
written to OUT as results.json (everything) and report.txt (the tables).

One module of ~750 lines on purpose: it is shipped to a lent machine and run once, within a fixed device budget, so
every phase lives beside the Budget and the report it writes into; nothing else imports it.

Phases, in order, each recorded with its status and time (a failing phase is reported and the next one runs):
- env: versions, the device, ONNX Runtime's providers;
- equivalence: tests/test_gpu.py through pytest on the device: transformers greedy == eaglex vanilla ==
  speculative in fp32 for every case of the equivalence suite (CUDA graphs and eager), graphs replayed, host
  synchronisations per cycle, bf16 margins, ONNX Runtime's CUDA provider where installed;
- models: a seeded Llama-shaped target built on the device (Llama-3.1-8B's shape in bf16 on a GPU, a small one with
  --quick) with an EAGLE-3 head that agrees with it at a known rate, eaglex/bench_models.py's construction; the
  target's attention scale is calibrated so that it follows the head's token map at rate ALPHA (tau ~ 4);
- bench: batch 1, interleaved per prompt: eaglex vanilla and EAGLE-3 at the tuned tree and fixed trees (CUDA graphs;
  the tuned tree eagerly too), transformers greedy, prompt lookup and assisted generation (a one-layer assistant that
  follows the same map); tokens/s, speedups, tau, per-cycle draft/verify/other ms; the goals checked;
- batched: in-flight batching on the device (runtime/batch.py over the bench models' slots, CUDA graphs per batch
  size): 1, 4 and 16 requests in flight, vanilla-batched against EAGLE-3-batched (the chain an untuned engine
  batches, and the tree tuned at batch 1 or a dynamic tree) in aggregate tokens/s, every request's output against the same request
  decoded alone by vanilla decoding (in bf16 with the target's logit margin at each divergence); a run that raises
  is recorded with its traceback and the others still run;
- check: `eaglex check`-style greedy comparison in bf16 on the bench target and on models/tiny (through the CLI),
  every divergence with the target's logit margin;
- attention: one layer's tree attention at the target's shape: SDPA (each backend), SDPA with the KV heads
  expanded, and FlexAttention with a block mask (GPU only), to choose the fused call.

    python -m eaglex.gpu_check --out DIR --repo REPO [--device auto|cpu|cuda:N] [--quick] [--budget SECONDS] [--phases a,b]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from eaglex.presets import DATA

PHASES = ("env", "equivalence", "models", "bench", "batched", "check", "attention")
SHAPES = {   # the target; the head gets the target's width, intermediate size and attention shape, like a real one
    "llama3.1-8b": dict(vocab=128256, hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128,
                        frequent=32000, max_pos=4096, rope_theta=500000.0, rms_norm_eps=1e-5),
    "quick": dict(vocab=4096, hidden=256, intermediate=512, layers=8, heads=8, kv_heads=2, head_dim=32,
                  frequent=1024, max_pos=1024, rope_theta=500000.0, rms_norm_eps=1e-5),
}
KNOBS = dict(eps_attn=2.7, eps_mlp=0.4, qk_gain=2.0, anti_self=0.9, norm_jitter=0.1)   # bench_models.BIG_SPEC's
ALPHA = 0.8            # map-following rate the target is calibrated to: a 6-token chain then commits ~3.9 per cycle
GPU_TREES = ("chain:4", "chain:6", "dynamic:16/6/4", "dynamic:32/7/8", "dynamic:60/8/10")
IN_FLIGHT = (1, 4, 16)  # requests decoded together in the batched phase


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def log(*parts) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}]", *parts, flush=True)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------ models

def token_map(seed: int, vocab: int, frequent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(S sorted [F], next [V]): next is one random cycle through the frequent set S, -1 elsewhere."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 11)
    S = torch.sort(torch.randperm(vocab, generator=g)[:frequent]).values
    order = S[torch.randperm(frequent, generator=g)]
    nxt = torch.full((vocab,), -1, dtype=torch.long)
    nxt[order] = torch.roll(order, -1)
    return S, nxt


def target_weights(s: dict, k: dict, seed: int, device, dtype) -> tuple[dict, int, torch.Tensor, torch.Tensor]:
    """eaglex/bench_models.target_state_dict's construction, drawn on `device` (an 8B target in seconds):
    (state dict in `dtype`, eos id, S, next)."""
    V, H, L, I = s["vocab"], s["hidden"], s["layers"], s["intermediate"]
    nh, nkv, hd = s["heads"], s["kv_heads"], s["head_dim"]
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + 1)

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=g, device=device) * std

    E = randn(V, H)
    E *= math.sqrt(H) / E.norm(dim=-1, keepdim=True)
    S, nxt = token_map(seed, V, s["frequent"])
    head = torch.zeros(V, H, device=device)
    head[nxt[S].to(device)] = E[S.to(device)]
    eos = int((nxt < 0).nonzero().max())                               # a dead token: never generated
    sd = {"model.embed_tokens.weight": E.to(dtype), "lm_head.weight": head.to(dtype)}
    del E, head
    a, G, qk = k["anti_self"], nh // nkv, k["qk_gain"] / math.sqrt(H)
    for i in range(L):
        p = f"model.layers.{i}."
        q = randn(nh * hd, H, std=qk)
        qg = q.view(nkv, G, hd, H)
        qg[:, 1:] = a * qg[:, :1] + math.sqrt(1 - a * a) * qg[:, 1:]
        sd.update({
            p + "input_layernorm.weight": (1.0 + randn(H, std=k["norm_jitter"])).to(dtype),
            p + "post_attention_layernorm.weight": (1.0 + randn(H, std=k["norm_jitter"])).to(dtype),
            p + "self_attn.q_proj.weight": q.to(dtype),
            p + "self_attn.k_proj.weight": (-qg[:, 0].reshape(nkv * hd, H)).to(dtype),
            p + "self_attn.v_proj.weight": randn(nkv * hd, H, std=1 / math.sqrt(H)).to(dtype),
            p + "self_attn.o_proj.weight": randn(H, nh * hd, std=k["eps_attn"] / math.sqrt(nh * hd)).to(dtype),
            p + "mlp.gate_proj.weight": randn(I, H, std=1 / math.sqrt(H)).to(dtype),
            p + "mlp.up_proj.weight": randn(I, H, std=1 / math.sqrt(H)).to(dtype),
            p + "mlp.down_proj.weight": randn(H, I, std=k["eps_mlp"] / math.sqrt(I)).to(dtype),
        })
    sd["model.norm.weight"] = (1.0 + randn(H, std=k["norm_jitter"])).to(dtype)
    return sd, eos, S, nxt


def hf_llama(sd: dict, s: dict, eos: int, device, layers: int | None = None):
    """LlamaForCausalLM over the tensors of `sd` (no copy, no random init)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                      num_hidden_layers=layers or s["layers"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                      max_position_embeddings=s["max_pos"], rms_norm_eps=s["rms_norm_eps"],
                      rope_theta=s["rope_theta"], tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos,
                      pad_token_id=eos, architectures=["LlamaForCausalLM"])
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.load_state_dict(sd, strict=True, assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)        # its buffers were created on meta
    model.to(device)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos, do_sample=False)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def measure_alpha(model, nxt: torch.Tensor, S: torch.Tensor, seed: int, n_new: int = 32, batch: int = 8,
                  length: int = 48) -> float:
    """Share of greedy tokens that follow the map (batched, equal-length prompts of frequent tokens)."""
    device = model.device
    g = torch.Generator().manual_seed(seed * 1_000_003 + 31)
    ids = S[torch.randint(0, S.shape[0], (batch, length), generator=g)].to(device)
    nxt = nxt.to(device)
    out = model(ids, use_cache=True)
    cache, prev, tok = out.past_key_values, ids[:, -1], out.logits[:, -1].argmax(-1)
    follow = total = 0
    for _ in range(n_new):
        follow += int((nxt[prev] == tok).sum())
        total += batch
        out = model(tok[:, None], past_key_values=cache, use_cache=True)
        cache, prev, tok = out.past_key_values, tok, out.logits[:, -1].argmax(-1)
    return follow / total


def calibrate(model, sd: dict, nxt, S, seed: int, target: float = ALPHA, steps: int = 7) -> tuple[float, list]:
    """Scale every o_proj (the context's weight against the map) until the target follows the map at `target`."""
    names = [n for n in sd if n.endswith("o_proj.weight")]
    base = {n: sd[n].clone() for n in names}
    lo = hi = None
    scale, history = 1.0, []
    for _ in range(steps):
        for n in names:
            sd[n].copy_(base[n] * scale)
        a = measure_alpha(model, nxt, S, seed)
        history.append((round(scale, 4), round(a, 4)))
        if abs(a - target) < 0.02:
            break
        if a > target:
            lo = scale
        else:
            hi = scale
        scale = math.sqrt(lo * hi) if lo is not None and hi is not None else scale * (2.0 if hi is None else 0.5)
    return history[-1][1], history


@torch.no_grad()
def head_weights(model, s: dict, S: torch.Tensor, seed: int, device, dtype) -> tuple[dict, dict]:
    """eaglex/bench_models.head_state_dict's EAGLE-3 head, drawn on `device`: (state dict, config)."""
    from eaglex.bench_models import BIG_HEAD_SPEC as hs
    H, V, L, I = s["hidden"], s["vocab"], s["layers"], s["intermediate"]
    nh, nkv, hd = s["heads"], s["kv_heads"], s["head_dim"]
    G, R = nh // nkv, nkv * hd
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + 3)

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=g, device=device) * std

    taps = [2, L // 2, L - 3]
    probe = S[torch.randint(0, S.shape[0], (2, 64), generator=torch.Generator().manual_seed(99))].to(device)
    hs_out = model(probe, output_hidden_states=True).hidden_states
    tap_rms = [float(hs_out[i].float().pow(2).mean().sqrt()) for i in taps]
    ids = S.to(device)
    Vd = ids.shape[0]
    fc = torch.cat([randn(H, H, std=1 / (math.sqrt(3 * H) * r)) for r in tap_rms], 1)
    c, noise = hs["self_attn_gain"], hs["noise"] / math.sqrt(2 * H)
    eye = torch.eye(R, device=device)
    k_w = torch.zeros(R, 2 * H, device=device)
    k_w[:, :R] = c * eye
    q_w = k_w.view(nkv, 1, hd, 2 * H).expand(nkv, G, hd, 2 * H).reshape(nh * hd, 2 * H).clone()
    v_w = torch.zeros(R, 2 * H, device=device)
    v_w[:, :R], v_w[:, H:H + R] = eye, -eye
    o_w = torch.zeros(H, nh * hd, device=device)
    for i in range(nh):
        j = i // G
        o_w[j * hd:(j + 1) * hd, i * hd:(i + 1) * hd] = torch.eye(hd, device=device) / G
    lm = model.lm_head.weight[ids].float().clone()
    lm[:, R:] = 0.0
    sd = {
        "fc.weight": fc,
        "midlayer.hidden_norm.weight": 1.0 + randn(H, std=hs["norm_jitter"]),
        "midlayer.input_layernorm.weight": 1.0 + randn(H, std=hs["norm_jitter"]),
        "midlayer.self_attn.q_proj.weight": q_w + randn(*q_w.shape, std=noise),
        "midlayer.self_attn.k_proj.weight": k_w + randn(*k_w.shape, std=noise),
        "midlayer.self_attn.v_proj.weight": v_w + randn(*v_w.shape, std=noise),
        "midlayer.self_attn.o_proj.weight": o_w + randn(*o_w.shape, std=hs["noise"] / math.sqrt(H)),
        "midlayer.post_attention_layernorm.weight": 1.0 + randn(H, std=hs["norm_jitter"]),
        "midlayer.mlp.gate_proj.weight": randn(I, H, std=1 / math.sqrt(H)),
        "midlayer.mlp.up_proj.weight": randn(I, H, std=1 / math.sqrt(H)),
        "midlayer.mlp.down_proj.weight": randn(H, I, std=hs["mlp_scale"] / math.sqrt(I)),
        "norm.weight": 1.0 + randn(H, std=hs["norm_jitter"]),
        "lm_head.weight": lm,
    }
    sd = {k: v.to(dtype) for k, v in sd.items()}
    sd["d2t"] = (ids - torch.arange(Vd, device=device)).long()
    t2d = torch.zeros(V, dtype=torch.bool, device=device)
    t2d[ids] = True
    sd["t2d"] = t2d
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": I,
           "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd, "num_hidden_layers": 1,
           "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": hs["max_pos"], "vocab_size": V,
           "draft_vocab_size": Vd, "pad_token_id": 0, "bos_token_id": None, "eos_token_id": model.config.eos_token_id,
           "tie_word_embeddings": False, "torch_dtype": str(dtype).replace("torch.", "")}
    return sd, cfg


def assistant(target, sd: dict, s: dict, eos: int, device, dtype):
    """transformers' assistant for assisted generation: one decoder layer that adds nothing (zero o_proj and
    down_proj) over the target's own embedding and lm_head, so it always predicts the map, as the EAGLE head does."""
    small = {k: v for k, v in sd.items() if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    small["model.layers.0.self_attn.o_proj.weight"] = torch.zeros_like(sd["model.layers.0.self_attn.o_proj.weight"])
    small["model.layers.0.mlp.down_proj.weight"] = torch.zeros_like(sd["model.layers.0.mlp.down_proj.weight"])
    return hf_llama(small, s, eos, device, layers=1)


def make_prompts(S: torch.Tensor, n: int, seed: int, lengths: tuple[int, int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + 21)
    out = []
    for _ in range(n):
        k = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        out.append(S[torch.randint(0, S.shape[0], (k,), generator=g)].tolist())
    return out


# ------------------------------------------------------------------------------------------------ phases

class Check:
    def __init__(self, args):
        from eaglex.runtime.device import resolve_device
        self.args, self.out = args, Path(args.out)
        self.device = resolve_device(args.device)
        self.cuda = self.device.type == "cuda"
        self.quick = args.quick
        self.dtype = "bfloat16" if self.cuda else "float32"
        self.shape = "quick" if self.quick or not self.cuda else "llama3.1-8b"
        self.budget = Budget(args.budget)
        self.results = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "device": str(self.device),
                        "quick": self.quick, "dtype": self.dtype, "shape": self.shape, "phases": {}}
        self.report: list[str] = []
        self.models = None

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str) + "\n")
        (self.out / "report.txt").write_text("\n".join(self.report) + "\n")

    def section(self, title: str, body: str) -> None:
        self.report += [f"== {title} " + "=" * max(0, 100 - len(title)), body, ""]
        print(f"\n== {title}\n{body}\n", flush=True)

    def run(self, phases) -> int:
        for name in phases:
            need = {"equivalence": 60, "models": 30, "bench": 60, "batched": 40, "check": 20,
                    "attention": 10}.get(name, 0)
            if self.budget.left() < need:
                self.results["phases"][name] = {"status": "skipped", "why": f"budget: {self.budget.left():.0f} s left"}
                log(f"{name}: skipped ({self.budget.left():.0f} s left)")
                self.save()
                continue
            log(f"{name} ...")
            t = time.monotonic()
            try:
                info = getattr(self, "phase_" + name)() or {}
                status = info.pop("status", "ok")
                self.results["phases"][name] = {"status": status, "seconds": round(time.monotonic() - t, 1), **info}
            except Exception as e:  # noqa: BLE001 - one phase failing must not hide the others' results
                tb = traceback.format_exc()
                self.results["phases"][name] = {"status": "error", "seconds": round(time.monotonic() - t, 1),
                                                "error": f"{type(e).__name__}: {e}", "traceback": tb[-4000:]}
                self.section(f"{name}: ERROR", tb)
            log(f"{name}: {self.results['phases'][name]['status']} ({time.monotonic() - t:.1f} s)")
            self.save()
        statuses = [p["status"] for p in self.results["phases"].values()]
        self.results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        self.save()
        return 0 if all(s in ("ok", "skipped") for s in statuses) else 1

    # ---- env
    def phase_env(self):
        import onnxruntime as ort
        import transformers

        import eaglex
        from eaglex.runtime.device import describe
        env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
               "transformers": transformers.__version__, "onnxruntime": ort.__version__,
               "ort_providers": ort.get_available_providers(), "eaglex": eaglex.__version__,
               "eaglex_from": str(Path(eaglex.__file__).parent), "device": describe(self.device),
               "commit": os.environ.get("EAGLEX_COMMIT", ""), "cores": os.cpu_count(),
               "float32_matmul_precision": torch.get_float32_matmul_precision()}
        if self.cuda:
            p = torch.cuda.get_device_properties(self.device)
            env.update(gpu_memory_gib=round(p.total_memory / 2 ** 30, 1), sms=p.multi_processor_count,
                       capability=f"{p.major}.{p.minor}")
        self.results["env"] = env
        self.section("environment", "\n".join(f"{k}: {v}" for k, v in env.items()))
        return {}

    # ---- equivalence (pytest tests/test_gpu.py on the device)
    def phase_equivalence(self):
        xml = self.out / "pytest.xml"
        env = {**os.environ, "EAGLEX_TEST_DEVICE": str(self.device), "EAGLEX_TEST_QUICK": "1" if self.quick else "0"}
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(self.args.repo / "tests/test_gpu.py"),
               "-c", str(self.args.repo / "pyproject.toml"), "--rootdir", str(self.args.repo), f"--junitxml={xml}"]
        timeout = max(60, min(self.args.equivalence_timeout, self.budget.left() - 150))
        try:
            proc = subprocess.run(cmd, env=env, cwd=self.out, capture_output=True, text=True, timeout=timeout)
            text, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            text, rc = f"{e.stdout or ''}{e.stderr or ''}\npytest: timed out after {timeout:.0f} s", -1
        (self.out / "pytest.txt").write_text(text)
        summary = {"returncode": rc, "tests": []}
        if xml.is_file():
            for case in ET.parse(xml).getroot().iter("testcase"):
                state = "passed"
                for tag in ("failure", "error", "skipped"):
                    el = case.find(tag)
                    if el is not None:
                        state = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                        summary["tests"].append({"test": case.get("name"), "state": state,
                                                 "message": (el.get("message") or "")[:300]})
                        break
                else:
                    summary["tests"].append({"test": case.get("name"), "state": state,
                                             "seconds": float(case.get("time", 0))})
        counts = {s: sum(t["state"] == s for t in summary["tests"]) for s in ("passed", "failed", "error", "skipped")}
        summary["counts"] = counts
        self.results["equivalence"] = summary
        lines = [f"{t['state']:<8} {t['test']}" + (f"  ({t['message']})" if t.get("message") else "")
                 for t in summary["tests"]]
        lines.append(f"pytest tests/test_gpu.py on {self.device}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
        self.section("equivalence suite (fp32): transformers == vanilla == speculative", "\n".join(lines))
        return {"status": "ok" if rc == 0 else "failed", "counts": counts}

    # ---- models
    def phase_models(self):
        from eaglex.bench_models import _write_folder
        from eaglex.models.target import DTYPES, target_from_model
        from eaglex.runtime.torch_backend import TorchBackend

        s, seed, device, dtype = SHAPES[self.shape], 0, self.device, DTYPES[self.dtype]
        t = time.monotonic()
        sd, eos, S, nxt = target_weights(s, KNOBS, seed, device, dtype)
        model = hf_llama(sd, s, eos, device)
        sync(device)
        built = time.monotonic() - t
        alpha, history = calibrate(model, sd, nxt, S, seed)
        hsd, hcfg = head_weights(model, s, S, seed, device, dtype)
        head_dir = Path(self.args.work) / f"head-{self.shape}"
        _write_folder(head_dir, {k: v.cpu() for k, v in hsd.items()}, hcfg)
        del hsd
        target = target_from_model(model)
        backend = TorchBackend(target, head_dir, self.dtype, device=device, mode="graphs" if self.cuda else "static")
        params = sum(v.numel() for v in sd.values())
        n, lengths = (4, (32, 96)) if self.quick else (8, (64, 256))
        self.models = dict(model=model, sd=sd, eos=eos, S=S, nxt=nxt, target=target, backend=backend,
                           head_dir=head_dir, prompts=make_prompts(S, n, seed, lengths), seed=seed, lengths=lengths)
        info = {"shape": self.shape, "spec": s, "knobs": KNOBS, "target_params": params, "dtype": self.dtype,
                "build_seconds": round(built, 1), "alpha": alpha, "alpha_target": ALPHA,
                "calibration (o_proj scale, alpha)": history, "prompts": n, "prompt_lengths": lengths,
                "graphs_mode": backend.mode}
        self.results["models"] = info
        self.section("bench models", "\n".join(f"{k}: {v}" for k, v in info.items()))
        return {}

    # ---- bench
    def phase_bench(self):
        from eaglex import bench
        from eaglex.runtime.autotune import CANDIDATES, autotune
        from eaglex.runtime.generate import SpeculativeGenerator, VanillaGenerator
        from eaglex.runtime.torch_backend import TorchBackend
        from eaglex.runtime.types import TreeConfig

        m = self.models or self._need_models()
        backend, prompts, device = m["backend"], m["prompts"], self.device
        max_new = 24 if self.quick else 128
        ladder = tuple(t for t in CANDIDATES if t.max_nodes >= 4)        # the tuning ladder from chain:3 on
        candidates = ladder[:4] if self.quick else ladder
        tune_prompts, tune_new = prompts[:2 if self.quick else 4], 16 if self.quick else 32
        if not self.quick:                     # a first pass captures every candidate's graphs; the second is timed
            autotune(backend, tune_prompts, tune_new, candidates)
        best, tune_rows = autotune(backend, tune_prompts, tune_new, candidates)
        tuning = [{"tree": str(r.tree or "vanilla"), "tokens_per_s": round(r.tokens_per_s, 1), "tau": round(r.tau, 2),
                   "identical": r.identical} for r in tune_rows]
        trees = [best] + [t for t in (TreeConfig.parse(x) for x in (GPU_TREES[:2] if self.quick else GPU_TREES))
                          if t != best]
        where = f"{device} {self.dtype}"

        def prime(b, trees_, some=None):         # every shape captured before timing (graphs are made on reuse)
            for p in prompts[:some]:
                for g in [VanillaGenerator(b)] + [SpeculativeGenerator(b, t) for t in trees_]:
                    g.generate(p, max_new)
                    g.generate(p, max_new)
        prime(backend, trees)
        sizes, draft_sizes = bench.sizes_for(trees)
        sampler = bench.CostSampler(backend, sizes=sizes, draft_sizes=draft_sizes)
        for i in range(3):
            sampler.round(record=i > 0)
        rows = bench.run_backend("eaglex", backend, trees, prompts, max_new, "eagle3", sampler)
        cm = sampler.summary()
        for row, tree in zip(rows[1:], trees):
            row.tree = str(tree) + (" (tuned)" if tree == best else "")
            tau = sum(row.accept_lengths) / max(len(row.accept_lengths), 1)
            row.predicted_speedup = bench.predicted_speedup(cm, tree, tau)
        for row in rows:
            row.device, row.threads = f"{where} {backend.mode}", f"torch {torch.get_num_threads()}"
        out = [r.as_dict() for r in rows]
        if backend.mode != "eager":                     # the same models without graphs: what they buy
            eager = TorchBackend(m["target"], backend.draft, self.dtype, device=device, mode="eager")
            prime(eager, [best], 1)                         # nothing to capture: a warm-up is enough
            for r in bench.run_backend("eaglex", eager, [best], prompts, max_new, "eagle3"):
                r.device, r.threads = f"{where} eager", f"torch {torch.get_num_threads()}"
                out.append(r.as_dict())
            del eager
        reference = [VanillaGenerator(backend).generate(p, max_new).output_ids for p in prompts]
        if not self.args.no_peers:
            helper = assistant(m["model"], m["sd"], SHAPES[self.shape], m["eos"], device, m["sd"][
                "lm_head.weight"].dtype)
            for r in bench.run_hf_peers(None, prompts, max_new, reference=reference, model=m["model"],
                                        draft_lm=helper):
                r.threads = f"torch {torch.get_num_threads()}"
                out.append(r.as_dict())
            del helper
        hf = next((r for r in out if r["method"] == "hf greedy"), None)
        ours = out[0]
        for r in out:
            r["vs_hf_greedy"] = round(r["tokens_per_s"] / hf["tokens_per_s"], 3) if hf and r["tokens_per_s"] \
                else None
            r["vs_vanilla"] = round(r["tokens_per_s"] / ours["tokens_per_s"], 3) if r["tokens_per_s"] else None
        goals = self._goals(out)
        self.results["bench"] = {"rows": out, "tuning": tuning, "tuned_tree": str(best), "cost_model": cm,
                                 "max_new_tokens": max_new, "prompts": len(prompts), "goals": goals,
                                 "graphs": len(backend.graphs.graphs) if backend.graphs is not None else None,
                                 "graph_failures": backend.graphs.failed if backend.graphs is not None else None}
        self.models["best"] = best
        text = _capture(bench.print_table, out)
        text += "\ntuning (4 prompts, 32 tokens): " + ", ".join(f"{t['tree']} {t['tokens_per_s']}" for t in tuning)
        text += "\ngoals (set for one H200 and the 8B-shaped bf16 target; informational elsewhere):\n" + "\n".join(f"  {'PASS' if g['pass'] else 'FAIL'}  {g['goal']}: {g['measured']}"
                                         for g in goals)
        self.section(f"bench, batch 1, {self.shape} target in {self.dtype} on {device} ({max_new} new tokens, "
                     f"{len(prompts)} prompts)", text)
        return {"tuned_tree": str(best)}

    def _goals(self, rows: list[dict]) -> list[dict]:
        vanilla = rows[0]
        eagle = [r for r in rows if r["method"] == "eagle3" and not r["device"].endswith("eager")]
        best = max(eagle, key=lambda r: r["tokens_per_s"] or 0)
        hf = next((r for r in rows if r["method"] == "hf greedy"), None)
        goals = [
            {"goal": "speculative output identical to vanilla (every tree)",
             "measured": all(r["identical_to_vanilla"] for r in rows if r["engine"] == "eaglex"),
             "pass": all(r["identical_to_vanilla"] for r in rows if r["engine"] == "eaglex")},
            {"goal": "EAGLE-3 >= 2.5x eaglex vanilla", "measured": f"{best['tree']}: "
             f"{best['tokens_per_s'] / vanilla['tokens_per_s']:.2f}x",
             "pass": best["tokens_per_s"] >= 2.5 * vanilla["tokens_per_s"]},
            {"goal": "tau ~ 4 (3.5-4.5)", "measured": best["tau"], "pass": 3.5 <= (best["tau"] or 0) <= 4.5},
            {"goal": "per-cycle time outside the forwards < 1 ms", "measured": f"{best['other_ms_per_cycle']} ms",
             "pass": (best["other_ms_per_cycle"] or 99) < 1.0},
        ]
        if hf is not None:
            goals.insert(2, {"goal": "EAGLE-3 >= 3x transformers greedy",
                             "measured": f"{best['tokens_per_s'] / hf['tokens_per_s']:.2f}x",
                             "pass": best["tokens_per_s"] >= 3 * hf["tokens_per_s"]})
        return goals

    def _need_models(self):
        self.phase_models()
        return self.models

    # ---- batched (in-flight batching on the device)
    def phase_batched(self):
        from eaglex.runtime.autotune import run_batch, schedule_from
        from eaglex.runtime.batch import BatchedGenerator, chain_for
        from eaglex.runtime.equivalence import first_divergence, logit_margin
        from eaglex.runtime.generate import VanillaGenerator
        from eaglex.runtime.types import TreeConfig

        m = self.models or self._need_models()
        best = m.get("best") or TreeConfig.parse("dynamic:16/6/4")
        # the chain an engine batches before its batch tuning (batch.chain_for), and the tree tuned at batch 1, or
        # when that is a chain a dynamic tree, so that batched dynamic trees run on the device either way
        trees = [chain_for(best), best if best.kind != "chain" else TreeConfig.parse("dynamic:16/6/4")]
        max_new = 16 if self.quick else 64
        # the bench's prompts first (make_prompts draws them one after the other), then more of the same kind
        prompts = make_prompts(m["S"], max(IN_FLIGHT), m["seed"], m["lengths"])
        nodes = max(t.max_nodes for t in trees)
        single = m["backend"]
        # slots as long as these requests need, with room for a tree after the last token (every slot holds it)
        backend = single.with_slots(max(IN_FLIGHT), nodes,
                                    min(max(map(len, prompts)) + max_new + nodes, single.spec.max_context))
        alone = VanillaGenerator(single)
        want = [alone.generate(p, max_new).output_ids for p in prompts]
        exact = self.dtype == "float32"      # fp32 promises equality; bf16 rows batched round differently
        rows, errors = [], []
        for size in IN_FLIGHT:
            if self.budget.left() < 20:          # the budget's end: the larger batches are left out, not overrun
                rows.append({"requests": size, "schedule": "-", "skipped": f"budget: {self.budget.left():.0f} s left"})
                continue
            for tree in [None] + trees:
                row = {"requests": size, "schedule": str(tree or "vanilla")}
                rows.append(row)
                try:
                    # the first pass runs every shape (captured as CUDA graphs when they recur), the second is timed
                    for i in range(2):
                        tokens, seconds, reqs = run_batch(lambda _, s, b=backend: BatchedGenerator(b, s), tree, prompts,
                                                          size, max_new)
                        rate = tokens / max(seconds, 1e-9)
                        divs = [first_divergence(want[j], r.result.output_ids) for j, r in enumerate(reqs)]
                        bad = [{"request": j, "pass": i, "at": d,
                                "margin": round(logit_margin(single, prompts[j] + want[j][:d]), 4)}
                               for j, d in enumerate(divs) if d is not None]
                        row.setdefault("divergences", []).extend(bad)
                    lengths = [n for r in reqs for n in r.result.accept_lengths]
                    row.update(tokens_per_s=round(rate, 1), tau=round(sum(lengths) / max(len(lengths), 1), 2),
                               identical=f"{2 * size - len(row['divergences'])}/{2 * size}")
                except Exception as e:  # noqa: BLE001 - a failing shape must not hide the other measurements
                    row["error"] = f"{type(e).__name__}: {e}"
                    errors.append(f"{size} requests, {row['schedule']}:\n{traceback.format_exc()[-3000:]}")
            base = next((r.get("tokens_per_s") for r in rows if r["requests"] == size and r["schedule"] == "vanilla"),
                        None)
            for r in rows:
                if r["requests"] == size and r.get("tokens_per_s") and base:
                    r["vs_vanilla"] = round(r["tokens_per_s"] / base, 3)
        table = {}
        for r in rows:
            if r.get("tokens_per_s"):
                table.setdefault(r["requests"], {})[r["schedule"]] = r["tokens_per_s"]
        picked = str(schedule_from(table)) if table else None
        graphs = backend.graphs
        diverged = [r for r in rows if r.get("divergences")]
        self.results["batched"] = {"rows": rows, "max_new_tokens": max_new, "requests_checked": len(prompts),
                                   "schedule_from_table": picked, "mode": backend.mode,
                                   "graphs": len(graphs.graphs) if graphs is not None else None,
                                   "graph_failures": graphs.failed if graphs is not None else None}
        lines = [f"{'requests':>8} {'schedule':<16} {'tokens/s':>9} {'vs vanilla':>10} {'tau':>5} {'identical':>9}"
                 "  first divergences (request@token, margin)"]
        for r in rows:
            if "skipped" in r or "error" in r:
                lines.append(f"{r['requests']:>8} {r['schedule']:<16} {r.get('skipped') or 'ERROR ' + r['error']}")
                continue
            divs = ", ".join(f"{d['request']}@{d['at']} ({d['margin']})" for d in r["divergences"][:6])
            lines.append(f"{r['requests']:>8} {r['schedule']:<16} {r['tokens_per_s']:>9} "
                         f"{r.get('vs_vanilla', '-'):>10} {r['tau']:>5} {r['identical']:>9}  {divs}")
        lines.append(f"each request against the same request decoded alone by vanilla decoding ({max_new} tokens; "
                     f"both passes of every row; {self.dtype}"
                     + ("" if exact else ": a divergence at a small logit margin is rounding, a large one a bug") + ")")
        lines.append(f"the schedule these numbers give (runtime/autotune.schedule_from): {picked}")
        if graphs is not None:
            lines.append(f"CUDA graphs: {len(graphs.graphs)} kept, {len(graphs.failed)} failed captures")
        self.section(f"batched: vanilla vs EAGLE-3 in-flight batching, {self.shape} target in {self.dtype} on "
                     f"{self.device} ({backend.mode} forwards)", "\n".join(lines + errors))
        del backend
        if self.cuda:
            torch.cuda.empty_cache()
        status = "error" if errors else "failed" if exact and diverged else "ok"
        return {"status": status, "diverged_rows": len(diverged), "errors": len(errors)}

    # ---- check (bf16 divergences with margins)
    def phase_check(self):
        from eaglex.runtime.equivalence import check_identical, format_identical
        from eaglex.runtime.types import TreeConfig

        m = self.models or self._need_models()
        tree = m.get("best") or TreeConfig.parse("dynamic:16/6/4")
        max_new = 24 if self.quick else 96
        rows = check_identical(m["backend"], tree, m["prompts"], max_new)
        threads = ["--threads", "1"] if not self.cuda else []
        text = format_identical(rows, f"eagle3, tree {tree}, {self.dtype} on {self.device}")
        divergences = [{"prompt": r.index, "at": r.divergence, "margin": r.margin} for r in rows if not r.identical]
        # the committed tiny model through the CLI, as a user runs it
        prompts = Path(self.args.work) / "tiny-prompts.jsonl"
        lines = (DATA / "tiny/prompts.jsonl").read_text().splitlines()
        prompts.write_text("\n".join(lines[: 3 if self.quick else 16]) + "\n")
        cmd = [sys.executable, "-m", "eaglex.cli", "check", "--target", str(DATA / "tiny/target"), "--draft",
               str(DATA / "tiny/eagle3"), "--dtype", "bfloat16", "--device", str(self.device), "--prompts",
               str(prompts), "--max-new-tokens", "32" if self.quick else "64", *threads]
        proc = subprocess.run(cmd, cwd=self.args.work, capture_output=True, text=True, timeout=300)
        tiny = proc.stdout + (proc.stderr if proc.returncode not in (0, 1) else "")
        self.results["check"] = {"bench_target": {"tree": str(tree), "divergences": divergences,
                                                   "identical": sum(r.identical for r in rows), "prompts": len(rows)},
                                 "tiny_cli": {"returncode": proc.returncode, "output": tiny[-4000:]}}
        self.section(f"check in {self.dtype}: the bench target ({self.shape})", text)
        self.section(f"check in bfloat16 through the CLI: models/tiny on {self.device} (exit {proc.returncode})", tiny)
        return {"divergences": len(divergences), "tiny_returncode": proc.returncode}

    # ---- attention micro-benchmark
    def phase_attention(self):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        s, device = SHAPES[self.shape], self.device
        dtype = torch.bfloat16 if self.cuda else torch.float32
        nh, nkv, hd = s["heads"], s["kv_heads"], s["head_dim"]
        g = torch.Generator(device=device).manual_seed(0)
        results, lines = [], []
        reps = 50 if self.cuda else 5
        flex = None
        if self.cuda and not self.args.no_flex and self.budget.left() > 120:
            try:
                from torch.nn.attention.flex_attention import create_block_mask, flex_attention
                flex = (torch.compile(flex_attention, dynamic=False), create_block_mask)
            except Exception as e:  # noqa: BLE001 - older torch: no FlexAttention
                lines.append(f"flex_attention unavailable: {e}")

        def timed(fn):
            try:
                fn()
                sync(device)
            except Exception as e:  # noqa: BLE001 - a backend that does not take these inputs
                return f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    fn()
                end.record()
                sync(device)
                return round(start.elapsed_time(end) / reps * 1e3, 1)         # microseconds
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            return round((time.perf_counter() - t) / reps * 1e6, 1)

        for n in (1, 16, 60):
            for T in (512, 2048):
                q = torch.randn(1, nh, n, hd, device=device, generator=g).to(dtype)
                k = torch.randn(1, nkv, T, hd, device=device, generator=g).to(dtype)
                v = torch.randn(1, nkv, T, hd, device=device, generator=g).to(dtype)
                mask = torch.ones(1, 1, n, T, dtype=torch.bool, device=device)
                mask[..., T - n:] = torch.rand(n, n, device=device, generator=g).lt(0.5).tril() | torch.eye(
                    n, dtype=torch.bool, device=device)
                row = {"N": n, "T": T}
                row["sdpa"] = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
                if self.cuda:
                    for name, b in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                                    ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)):
                        def one(b=b):
                            with sdpa_kernel([b]):
                                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                        row[f"sdpa[{name}]"] = timed(one)
                ke, ve = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
                row["sdpa expanded kv"] = timed(lambda: F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask))
                if flex is not None and self.budget.left() < 60:
                    row["flex"] = "skipped (budget)"
                elif flex is not None:
                    compiled, create_block_mask = flex
                    dense = mask[0, 0]

                    def mask_mod(b, h, qi, ki):
                        return dense[qi, ki]
                    try:
                        bm = create_block_mask(mask_mod, None, None, n, T, device=device)
                        row["flex"] = timed(lambda: compiled(q, k, v, block_mask=bm, enable_gqa=True))
                    except Exception as e:  # noqa: BLE001
                        row["flex"] = f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
                results.append(row)
        keys = list(dict.fromkeys(k for r in results for k in r if k not in ("N", "T")))
        lines.append(f"one layer's tree attention, {nh} query / {nkv} KV heads of {hd}, {dtype}, microseconds "
                     f"per call ({reps} calls timed{' with CUDA events' if self.cuda else ''}):")
        lines.append(f"{'N':>3} {'T':>5} " + " ".join(f"{k:>18}" for k in keys))
        for r in results:
            lines.append(f"{r['N']:>3} {r['T']:>5} " + " ".join(f"{str(r.get(k, '-')):>18}" for k in keys))
        self.results["attention"] = results
        self.section("attention: SDPA vs FlexAttention", "\n".join(lines))
        return {}


def _capture(fn, *args) -> str:
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn(*args)
    return buf.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eaglex.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "build/gpu_check"))
    ap.add_argument("--repo", type=Path, default=Path.cwd(), help="the checkout whose tests/test_gpu.py runs (default: .)")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: OUT/../gpu_check_work)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true", help="small models and few prompts (the CPU dry run)")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for all phases; late phases are skipped")
    ap.add_argument("--equivalence-timeout", type=float, default=200.0)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--no-peers", action="store_true", help="skip the transformers rows of the bench")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile takes ~30 s)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: 1 on the CPU, where small models run fastest on one; as is on GPUs)")
    args = ap.parse_args(argv)
    args.work = args.work or Path(args.out).resolve().parent / "gpu_check_work"
    if args.threads is None and not args.device.startswith("cuda") and not (args.device == "auto" and
                                                                            torch.cuda.is_available()):
        args.threads = 1
    args.work.mkdir(parents=True, exist_ok=True)
    phases = [p for p in args.phases.split(",") if p]
    unknown = set(phases) - set(PHASES)
    if unknown:
        ap.error(f"unknown phases {sorted(unknown)}; choose from {', '.join(PHASES)}")
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    check = Check(args)
    log(f"device {check.device}, shape {check.shape}, dtype {check.dtype}, budget {args.budget:.0f} s, out {args.out}")
    rc = check.run(phases)
    log(f"done: {args.out}/results.json, {args.out}/report.txt (exit {rc})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
