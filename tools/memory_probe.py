"""Peak memory of an engine build, per phase: `python tools/memory_probe.py TARGET [DRAFT] OUT`.

Prints one JSON object: the weights' size, the baseline after imports, and for each phase (load, transpose, export,
torch reference, ORT check) the peak anonymous RSS (memory the process really holds) and the peak total RSS (which
also counts the page cache of the safetensors file that transformers maps, reclaimable by the kernel).

Measured on a 155.7M-parameter Llama (623 MB fp32, H=1024, 8 layers, V=32000), one build:
    anonymous: baseline + 1.02x the weights at peak (export 0.99x, ORT check 1.02x)
    total RSS: baseline + 2.03x (the extra ~1x is the mapped safetensors file, touched while transposing)
Before the fixes in export/onnx_export.py and engines/build.py the same build peaked at baseline + 7.4x total
(in-memory protobuf serialization, weights kept alive by onnxscript's rewrite rules, torch and ORT copies together).
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path


def _rss() -> tuple[int, int]:
    d = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon", "RssFile")):
                d[line.split(":")[0]] = int(line.split()[1]) * 1024
    return d["RssAnon"], d["RssAnon"] + d["RssFile"]


def probe(target_dir, draft_dir, out_dir) -> dict:
    import onnxruntime
    import torch  # noqa: F401 - imported before the baseline

    import eaglex.export.graphs as graphs
    import eaglex.export.layout as layout
    import eaglex.export.parity as parity
    import eaglex.models.target as target
    from eaglex.engines.build import build_engine

    state = {"phase": "baseline", "peaks": {}, "stop": False}

    def sample():
        while not state["stop"]:
            anon, total = _rss()
            p = state["peaks"].setdefault(state["phase"], [0, 0])
            p[0], p[1] = max(p[0], anon), max(p[1], total)
            time.sleep(0.002)

    def phase(mod, name, label):
        fn = getattr(mod, name)

        def wrapped(*a, **k):
            state["phase"] = label
            return fn(*a, **k)
        setattr(mod, name, wrapped)

    phase(target, "load_target", "load")
    phase(layout, "to_matmul_layout", "transpose")
    phase(graphs, "target_graph", "export")
    phase(parity, "reference_cases", "torch reference")
    phase(onnxruntime, "InferenceSession", "ort load")
    phase(parity, "compare", "ort check")
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    time.sleep(0.1)
    base_anon, base_total = _rss()
    t0 = time.perf_counter()
    build_engine(target_dir, draft_dir, out_dir, force=True, progress=False)
    seconds = time.perf_counter() - t0
    state["stop"] = True
    thread.join()
    weights = sum(f.stat().st_size for f in Path(target_dir).glob("*.safetensors"))
    if draft_dir is not None:
        weights += sum(f.stat().st_size for f in Path(draft_dir).iterdir() if f.suffix in (".safetensors", ".bin"))
    peaks = state["peaks"]
    peaks.pop("baseline", None)
    return {"weights_bytes": weights, "baseline_anon": base_anon, "baseline_total": base_total,
            "seconds": round(seconds, 1),
            "phases": {k: {"anon_x_weights": round((a - base_anon) / weights, 3),
                           "total_x_weights": round((t - base_total) / weights, 3)} for k, (a, t) in peaks.items()},
            "peak_anon_x_weights": round((max(a for a, _ in peaks.values()) - base_anon) / weights, 3),
            "peak_total_x_weights": round((max(t for _, t in peaks.values()) - base_total) / weights, 3)}


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) not in (2, 3):
        sys.exit("usage: python tools/memory_probe.py TARGET [DRAFT] OUT")
    target_dir, out = args[0], args[-1]
    draft = args[1] if len(args) == 3 else None
    print(json.dumps(probe(target_dir, draft, out), indent=2))
