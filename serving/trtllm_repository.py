"""`eaglex triton --backend tensorrt-llm`: a Triton model repository serving a TensorRT-LLM bundle through
TensorRT-LLM's own Python-backend model (the "llmapi" model, triton_backend/all_models/llmapi/tensorrt_llm).

    REPO/
      <name>/                 (default name: tensorrt_llm)
        config.pbtxt          copied from the llmapi template when one is found (see below)
        1/
          model.yaml          the bundle's LLM-API options with absolute paths: model (BUNDLE/target),
                              speculative_config.speculative_model (BUNDLE/draft), plus triton_config
                              {max_batch_size, decoupled}
          model.py, helpers.py  copied from the template when one is found
      README.eaglex.txt       what is here, what to copy where, how to start it

TensorRT-LLM's llmapi model reads model.yaml from its version folder, takes `triton_config` for Triton and passes
every other key to `tensorrt_llm.LLM` (trtllm_upstream.LLMAPI_*). model.py and config.pbtxt belong to TensorRT-LLM
and ship in its Triton containers (/app/all_models/llmapi/tensorrt_llm); eaglex does not carry a copy. Pass
`template=` (or run where that folder exists) to have them copied in; otherwise the repository holds model.yaml and
the README says which two files to copy. `validate_llmapi_repository` checks model.yaml like the bundle's options
(same upstream field lists), plus that its paths point at a valid bundle.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from eaglex.base.errors import ModelError
from eaglex.base.fsio import check_out, staged
from eaglex.engines import trtllm
from eaglex.engines import trtllm_upstream as upstream

DEFAULT_NAME = "tensorrt_llm"
CONTAINER_TEMPLATE = Path("/app/all_models/llmapi/tensorrt_llm")
README = "README.eaglex.txt"
TEMPLATE_FILES = ("config.pbtxt", "1/model.py", "1/helpers.py")


def llmapi_model_yaml(bundle, max_batch_size: int = 0, decoupled: bool = False) -> dict:
    """model.yaml for a validated bundle: its options with absolute paths, plus triton_config."""
    bundle = Path(bundle).resolve()
    m = trtllm.validate_bundle(bundle)
    opts = dict(m["llm_api_options"])
    spec = dict(opts["speculative_config"])
    spec["speculative_model"] = str((bundle / spec["speculative_model"]).resolve())
    out = {"model": str((bundle / m["target"]["path"]).resolve())}
    out.update({k: v for k, v in opts.items() if k != "speculative_config"})
    out["speculative_config"] = spec
    if max_batch_size < 0:
        raise ModelError("--max-batch-size must be >= 0 (0: Triton does not batch; the LLM batches in flight)")
    out["triton_config"] = {"max_batch_size": int(max_batch_size), "decoupled": bool(decoupled)}
    return out


def write_llmapi_repository(bundle, out, name: str = DEFAULT_NAME, template=None, max_batch_size: int = 0,
                            decoupled: bool = False, force: bool = False) -> Path:
    """Write the repository `out` for `bundle`; returns the model folder. `template`: a copy of TensorRT-LLM's
    llmapi model folder (config.pbtxt, 1/model.py, 1/helpers.py); default: the container's, when present."""
    import yaml

    out = Path(out)
    if not name or "/" in name or name.startswith("."):
        raise ModelError(f"--name {name!r}: a plain folder name")
    model_yaml = llmapi_model_yaml(bundle, max_batch_size, decoupled)
    template = Path(template) if template is not None else (CONTAINER_TEMPLATE if CONTAINER_TEMPLATE.is_dir() else None)
    if template is not None:
        missing = [f for f in TEMPLATE_FILES if not (template / f).is_file()]
        if missing:
            raise ModelError(f"{template} is not TensorRT-LLM's llmapi model folder (missing {', '.join(missing)})")
    check_out(out, force, (README,), "a Triton repository written by eaglex")
    with staged(out) as tmp:
        model = tmp / name
        (model / "1").mkdir(parents=True)
        header = (f"# eaglex: TensorRT-LLM llmapi model for bundle {Path(bundle).resolve()}\n"
                  "# Keys other than triton_config are passed to tensorrt_llm.LLM(**kwargs).\n")
        (model / "1" / upstream.LLMAPI_MODEL_YAML).write_text(
            header + yaml.safe_dump(model_yaml, sort_keys=False, default_flow_style=None))
        if template is not None:
            for f in TEMPLATE_FILES:
                shutil.copy2(template / f, model / f)
            if name != DEFAULT_NAME:
                _rename_model(model / "config.pbtxt", name)
        (tmp / README).write_text(_readme(name, bundle, template))
        validate_llmapi_repository(tmp, name)
    return out / name


