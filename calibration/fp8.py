"""`eaglex calibrate`: FP8 post-training quantization of a target with NVIDIA ModelOpt, on CPU or GPU(s).

One module of ~550 lines on purpose: each ModelOpt fact listed below is handled beside the one call that needs it.

    target folder --(ModelOpt mtq.quantize, FP8_DEFAULT_CFG [+ FP8_KV_CFG], max calibration over real text)-->
    ModelOpt's unified Hugging Face checkpoint (export_hf_checkpoint, in bfloat16 unless asked otherwise)
    + tokenizer + eaglex_calibration.json

The checkpoint is what TensorRT-LLM's PyTorch backend, vLLM and SGLang load as a pre-quantized FP8 model, and what
`eaglex build --quant fp8 --calibrated DIR` reads the scales from (calibration/checkpoint.py). Facts this relies on
(measured with ModelOpt 0.47 + transformers 5.14.1 on CPU):
- `quant_cfg` is a *list* of {quantizer_name, cfg|enable} entries; FP8_KV_CFG is a fragment to append, never a
  config of its own (alone, the weights fall back to int8 without amax and export fails).
- On CPU the fake quant is plain torch (x*448/amax -> float8_e4m3fn -> *amax/448); per-tensor scales.
- export_hf_checkpoint needs config.architectures and turns the model's weights into float8 in place, so it runs
  last, after every evaluation (no second copy of the weights is ever made). Its `dtype` is the dtype of every
  tensor it does not quantize (embeddings, norms, lm_head) and of config.json: bfloat16 by default here, because
  TensorRT-LLM takes the model dtype from the config and most of its kernels have no float32 path.

Memory (calibration/memory.py): the target is loaded in the calibration dtype (bfloat16 by default); on the CPU its
tensors are read into process memory one by one (no memory map), so that the export's in-place FP8 conversion frees
them and the peak stays near one copy of the weights; on GPUs they are spread over every visible GPU with a device
map (what does not fit is offloaded to CPU RAM). What the target needs is checked against the machine before any
weight is read, and refused in one line when it is not there. The report records the measured peak.

The quality report compares the fake-quantized model with the unquantized one on held-out text: perplexity of both,
top-1 agreement, mean KL(ref || quant) and the relative L2 error of the logits. Exact top-1 equality is not expected:
FP8 rounding flips cascade to a few percent of logit error.

The draft head stays float unless asked (`--quant-draft`): then the EAGLE head is quantized the same way, calibrated
on the quantized target's features over the same windows, and written as an FP8 head folder next to the target.
"""
from __future__ import annotations

import contextlib
import copy
import ctypes
import json
import math
import shutil
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from eaglex.base.errors import ModelError
from eaglex.base.fsio import check_out, staged
from eaglex.base.prompts import TOKENIZER_FILES, load_tokenizer

from . import memory
from .windows import TextWindows, load_windows

QUANTS = ("fp8",)
KV_CACHE = ("fp8",)
REPORT = "eaglex_calibration.json"
# Reference logits of the evaluation windows are kept in float32 up to this many values, in float16 beyond.
REF_FLOAT32_LIMIT = 64 * 1024 ** 2


@dataclass(frozen=True)
class CalibrateConfig:
    quant: str = "fp8"
    kv_cache: str | None = None      # "fp8": also calibrate the k/v cache scales (FP8_KV_CFG)
    data: str = "auto"               # auto | builtin-chat | builtin | hf:NAME[:SPLIT] | a JSONL file (windows.py)
    samples: int = 32                # calibration windows
    seq_len: int = 256               # tokens per window
    eval_samples: int = 8            # held-out windows for the quality report
    batch_size: int = 4
    dtype: str = "bfloat16"          # dtype the target is loaded, calibrated and exported in
    quant_draft: bool = False        # also quantize the EAGLE head given as draft_dir
    device: str = "auto"             # auto (every visible GPU when there is one, else the CPU) | cpu | cuda | cuda:N


