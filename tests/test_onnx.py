"""ONNX engines: export parity, ORT speculative == ORT vanilla == torch vanilla, and clear errors for bad engines.

Two engines are built once per session from the shared fixtures: Llama + EAGLE-3 (draft vocabulary 40 of 48, so d2t
is exercised; draft_fc + draft graphs) and Qwen2 + EAGLE-1 (qkv biases, tied embeddings; one draft graph).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from eaglex.base.errors import ModelError
from eaglex.cli import main
from eaglex.engines.build import build_engine
from eaglex.runtime import cost as cost_mod
from eaglex.runtime import kernels as library
from eaglex.runtime.backend import ONE
from eaglex.runtime.cost import CostCurve, cost_curve
from eaglex.runtime.generate import SpeculativeGenerator, VanillaGenerator
from eaglex.runtime.manifest import FORMAT_VERSION, MANIFEST, read_manifest, write_manifest
from eaglex.runtime.ort_backend import OrtBackend
from eaglex.runtime.torch_backend import TorchBackend
from eaglex.runtime.types import TreeConfig

MAX_NEW = 40
# every kernel eaglex has (TreeAttention included) where the library is built, else stock ops
ALL_KERNELS = "eaglex" if library.available() else "stock"
ENGINES = {   # engine -> (target, head, tree the loop drafts with, tau floor, kernels)
    "llama-eagle3": ("llama", "eagle3", TreeConfig.parse("dynamic:60/8/10"), 2.0, ALL_KERNELS),
    "qwen2-eagle1": ("qwen2", "eagle1", TreeConfig("static"), 1.5, "stock"),
}


@pytest.fixture(scope="session")
def engines(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    out = {}
    for name, (target, head, _, _, kernels) in ENGINES.items():
        build_engine(models[target], models[f"{target}/{head}"], root / name, progress=False, kernels=kernels)
        out[name] = root / name
    return out


@pytest.mark.parametrize("name", ENGINES)
def test_export_parity_and_structure(name, engines):
    m = read_manifest(engines[name])
    layers = m["target"]["spec"]["num_layers"]
    fused = "TreeAttention" in m["graphs"]["target"]["ops"]          # built on eaglex's kernels
    for graph, n in (("target", layers), ("draft", 1)):
        ops = m["graphs"][graph]["ops"]
        if fused:
            assert ops["TreeAttention"] == n and not {"Attention", "FusedMatMul", "ScatterND"} & set(ops)
        else:
            assert "Attention" not in ops and ops["FusedMatMul"] == 3 * n and ops["ScatterND"] == 2 * n
        assert ops["RotaryEmbedding"] == 2 * n
    assert m["graphs"]["target"]["ops"]["SkipSimplifiedLayerNormalization"] == 2 * layers
    assert {"LogSoftmax", "TopK"} <= set(m["graphs"]["draft"]["ops"])
    assert ("draft_fc" in m["graphs"]) == (m["draft"]["kind"] == "eagle3")
    for graph, report in m["parity"].items():
        assert report["cases"] >= 1 and report["worst"] < 1e-4, (graph, report)
    # Each present_* is its past_* buffer with the new rows written in (in place when bound to it), nothing else
    # reads a past, and the attention reads the keys/values from that buffer as they lie: no copy of the cache, no
    # repeat_kv. Stock ops: ScatterND writes, FusedMatMul (transBatchB) reads; kernels: one TreeAttention does both,
    # fed the projections (or their rotary) in their own layout.
    for graph in ("target", "draft"):
        g = onnx.load(str(engines[name] / f"{graph}.onnx")).graph
        producer = {o: n for n in g.node for o in n.output}
        pasts = [i.name for i in g.input if i.name.startswith("past_")]
        assert len(pasts) == 2 * (layers if graph == "target" else 1)
        for past in pasts:
            present = "present_" + past[len("past_"):]
            if fused:
                node = producer[present]
                assert node.op_type == "TreeAttention" and past in node.input[3:5]
                assert {n.op_type for n in g.node if past in n.input} <= {"TreeAttention", "Shape"}
                assert not [n for n in g.node if present in n.input]
                assert {producer[i].op_type for i in node.input[:3]} <= {"RotaryEmbedding", "Split", "LinearF32"}
                continue
            assert producer[present].op_type == "ScatterND" and producer[present].input[0] == past
            assert {n.op_type for n in g.node if past in n.input} <= {"ScatterND", "Shape"}
            readers = [n for n in g.node if present in n.input and n.op_type != "Reshape"]
            readers += [n for r in g.node if r.op_type == "Reshape" and r.input[0] == present
                        for n in g.node if r.output[0] in n.input]
            assert readers and all(n.op_type == "FusedMatMul" and
                                   {a.name: a.i for a in n.attribute}.get("transBatchB") == 1 for n in readers)
            # the new rows reach the buffer through one layout copy: Transpose(Reshape(projection or its rotary))
            rows = producer[producer[present].input[2]]
            assert rows.op_type == "Transpose" and producer[rows.input[0]].op_type == "Reshape", present


def test_head_layouts_keep_every_number(models, tmp_path, monkeypatch):
    """export/fuse.py's fuse_head_transposes moves copies only: the graphs built with and without it give the same
    bits for every output, at one row and at many rows, batched, with a past, and two Transposes fewer a layer."""
    import onnxruntime as ort

    import eaglex.export.onnx_export as ox
    from eaglex.runtime.ort_session import session_options
    build_engine(models["llama"], models["llama/eagle3"], tmp_path / "with", progress=False, kernels="stock")
    monkeypatch.setattr(ox, "fuse_head_transposes", lambda model, kv_heads: 0)
    build_engine(models["llama"], models["llama/eagle3"], tmp_path / "without", progress=False, kernels="stock")
    layers = read_manifest(tmp_path / "with")["target"]["spec"]["num_layers"]
    ops = [read_manifest(tmp_path / e)["graphs"]["target"]["ops"]["Transpose"] for e in ("with", "without")]
    assert ops[1] - ops[0] == 2 * layers
    a, b = (ort.InferenceSession(str(tmp_path / e / "target.onnx"), session_options(),
                                 providers=["CPUExecutionProvider"]) for e in ("with", "without"))
    rng = np.random.default_rng(0)
    pasts = [i for i in a.get_inputs() if i.name.startswith("past_")]
    for B, N, P in ((1, 1, 7), (2, 5, 0), (3, 4, 9)):
        feeds = {"input_ids": rng.integers(0, 40, (B, N)), "position_ids": np.tile(np.arange(P, P + N), (B, 1)),
                 "attn_mask": np.tril(np.ones((N, P + N), bool), P)[None, None].repeat(B, 0),
                 "logits_rows": np.arange(N)}
        feeds |= {i.name: rng.standard_normal((P + N, B, *i.shape[2:])).astype(np.float32) for i in pasts}
        for x, y in zip(a.run(None, feeds), b.run(None, feeds)):
            assert np.array_equal(x, y), (B, N, P)


@pytest.mark.parametrize("name", ENGINES)
def test_ort_speculative_matches_vanilla_and_torch(name, engines, models, prompts):
    target, head, tree, floor, _ = ENGINES[name]
    ort_backend, torch_backend = OrtBackend(engines[name]), TorchBackend(models[target])
    assert ort_backend.draft_kind == head and ort_backend.spec == torch_backend.spec
    torch_vanilla = VanillaGenerator(torch_backend)
    ort_vanilla, ort_spec = VanillaGenerator(ort_backend), SpeculativeGenerator(ort_backend, tree)
    taus = []
    for p in prompts:
        want = torch_vanilla.generate(p, MAX_NEW).output_ids
        assert ort_vanilla.generate(p, MAX_NEW).output_ids == want, p
        r = ort_spec.generate(p, MAX_NEW)
        assert r.output_ids == want, p
        taus.append(r.tau)
    assert sum(taus) / len(taus) > floor


@pytest.mark.parametrize("name,tree", [("llama-eagle3", "cost:6/4"), ("qwen2-eagle1", "cost:5/3")])
def test_ort_cost_tree_matches_vanilla(name, tree, engines, prompts, tmp_path, monkeypatch):
    """A cost tree on ONNX Runtime decodes vanilla's tokens, sized by the curve measured on first use, and by the
    one tuning stored in the manifest (nothing is measured then)."""
    tree = TreeConfig.parse(tree)
    backend = OrtBackend(engines[name])
    vanilla = VanillaGenerator(backend)
    want = [vanilla.generate(p, MAX_NEW).output_ids for p in prompts]
    assert [SpeculativeGenerator(backend, tree).generate(p, MAX_NEW).output_ids for p in prompts] == want
    stored = CostCurve(((1, 10.0), (64, 640.0)), ((1, 1.0), (64, 1.0)), 256)
    folder = tmp_path / name
    shutil.copytree(engines[name], folder)
    m = read_manifest(folder)
    m["tuning"] = {"cpu": "test", **stored.to_tuning()}
    write_manifest(folder, m)
    monkeypatch.setattr(cost_mod, "measure_curve", lambda b: pytest.fail("the stored curve was not used"))
    backend = OrtBackend(folder)
    assert cost_curve(backend) == stored
    gen = SpeculativeGenerator(backend, tree)
    results = [gen.generate(p, MAX_NEW) for p in prompts]
    assert [r.output_ids for r in results] == want
    assert sum(r.tau for r in results) / len(results) > 1.5


def test_draft_steps_match_torch(engines, models):
    """Draft outputs (hidden, top-k log-probs, target ids) of both backends agree step by step, commits included."""
    ob = OrtBackend(engines["llama-eagle3"])
    tb = TorchBackend(models["llama"], models["llama/eagle3"])
    g = torch.Generator().manual_seed(0)
    for b in (ob, tb):
        b.reset(64)
    ids = torch.randint(0, 48, (1, 9), generator=g)
    outs = [b.target_forward(ONE, ids, torch.arange(9)[None], None) for b in (ob, tb)]
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-4) and torch.allclose(outs[0][1], outs[1][1], atol=1e-4)
    feats = outs[1][1]
    steps = [(feats[:, :8], ids[:, 1:], torch.arange(8)[None], None, True),
             (torch.randn(1, 3, 96, generator=g), torch.tensor([[5, 6, 7]]), torch.full((1, 3), 8),
              torch.tensor([[[True, False, False], [True, True, False], [True, False, True]]]), False)]
    for i, (h, t, pos, mask, project) in enumerate(steps):
        res = [b.draft_forward(ONE, h, t, pos, mask, project, 4) for b in (ob, tb)]
        assert torch.allclose(res[0][0], res[1][0], atol=1e-4)
        assert torch.allclose(res[0][1], res[1][1], atol=1e-4)
        assert torch.equal(res[0][2], res[1][2])
        if i == 0:
            for b in (ob, tb):
                b.draft_commit(0, torch.arange(8))
    for b in (ob, tb):
        b.draft_rollback(ONE)


def test_tree_commits_move_rows_losslessly(engines, prompts, monkeypatch):
    """Accepted tree paths are moved into place in the KV buffers (chains and wide trees both take that path) and
    the output stays the vanilla output."""
    b = OrtBackend(engines["llama-eagle3"])
    moves = {"rows": 0}
    commit = b.tcache.commit

    def spy_commit(slot, keep):
        if keep.shape[0] and not torch.equal(keep, torch.arange(keep.shape[0])):
            moves["rows"] += int(keep.shape[0])
        commit(slot, keep)
    monkeypatch.setattr(b.tcache, "commit", spy_commit)
    vanilla = VanillaGenerator(b)
    for tree in (TreeConfig.chain(4), TreeConfig.parse("dynamic:60/8/10")):
        spec = SpeculativeGenerator(b, tree)
        for p in prompts[:8]:
            assert spec.generate(p, MAX_NEW).output_ids == vanilla.generate(p, MAX_NEW).output_ids, (tree, p)
    assert moves["rows"] > 0


def test_moved_rows_equal_rows_computed_in_place(engines):
    """After a partial prefill commit and a path through a tree, the cache holds the context's rows bit for bit as
    a prefill of that context computes them, and the next verification gives the same logits and features."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 48, (1, 12), generator=g)
    tree = torch.randint(0, 48, (1, 5), generator=g)
    mask = torch.tensor([[[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]],
                        dtype=torch.bool)
    moved, direct = OrtBackend(engines["llama-eagle3"]), OrtBackend(engines["llama-eagle3"])
    for b in (moved, direct):
        b.reset(64)
    moved.target_forward(ONE, ids, torch.arange(12)[None], None)
    moved.target_commit(0, torch.tensor([0, 1, 2, 3, 4, 5, 6]))           # 7 of 12 prefill rows: a prefix
    moved.target_forward(ONE, tree, torch.tensor([[7, 8, 8, 9, 9]]), mask)
    moved.target_commit(0, torch.tensor([0, 2, 4]))                         # a path through the tree
    context = torch.cat([ids[:, :7], tree[:, [0, 2, 4]]], 1)
    direct.target_forward(ONE, context, torch.arange(10)[None], None)
    direct.target_commit(0, torch.arange(10))
    assert moved.tcache.length == direct.tcache.length == [10]
    assert np.array_equal(moved.tcache.kv[:, :10], direct.tcache.kv[:, :10])
    out = [b.target_forward(ONE, tree, torch.tensor([[10, 11, 11, 12, 12]]), mask) for b in (moved, direct)]
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def _copy(engines, tmp_path, name="llama-eagle3"):
    dst = tmp_path / name
    shutil.copytree(engines[name], dst)
    return dst


def _edit_manifest(folder, fn):
    m = json.loads((folder / MANIFEST).read_text())
    fn(m)
    (folder / MANIFEST).write_text(json.dumps(m))


def test_missing_file(engines, tmp_path):
    e = _copy(engines, tmp_path)
    (e / "draft.onnx").unlink()
    with pytest.raises(ModelError, match=r"is missing draft\.onnx: rebuild"):
        OrtBackend(e)


def test_corrupt_file(engines, tmp_path):
    e = _copy(engines, tmp_path)
    data = bytearray((e / "target.onnx").read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)        # same size: only the hash can tell
    (e / "target.onnx").write_bytes(bytes(data))
    with pytest.raises(ModelError, match=r"target\.onnx is corrupt or comes from another engine"):
        OrtBackend(e)
    (e / "target.onnx").write_bytes(bytes(data[:1000]))          # truncated
    with pytest.raises(ModelError, match=r"target\.onnx is corrupt \(1000 bytes"):
        OrtBackend(e)
    (e / MANIFEST).write_text("{not json")
    with pytest.raises(ModelError, match="manifest.json is corrupt"):
        OrtBackend(e)


def test_truncated_graph_too_big_to_hash(engines, tmp_path):
    """Above the hash limit only sizes are checked; a garbled graph still fails with one line when ORT loads it."""
    e = _copy(engines, tmp_path)
    data = (e / "draft.onnx").read_bytes()
    (e / "draft.onnx").write_bytes(b"\x00garbage" * (len(data) // 8) + b"\x00" * (len(data) % 8))
    with pytest.raises(ModelError, match=r"draft\.onnx cannot be loaded .*it is corrupt"):
        OrtBackend(e, hash_limit=0)


@pytest.mark.parametrize("version", [1, 99])     # 1: graphs that concatenate their KV cache (before in-place)
def test_other_format_version(engines, tmp_path, version):
    e = _copy(engines, tmp_path)
    _edit_manifest(e, lambda m: m.update(format_version=version))
    with pytest.raises(ModelError, match=rf"format version {version}, this eaglex reads version {FORMAT_VERSION}: "
                                         "rebuild"):
        OrtBackend(e)


def test_draft_from_another_engine(engines, tmp_path):
    """The draft graph of the Qwen2 engine copied into the Llama engine, with the file list updated too."""
    e = _copy(engines, tmp_path)
    shutil.copy(engines["qwen2-eagle1"] / "draft.onnx", e / "draft.onnx")
    with pytest.raises(ModelError, match=r"draft\.onnx is corrupt .*rebuild the engine"):
        OrtBackend(e)
    files = read_manifest(engines["qwen2-eagle1"])["files"]
    _edit_manifest(e, lambda m: m["files"].update({"draft.onnx": files["draft.onnx"]}))
    with pytest.raises(ModelError, match=r"draft\.onnx belongs to another engine"):
        OrtBackend(e)


def test_draft_does_not_match_target(engines, tmp_path):
    e = _copy(engines, tmp_path)
    _edit_manifest(e, lambda m: m["target"].update(feature_size=96))
    with pytest.raises(ModelError, match=r"the draft does not match the target \(the draft reads features of "
                                         r"width 288 but the target gives 96\)"):
        OrtBackend(e)
    with pytest.raises(ModelError, match="holds an eagle3 draft head, not eagle1"):
        OrtBackend(engines["llama-eagle3"], draft_kind="eagle1")


def test_build_input_errors(engines, models, tmp_path):
    with pytest.raises(ModelError, match="already exists: pass --force"):
        build_engine(models["llama"], models["llama/eagle3"], engines["llama-eagle3"])
    with pytest.raises(ModelError, match="backend 'tensorrt' cannot be built yet"):
        build_engine(models["llama"], None, tmp_path / "e", backend="tensorrt")
    with pytest.raises(ModelError, match="dtype 'bfloat16' is not available"):
        build_engine(models["llama"], None, tmp_path / "e", dtype="bfloat16")
    with pytest.raises(ModelError, match="does not exist"):
        build_engine(tmp_path / "nope", None, tmp_path / "e")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    with pytest.raises(ModelError, match="is not an engine folder: refusing to replace it"):
        build_engine(models["llama"], None, tmp_path / "notes", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]       # nothing half-built left behind


def test_failed_build_keeps_old_engine(engines, models, tmp_path, monkeypatch):
    import eaglex.engines.build as build

    e = _copy(engines, tmp_path)
    before = (e / MANIFEST).read_text()

    def boom(*args, **kwargs):
        (args[2] / "target.onnx").write_bytes(b"partial")
        raise ModelError("simulated export failure")
    monkeypatch.setattr(build, "_export", boom)
    with pytest.raises(ModelError, match="simulated"):
        build_engine(models["llama"], models["llama/eagle3"], e, force=True)
    assert (e / MANIFEST).read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama-eagle3"]


def test_cli_engine_generate_and_errors(engines, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [3, 4, 5]}\n{"input_ids": [7]}\n')
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--engine", str(engines["llama-eagle3"]), "--prompts", str(prompts),
                 "--max-new-tokens", "12", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(r["output_ids"] for r in rows)
    assert main(["build", "--target", str(tmp_path), "--out", str(engines["llama-eagle3"])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already exists: pass --force" in err[0]


def test_cli_bench_engine(engines, tmp_path, capsys):
    """`eaglex bench` on an engine: vanilla + chain + tree rows, identical outputs, a cost model measured in rounds
    between the prompts, decode-phase speedups next to the prediction, and the load average recorded. The JSON's
    folder need not exist yet (build/ on a fresh clone). --plot draws it (atomically: no temporary file left)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": list(range(i, i + 6))}) + "\n" for i in range(3)))
    out, png = tmp_path / "build" / "bench.json", tmp_path / "plots" / "bench.png"
    assert main(["bench", "--engine", str(engines["llama-eagle3"]), "--prompts", str(prompts), "--trees",
                 "chain:3,dynamic:8/5/3", "--max-new-tokens", "16", "--out", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and list(png.parent.iterdir()) == [png]
    d = json.loads(out.read_text())
    cm = d["cost_model"]["ort:llama-eagle3"]
    assert cm["rounds"] == 2 + 3 and set(cm["draft_ms"]) == {"1", "3", "10"}
    assert {"1", "4", "8"} <= set(cm["target_ms"]) and cm["draft_first_ms"] > 0     # chain:3 verifies 4 nodes
    rows = {r["tree"]: r for r in d["rows"]}
    assert set(rows) == {"-", "chain:3", "dynamic:8/5/3"}
    assert all(r["identical_to_vanilla"] for r in rows.values())
    for label in ("chain:3", "dynamic:8/5/3"):
        r = rows[label]
        assert r["decode_speedup"] > 0 and r["predicted_speedup"] > 0 and r["tau"] >= 1
        assert r["measured_over_predicted"] == pytest.approx(r["decode_speedup"] / r["predicted_speedup"], rel=1e-2)
    assert len(d["machine"]["load_average_at_start"]) == 3
    assert "decode" in capsys.readouterr().out


@pytest.mark.slow
def test_export_memory(tmp_path):
    """Building an engine for a 623 MB target holds at most 1.3x its weights (anonymous RSS over the baseline)."""
    import subprocess
    import sys

    make = (
        "import torch, sys\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,\n"
        "    num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,\n"
        "    tie_word_embeddings=False, eos_token_id=2, architectures=['LlamaForCausalLM'])\n"
        "torch.manual_seed(0)\n"
        "LlamaForCausalLM(cfg).save_pretrained(sys.argv[1], safe_serialization=True)\n")
    subprocess.run([sys.executable, "-c", make, str(tmp_path / "big")], check=True, capture_output=True)
    probe = Path(__file__).resolve().parent.parent / "tools" / "memory_probe.py"
    out = subprocess.run([sys.executable, str(probe), str(tmp_path / "big"),
                          str(tmp_path / "engine")], check=True, capture_output=True, text=True).stdout
    report = json.loads(out)
    assert report["peak_anon_x_weights"] <= 1.3, report
    assert (tmp_path / "engine" / "target.onnx.data").is_file()       # weights streamed to external data


def test_float32_parity_gets_a_float64_second_opinion(models, tmp_path, monkeypatch):
    """On deep targets torch's own float32 logits can be the inexact ones; a target that fails against them is judged
    against the same inputs in float64, and fails only if ORT is off from those too."""
    import eaglex.export.parity as parity
    from eaglex.base.errors import ModelError
    real = parity.reference_cases

    def skewed(only_float32):
        def cases(spec, *args, **kwargs):
            out = real(spec, *args, **kwargs)
            float32 = next(spec.module.parameters()).dtype == torch.float32
            for c in out:
                if "logits" in c.ref and (float32 or not only_float32):
                    c.ref["logits"] = c.ref["logits"] * (1 + 1e-3)
            return out
        return cases

    monkeypatch.setattr(parity, "reference_cases", skewed(only_float32=True))   # torch float32 off, float64 right
    m = build_engine(models["llama"], models["llama/eagle3"], tmp_path / "a", progress=False)
    assert m["parity"]["target"]["reference"] == "float64" and m["parity"]["target"]["worst"] < 1e-4
    assert "logits relative error 9.99e-04" in m["parity"]["target"]["float32_reference"]
    monkeypatch.setattr(parity, "reference_cases", skewed(only_float32=False))  # the export itself off
    with pytest.raises(ModelError, match="differs from PyTorch"):
        build_engine(models["llama"], models["llama/eagle3"], tmp_path / "b", progress=False)
