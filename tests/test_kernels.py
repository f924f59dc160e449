"""eaglex's kernel library through ONNX Runtime, as engines use it (runtime/kernels.py, export/kernel_graphs.py):
each op equals a numpy reference of its arithmetic; every row is bit-identical to itself computed alone, for
M = 1..16 and any mix of rows; every ISA path gives the same bits; odd shapes, no rows, NaN / inf / denormal
inputs; bad inputs are refused with an error. Engines built on the kernels: in engine tests elsewhere (the build
takes the kernels wherever the library is built) and here (stock vs kernels, ISA paths, a missing library)."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from eaglex.base.errors import ModelError
from eaglex.export import kernel_graphs as kg
from eaglex.runtime import kernels, ort_session

REPO = Path(__file__).resolve().parents[1]
needs_library = pytest.mark.skipif(not kernels.available(), reason="the kernel library is not built (make kernels)")
ISAS = ["portable", "avx2", "avx512"]


def runnable_isas(monkeypatch) -> list[str]:
    out = []
    for isa in ISAS:
        monkeypatch.setenv("EAGLEX_ISA", isa)
        try:
            kernels.isa()
            out.append(isa)
        except ModelError:
            pass
    monkeypatch.delenv("EAGLEX_ISA")
    return out


# ------------------------------------------------------------------------------------------- numpy references

def q8_reference(x: np.ndarray, q: np.ndarray, scales: np.ndarray, N: int) -> np.ndarray:
    """The LinearQ8 arithmetic in numpy float32: rows quantized per block of 32 (d = amax / 127, round half to
    even, clamp +-127; d = 0 gives q = 0; a non-finite block gives d = NaN, q = 0), y = y + (s * d) * dot per
    block in order; NaN outputs as the quiet NaN."""
    M, _ = x.shape
    Kp, Np = q.shape
    xq, d = _quantized_rows(x, Kp)
    wq = q.reshape(-1, 32, Np).astype(np.int32)                       # [Kb, 32, Np]
    y = np.zeros((M, Np), np.float32)
    for b in range(wq.shape[0]):
        dot = (xq[:, b, :] @ wq[b]).astype(np.float32)                 # exact: |dot| < 2^24
        sd = scales[b].astype(np.float32)[None, :] * d[:, b:b + 1]
        with np.errstate(invalid="ignore", over="ignore"):
            y = y + sd * dot
    return y[:, :N]


def q4_reference(x: np.ndarray, q: np.ndarray, d: np.ndarray, m: np.ndarray, N: int) -> np.ndarray:
    """The LinearQ4 arithmetic: rows quantized as for LinearQ8, then per block in order y = y + (d * dx) * dot,
    y = y + (m * dx) * qsum (dot over the 4-bit q in 0..15, qsum the row's sum of its quantized block)."""
    M, K = x.shape
    xq, dx = _quantized_rows(x, q.shape[0])
    wq = q.reshape(-1, 32, q.shape[1]).astype(np.int32)
    y = np.zeros((M, q.shape[1]), np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for b in range(wq.shape[0]):
            dot = (xq[:, b, :] @ wq[b]).astype(np.float32)
            qsum = xq[:, b, :].sum(-1).astype(np.float32)[:, None]
            y = y + (d[b].astype(np.float32)[None, :] * dx[:, b:b + 1]) * dot
            y = y + (m[b].astype(np.float32)[None, :] * dx[:, b:b + 1]) * qsum
    return y[:, :N]


def _quantized_rows(x: np.ndarray, Kp: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows quantized per block of 32: (q int32 [M, Kb, 32], d float32 [M, Kb])."""
    M, K = x.shape
    xp = np.zeros((M, Kp), np.float32)
    xp[:, :K] = x
    xb = xp.reshape(M, -1, 32)
    finite = np.isfinite(xb).all(-1)
    amax = np.abs(np.where(np.isfinite(xb), xb, 0)).max(-1)
    d = np.where(finite, amax / np.float32(127), np.float32(np.nan)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        xq = np.where((d > 0)[..., None], np.rint(xb / np.where(d > 0, d, 1)[..., None]), 0)
    return np.clip(xq, -127, 127).astype(np.int32), d


def f32_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """One FMA chain per output over k in order, y = fma(x_k, w_k, y), from 0: in 80-bit extended precision the
    product is exact and the sum rounds once before float32 (a double rounding differs from the FMA only for
    ties at 2^-40 odds, which these random inputs do not hit)."""
    x, w = x.astype(np.longdouble), w.astype(np.longdouble)
    y = np.zeros((x.shape[0], w.shape[1]), np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for k in range(w.shape[0]):
            y = (y.astype(np.longdouble) + x[:, k:k + 1] * w[k][None, :]).astype(np.float32)
    return y


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-identical, NaN for NaN."""
    return a.shape == b.shape and np.array_equal(np.isnan(a), np.isnan(b)) and \
        np.array_equal(a[~np.isnan(a)].view(np.uint32), b[~np.isnan(b)].view(np.uint32))


# ----------------------------------------------------------------------------------------------- sessions

def linear_model(w: np.ndarray, op: str) -> onnx.ModelProto:
    K, _ = w.shape
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", K])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y],
                          [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    if op == "f32":
        assert kg.to_kernel_f32(m) == 1
    elif op == "q8":
        assert kg.to_kernel_q8(m) == ["w"]
    elif op == "q4":
        assert kg.to_kernel_q4(m) == ["w"]
    return m


def session(model: onnx.ModelProto, isa: str | None = None, monkeypatch=None) -> ort.InferenceSession:
    if isa is not None:
        monkeypatch.setenv("EAGLEX_ISA", isa)
    # the process-wide pool every eaglex session runs on (ONNX Runtime refuses per-session threads once it exists)
    so = ort_session.session_options()
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    if isa is not None:
        monkeypatch.delenv("EAGLEX_ISA")
    return sess


def run(sess, x):
    return sess.run(None, {"x": np.ascontiguousarray(x, np.float32)})[0]


SHAPES = [(32, 16), (576, 960), (1, 1), (31, 15), (33, 17), (100, 40), (64, 130)]     # (K, N)


def weights(K: int, N: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((K, N)) * 0.05).astype(np.float32)


def rows(M: int, K: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((M, K)).astype(np.float32)


# ----------------------------------------------------------------------------------------------------- tests

def test_packing_round_trips_and_quantizes_as_q8_0():
    w = weights(100, 40)
    assert np.array_equal(kg.unpack_f32(kg.pack_f32(w), 40), w)
    q, s = kg.quantize_q8(w)
    assert q.shape == (128, 48) and s.shape == (4, 48) and s.dtype == np.float16
    assert np.abs(q).max() == 127 and not q[100:].any() and not q[:, 40:].any()     # padding is zero
    deq = kg.dequantize_q8(q, s, 100, 40)
    assert np.abs(deq - w).max() <= np.abs(w).max() / 127           # at most one step of the largest block scale
    W, S = kg.pack_q8(q, s)
    assert W.shape == (3, 4, 512) and S.shape == (3, 4, 16)
    # record layout: tile t, block b, k-quad j, channel c, 4 consecutive k; bytes w + 128
    t, b, j, c, e = 2, 1, 5, 7, 3
    assert int(W[t, b, (j * 16 + c) * 4 + e]) - 128 == q[b * 32 + j * 4 + e, t * 16 + c]
    assert S[t, b, c] == s[b, t * 16 + c]


def test_q4_packing_keeps_q4_1_weights_exactly():
    """Weights that are Q4_1 values already (a GGUF target's) quantize to themselves: no second rounding."""
    w = weights(100, 40)
    q, d, m = kg.quantize_q4(w)
    assert q.max() == 15 and d.dtype == m.dtype == np.float16
    assert np.abs(kg.dequantize_q4(q, d, m, 100, 40) - w).max() <= d.astype(np.float32).max() / 2 + 1e-6
    w4 = kg.dequantize_q4(q, d, m, 100, 40)
    assert np.array_equal(kg.dequantize_q4(*kg.quantize_q4(w4), 100, 40), w4)
    W, S = kg.pack_q4(q, d, m)
    assert W.shape == (3, 4, 256) and S.shape == (3, 4, 32)
    t, b, jj, c, e = 2, 1, 3, 7, 2
    assert W[t, b, (jj * 16 + c) * 4 + e] == q[b * 32 + 4 * jj + e, t * 16 + c] | q[b * 32 + 16 + 4 * jj + e,
                                                                                     t * 16 + c] << 4
    assert S[t, b, c] == d[b, t * 16 + c] and S[t, b, 16 + c] == m[b, t * 16 + c]


def test_to_stock_gives_back_the_matmul_bit_for_bit():
    w = weights(33, 17)
    m = linear_model(w, "f32")
    kg.to_stock(m)
    assert [n.op_type for n in m.graph.node] == ["MatMul"]
    assert np.array_equal(numpy_helper.to_array(m.graph.initializer[0]), w)
    assert not any(o.domain == kernels.DOMAIN for o in m.opset_import)
    with pytest.raises(ValueError, match="quantized"):
        kg.to_stock(linear_model(w, "q8"))


@needs_library
@pytest.mark.parametrize("K,N", SHAPES)
def test_ops_equal_their_numpy_reference(K, N):
    w, x = weights(K, N), rows(7, K)
    q, s = kg.quantize_q8(w)
    assert same(run(session(linear_model(w, "q8")), x), q8_reference(x, q, s, N))
    assert same(run(session(linear_model(w, "q4")), x), q4_reference(x, *kg.quantize_q4(w), N))
    assert same(run(session(linear_model(w, "f32")), x), f32_reference(x, w))


@needs_library
@pytest.mark.parametrize("op", ["q8", "q4", "f32"])
@pytest.mark.parametrize("K,N", [(576, 960), (33, 17), (100, 130)])
def test_every_row_equals_itself_alone_and_every_isa_path_agrees(op, K, N, monkeypatch):
    w, x = weights(K, N), rows(16, K)
    isas = runnable_isas(monkeypatch)
    assert "portable" in isas
    sessions = {isa: session(linear_model(w, op), isa, monkeypatch) for isa in isas}
    alone = np.concatenate([run(sessions["portable"], x[r:r + 1]) for r in range(16)])
    rng = np.random.default_rng(2)
    for isa, sess in sessions.items():
        for M in range(1, 17):                                      # the first M rows together
            assert same(run(sess, x[:M]), alone[:M]), (isa, M)
        for _ in range(4):                                          # any mix: rows shuffled, repeated
            pick = rng.integers(0, 16, rng.integers(1, 40))
            assert same(run(sess, x[pick]), alone[pick]), (isa, pick)


@needs_library
@pytest.mark.parametrize("op", ["q8", "q4", "f32"])
def test_no_rows_and_batched_leading_dims(op):
    w = weights(64, 40)
    sess = session(linear_model(w, op))
    assert run(sess, np.zeros((0, 64), np.float32)).shape == (0, 40)
    x = rows(6, 64)
    m3 = linear_model(w, op)
    m3.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "b"
    m3.graph.input[0].type.tensor_type.shape.dim.insert(1, onnx.TensorShapeProto.Dimension(dim_param="n"))
    y3 = session(m3).run(None, {"x": x.reshape(2, 3, 64)})[0]
    assert same(y3.reshape(6, 40), run(sess, x))


@needs_library
@pytest.mark.parametrize("op", ["q8", "q4", "f32"])
def test_nan_inf_and_denormal_inputs_give_the_references_result(op, monkeypatch):
    K, N = 100, 40
    w, x = weights(K, N), rows(8, K)
    x[0, 3] = np.nan
    x[1, 40] = np.inf
    x[2, 99] = -np.inf
    x[3] = np.float32(1e-45) * np.arange(K)                          # denormals only
    x[4, :32] = np.float32(-1e-40)
    x[5] = 0.0
    x[6, 7] = 3e38
    q, s = kg.quantize_q8(w)
    want = {"q8": lambda: q8_reference(x, q, s, N), "q4": lambda: q4_reference(x, *kg.quantize_q4(w), N),
            "f32": lambda: f32_reference(x, w)}[op]()
    for isa in runnable_isas(monkeypatch):
        got = run(session(linear_model(w, op), isa, monkeypatch), x)
        assert same(got, want), isa
        assert not np.isnan(got[5]).any()


@needs_library
def test_bad_inputs_are_refused_with_an_error_not_a_crash():
    w = weights(64, 40)
    m = linear_model(w, "q8")
    m.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "k"      # no declared K: the op itself checks
    sess = session(m)
    with pytest.raises(Exception, match="must end in K=64"):
        sess.run(None, {"x": np.zeros((2, 63), np.float32)})
    m = linear_model(w, "q8")
    m.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.zeros((3, 3, 512), np.uint8),
                                                            m.graph.initializer[0].name))
    with pytest.raises(Exception, match="packed weight"):
        session(m).run(None, {"x": np.zeros((2, 64), np.float32)})


def test_a_bad_isa_name_is_one_line(monkeypatch):
    if not kernels.available():
        pytest.skip("the kernel library is not built")
    monkeypatch.setenv("EAGLEX_ISA", "sse9")
    with pytest.raises(ModelError, match="EAGLEX_ISA must be auto, avx512, avx2 or portable"):
        kernels.isa()


def test_without_the_library_a_kernel_engine_refuses_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLEX_KERNELS_LIB", str(tmp_path / "missing.so"))
    assert not kernels.available()
    with pytest.raises(ModelError, match=r"make setup.*--kernels stock"):
        kernels.require("engine E runs on eaglex's kernels")


@needs_library
def test_the_self_test_passes_under_the_build():
    """The C++ self-test the build ran (tools/build_kernels.sh): every ISA path, rows alone, odd shapes."""
    test = REPO / "build" / "kernels" / "eaglex_linear_test"
    if not test.is_file():
        pytest.skip("the library comes from elsewhere (EAGLEX_KERNELS_LIB or the wheel)")
    out = subprocess.run([str(test)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stdout[-2000:]


# ------------------------------------------------------------------------------------------------ engines

@pytest.fixture(scope="module")
def kernel_engines(models, tmp_path_factory):
    """The Llama fixture with its EAGLE-3 head on eaglex's kernels (float32; int8 target and draft) and on stock
    ops."""
    from eaglex.engines.build import build_engine
    from eaglex.engines.quantize import quantize_engine

    if not kernels.available():
        pytest.skip("the kernel library is not built (make kernels)")
    root = tmp_path_factory.mktemp("kernel-engines")
    out = {k: root / k for k in ("f32", "int8", "stock")}
    build_engine(models["llama"], models["llama/eagle3"], out["f32"], progress=False, kernels="eaglex")
    build_engine(models["llama"], models["llama/eagle3"], out["stock"], progress=False, kernels="stock")
    shutil.copytree(out["f32"], out["int8"])
    quantize_engine(out["int8"], "int8", draft=True, progress=False)
    return out


def test_engines_record_their_kernels(kernel_engines, models):
    from eaglex.runtime.manifest import read_manifest

    L = json.loads((models["llama"] / "config.json").read_text())["num_hidden_layers"]
    f32, int8, stock = (read_manifest(kernel_engines[k]) for k in ("f32", "int8", "stock"))
    count = {op: sum(g["ops"].get(op, 0) for g in f32["graphs"].values()) for op in ("LinearF32", "TreeAttention")}
    assert f32["kernels"] == {"domain": "eaglex", "version": kernels.VERSION, "ops": count}
    assert f32["graphs"]["target"]["ops"]["LinearF32"] == 7 * L + 1                 # every linear layer
    assert f32["graphs"]["target"]["ops"]["TreeAttention"] == L                     # one attention node a layer
    assert {"FusedMatMul", "ScatterND", "Where", "Exp"}.isdisjoint(f32["graphs"]["target"]["ops"])   # no decomposition
    assert int8["graphs"]["target"]["ops"]["LinearQ8"] == 4 * L + 1          # q|k|v and gate|up fused
    assert "LinearQ8" in int8["graphs"]["draft"]["ops"] and int8["quant"]["format"].startswith("eaglex::LinearQ8")
    assert stock["kernels"] is None and "MatMul" in stock["graphs"]["target"]["ops"]


def test_engine_outputs_are_the_same_on_every_isa_path(kernel_engines, prompts, monkeypatch):
    """Vanilla and speculative (a dynamic tree, batched) outputs of the float32 and int8 kernel engines: one
    answer per engine, whatever path EAGLEX_ISA forces."""
    from eaglex.runtime.engine import open_engine
    from eaglex.runtime.types import TreeConfig

    tree = TreeConfig.parse("dynamic:8/4/2")
    for name in ("f32", "int8"):
        answers = set()
        for isa in runnable_isas(monkeypatch):
            monkeypatch.setenv("EAGLEX_ISA", isa)
            vanilla = open_engine(kernel_engines[name], method="vanilla").generate(prompts[:6], max_new_tokens=24)
            spec = open_engine(kernel_engines[name], tree=tree).generate(prompts[:6], max_new_tokens=24, batch=3)
            v, s = [r.output_ids for r in vanilla], [r.output_ids for r in spec]
            assert s == v, (name, isa)
            answers.add(json.dumps(v))
        assert len(answers) == 1, name


def test_a_kernel_engine_without_the_library_refuses_and_a_stock_one_runs(kernel_engines, prompts, monkeypatch,
                                                                          tmp_path):
    from eaglex.runtime.engine import open_engine

    monkeypatch.setenv("EAGLEX_KERNELS_LIB", str(tmp_path / "missing.so"))
    with pytest.raises(ModelError, match=r"runs on eaglex's kernels, and the kernel library is not built here"):
        open_engine(kernel_engines["int8"])
    assert open_engine(kernel_engines["stock"], method="vanilla").generate(prompts[:1], max_new_tokens=4)