def require_modelopt():
    """(mtq, mte) or a one-line ModelError; ModelOpt is an optional dependency (`pip install eaglex[quant]`)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")          # version-compat and deprecation chatter at import
            import modelopt.torch.export as mte
            import modelopt.torch.quantization as mtq
    except ImportError as e:
        raise ModelError(f"NVIDIA ModelOpt is not installed ({e.name or e}): pip install 'eaglex[quant]' "
                         "(nvidia-modelopt==0.47.0)") from None
    return mtq, mte


def modelopt_config(mtq, cfg: CalibrateConfig) -> dict:
    """FP8_DEFAULT_CFG, plus the FP8_KV_CFG entries when asked (list concatenation: ModelOpt >= 0.4x)."""
    out = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    if cfg.kv_cache == "fp8":
        out["quant_cfg"] = list(out["quant_cfg"]) + copy.deepcopy(list(mtq.FP8_KV_CFG["quant_cfg"]))
    return out


def calibrate(target_dir, out_dir, cfg: CalibrateConfig = CalibrateConfig(), draft_dir=None, draft_out=None,
              force: bool = False, progress: bool = True, machine: memory.Machine | None = None,
              dataset_loader=None) -> dict:
    """Quantize, evaluate and export; returns the report (also written to OUT/eaglex_calibration.json).
    `machine` replaces the probe of this machine's free memory (tests); `dataset_loader` replaces
    datasets.load_dataset for --data hf:NAME."""
    from eaglex.models.target import DTYPES

    t0 = time.perf_counter()
    if cfg.quant not in QUANTS:
        raise ModelError(f"--quant {cfg.quant!r}: eaglex calibrates {', '.join(QUANTS)}")
    if cfg.kv_cache not in (None,) + KV_CACHE:
        raise ModelError(f"--kv-cache {cfg.kv_cache!r}: choose {', '.join(KV_CACHE)}")
    if cfg.dtype not in DTYPES:
        raise ModelError(f"--dtype {cfg.dtype!r}: choose {', '.join(DTYPES)}")
    if cfg.quant_draft and draft_dir is None:
        raise ModelError("--quant-draft needs the EAGLE head: --draft DIR")
    target_dir, out = Path(target_dir), Path(out_dir)
    draft_out = Path(draft_out) if draft_out is not None else out.with_name(out.name + "-draft")
    for folder in [out] + ([draft_out] if cfg.quant_draft else []):
        _check_out(folder, force)
    _check_target_folder(target_dir)
    weight_bytes = memory.weights_bytes(target_dir, cfg.dtype)
    machine = machine or memory.probe()
    placement = memory.plan(weight_bytes, cfg.device, machine, cfg.dtype)     # refuses before any weight is read
    mtq, mte = require_modelopt()
    tokenizer = load_tokenizer(target_dir)

    peak = _PeakMemory()
    target = load_for_calibration(target_dir, cfg.dtype, placement)
    spec = target.spec
    windows = load_windows(cfg.data, tokenizer, spec.vocab_size, spec.eos_ids[0] if spec.eos_ids else None,
                           cfg.samples, cfg.seq_len, cfg.eval_samples, dataset_loader)
    model = target.hf
    device = input_device(model)
    ref = _logits(model, windows.evaluation, progress, "reference")

    batches = _batches(windows.calibration, cfg.batch_size)

    def forward_loop(m):
        for batch in tqdm(batches, desc="calibrate", unit="batch", disable=not progress, file=sys.stderr):
            m(input_ids=batch.to(device))

    with torch.no_grad(), _stdout_to_stderr(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, modelopt_config(mtq, cfg), forward_loop)
    _trim()
    quality = _quality(model, windows.evaluation, ref, progress)
    del ref
    _trim()
    quantizers = quantizer_summary(model)

    draft_report = None
    if cfg.quant_draft:
        draft_report = _quantize_draft(mtq, target, draft_dir, draft_out, windows, cfg, progress, force)

    report = {
        "target": str(target_dir.resolve()), "out": str(out.resolve()), "config": asdict(cfg),
        "dtype": cfg.dtype, "placement": placement.note,
        "data": {"source": windows.source, "calibration_windows": len(windows.calibration),
                 "calibration_tokens": windows.calibration_tokens, "evaluation_windows": len(windows.evaluation),
                 "evaluation_tokens": windows.evaluation_tokens},
        "quality": quality, "quantizers": quantizers, "draft": draft_report,
        "tools": _versions(),
    }
    export_dtype = DTYPES[cfg.dtype]
    with staged(out) as tmp:
        if not getattr(model.config, "architectures", None):       # export reads it
            model.config.architectures = [spec.arch]
        with torch.no_grad(), _stdout_to_stderr(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # mutates the model (weights become float8 in place): its last use. Shards of at most an eighth of the
            # weights keep the serialization buffer small next to them.
            mte.export_hf_checkpoint(model, dtype=export_dtype, export_dir=str(tmp),
                                     max_shard_size=_shard_size(weight_bytes))
        del model, target
        _trim()
        _finish_checkpoint(tmp, cfg.dtype)
        for name in TOKENIZER_FILES:
            if (target_dir / name).is_file():
                shutil.copy2(target_dir / name, tmp / name)
        report["seconds"] = round(time.perf_counter() - t0, 2)
        report["memory"] = {"weights_bytes": weight_bytes, **peak.read(),
                            "machine": machine.describe()}
        (tmp / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return report


# ---------------------------------------------------------------------------------------------------- loading

def _check_target_folder(path: Path) -> None:
    from eaglex.models.target import SUPPORTED_ARCHS, read_config

    raw = read_config(path)
    arch = (raw.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(f"{path}: architecture {arch} is not supported; eaglex runs {', '.join(SUPPORTED_ARCHS)}")


def load_for_calibration(path, dtype: str, placement: memory.Placement):
    """The target as a models.target.Target in `dtype`, placed as `placement` says. On the CPU the safetensors are
    read tensor by tensor into process memory (pread, no memory map; converted to `dtype` one tensor at a time), so
    that RAM holds one copy of the weights and ModelOpt's in-place FP8 export releases them; on GPUs transformers
    loads shard by shard onto the device map."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from eaglex.models.target import DTYPES, Target, load_error, spec_from_config

    hf_logging.disable_progress_bar()
    path = Path(path)
    torch_dtype = DTYPES[dtype]
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        config._attn_implementation = "sdpa"
        files = sorted(path.glob("*.safetensors"))
        if placement.kind == "cpu" and files:
            _bound_malloc()
            state = _read_state(files, torch_dtype)
            cls = AutoModelForCausalLM._model_mapping[type(config)]
            model, info = cls.from_pretrained(None, config=config, state_dict=state, dtype=torch_dtype,
                                              output_loading_info=True)
            del state
            tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
            missing = sorted(set(info.get("missing_keys", ())) - tied)
            if missing or info.get("unexpected_keys"):
                raise ModelError(f"{path}: weights do not match the config (missing {missing[:3]}, unexpected "
                                 f"{sorted(info.get('unexpected_keys', ()))[:3]})")
        elif placement.kind == "cpu":
            model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch_dtype)
        else:
            if placement.device_map == "auto":
                try:
                    import accelerate  # noqa: F401 - device_map="auto" dispatches with it
                except ImportError:
                    raise ModelError("spreading the target over several GPUs needs `accelerate`: pip install "
                                     "accelerate (or pass --device cuda:0 for a target that fits one GPU)") from None
            kwargs = {"device_map": placement.device_map}
            if placement.max_memory:
                kwargs["max_memory"] = placement.max_memory
            model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch_dtype, **kwargs)
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to decode the user's files is bad input, said in one line
        raise load_error(path, e) from None
    model.eval().requires_grad_(False)
    return Target(model, spec_from_config(config, path))


