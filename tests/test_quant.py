"""Quantization: ModelOpt FP8 calibration (checkpoint layout, scales, quality report), FP8 Q/DQ and int8/int4
MatMulNBits graphs in ONNX Runtime, the row independence of the MatMulNBits engines (a row's logits bit for bit the
same at any call shape), and `eaglex check` on quantized engines (speculative == vanilla on the same engine).

One float engine (Llama fixture + EAGLE-3 head) is built per module and copied for each quantization; one
calibration is shared by every FP8 test. The calibration text is the target's own greedy continuations, so that its
perplexity is meaningful. ModelOpt tests skip when `nvidia-modelopt` is not installed (`pip install eaglex[quant]`).
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers import write_prompt_file
from onnx import TensorProto, helper, numpy_helper
from safetensors import safe_open

from eaglex.base.errors import ModelError
from eaglex.cli import main
from eaglex.engines.build import build_engine
from eaglex.engines.quantize import quantize_draft, quantize_engine, target_parity
from eaglex.export import quant_graphs as q
from eaglex.export.parity import ort_feeds, torch_outputs
from eaglex.export.row_attention import ROWS_AXIS
from eaglex.runtime import kernels
from eaglex.runtime.backend import ONE
from eaglex.runtime.engine import open_engine
from eaglex.runtime.generate import VanillaGenerator
from eaglex.runtime.manifest import read_manifest
from eaglex.runtime.ort_backend import OrtBackend
from eaglex.runtime.ort_session import use_global_pool
from eaglex.runtime.torch_backend import TorchBackend
from eaglex.runtime.types import TreeConfig

HAVE_MODELOPT = importlib.util.find_spec("modelopt") is not None
needs_modelopt = pytest.mark.skipif(not HAVE_MODELOPT, reason="nvidia-modelopt is not installed "
                                                               "(pip install 'eaglex[quant]')")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _sizes(target_dir) -> tuple[int, int, int, int]:
    """(layers, kv heads, head_dim, vocab) of a fixture target, so that counts follow the fixture's spec."""
    c = json.loads((target_dir / "config.json").read_text())
    return (c["num_hidden_layers"], c["num_key_value_heads"], c.get("head_dim") or c["hidden_size"]
            // c["num_attention_heads"], c["vocab_size"])


@pytest.fixture(scope="module")
def calib_data(models, prompts, tmp_path_factory):
    """JSONL of the target's greedy continuations of the fixture prompts (input_ids lines; the random prompts
    themselves are left out: the peaked fixture assigns them near-zero probability)."""
    backend = TorchBackend(models["llama"])
    gen = VanillaGenerator(backend)
    path = tmp_path_factory.mktemp("calib") / "calib.jsonl"
    with open(path, "w") as f:
        for p in prompts[:16]:
            f.write(json.dumps({"input_ids": gen.generate(p, 48).output_ids}) + "\n")
    return path


@pytest.fixture(scope="module")
def calibrated(models, calib_data, tmp_path_factory):
    if not HAVE_MODELOPT:
        pytest.skip("nvidia-modelopt is not installed (pip install 'eaglex[quant]')")
    out = tmp_path_factory.mktemp("cal") / "llama-fp8"
    assert main(["calibrate", "--target", str(models["llama"]), "--out", str(out), "--data", str(calib_data),
                 "--samples", "8", "--seq-len", "48", "--eval-samples", "4", "--kv-cache", "fp8",
                 "--dtype", "bfloat16"]) == 0
    return out, json.loads((out / "eaglex_calibration.json").read_text())


class _GlobalPoolOptions(ort.SessionOptions):
    def __init__(self):
        super().__init__()
        self.use_per_session_threads = False


@pytest.fixture(scope="module")
def float_engine(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("qengine") / "llama-eagle3"
    with pytest.MonkeyPatch.context() as mp:
        # build_engine's parity check opens sessions with per-session threads, which ORT refuses once an OrtBackend
        # created the process-wide pool (earlier test modules do); route them to that pool instead.
        use_global_pool()
        mp.setattr(ort, "SessionOptions", _GlobalPoolOptions)
        build_engine(models["llama"], models["llama/eagle3"], out, progress=False)
    return out


def _session(path) -> ort.InferenceSession:
    use_global_pool()
    so = ort.SessionOptions()
    so.use_per_session_threads = False
    kernels.register(so)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _int8_op(engine) -> str:
    """The op int8 layers become: eaglex's LinearQ8 on an engine built on the kernel library, else MatMulNBits."""
    return "LinearQ8" if read_manifest(engine)["kernels"] else "MatMulNBits"


def _exact_keys(engine) -> int | None:
    """The keys per call a row-independent quantized engine stays exact within: no bound on eaglex's TreeAttention,
    the decomposed attention's 1024 otherwise."""
    return None if "TreeAttention" in (read_manifest(engine)["kernels"] or {}).get("ops", {}) else 1024


def _rules(engine) -> dict:
    keys = _exact_keys(engine)
    return {"row_independent_keys": keys} if keys else {}


def _copy_engine(src, dst):
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------------------------- calibration

@needs_modelopt
def test_calibrated_checkpoint_layout_and_scales(calibrated, models):
    out, report = calibrated
    for name in ("config.json", "hf_quant_config.json", "model.safetensors", "generation_config.json",
                 "eaglex_calibration.json"):
        assert (out / name).is_file(), name
    hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "FP8" and hq["kv_cache_quant_algo"] == "FP8"
    assert "lm_head" in hq["exclude_modules"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "modelopt" and cfg["architectures"] == ["LlamaForCausalLM"]
    # calibrated and exported in bfloat16: the config (both keys), the report and every unquantized tensor agree
    assert cfg["dtype"] == cfg["torch_dtype"] == report["dtype"] == "bfloat16"
    with safe_open(str(models["llama"] / "model.safetensors"), "pt") as f:
        orig = {k: f.get_tensor(k).to(torch.bfloat16).float() for k in f.keys()}     # the weights calibrated
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        ck = {k: f.get_tensor(k) for k in f.keys()}
    assert ck["lm_head.weight"].dtype == torch.bfloat16 and ck["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert {v.dtype for k, v in ck.items() if not k.endswith("_scale")} == {torch.bfloat16, torch.float8_e4m3fn}
    for layer in range(_sizes(models["llama"])[0]):
        for lin in LINEARS:
            part = "self_attn" if lin.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            m = f"model.layers.{layer}.{part}.{lin}"
            w, ws, xs = ck[m + ".weight"], ck[m + ".weight_scale"], ck[m + ".input_scale"]
            assert w.dtype == torch.float8_e4m3fn and ws.shape == () and xs.shape == () and float(xs) > 0
            # per-tensor max calibration of the weight: scale = amax / 448
            assert float(ws) == pytest.approx(float(orig[m + ".weight"].abs().max()) / 448, rel=1e-6)
            deq = w.float() * ws
            rel = (deq - orig[m + ".weight"]).norm() / orig[m + ".weight"].norm()
            assert rel < 0.05, (m, float(rel))
        attn = f"model.layers.{layer}.self_attn"
        assert float(ck[attn + ".k_proj.k_scale"]) > 0 and float(ck[attn + ".v_proj.v_scale"]) > 0
        # q/k/v read the same input, so ModelOpt calibrates one input amax for all three
        assert float(ck[attn + ".q_proj.input_scale"]) == float(ck[attn + ".k_proj.input_scale"])


@needs_modelopt
def test_quality_report_is_sane(calibrated, models):
    out, report = calibrated
    L = _sizes(models["llama"])[0]
    quality = report["quality"]
    # The fixture's logits are very peaked: the few tokens that a window's missing context decides dominate its
    # perplexity (hundreds), and FP8 noise moves those either way; top-1 agreement and KL are the tight checks here.
    assert 1.0 <= quality["perplexity_reference"] < 1e4 and quality["perplexity_quantized"] >= 1.0
    assert 0.25 < quality["perplexity_ratio"] < 4
    assert quality["top1_agreement"] > 0.85 and 0 < quality["kl_mean"] < 0.5
    assert 0 < quality["logits_rel_error"] < 0.5
    counts = {k: v["count"] for k, v in report["quantizers"].items()}
    assert counts == {"input_quantizer": 7 * L, "weight_quantizer": 7 * L, "k_bmm_quantizer": L, "v_bmm_quantizer": L}
    assert report["data"]["calibration_windows"] >= 1 and report["data"]["evaluation_windows"] >= 1


@needs_modelopt
def test_calibrate_errors(models, tmp_path, calibrated):
    from eaglex.calibration.fp8 import CalibrateConfig, calibrate
    with pytest.raises(ModelError, match="needs a tokenizer"):          # fixtures have no tokenizer
        calibrate(models["llama"], tmp_path / "x", CalibrateConfig(data="builtin"), progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 999]}\n')
    with pytest.raises(ModelError, match="outside the target's vocabulary"):
        calibrate(models["llama"], tmp_path / "x", CalibrateConfig(data=str(bad)), progress=False)
    with pytest.raises(ModelError, match="already exists"):
        calibrate(models["llama"], calibrated[0], CalibrateConfig(data=str(bad)), progress=False)


# ----------------------------------------------------------------------------------------------- graph passes

def _single_matmul(path, w: np.ndarray, name="target.inner.layers.0.mlp.up_proj.weight_t"):
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", w.shape[0]])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", w.shape[1]])
    node = onnx.helper.make_node("MatMul", ["x", name], ["y"], name="mm")
    g = onnx.helper.make_graph([node], "g", [x], [y], [onnx.numpy_helper.from_array(w, name)])
    m = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 23)])
    m.metadata_props.add(key="eaglex.graph", value="target")
    onnx.save(m, str(path))