def _rename_model(pbtxt: Path, name: str) -> None:
    import re
    text = pbtxt.read_text()
    text, n = re.subn(r'(?m)^name:\s*"[^"]*"', f'name: "{name}"', text, count=1)
    pbtxt.write_text(text if n else f'name: "{name}"\n' + text)


def _readme(name: str, bundle, template) -> str:
    have = ("config.pbtxt, 1/model.py and 1/helpers.py were copied from " + str(template)) if template else (
        "Copy TensorRT-LLM's llmapi model files in first (they ship in its Triton containers):\n"
        f"    cp {CONTAINER_TEMPLATE}/config.pbtxt {name}/\n"
        f"    cp {CONTAINER_TEMPLATE}/1/model.py {CONTAINER_TEMPLATE}/1/helpers.py {name}/1/\n"
        + (f"  and set name: \"{name}\" in {name}/config.pbtxt.\n" if name != DEFAULT_NAME else ""))
    return (f"Triton model repository for the TensorRT-LLM bundle {Path(bundle).resolve()} (EAGLE-3 on TensorRT-LLM's "
            f"PyTorch backend,\nTensorRT-LLM >= {trtllm.MIN_TRTLLM}).\n\n"
            f"{name}/1/model.yaml holds the bundle's LLM-API options with absolute paths; keep the bundle where it is.\n"
            f"{have}\n\n"
            "Start (inside a TensorRT-LLM Triton container, e.g. nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3):\n"
            "    python3 /app/scripts/launch_triton_server.py --model_repo=$PWD\n"
            f"Query:\n    curl -X POST localhost:8000/v2/models/{name}/generate "
            "-d '{\"text_input\": \"Hello\", \"sampling_param_max_tokens\": 64}'\n")


def llmapi_problems(repo, name: str = DEFAULT_NAME) -> list[str]:
    """Problems of a repository written above: model.yaml readable, its LLM keys accepted by the recorded
    TensorRT-LLM versions, triton_config as the llmapi model reads it, paths pointing at a valid bundle whose
    options match."""
    import yaml

    folder = Path(repo) / name
    path = folder / "1" / upstream.LLMAPI_MODEL_YAML
    if not path.is_file():
        return [f"{path}: missing"]
    try:
        y = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        return [f"{path}: not YAML ({str(e).splitlines()[0]})"]
    probs = []
    tc = y.get("triton_config")
    if not isinstance(tc, dict):
        probs.append("model.yaml: triton_config missing (the llmapi model reads max_batch_size and decoupled from it)")
    else:
        probs += [f"model.yaml: triton_config.{k} missing" for k in upstream.LLMAPI_TRITON_REQUIRED if k not in tc]
        probs += [f"model.yaml: triton_config.{k} is not read by the llmapi model" for k in tc
                  if k not in upstream.LLMAPI_TRITON_KEYS]
        if not isinstance(tc.get("max_batch_size", 0), int) or isinstance(tc.get("decoupled", False), str):
            probs.append("model.yaml: triton_config.max_batch_size must be an integer, decoupled a boolean")
    llm = {k: v for k, v in y.items() if k not in ("triton_config", "model")}
    if "model" not in y:
        probs.append("model.yaml: model (the target folder) missing")
    probs += trtllm.upstream_problems(llm)
    spec = y.get("speculative_config") or {}
    target, draft = Path(str(y.get("model", ""))), Path(str(spec.get("speculative_model", "")))
    if not target.is_absolute() or not draft.is_absolute():
        probs.append("model.yaml: model and speculative_model must be absolute paths (Triton runs elsewhere)")
        return probs
    bundle = target.parent
    try:
        m = trtllm.validate_bundle(bundle)
    except ModelError as e:
        return probs + [f"model.yaml: model is not in a valid bundle ({e})"]
    if target != (bundle / m["target"]["path"]).resolve() or draft != (bundle / trtllm.DRAFT).resolve():
        probs.append("model.yaml: model / speculative_model are not the bundle's target and draft folders")
    want = dict(m["llm_api_options"])
    want["speculative_config"] = dict(want["speculative_config"], speculative_model=str(draft))
    if llm != want:
        probs.append("model.yaml: LLM options differ from the bundle's llm_api_options")
    pbtxt = folder / "config.pbtxt"
    if pbtxt.is_file():
        text = pbtxt.read_text()
        if 'backend: "python"' not in text.replace("'", '"'):
            probs.append("config.pbtxt: the llmapi model runs on the python backend")
        if f'name: "{name}"' not in text and "name:" in text:
            probs.append(f"config.pbtxt: name is not {name!r}")
    return probs


def validate_llmapi_repository(repo, name: str = DEFAULT_NAME) -> None:
    probs = llmapi_problems(repo, name)
    if probs:
        raise ModelError(f"Triton repository {repo} is invalid: " + "; ".join(probs[:6])
                         + (f" (+{len(probs) - 6} more)" if len(probs) > 6 else ""))
