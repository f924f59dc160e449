"""Reading ModelOpt's unified Hugging Face FP8 checkpoint (what `eaglex calibrate` writes) without ModelOpt.

Layout (ModelOpt's export_hf_checkpoint), per quantized Linear `<m>`:
    <m>.weight        float8_e4m3fn [out, in]      = round(W / weight_scale)
    <m>.weight_scale  float32 scalar               = weight amax / 448
    <m>.input_scale   float32 scalar               = calibrated input amax / 448
    <m>.k_scale, <m>.v_scale (on k_proj / v_proj)   FP8 KV cache, when calibrated
plus `hf_quant_config.json` {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": ..., "exclude_modules"}}.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eaglex.base.errors import ModelError

QUANT_CONFIG = "hf_quant_config.json"


@dataclass(frozen=True)
class Fp8Scales:
    """Calibrated FP8 scales of one Linear (both amax / 448) and its FP8 weight bits as stored. The same fields as
    export.quant_graphs.Fp8Scales, which reads them by name (calibration does not import export)."""
    weight_scale: float
    input_scale: float
    weight_fp8: np.ndarray | None = None     # uint8 bit patterns of float8_e4m3fn, [out, in] as in the checkpoint


def quant_config(folder: str | Path) -> dict:
    """The `quantization` section of hf_quant_config.json; {} when the folder is not a ModelOpt checkpoint."""
    path = Path(folder) / QUANT_CONFIG
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text()).get("quantization") or {}
    except json.JSONDecodeError as e:
        raise ModelError(f"{path} is not valid JSON ({e})") from None


def read_fp8_scales(folder: str | Path, prefix_map: dict[str, str] | None = None) -> dict[str, Fp8Scales]:
    """{module: Fp8Scales} of every FP8 Linear in a ModelOpt checkpoint folder.

    `prefix_map` renames module prefixes (e.g. {"layers.0.": "midlayer."} for a ModelOpt-named EAGLE-3 head).
    """
    import torch
    from safetensors import safe_open

    folder = Path(folder)
    if not folder.is_dir():
        raise ModelError(f"calibrated checkpoint {folder} does not exist: write it with `eaglex calibrate`")
    qc = quant_config(folder)
    if qc.get("quant_algo") != "FP8":
        raise ModelError(f"{folder} is not an FP8 checkpoint from `eaglex calibrate` (hf_quant_config.json "
                         f"quant_algo: {qc.get('quant_algo')!r})")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"calibrated checkpoint {folder} holds no *.safetensors")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                if k.endswith((".weight_scale", ".input_scale")) or (
                        k.endswith(".weight") and st.get_slice(k).get_dtype() == "F8_E4M3"):
                    tensors[k] = st.get_tensor(k)
    out = {}
    for key, ws in tensors.items():
        if not key.endswith(".weight_scale"):
            continue
        mod = key[: -len(".weight_scale")]
        w, xs = tensors.get(mod + ".weight"), tensors.get(mod + ".input_scale")
        if w is None or w.dtype != torch.float8_e4m3fn or xs is None or ws.numel() != 1 or xs.numel() != 1:
            raise ModelError(f"{folder}: {mod} is not a per-tensor FP8 Linear (weight {getattr(w, 'dtype', None)}, "
                             f"input_scale {'present' if xs is not None else 'missing'}); eaglex reads FP8 "
                             "per-tensor checkpoints (FP8_DEFAULT_CFG)")
        for old, new in (prefix_map or {}).items():
            if mod.startswith(old):
                mod = new + mod[len(old):]
        out[mod] = Fp8Scales(float(ws), float(xs), w.view(torch.uint8).numpy().astype(np.uint8, copy=False))
    if not out:
        raise ModelError(f"{folder} holds no FP8 weight scales")
    return out
