"""GGUF targets: convert a Llama-family GGUF file (llama.cpp's format) into a plain Hugging Face folder.

Transformers does the reading: it dequantizes every tensor, undoes llama.cpp's rotary permutation of the Q/K weights
and rebuilds the tokenizer (with its chat template) from the file's metadata. This module validates the file first so
that a wrong one fails with one clear line, writes the folder atomically (a hidden sibling, renamed when complete),
and keeps a cache of converted folders so that a `.gguf` path can stand wherever a target folder is expected.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from eaglex.base.errors import ModelError

GGUF_MAGIC = b"GGUF"
# GGUF `general.architecture` values converted here: llama.cpp writes Llama and Mistral models as "llama" (Q/K rows
# permuted for its rotary layout; transformers undoes that). Other families the target loader runs (Qwen2/3) are
# read by transformers too but untested here, so they are refused rather than trusted.
SUPPORTED_GGUF_ARCHS = ("llama",)
MARKER = "eaglex_gguf.json"          # written into every converted folder: where it came from
CACHE_ENV = "EAGLEX_CACHE_DIR"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def is_gguf_path(path: str | os.PathLike) -> bool:
    """Whether `path` names a GGUF file by its suffix (the file itself is checked by `inspect_gguf`)."""
    return str(path).lower().endswith(".gguf")


def inspect_gguf(path: str | os.PathLike) -> dict:
    """Validate a GGUF file for conversion; return its architecture, model name and tensor count.

    Raises ModelError (one line) for a missing path, a non-GGUF file, a truncated or corrupt one, an architecture
    the target loader does not run, or a file without the tokenizer a target folder needs.
    """
    path = Path(path)
    if not path.exists():
        raise ModelError(f"{path}: no such GGUF file")
    if not path.is_file():
        raise ModelError(f"{path}: not a file (a GGUF target is a single .gguf file)")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ModelError("reading a GGUF file needs the `gguf` package (pip install gguf)") from None
    try:
        reader = GGUFReader(path)
        fields = reader.fields

        def field(name):
            f = fields.get(name)
            return None if f is None else f.contents()

        arch = field("general.architecture")
        name = field("general.name") or path.stem
        tensors = [(t.name, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
        has_tokens = "tokenizer.ggml.tokens" in fields
    except ModelError:
        raise
    except Exception as e:  # the reader raises whatever numpy/struct raise on a damaged file
        raise ModelError(f"{path}: truncated or corrupt GGUF file ({_one_line(e)})") from None
    if not isinstance(arch, str):
        raise ModelError(f"{path}: corrupt GGUF file (no general.architecture field)")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ModelError(f"{path}: GGUF architecture '{arch}' is not supported; "
                         f"eaglex converts {', '.join(SUPPORTED_GGUF_ARCHS)}")
    if not tensors or "token_embd.weight" not in {t[0] for t in tensors}:
        raise ModelError(f"{path}: corrupt GGUF file (no token_embd.weight tensor)")
    end = max(off + n for _, off, n in tensors)
    if end > size:
        raise ModelError(f"{path}: truncated GGUF file ({size} bytes, its tensors need {end})")
    if not has_tokens:
        raise ModelError(f"{path}: the GGUF file holds no tokenizer (tokenizer.ggml.tokens)")
    return {"architecture": arch, "name": str(name), "tensors": len(tensors), "size": size}


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fix_special_tokens(tokenizer, path: Path) -> None:
    """Name the file's own BOS/EOS/PAD/UNK tokens (transformers' GGUF tokenizer swaps or guesses some of them)."""
    from gguf import GGUFReader
    reader = GGUFReader(path)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    n = len(tokens.data)
    for attr, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("pad_token", "padding_token_id"), ("unk_token", "unknown_token_id")):
        f = reader.fields.get(f"tokenizer.ggml.{key}")
        if f is None:
            continue
        i = int(f.contents())
        if 0 <= i < n:
            setattr(tokenizer, attr, tokens.contents(i))


def _convert_into(src: Path, stage: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    finally:
        hf_logging.set_verbosity(verbosity)
    _fix_special_tokens(tokenizer, src)
    # The GGUF loader asks for WordPiece-style clean-up, which drops spaces before punctuation on decode in a BPE
    # tokenizer; transformers then warns on every load. The original tokenizers do not clean up.
    tokenizer.clean_up_tokenization_spaces = False
    gen = model.generation_config
    if gen is not None and tokenizer.eos_token_id is not None and gen.eos_token_id is None:
        gen.eos_token_id = tokenizer.eos_token_id
    # Newer transformers mark a GGUF-loaded model as quantized and refuse to save it; its weights are plain
    # dequantized tensors, so it is saved as the unquantized model it now is.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
        model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(stage)
    tokenizer.save_pretrained(stage)


def convert_gguf(src: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Convert the GGUF file `src` into the Hugging Face folder `out` (fp32 safetensors, config, generation config,
    tokenizer with its chat template); return `out`.

    The folder appears complete or not at all: it is written into a hidden sibling and renamed. An existing `out`
    is an error unless `overwrite`. Every failure is a one-line ModelError.
    """
    src, out = Path(src), Path(out)
    info = inspect_gguf(src)
    if out.exists() and not overwrite:
        raise ModelError(f"{out} already exists (choose another folder or overwrite it)")
    stage = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(stage, ignore_errors=True)
        try:
            _convert_into(src, stage)
        except ImportError as e:
            raise ModelError(f"converting a GGUF file needs the `gguf` and `accelerate` packages ({_one_line(e)})") \
                from None
        except Exception as e:
            raise ModelError(f"{src}: cannot convert this GGUF file ({_one_line(e)})") from None
        st = src.stat()
        (stage / MARKER).write_text(json.dumps({
            "source": src.name, "architecture": info["architecture"], "name": info["name"],
            "size": st.st_size, "sha256": file_sha256(src)}, indent=1) + "\n")
        if out.exists():                                   # overwrite: swap the old folder out, then drop it
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.rename(out, old)
            os.rename(stage, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(stage, out)
    except OSError as e:
        raise ModelError(f"cannot write {out} ({_one_line(e)})") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out


def default_cache_dir() -> Path:
    """$EAGLEX_CACHE_DIR, else $XDG_CACHE_HOME/eaglex, else ~/.cache/eaglex."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "eaglex"


def cached_folder(src: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where `resolve_target` keeps the conversion of `src`: keyed by the file's absolute path, size and mtime."""
    src = Path(src)
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return Path(cache_dir or default_cache_dir()) / "gguf" / f"{src.stem}-{key}"


def resolve_target(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """A target folder for `path`: a `.gguf` file becomes its converted folder (converted once, then cached; a
    changed file converts again), anything else is returned unchanged."""
    path = Path(path)
    if not is_gguf_path(path):
        return path
    if not path.is_file():
        inspect_gguf(path)                                 # raises the one-line error for this path
    folder = cached_folder(path, cache_dir)
    if (folder / MARKER).is_file():
        return folder
    try:
        convert_gguf(path, folder, overwrite=folder.exists())
    except ModelError:
        if (folder / MARKER).is_file():                    # another process finished the same conversion first
            return folder
        raise
    return folder
