"""Named presets for `make engine MODEL=...`: which target and which EAGLE head, where their weights come from.

Weights are looked up in this order: an explicit folder (MODEL_DIR / DRAFT_DIR), the local Hugging Face cache,
then a download with huggingface_hub (skipped when HF_HUB_OFFLINE=1). The embedded default `tiny` lives in the
repository (models/tiny) and needs none of that.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from eaglex.models.errors import ModelError

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_DIR = REPO_ROOT / "models" / "tiny"


@dataclass(frozen=True)
class Preset:
    name: str
    target_repo: str          # Hugging Face repository of the target, or a path under the repository for `tiny`
    draft_repo: str           # the official EAGLE head for it
    backend: str              # default backend
    hardware: str             # what it needs, said plainly in the README and in errors
    quant: str = "none"
    local: bool = False
    prompts: str | None = None  # check/demo prompts (a path under the repository); None: eaglex.prompts.BUILTIN_PROMPTS


PRESETS = {p.name: p for p in [
    Preset("tiny", "models/tiny/target", "models/tiny/eagle3", "onnxruntime",
           "any CPU; about 100 MB of RAM", local=True, prompts="models/tiny/prompts.jsonl"),
    Preset("llama3-8b", "meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "onnxruntime",
           "CPU: 40 GB RAM for the float32 export (16 GB of weights); GPU: one 24 GB card"),
    Preset("llama3-70b", "meta-llama/Llama-3.3-70B-Instruct", "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B",
           "tensorrt-llm", "NVIDIA GPUs: 2x H100/H200 80 GB with FP8 (tensor parallel), or 4x A100 80 GB in bf16",
           quant="fp8"),
    Preset("vicuna-13b", "lmsys/vicuna-13b-v1.3", "yuhuili/EAGLE3-Vicuna1.3-13B", "onnxruntime",
           "CPU: 64 GB RAM for the float32 export; GPU: one 40 GB card"),
    Preset("deepseek-r1-llama-8b", "deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
           "yuhuili/EAGLE3-DeepSeek-R1-Distill-LLaMA-8B", "onnxruntime",
           "CPU: 40 GB RAM for the float32 export; GPU: one 24 GB card"),
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


def preset_folders(preset: Preset, model_dir=None, draft_dir=None) -> tuple[Path, Path]:
    if preset.local:
        target = Path(model_dir) if model_dir else REPO_ROOT / preset.target_repo
        draft = Path(draft_dir) if draft_dir else REPO_ROOT / preset.draft_repo
        if not (target / "config.json").is_file():
            raise ModelError(f"{target} is missing: run `make tiny` to regenerate the embedded default")
        return target, draft
    return (resolve_weights(preset.target_repo, model_dir, "target", "MODEL_DIR"),
            resolve_weights(preset.draft_repo, draft_dir, "EAGLE head", "DRAFT_DIR"))