def _fake_fp8(a: np.ndarray, scale: float) -> np.ndarray:
    return (torch.from_numpy(a) / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float().numpy() * scale


def test_fp8_qdq_matches_fake_quant_math(tmp_path):
    """One MatMul: ORT's Q/DQ graph computes fake-quant(x) @ fake-quant(W) with the given scales."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    x = (rng.standard_normal((5, 64)) * 3).astype(np.float32)
    _single_matmul(tmp_path / "m.onnx", w)
    ws, xs = float(np.abs(w).max()) / 448, 6.0 / 448             # x beyond 6.0 saturates, as in ModelOpt
    scales = {"model.layers.0.mlp.up_proj": q.Fp8Scales(ws, xs)}
    rep = q.fp8_qdq(tmp_path / "m.onnx", tmp_path / "f.onnx", scales)
    assert rep.quantized == ("model.layers.0.mlp.up_proj",) and rep.skipped == ()
    m = onnx.load(str(tmp_path / "f.onnx"))
    assert {i.data_type for i in m.graph.initializer if i.name.endswith("_fp8")} == {onnx.TensorProto.FLOAT8E4M3FN}
    assert [n.op_type for n in m.graph.node] == ["DequantizeLinear", "QuantizeLinear", "DequantizeLinear", "MatMul"]
    assert {p.key: p.value for p in m.metadata_props} == {"eaglex.graph": "target"}
    got = _session(tmp_path / "f.onnx").run(None, {"x": x})[0]
    want = _fake_fp8(x, xs) @ _fake_fp8(w, ws)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ModelError, match="no MatMul weight matches"):
        q.fp8_qdq(tmp_path / "m.onnx", tmp_path / "g.onnx", {"lm_head": q.Fp8Scales(ws, xs)})
    wrong = q.Fp8Scales(ws, xs, q._to_fp8_bits(-w.T, ws))        # bits of another weight
    with pytest.raises(ModelError, match="another model"):
        q.fp8_qdq(tmp_path / "m.onnx", tmp_path / "g.onnx", {"model.layers.0.mlp.up_proj": wrong})


def test_module_names():
    assert q.module_name("target.inner.layers.3.mlp.up_proj.weight_t") == "model.layers.3.mlp.up_proj"
    assert q.module_name("target.hf.lm_head.weight_t") == "lm_head"
    assert q.module_name("head.midlayer.self_attn.q_proj.weight_t") == "midlayer.self_attn.q_proj"
    assert q.module_name("fc.weight_t") == "fc"
    assert q.module_name("val_16") is None


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@needs_modelopt
def test_fp8_target_graph_runs_close_to_fp32(float_engine, calibrated, models, tmp_path, monkeypatch):
    from eaglex.calibration.checkpoint import read_fp8_scales
    L, kv, hd, V = _sizes(models["llama"])
    scales = read_fp8_scales(calibrated[0])
    monkeypatch.setattr(q, "EXTERNAL_DATA_ABOVE", 0)            # exercise the external-data path
    rep = q.fp8_qdq(float_engine / "target.onnx", tmp_path / "target.onnx", scales, exclude=(r"lm_head$",))
    assert len(rep.quantized) == 7 * L and rep.skipped == ("lm_head",)
    assert rep.files == ("target.onnx", "target.onnx.data") and rep.bytes_after < rep.bytes_before / 2
    m = onnx.load(str(tmp_path / "target.onnx"), load_external_data=False)
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("MatMul") == 7 * L + 2                     # the linears, lm_head, RoPE frequencies
    assert ops.count("QuantizeLinear") == 4 * L                 # shared by q/k/v and gate/up: 4 inputs per layer
    assert ops.count("DequantizeLinear") == 7 * L + 4 * L
    meta = {p.key: p.value for p in m.metadata_props}
    assert meta["eaglex.graph"] == "target" and "eaglex.engine_id" in meta
    manifest = read_manifest(float_engine)
    parity = target_parity(float_engine, tmp_path, manifest)
    assert parity["logits_rel_error"] < 0.5 and parity["top1_agreement"] >= 0.9
    # The graph computes exactly the checkpoint's quantization: HF forward with the FP8 weights dequantized and
    # every Linear input fake-quantized with its input_scale gives the same logits (FP8 rounding error is ~20 %).
    ids = torch.randint(0, V, (1, 24), generator=torch.Generator().manual_seed(0))
    want = _fake_quant_reference(models["llama"], calibrated[0], ids)
    feeds = {"input_ids": ids.numpy(), "position_ids": np.arange(24)[None], "logits_rows": np.arange(24),
             "attn_mask": np.tril(np.ones((24, 24), dtype=bool))[None, None]}
    for i in range(L):
        feeds[f"past_key_{i}"] = feeds[f"past_value_{i}"] = np.zeros((1, kv, 0, hd), dtype=np.float32)
    got = _session(tmp_path / "target.onnx").run(["logits"], ort_feeds(feeds, 24))[0][0]
    assert _rel(got, want) < 1e-5


@torch.no_grad()
def _fake_quant_reference(target_dir, checkpoint, ids) -> np.ndarray:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ck = load_file(str(checkpoint / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name + ".weight_scale" in ck:
            mod.weight.data = ck[name + ".weight"].float() * ck[name + ".weight_scale"]
            scale = float(ck[name + ".input_scale"])
            mod.register_forward_pre_hook(lambda m, args, s=scale: (torch.from_numpy(_fake_fp8(args[0].numpy(), s)),))
    return model(ids).logits[0].numpy()


@pytest.mark.parametrize("bits", [8, 4])
def test_nbits_target_graph_runs_close_to_fp32(float_engine, models, tmp_path, bits):
    L = _sizes(models["llama"])[0]
    spec = read_manifest(float_engine)["target"]["spec"]
    heads = (spec["num_heads"], spec["num_kv_heads"], spec["head_dim"])
    rep = q.nbits_weight_only(float_engine / "target.onnx", tmp_path / "target.onnx", bits, row_attention=heads)
    assert len(rep.quantized) == 7 * L + 1 and rep.skipped == ()     # lm_head included (no calibrated scale needed)
    m = onnx.load(str(tmp_path / "target.onnx"))
    nbits = [n for n in m.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 4 * L + 1                                    # q|k|v and gate|up fused: one kernel each
    attrs = {a.name: a.i for a in nbits[0].attribute}
    assert attrs["bits"] == bits and attrs["block_size"] == 32 and attrs["accuracy_level"] == 4
    ops = [n.op_type for n in m.graph.node]
    fused = _exact_keys(float_engine) is None                       # eaglex.TreeAttention: one node a layer
    assert "Attention" not in ops and ops.count("TreeAttention" if fused else "FusedMatMul") == (1 if fused else 3) * L
    assert {p.key for p in m.metadata_props} >= {"eaglex.engine_id", "eaglex.graph"}
    parity = target_parity(float_engine, tmp_path, read_manifest(float_engine))
    # 4-bit blocks of this tiny random fixture move its logits far more than a trained model's (quality on SmolLM2:
    # docs/results.md); the bound here only says the graph computes the same model
    max_error, min_top1 = (0.1, 0.95) if bits == 8 else (0.6, 0.8)
    assert parity["logits_rel_error"] < max_error and parity["top1_agreement"] >= min_top1, parity


@pytest.mark.parametrize("heads, error", [((8, 3, 16), "do not group"), ((8, 2, 256), "head_dim <= 128")])
def test_row_attention_refuses_what_it_cannot_keep_exact(float_engine, tmp_path, heads, error):
    with pytest.raises(ModelError, match=error):
        q.nbits_weight_only(float_engine / "target.onnx", tmp_path / "target.onnx", 8, row_attention=heads)


def test_nbits_refuses_fused_attention(models, tmp_path):
    """A graph with ONNX Runtime's fused Attention (an older eaglex's engine) is not quantized as row-independent."""
    plain = _plain_target_graph(models["llama"], tmp_path)
    with pytest.raises(ModelError, match="fused Attention"):
        q.nbits_weight_only(plain, tmp_path / "q.onnx", 8, row_attention=(4, 2, 16))


def _plain_target_graph(target_dir, out_dir):
    """The fixture target exported as the exporter gives it: ONNX Runtime's fused Attention over Concat(past, new)
    ([B,Hkv,P,D] KV tensors), none of the engine rewrites (export/row_attention.py)."""
    import dataclasses

    from eaglex.export.graphs import target_graph
    from eaglex.export.layout import to_matmul_layout
    from eaglex.export.onnx_export import export_graph
    from eaglex.models.target import load_target

    target = load_target(target_dir)
    to_matmul_layout(target)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = export_graph(dataclasses.replace(target_graph(target), heads=None), out_dir)
    assert res.nodes["Attention"] == target.spec.num_layers
    return res.path


def _run(sess, spec, tokens, positions, mask, past) -> dict[str, np.ndarray]:
    """One target call with [B,Hkv,P,D] pasts, returning [B,Hkv,P+N,D] presents, whichever KV layout the graph has
    (an engine graph's rows-first buffers, or the exporter's plain tensors)."""
    feeds = {"input_ids": tokens, "position_ids": positions, "attn_mask": mask,
             "logits_rows": np.arange(tokens.shape[1])}
    for i in range(spec["num_layers"]):
        feeds[f"past_key_{i}"], feeds[f"past_value_{i}"] = past[2 * i], past[2 * i + 1]
    rows_first = next(i for i in sess.get_inputs() if i.name == "past_key_0").shape[0] == ROWS_AXIS
    if rows_first:
        feeds = ort_feeds(feeds, tokens.shape[1])
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    return torch_outputs(out) if rows_first else out


def _presents(out: dict, layers: int) -> list[np.ndarray]:
    return [out[f"present_{k}_{i}"] for i in range(layers) for k in ("key", "value")]


def _row_identity_table(sess, spec, ids: np.ndarray, holes: int = 3) -> list[str]:
    """Every row of `ids` computed alone (one-token steps: the reference), then again
    - in calls of M rows for M = 1..64, after the past of the first len(ids) - M tokens;
    - the same with `holes` masked junk keys between that past and the call's rows (a KV cache with holes, a tree's
      siblings between a node and its ancestors);
    - in batches of 3 requests whose pasts have other lengths, padded with masked junk to the longest;
    and returns the cases where a row's logits or new KV rows differ from the reference in any bit."""
    L, kv, hd = spec["num_layers"], spec["num_kv_heads"], spec["head_dim"]
    rng = np.random.default_rng(0)
    S = ids.shape[0]
    ref, past = [], [np.zeros((1, kv, 0, hd), np.float32)] * (2 * L)
    for p in range(S):
        out = _run(sess, spec, ids[None, p:p + 1], np.array([[p]]), np.ones((1, 1, 1, p + 1), bool), past)
        ref.append(out["logits"][0, 0])
        past = _presents(out, L)
    ref, kv_ref = np.stack(ref), past

    def junk(n, b=1):
        return rng.standard_normal((b, kv, n, hd)).astype(np.float32)

    def call(starts, M, h):
        """Rows starts[b]..starts[b]+M-1 of each batch row b over its own past, padded to the longest plus h."""
        P = max(starts) + h
        mask = np.zeros((len(starts), 1, M, P + M), bool)
        tensors = []
        for b, s in enumerate(starts):
            mask[b, 0, :, :s] = True
            mask[b, 0, :, P:] = np.tril(np.ones((M, M), bool))
        for t in range(2 * L):
            tensors.append(np.concatenate([np.concatenate([kv_ref[t][:, :, :s], junk(P - s)], 2)
                                           for s in starts], 0))
        tokens = np.stack([ids[s:s + M] for s in starts])
        positions = np.stack([np.arange(s, s + M) for s in starts])
        out = _run(sess, spec, tokens, positions, mask, tensors)
        return out["logits"], _presents(out, L), P

    bad = []
    cases = [([S - M], M, 0) for M in range(1, 65)] + [([S - M], M, holes) for M in (1, 2, 3, 8, 17, 64)] \
        + [([S - M - 9, S - M, S - M - 4], M, 0) for M in (1, 2, 5, 16)]
    for starts, M, h in cases:
        logits, presents, P = call(starts, M, h)
        for b, s in enumerate(starts):
            if not np.array_equal(logits[b], ref[s:s + M]):
                bad.append(f"logits: M={M} holes={h} batch starts {starts} row {b}")
            if not all(np.array_equal(presents[t][b, :, P:], kv_ref[t][0, :, s:s + M]) for t in range(2 * L)):
                bad.append(f"KV: M={M} holes={h} batch starts {starts} row {b}")
    return bad


