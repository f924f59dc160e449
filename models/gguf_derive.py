"""GGUF files derived from a GGUF file: the same weights re-encoded as F32 or Q8_0, for llama.cpp.

Every metadata field is copied; `general.file_type` names the new encoding. Tensors are dequantized with the
`gguf` package (what transformers uses when it converts a GGUF file, so an F32 file holds exactly the weights of
the converted Hugging Face folder, in llama.cpp's layout). Q8_0 follows llama.cpp's `--type q8_0` rules: matrices
become Q8_0 (tensors already in Q8_0 are copied byte for byte), 1-D tensors (norms) and matrices whose rows are not
a whole number of 32-value blocks stay F32.

Derived files are cached, keyed by the source file's sha256 and the encoding, and written atomically.
"""
from __future__ import annotations

import os
from pathlib import Path

from eaglex.base.errors import ModelError

from .gguf import _one_line, file_sha256, inspect_gguf

ENCODINGS = ("F32", "Q8_0")


def _plan(reader, encoding: str):
    """(name, numpy shape, output type, output bytes, source tensor) per tensor, in the source's order."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    out = []
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))    # the reader lists ggml's ne0 first
        qtype = Q.F32
        if encoding == "Q8_0" and len(shape) >= 2 and shape[-1] % GGML_QUANT_SIZES[Q.Q8_0][0] == 0:
            qtype = Q.Q8_0
        nbytes = int(np.prod(shape)) * 4 if qtype == Q.F32 else \
            int(np.prod(shape)) // GGML_QUANT_SIZES[Q.Q8_0][0] * GGML_QUANT_SIZES[Q.Q8_0][1]
        out.append((t.name, shape, qtype, nbytes, t))
    return out


def _data(t, qtype, shape):
    """The bytes (uint8, rows x row bytes) or floats of one tensor in `qtype`."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    if qtype == t.tensor_type:                        # already in the wanted encoding: no round trip
        return np.asarray(t.data) if qtype != Q.F32 else np.asarray(t.data, dtype=np.float32).reshape(shape)
    floats = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32, copy=False).reshape(shape)
    return floats if qtype == Q.F32 else quantize(floats, qtype)


def write_gguf_as(src: str | os.PathLike, out: str | os.PathLike, encoding: str) -> Path:
    """Write the weights of the GGUF file `src` as `encoding` ("F32" or "Q8_0") into the GGUF file `out`, with
    every metadata field of `src` (general.file_type updated). Tensors are converted one at a time, so memory stays
    near one tensor. `out` appears complete or not at all (a temporary sibling, renamed)."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, Keys, LlamaFileType

    if encoding not in ENCODINGS:
        raise ModelError(f"GGUF encoding {encoding!r} is not written here; choose one of {', '.join(ENCODINGS)}")
    src, out = Path(src), Path(out)
    inspect_gguf(src)
    reader = GGUFReader(src)
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    file_type = LlamaFileType.ALL_F32 if encoding == "F32" else LlamaFileType.MOSTLY_Q8_0
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(tmp, arch)
    try:
        for field in reader.fields.values():
            # GGUF.* are the reader's view of the header; the writer writes the architecture itself
            if field.name.startswith("GGUF.") or field.name == Keys.General.ARCHITECTURE:
                continue
            vtype = field.types[0]
            sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
            value = int(file_type) if field.name == Keys.General.FILE_TYPE else field.contents()
            writer.add_key_value(field.name, value, vtype, sub_type=sub)
        if Keys.General.FILE_TYPE not in reader.fields:
            writer.add_file_type(int(file_type))
        if Keys.General.ALIGNMENT in reader.fields:
            writer.data_alignment = int(reader.fields[Keys.General.ALIGNMENT].contents())
        plan = _plan(reader, encoding)
        for name, shape, qtype, nbytes, _ in plan:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, shape, qtype, nbytes, t in plan:
            data = _data(t, qtype, shape)
            if data.nbytes != nbytes:
                raise ModelError(f"{src}: tensor {name} converts to {data.nbytes} bytes, expected {nbytes}")
            writer.write_tensor_data(data)
        writer.close()
        os.replace(tmp, out)
    except ModelError:
        raise
    except Exception as e:   # numpy/struct errors on odd files, OSError on a full disk: one line
        raise ModelError(f"cannot write {out} as {encoding} from {src} ({_one_line(e)})") from None
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return out


def derived_gguf(src: str | os.PathLike, encoding: str, cache_dir: str | os.PathLike,
                 sha256: str | None = None) -> Path:
    """The file `write_gguf_as(src, ..., encoding)` writes, kept in `cache_dir` under a name keyed by the sha256 of
    `src` (`sha256`, when the caller already hashed it) and the encoding: written once, then reused."""
    src = Path(src)
    key = (sha256 or file_sha256(src))[:16]
    path = Path(cache_dir) / f"{src.name.split('.')[0]}-{key}.{encoding}.gguf"
    if path.is_file():
        return path
    return write_gguf_as(src, path, encoding)