def _read_state(files: list[Path], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    state = {}
    for f in files:
        with safe_open(str(f), "pt", backend="pread") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                state[k] = t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t
    return state


def input_device(model) -> torch.device:
    """Where input ids go: the device of the input embeddings (the first stage of a device map)."""
    return model.get_input_embeddings().weight.device


def _shard_size(weight_bytes: int) -> int:
    return int(min(5 * 1024 ** 3, max(64 * 1024 ** 2, weight_bytes // 8)))


def _finish_checkpoint(folder: Path, dtype: str) -> None:
    """config.json also says torch_dtype (the key transformers 4.x, TensorRT-LLM's pin, reads), and every tensor
    that is not FP8 or a float32 scale is in `dtype`: the config, the tensors and the bundle's options agree."""
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("dtype", dtype) != dtype:
        raise ModelError(f"exported config.json says dtype {cfg.get('dtype')!r}, the calibration ran in {dtype}")
    cfg["dtype"] = cfg["torch_dtype"] = dtype
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    want = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[dtype]
    for f in sorted(folder.glob("*.safetensors")):
        for name, info in memory.safetensors_header(f).items():
            if name == "__metadata__" or name.endswith(SCALE_SUFFIXES):
                continue
            if info["dtype"] not in (want, "F8_E4M3") and info["dtype"].startswith(("F", "BF")):
                raise ModelError(f"exported {f.name}: {name} is {info['dtype']}, expected {want} or F8_E4M3")


SCALE_SUFFIXES = ("_scale", "_scale_2", ".k_scale", ".v_scale")


class _PeakMemory:
    """Peak resident memory of this process from now on (Linux: VmHWM after resetting it through clear_refs; where
    that is not allowed the lifetime peak is reported and marked so)."""

    def __init__(self):
        self.reset = _write("/proc/self/clear_refs", "5")
        self.baseline = _status_kib("VmRSS")

    def read(self) -> dict:
        peak = _status_kib("VmHWM")
        if peak is None or self.baseline is None:
            return {}
        return {"rss_baseline_bytes": self.baseline * 1024, "rss_peak_bytes": peak * 1024,
                "peak_is_lifetime": not self.reset}


def _status_kib(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _write(path: str, text: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(text)
        return True
    except OSError:
        return False


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _bound_malloc() -> None:
    """glibc raises its mmap threshold after large frees, after which freed activation and fake-quant buffers stay in
    the heap: pin it at 1 MiB so that large buffers go back to the system when freed (measured: +13 % of the
    weights at peak instead of +35 %)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, 1 << 20)                 # M_MMAP_THRESHOLD


def _trim() -> None:
    import gc
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


# ------------------------------------------------------------------------------------------------ evaluation

def _batches(windows, batch_size: int) -> list[torch.Tensor]:
    """[B, T] int64 batches of equal-length windows, in order."""
    out, run = [], []
    for w in windows:
        if run and (len(run) == batch_size or len(run[0]) != len(w)):
            out.append(torch.tensor(run))
            run = []
        run.append(list(w))
    if run:
        out.append(torch.tensor(run))
    return out


@torch.no_grad()
def _logits(model, windows, progress: bool, desc: str) -> list[torch.Tensor]:
    total = sum(len(w) for w in windows) * model.config.vocab_size
    keep = torch.float32 if total <= REF_FLOAT32_LIMIT else torch.float16
    out = []
    for w in tqdm(windows, desc=desc, unit="window", disable=not progress, file=sys.stderr):
        out.append(model(input_ids=torch.tensor([w], device=input_device(model))).logits[0].float().to("cpu", keep))
    return out


@torch.no_grad()
def _quality(model, windows, ref: list[torch.Tensor], progress: bool) -> dict:
    """Perplexity of both models, top-1 agreement, KL(ref||quant) and relative logit error over the windows."""
    nll = {"reference": 0.0, "quantized": 0.0}
    agree = positions = 0
    kl = diff2 = ref2 = 0.0
    for w, r in tqdm(list(zip(windows, ref)), desc="evaluate", unit="window", disable=not progress,
                     file=sys.stderr):
        ids = torch.tensor(w)
        q = model(input_ids=ids[None].to(input_device(model))).logits[0].float().cpu()
        r = r.float()
        for name, lg in (("reference", r), ("quantized", q)):
            nll[name] += torch.nn.functional.cross_entropy(lg[:-1], ids[1:], reduction="sum").item()
        agree += int((q.argmax(-1) == r.argmax(-1)).sum())
        positions += len(w)
        lr, lq = torch.log_softmax(r, -1), torch.log_softmax(q, -1)
        kl += float((lr.exp() * (lr - lq)).sum())
        diff2 += float(((q - r) ** 2).sum())
        ref2 += float((r ** 2).sum())
    scored = sum(len(w) - 1 for w in windows)
    ppl = {k: math.exp(v / max(scored, 1)) for k, v in nll.items()}
    return {"perplexity_reference": round(ppl["reference"], 4), "perplexity_quantized": round(ppl["quantized"], 4),
            "perplexity_ratio": round(ppl["quantized"] / ppl["reference"], 5),
            "top1_agreement": round(agree / positions, 5), "kl_mean": round(kl / positions, 6),
            "logits_rel_error": round(math.sqrt(diff2 / max(ref2, 1e-30)), 5),
            "positions": positions, "scored_tokens": scored}


def quantizer_summary(model) -> dict:
    """Enabled quantizers by kind, and the amax range of each kind."""
    kinds: dict[str, list[float]] = {}
    for name, mod in model.named_modules():
        if not name.endswith("quantizer") or not getattr(mod, "is_enabled", False):
            continue
        amax = getattr(mod, "amax", None)
        kind = name.rsplit(".", 1)[-1]
        kinds.setdefault(kind, [])
        if amax is not None:
            kinds[kind].append(float(torch.as_tensor(amax).float().max()))
    return {k: {"count": len(v), "amax_min": round(min(v), 6) if v else None,
                "amax_max": round(max(v), 6) if v else None} for k, v in sorted(kinds.items())}


# ---------------------------------------------------------------------------------------------------- draft

def _quantize_draft(mtq, target, draft_dir, draft_out: Path, windows: TextWindows, cfg: CalibrateConfig,
                    progress: bool, force: bool) -> dict:
    """FP8 for the EAGLE head, calibrated on the (already quantized) target's features: the head sees at serving
    time what the quantized target gives it. Written as an FP8 head folder (official tensor names)."""
    from eaglex.models.eagle import load_draft
    from eaglex.models.target import ConcatCache

    device = target.embed_weight.device
    dtype = target.embed_weight.dtype
    head = load_draft(draft_dir, target).to(device=device, dtype=dtype)
    target = target.with_features(head.spec.kind, head.spec.taps)
    s = target.spec

    def empty_cache(layers, kv_heads, head_dim):
        return ConcatCache([(torch.zeros(1, kv_heads, 0, head_dim, dtype=dtype, device=device),) * 2
                            for _ in range(layers)])

    def forward_loop(h):
        for w in tqdm(windows.calibration, desc="calibrate draft", unit="window", disable=not progress,
                      file=sys.stderr):
            ids = torch.tensor([w], device=device)
            T = ids.shape[1]
            mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
            pos = torch.arange(T, device=device)[None]
            _, feats = target(ids, pos, mask, empty_cache(s.num_layers, s.num_kv_heads, s.head_dim))
            d = head.spec
            # draft position i reads the target's features at i and the token after it (runtime/drafter.py)
            out = h(feats[:, :-1], ids[:, 1:], pos[:, :-1], mask[..., :-1, :-1],
                    empty_cache(1, d.num_kv_heads, d.head_dim), project=True)
            h.log_probs(out)

    with torch.no_grad(), _stdout_to_stderr(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(head, copy.deepcopy(mtq.FP8_DEFAULT_CFG), forward_loop)
    summary = quantizer_summary(head)
    write_fp8_head(head, Path(draft_dir), draft_out, force)
    return {"source": str(Path(draft_dir).resolve()), "out": str(draft_out.resolve()), "quantizers": summary}


def write_fp8_head(head, src: Path, out: Path, force: bool) -> None:
    """ModelOpt's per-tensor FP8 layout for the head's quantized Linears (weight float8_e4m3fn, weight_scale,
    input_scale, all amax/448) and float tensors for the rest; config + hf_quant_config.json mark it FP8."""
    from safetensors.torch import save_file

    tensors, quantized, excluded = {}, [], []
    modules = dict(head.named_modules())
    for name, mod in modules.items():
        wq, iq = getattr(mod, "weight_quantizer", None), getattr(mod, "input_quantizer", None)
        if wq is None or not isinstance(getattr(mod, "weight", None), torch.Tensor):
            continue
        if not (wq.is_enabled and iq is not None and iq.is_enabled and iq.amax is not None):
            excluded.append(name)
            continue
        w_amax, x_amax = float(wq.amax.float().max()), float(iq.amax.float().max())
        w_scale, x_scale = w_amax / 448.0, x_amax / 448.0
        w = mod.weight.detach().float().cpu()
        tensors[f"{name}.weight"] = (w / w_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[f"{name}.weight_scale"] = torch.tensor(w_scale, dtype=torch.float32)
        tensors[f"{name}.input_scale"] = torch.tensor(x_scale, dtype=torch.float32)
        if getattr(mod, "bias", None) is not None:
            tensors[f"{name}.bias"] = mod.bias.detach().cpu().clone()
        quantized.append(name)
    for key, value in head.state_dict().items():
        if key.split(".")[-1] in ("_amax", "_pre_quant_scale") or "quantizer" in key:
            continue
        if key.rsplit(".", 1)[0] in quantized and key.endswith((".weight", ".bias")):
            continue
        tensors.setdefault(key, value.detach().cpu().clone().contiguous())
    cfg = json.loads((src / "config.json").read_text())
    cfg["torch_dtype"] = str(next(head.parameters()).dtype).removeprefix("torch.")   # what the float tensors are
    qc = {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": sorted(excluded)}
    cfg["quantization_config"] = {"quant_method": "modelopt", **qc}
    with staged(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "eaglex", "version": _versions().get("eaglex")}, "quantization": qc}, indent=2)
            + "\n")


# ---------------------------------------------------------------------------------------------------- misc

def _check_out(out: Path, force: bool) -> None:
    check_out(out, force, (REPORT, "hf_quant_config.json"), "a calibrated checkpoint")


@contextlib.contextmanager
def _stdout_to_stderr():
    """ModelOpt prints progress ("Inserted N quantizers") with print(); stdout is kept for eaglex's own result."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _versions() -> dict:
    from importlib import metadata
    out = {}
    for name in ("eaglex", "nvidia-modelopt", "torch", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def format_report(report: dict) -> str:
    """The lines `eaglex calibrate` prints."""
    q, d = report["quality"], report["data"]
    kinds = ", ".join(f"{v['count']} {k}" for k, v in report["quantizers"].items())
    lines = [f"calibrated {report['target']} -> {report['out']} ({report['config']['quant']}"
             f"{', fp8 KV cache' if report['config']['kv_cache'] else ''}; {kinds})",
             f"  data: {d['source']}; {d['calibration_windows']} windows / {d['calibration_tokens']} tokens "
             f"calibration, {d['evaluation_windows']} / {d['evaluation_tokens']} held out",
             f"  perplexity {q['perplexity_reference']:.3f} -> {q['perplexity_quantized']:.3f} "
             f"(x{q['perplexity_ratio']:.4f}), top-1 agreement {q['top1_agreement']:.2%}, "
             f"KL {q['kl_mean']:.2e}, logits rel. error {q['logits_rel_error']:.2e}"]
    if report.get("draft"):
        lines.append(f"  draft: {report['draft']['out']} (FP8)")
    mem = report.get("memory") or {}
    if report.get("placement"):
        peak = ""
        if mem.get("rss_peak_bytes"):
            extra = mem["rss_peak_bytes"] - mem["rss_baseline_bytes"]
            peak = (f"; peak RAM {extra / 1e9:.2f} GB above the start "
                    f"({extra / max(mem['weights_bytes'], 1):.2f} x the weights)")
        lines.append(f"  ran on {report['placement']}; checkpoint in {report.get('dtype')}{peak}")
    if "seconds" in report:
        lines.append(f"  done in {report['seconds']:.1f} s")
    return "\n".join(lines)