@pytest.mark.parametrize("bits", [8, 4])
def test_nbits_rows_are_bit_identical_at_any_call_shape(float_engine, models, prompts, tmp_path, bits):
    """The identity row-independent engines rest on: a row's logits and KV rows are bit for bit the same whether it
    is computed alone, among M = 1..64 rows, over masked junk keys (a tree's siblings between a node and its
    ancestors), or batched with other requests padded to the longest. The same model quantized from the exporter's
    plain graph, with ONNX Runtime's fused Attention, fails it (the reason for the rewrite: its one-row calls and
    its softmax's lanes round differently), so the table can tell."""
    from eaglex.engines.quantize import ROW_INDEPENDENT_KEYS

    spec = read_manifest(float_engine)["target"]["spec"]
    ids = np.array([t for p in prompts for t in p][:72], dtype=np.int64)
    assert ids.shape[0] + 8 <= ROW_INDEPENDENT_KEYS
    heads = (spec["num_heads"], spec["num_kv_heads"], spec["head_dim"])
    q.nbits_weight_only(float_engine / "target.onnx", tmp_path / "rows.onnx", bits, row_attention=heads)
    assert _row_identity_table(_session(tmp_path / "rows.onnx"), spec, ids) == []
    plain = _plain_target_graph(models["llama"], tmp_path / "plain")
    q.nbits_weight_only(plain, tmp_path / "fused.onnx", bits)
    assert _row_identity_table(_session(tmp_path / "fused.onnx"), spec, ids) != []


@pytest.mark.skipif(not kernels.available(), reason="the kernel library is not built (make kernels)")
@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_rows_are_bit_identical_at_any_call_shape(float_engine, prompts, tmp_path, bits):
    """The same identity for eaglex's LinearQ8 / LinearQ4 target graphs (int8 / int4 engines on the kernel
    library)."""
    spec = read_manifest(float_engine)["target"]["spec"]
    ids = np.array([t for p in prompts for t in p][:72], dtype=np.int64)
    heads = (spec["num_heads"], spec["num_kv_heads"], spec["head_dim"])
    report = q.kernel_linear(float_engine / "target.onnx", tmp_path / "q.onnx", bits, row_attention=heads,
                             eight_bit=(r"(^|\.)lm_head$",))
    assert report.method == f"int{bits}" and not report.skipped and "lm_head" in report.quantized
    ops = Counter(n.op_type for n in onnx.load(str(tmp_path / "q.onnx"), load_external_data=False).graph.node)
    assert ops["LinearQ8"] == (1 if bits == 4 else 4 * _sizes(float_engine)[0] + 1)
    assert _row_identity_table(_session(tmp_path / "q.onnx"), spec, ids) == []


def _act_max(graph_path, seed=0) -> dict[str, np.ndarray]:
    """Made-up positive activation maxima for every module of a graph, one channel in eight an outlier."""
    rng = np.random.default_rng(seed)
    model = onnx.load(str(graph_path))
    out = {}
    for node, w in q._weight_matmuls(model.graph):
        a = rng.uniform(0.1, 1.0, w.dims[0]).astype(np.float32)
        a[::8] *= 40
        out[q.module_name(w.name)] = a
    return out


def test_w8a8_rows_are_bit_identical_at_any_call_shape(float_engine, prompts, tmp_path):
    """w8a8 (per-row int8 activations, smoothed, on MatMulInteger): the same table as MatMulNBits engines."""
    spec = read_manifest(float_engine)["target"]["spec"]
    ids = np.array([t for p in prompts for t in p][:72], dtype=np.int64)
    heads = (spec["num_heads"], spec["num_kv_heads"], spec["head_dim"])
    report = q.rowwise_int8(float_engine / "target.onnx", tmp_path / "rows.onnx", row_attention=heads,
                            act_max=_act_max(float_engine / "target.onnx"))
    assert report.method == "w8a8" and not report.skipped
    out = onnx.load(str(tmp_path / "rows.onnx"))
    assert not q._weight_matmuls(out.graph) and any(n.op_type == "MatMulInteger" for n in out.graph.node)
    assert _row_identity_table(_session(tmp_path / "rows.onnx"), spec, ids) == []


def _one_matmul(path, W):
    g = helper.make_graph([helper.make_node("MatMul", ["x", "layer.weight_t"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", W.shape[0]])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", W.shape[1]])],
                          [numpy_helper.from_array(W, "layer.weight_t")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    return path


def test_w8a8_matmul_is_the_integer_formula(tmp_path):
    """rowwise_int8's numbers, spelled out: q = round_half_even(x / s_row) + 128 (uint8, one blocked QuantizeLinear
    per input), y = (float(sum_k (q - 128) * Wq) * s_row) * s_col, every step in float32. Rows with halfway
    quotients (x / s = k + 0.5) and an all-zero row included; the graph must equal this formula bit for bit."""
    rng = np.random.default_rng(3)
    K, N = 96, 40
    W = rng.standard_normal((K, N)).astype(np.float32)
    x = rng.standard_normal((5, K)).astype(np.float32)
    s_row = np.maximum(np.abs(x).max(1, keepdims=True) / np.float32(127), np.finfo(np.float32).tiny)
    x[1, :10] = ((np.arange(10) - 5 + 0.5) * s_row[1]).astype(np.float32)       # halfway quotients
    x[4] = 0
    q.rowwise_int8(_one_matmul(tmp_path / "mm.onnx", W), tmp_path / "q.onnx")
    graph = onnx.load(str(tmp_path / "q.onnx"))
    ops = Counter(n.op_type for n in graph.graph.node)
    assert ops["QuantizeLinear"] == 1 and ops["Round"] == 0 and ops["MatMulInteger"] == 1
    y = _session(tmp_path / "q.onnx").run(None, {"x": x})[0]
    s_row = np.maximum(np.abs(x).max(1, keepdims=True) / np.float32(127), np.finfo(np.float32).tiny)
    s_col = np.maximum(np.abs(W).max(0) / 127.0, np.finfo(np.float32).tiny).astype(np.float32)
    Wq = np.clip(np.round(W / s_col), -127, 127).astype(np.int32)
    xq = np.clip(np.round(x / s_row) + 128, 0, 255).astype(np.int32) - 128
    want = ((xq @ Wq).astype(np.float32) * s_row) * s_col
    assert y.dtype == np.float32 and np.array_equal(y, want)


@pytest.mark.parametrize("smoothed", [False, True])
def test_w8a8_matmul_error_and_smoothing(tmp_path, smoothed):
    """One MatMul through rowwise_int8 against float: close, rows independent of the call, and an outlier
    channel (x100 on one input channel, as LLM activations have) costs the small channels their precision unless
    smoothed: with SmoothQuant's s the error drops several-fold."""
    rng = np.random.default_rng(0)
    W = rng.standard_normal((64, 32)).astype(np.float32)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    x[:, 5] *= 100
    src = _one_matmul(tmp_path / "mm.onnx", W)
    act = {"layer": np.abs(x).max(0)} if smoothed else None
    q.rowwise_int8(src, tmp_path / "q.onnx", act_max=act)
    sess = _session(tmp_path / "q.onnx")
    y = sess.run(None, {"x": x})[0]
    for i in range(6):                                   # each row alone: the same bits
        assert np.array_equal(sess.run(None, {"x": x[i:i + 1]})[0], y[i:i + 1])
    err = np.abs(y - x @ W).max() / np.abs(x @ W).max()
    q.rowwise_int8(src, tmp_path / "p.onnx")
    plain = _session(tmp_path / "p.onnx").run(None, {"x": x})[0]
    plain_err = np.abs(plain - x @ W).max() / np.abs(x @ W).max()
    assert err < 0.03
    if smoothed:
        assert err < plain_err / 3, (err, plain_err)


def test_w8a8_engine_check_is_token_exact(float_engine, models, tmp_path, prompts, calib_data, capsys, monkeypatch):
    """A w8a8 engine, calibrated on a JSONL of input ids, carries MatMulNBits engines' contract: no rule but the
    keys bound, and one-row steps, dynamic trees and batches all give its own vanilla output."""
    L = _sizes(models["llama"])[0]
    e = _copy_engine(float_engine, tmp_path / "w8a8")
    m = quantize_engine(e, "w8a8", data=str(calib_data), progress=False)
    assert m["quant"]["method"] == "w8a8" and m["quant"]["calibration"]["data"] == str(calib_data)
    assert m["graphs"]["target"]["ops"]["MatMulInteger"] == 4 * L + 1
    assert m["exactness"] == _rules(float_engine) and m["dtypes"]["weights"] == "int8"
    for tree in ("chain:3", "dynamic:8/4/2"):
        _check_engine(e, tmp_path, prompts, capsys, "--tree", tree, "--batch", "4")
    eng = open_engine(e, tree=TreeConfig.parse("dynamic:8/4/2"))
    alone = [r.output_ids for r in open_engine(e, method="vanilla").generate(prompts[:3], max_new_tokens=16)]
    assert [r.output_ids for r in eng.generate(prompts[:3], max_new_tokens=16, batch=3)] == alone
    import eaglex.runtime.ort_backend as ob  # on a CPU whose integer GEMM saturates: one warning
    monkeypatch.setattr(ob, "u8s8_saturates", lambda: True)
    with pytest.warns(RuntimeWarning, match="no VNNI or AMX"):
        ob.OrtBackend(e)


# ----------------------------------------------------------------------------------------------- engines

def _check_engine(engine, tmp_path, prompts, capsys, *options):
    rc = main(["check", "--engine", str(engine), "--prompts", str(write_prompt_file(tmp_path, prompts, 4)),
               "--max-new-tokens", "24", *options])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "4/4 identical to vanilla" in out


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_nbits_engine_check_is_token_exact(float_engine, models, tmp_path, prompts, capsys, quant):
    """MatMulNBits engines carry no exactness rule but their keys bound: one-row vanilla steps, KV holes, dynamic
    trees and in-flight batching all give the engine's own vanilla output."""
    L = _sizes(models["llama"])[0]
    e = _copy_engine(float_engine, tmp_path / quant)
    m = quantize_engine(e, quant, progress=False)
    assert m["quant"]["method"] == quant and m["quant"]["calibration"] is None
    op = {"int8": _int8_op(float_engine), "int4": "LinearQ4" if _int8_op(float_engine) == "LinearQ8"
          else "MatMulNBits"}[quant]
    ops = m["graphs"]["target"]["ops"]
    head = ops.get("LinearQ8", 0) if op == "LinearQ4" else 0          # LinearQ4 engines keep lm_head on LinearQ8
    assert m["dtypes"]["weights"] == quant and ops[op] + head == 4 * L + 1
    assert "Attention" not in m["graphs"]["target"]["ops"]
    assert m["quant"]["bytes_after"] < m["quant"]["bytes_before"]
    assert op not in m["graphs"]["draft"]["ops"]                    # the head stays float unless asked
    assert not list(tmp_path.glob(f".{quant}.*"))                 # no leftovers of the atomic swap
    assert m["exactness"] == _rules(float_engine) and m["tree"] is None
    b = OrtBackend(e)                                               # hashes match the new manifest
    assert (b.min_rows, b.exact_trees, b.batch_exact, b.exact_keys) == (1, None, True, _exact_keys(float_engine))
    for tree in ("chain:3", "dynamic:8/4/2"):
        _check_engine(e, tmp_path, prompts, capsys, "--tree", tree, "--batch", "4")
    eng = open_engine(e, tree=TreeConfig.parse("dynamic:8/4/2"))
    assert eng.batcher(8).backend.slots == 8                        # the fixture's context is within the bound
    alone = [r.output_ids for r in open_engine(e, method="vanilla").generate(prompts[:3], max_new_tokens=16)]
    assert [r.output_ids for r in eng.generate(prompts[:3], max_new_tokens=16, batch=3)] == alone
    with pytest.raises(ModelError, match="already quantized"):
        quantize_engine(e, quant, progress=False)


def test_int8_cache_keeps_rows_where_vanilla_computes_them(float_engine, tmp_path):
    """A one-row call is not padded; after a partial prefill commit and a path through a tree (rows moved into
    place), the cache holds every row bit for bit as a prefill of that context computes it, at its position, and
    the next verification gives the same logits and features."""
    e = _copy_engine(float_engine, tmp_path / "int8")
    quantize_engine(e, "int8", progress=False)
    moved, direct = OrtBackend(e), OrtBackend(e)
    for b in (moved, direct):
        b.reset(64)
    moved.target_forward(ONE, torch.arange(10, 20)[None], torch.arange(10)[None], None)
    moved.target_commit(0, torch.arange(8))                                    # 8 of 10 prefill rows
    logits, feats = moved.target_forward(ONE, torch.tensor([[5]]), torch.tensor([[8]]), None)
    assert logits.shape[1] == 1 and feats.shape[1] == 1 and moved.tcache.pending == [1]
    moved.target_commit(0, torch.arange(1))
    mask = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    moved.target_forward(ONE, torch.tensor([[6, 7, 8]]), torch.tensor([[9, 10, 10]]), mask)
    moved.target_commit(0, torch.tensor([0, 2]))                              # the middle row rejected
    context = torch.tensor([list(range(10, 18)) + [5, 6, 8]])
    direct.target_forward(ONE, context, torch.arange(11)[None], None)
    direct.target_commit(0, torch.arange(11))
    assert moved.tcache.length == direct.tcache.length == [11] and moved.tcache.pending == [0]
    for a, b in zip(moved.tcache.kv, direct.tcache.kv):
        assert np.array_equal(a[:11], b[:11])
    out = [b.target_forward(ONE, torch.tensor([[9, 10]]), torch.tensor([[11, 12]]), None) for b in (moved, direct)]
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_int8_draft_on_a_float_target_stays_exact(float_engine, models, tmp_path, prompts, capsys):
    """quantize_draft: the draft graphs become MatMulNBits, the target's files stay byte for byte, no exactness
    rules are added (the target is float), and speculative output still equals float vanilla decoding."""
    e = _copy_engine(float_engine, tmp_path / "dq")
    before = read_manifest(e)
    m = quantize_draft(e, progress=False)
    assert "quant" not in m and "exactness" not in m and m["draft_quant"]["method"] == "int8"
    assert m["draft_quant"]["bytes_after"] < m["draft_quant"]["bytes_before"]
    op = _int8_op(float_engine)
    assert op in m["graphs"]["draft"]["ops"] and op not in m["graphs"]["target"]["ops"]
    for f in before["graphs"]["target"]["files"]:
        assert m["files"][f] == before["files"][f]
    assert m["tree"] == before["tree"] and not list(tmp_path.glob(".dq.*"))
    assert OrtBackend(e).batch_exact                                 # batching stays on
    _check_engine(e, tmp_path, prompts, capsys)
    vanilla = open_engine(float_engine, method="vanilla").generate(prompts[:3], max_new_tokens=16)
    spec = open_engine(e).generate(prompts[:3], max_new_tokens=16, batch=3)
    assert [r.output_ids for r in spec] == [r.output_ids for r in vanilla]
    with pytest.raises(ModelError, match="already quantized"):
        quantize_draft(e, progress=False)
    with pytest.raises(ModelError, match="already quantized"):
        quantize_engine(_copy_engine(e, tmp_path / "dq2"), "int8", progress=False)


@needs_modelopt
def test_min_rows_pads_one_row_calls_and_keeps_no_holes(float_engine, calibrated, tmp_path):
    """An FP8 engine's backend turns a one-row target call into two (the padding row never reaches the caller or
    the committed cache), and a partial commit moves the kept rows into place (the cache keeps no holes), so every
    token sits at the same index of the KV cache whether vanilla decoding or a chain verification computed it."""
    e = _copy_engine(float_engine, tmp_path / "fp8")
    quantize_engine(e, "fp8", calibrated[0], progress=False)
    b = OrtBackend(e)
    b.reset(64)
    ids = torch.arange(10, 18)[None]
    b.target_forward(ONE, ids, torch.arange(8)[None], None)
    b.target_commit(0, torch.arange(8))
    logits, feats = b.target_forward(ONE, torch.tensor([[5]]), torch.tensor([[8]]), None)
    assert logits.shape[1] == 1 and feats.shape[1] == 1 and b.tcache.pending == [2]
    b.target_commit(0, torch.arange(1))
    assert b.tcache.length == [9] and b.tcache.pending == [0]
    b.target_forward(ONE, torch.tensor([[6, 7, 8]]), torch.tensor([[9, 10, 11]]), None)
    b.target_commit(0, torch.tensor([0, 1]))                          # the last row rejected
    assert b.tcache.length == [11] and b.tcache.pending == [0]


@needs_modelopt
def test_fp8_engine_check_is_token_exact(float_engine, calibrated, models, tmp_path, prompts, capsys):
    L = _sizes(models["llama"])[0]
    e = _copy_engine(float_engine, tmp_path / "fp8")
    m = quantize_engine(e, "fp8", calibrated[0], progress=False)
    qsec = m["quant"]
    assert qsec["method"] == "fp8" and qsec["calibration"]["quant_algo"] == "FP8"
    assert qsec["calibration"]["kv_cache_scales_applied"] is False
    assert set(qsec["calibration"]["sha256"]) == {"model.safetensors"}
    assert m["graphs"]["target"]["ops"]["QuantizeLinear"] == 4 * L and qsec["graphs"]["target"]["matmuls"] == 7 * L
    assert qsec["parity"]["top1_agreement"] >= 0.9
    assert m["exactness"] == {"min_rows": 2, "kv_holes": False, "trees": "chain", "batching": False}
    _check_engine(e, tmp_path, prompts, capsys)


def _target_steps(sess, spec, ids, prefill: int, chunk: int):
    """Logits of ids[prefill:] and the final KV cache, fed `chunk` tokens per call after a prefill (causal mask)."""
    L, kv, hd = spec["num_layers"], spec["num_kv_heads"], spec["head_dim"]
    past = [np.zeros((1, kv, 0, hd), dtype=np.float32)] * (2 * L)
    logits, P = [], 0
    for start in [0] + list(range(prefill, ids.shape[1], chunk)):
        tokens = ids[:, start:prefill] if start == 0 else ids[:, start:start + chunk]
        N = tokens.shape[1]
        mask = np.ones((1, 1, N, P + N), dtype=bool)
        mask[..., P:] = np.tril(np.ones((N, N), dtype=bool))
        out = _run(sess, spec, tokens, np.arange(P, P + N)[None], mask, past)
        past = _presents(out, L)
        if start:
            logits.append(out["logits"][0])
        P += N
    return np.concatenate(logits), past


def _assert_rows_do_not_depend_on_the_call(engine, m: dict, prompts, atol: float, chunks=(1, 4, 16)) -> None:
    """The target's logits and KV rows of 32 tokens fed chunks[0] per call == fed chunks[1:] per call (after a
    24-token prefill), to within `atol` (0: bit for bit)."""
    from eaglex.runtime.ort_session import open_session

    sess = open_session(engine / m["graphs"]["target"]["file"], m["engine_id"], "target")
    spec = m["target"]["spec"]
    ids = np.array([[t for p in prompts[:6] for t in p][:56]], dtype=np.int64)
    alone, kv_alone = _target_steps(sess, spec, ids, 24, chunks[0])
    for chunk in chunks[1:]:
        together, kv_together = _target_steps(sess, spec, ids, 24, chunk)
        np.testing.assert_allclose(alone, together, rtol=0, atol=atol, err_msg=f"logits, {chunk} tokens per call")
        for a, b in zip(kv_alone, kv_together):
            np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=f"KV cache, {chunk} tokens per call")


@needs_modelopt
def test_fp8_target_rows_do_not_depend_on_the_call(float_engine, calibrated, tmp_path, prompts):
    """Regression (models/tiny FP8 engine: `eaglex check` 11/12, a flip at logit margin 0.0025): greedy speculative
    == vanilla needs a token's logits and KV rows to be the same whether the target computes it alone (vanilla step)
    or among others (tree verification). With the DQ-only FP8 weights dequantized on every run, ORT's MatMul took
    its M=1 kernel for one token and the GEMM for many; the last-bit differences, rounded by the activations' FP8
    Q/DQ, became whole FP8 steps. The runtime's sessions fold the weights (packed, M-independent): bit-identical."""
    e = _copy_engine(float_engine, tmp_path / "fp8")
    _assert_rows_do_not_depend_on_the_call(e, quantize_engine(e, "fp8", calibrated[0], progress=False), prompts,
                                           atol=0.0)   # bit-identical


def test_int8_target_rows_do_not_depend_on_the_call(float_engine, tmp_path, prompts):
    """Regression (models/tiny int8 engine with ONNX Runtime's fused Attention: `eaglex check` 8/12, logits of a
    token computed alone up to 0.1 away from the same token among others): with the row-independent attention,
    one token per call and many per call agree bit for bit, logits and KV cache."""
    e = _copy_engine(float_engine, tmp_path / "int8")
    _assert_rows_do_not_depend_on_the_call(e, quantize_engine(e, "int8", progress=False), prompts, atol=0.0,
                                           chunks=(1, 2, 4, 16))


def test_quantize_engine_errors(float_engine, tmp_path, models):
    e = _copy_engine(float_engine, tmp_path / "e")
    before = sorted(p.name for p in e.iterdir())
    with pytest.raises(ModelError, match="needs the activation scales"):
        quantize_engine(e, "fp8", progress=False)
    with pytest.raises(ModelError, match="int8 quantization needs no calibration"):
        quantize_engine(e, "int8", tmp_path, progress=False)
    with pytest.raises(ModelError, match="not an FP8 checkpoint"):
        quantize_engine(e, "fp8", models["llama"], progress=False)
    with pytest.raises(ModelError, match="not available"):
        quantize_engine(e, "int2", progress=False)
    assert sorted(p.name for p in e.iterdir()) == before and read_manifest(e).get("quant") is None
    assert main(["build", "--target", str(models["llama"]), "--out", str(tmp_path / "x"), "--quant", "fp8"]) == 2


def test_calibrate_cli_help(capsys):
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    out = capsys.readouterr().out
    for flag in ("--target", "--out", "--quant", "--kv-cache", "--data", "--samples", "--seq-len", "--quant-draft"):
        assert flag in out


@pytest.mark.slow
@needs_modelopt
def test_fp8_draft_engine_check_is_token_exact(float_engine, calibrated, calib_data, models, tmp_path, prompts,
                                                capsys):
    """--quant-draft: the EAGLE-3 head calibrated on the quantized target's features, then FP8 draft graphs."""
    cal = tmp_path / "cal"
    assert main(["calibrate", "--target", str(models["llama"]), "--out", str(cal), "--data", str(calib_data),
                 "--samples", "4", "--seq-len", "48", "--eval-samples", "2", "--draft", str(models["llama/eagle3"]),
                 "--quant-draft", "--dtype", "bfloat16"]) == 0
    hq = json.loads((tmp_path / "cal-draft" / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "FP8" and hq["exclude_modules"] == ["lm_head"]
    e = _copy_engine(float_engine, tmp_path / "fp8-draft")
    m = quantize_engine(e, "fp8", cal, draft=True, calibrated_draft_dir=tmp_path / "cal-draft", progress=False)
    assert m["quant"]["graphs"]["draft"]["matmuls"] == 7 and m["quant"]["graphs"]["draft_fc"]["matmuls"] == 1
    _check_engine(e, tmp_path, prompts, capsys)


@pytest.mark.parametrize("machine, flags, saturates", [
    ("x86_64", "fpu avx2 fma", True),                                 # AVX2 only: VPMADDUBSW, int16 pair sums
    ("x86_64", "fpu avx2 avx512f avx512bw", True),                    # AVX-512 without VNNI: the same
    ("x86_64", "fpu avx2 avx512f avx512_vnni", False),
    ("x86_64", "fpu avx2 avx_vnni", False),
    ("x86_64", "fpu avx2 amx_tile amx_int8", False),
    ("aarch64", "fp asimd", False),                                   # ARM's dot products accumulate in int32
])
def test_u8s8_saturation_is_told_by_the_cpu_flags(machine, flags, saturates):
    from eaglex.runtime.ort_session import u8s8_saturates
    info = f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n"
    assert u8s8_saturates(info, machine) is saturates
