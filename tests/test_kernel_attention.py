"""eaglex.TreeAttention through ONNX Runtime (kernels/src/attention.h): equal to a numpy reference of its arithmetic
bit for bit; a row's output bit-identical whether computed alone, in a chain, in a tree, padded or in a batch,
whatever the context (4096 included) and on every ISA path; the new K/V rows written in place into bound buffers
(and the buffer copied when the caller binds fresh outputs); NaN / inf / denormal inputs; bad shapes refused with
an error, not a crash."""
from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from test_kernels import runnable_isas

from eaglex.runtime import kernels, ort_session

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not kernels.available(), reason="the kernel library is not built (make kernels)")
F32 = np.float32


# ------------------------------------------------------------------------------------------- numpy reference

def _exp_neg(x: np.ndarray) -> np.ndarray:
    """The kernel's e^x for x <= 0, operation for operation in float32 (Cephes' expf polynomial)."""
    x = x.astype(F32)
    with np.errstate(invalid="ignore", over="ignore"):
        xs = np.where(x == x, x, F32(0))
        xs = np.where(xs < F32(-87), F32(-87), xs).astype(F32)
        magic = F32(12582912.0)
        n = ((xs * F32(1.44269504088896341) + magic) - magic).astype(F32)
        r = (xs - n * F32(0.693359375)).astype(F32)
        r = (r - n * F32(-2.12194440e-4)).astype(F32)
        p = np.full_like(r, F32(1.9875691500e-4))
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            p = (p * r + F32(c)).astype(F32)
        y = ((p * r) * r + r + F32(1)).astype(F32)
        two_n = ((n.astype(np.int32) + 127) << 23).view(F32)
        y = (y * two_n).astype(F32)
        y = np.where(x < F32(-87), F32(0), y)
        return np.where(x == x, y, x).astype(F32)


def _dot(q: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Per key: 16 lanes summing q * k over d = l, l + 16, ... in order, then the lanes as a tree."""
    D = q.shape[-1]
    Dp = -(-D // 16) * 16
    prod = np.zeros((keys.shape[0], Dp), F32)
    with np.errstate(invalid="ignore", over="ignore"):
        prod[:, :D] = q[None, :] * keys
        lanes = np.add.accumulate(prod.reshape(len(keys), Dp // 16, 16), axis=1)[:, -1]
        for half in (8, 4, 2, 1):
            lanes = lanes[:, :half] + lanes[:, half:2 * half]
    return lanes[:, 0]


def attention_reference(q, k, v, kbuf, vbuf, mask, scale) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TreeAttention in numpy: (y [B,N,Hq*D], present_key, present_value)."""
    T, B, Hkv, D = kbuf.shape
    _, N, HqD = q.shape
    Hq, G = HqD // D, HqD // D // Hkv
    pk, pv = kbuf.copy(), vbuf.copy()
    pk[T - N:] = k.reshape(B, N, Hkv, D).transpose(1, 0, 2, 3)
    pv[T - N:] = v.reshape(B, N, Hkv, D).transpose(1, 0, 2, 3)
    y = np.zeros((B, N, Hq, D), F32)
    qh = q.reshape(B, N, Hq, D)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for b in range(B):
            for r in range(N):
                seen = np.flatnonzero(mask[b, 0, r])
                if not len(seen):
                    continue
                for hq in range(Hq):
                    s = (_dot(qh[b, r, hq], pk[seen, b, hq // G]) * F32(scale)).astype(F32)
                    m = s[0]
                    for x in s[1:]:
                        m = m if m > x else x
                    e = _exp_neg((s - m).astype(F32))
                    den = np.add.accumulate(e)[-1]
                    num = np.add.accumulate(e[:, None] * pv[seen, b, hq // G], axis=0)[-1]
                    y[b, r, hq] = num / den
    return y.reshape(B, N, HqD), pk, pv


# ------------------------------------------------------------------------------------------------- the op

def attention_model(scale: float) -> onnx.ModelProto:
    f = TensorProto.FLOAT
    ins = [helper.make_tensor_value_info("q", f, ["B", "N", "HqD"]),
           helper.make_tensor_value_info("k", f, ["B", "N", "HkvD"]),
           helper.make_tensor_value_info("v", f, ["B", "N", "HkvD"]),
           helper.make_tensor_value_info("past_key", f, ["T", "B", "Hkv", "D"]),
           helper.make_tensor_value_info("past_value", f, ["T", "B", "Hkv", "D"]),
           helper.make_tensor_value_info("mask", TensorProto.BOOL, ["B", 1, "N", "T"])]
    outs = [helper.make_tensor_value_info("y", f, None),
            helper.make_tensor_value_info("present_key", f, None),
            helper.make_tensor_value_info("present_value", f, None)]
    node = helper.make_node("TreeAttention", [i.name for i in ins], [o.name for o in outs], domain=kernels.DOMAIN,
                            scale=float(scale))
    return helper.make_model(helper.make_graph([node], "attention", ins, outs),
                             opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(kernels.DOMAIN, 1)])


def session(scale: float, isa: str | None = None, monkeypatch=None) -> ort.InferenceSession:
    if isa is not None:
        monkeypatch.setenv("EAGLEX_ISA", isa)
    sess = ort.InferenceSession(attention_model(scale).SerializeToString(), ort_session.session_options(),
                                providers=["CPUExecutionProvider"])
    if isa is not None:
        monkeypatch.delenv("EAGLEX_ISA")
    return sess


def run(sess, feeds: dict) -> tuple[np.ndarray, ...]:
    return tuple(sess.run(None, feeds))


def case(B, Hq, Hkv, N, T, D, mask, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    return {"q": rng.standard_normal((B, N, Hq * D)).astype(F32),
            "k": rng.standard_normal((B, N, Hkv * D)).astype(F32),
            "v": rng.standard_normal((B, N, Hkv * D)).astype(F32),
            "past_key": rng.standard_normal((T, B, Hkv, D)).astype(F32),
            "past_value": rng.standard_normal((T, B, Hkv, D)).astype(F32),
            "mask": mask}


def chain_mask(B: int, N: int, T: int) -> np.ndarray:
    """Causal: row r sees the past and the new rows up to itself."""
    m = np.zeros((B, 1, N, T), bool)
    for r in range(N):
        m[:, 0, r, :T - N + r + 1] = True
    return m


def tree_mask(parents: list[int], B: int, T: int) -> np.ndarray:
    """A draft tree (parents[i] < i, -1 for the root's children... here the root row has parent -1): a row sees the
    past and its ancestors."""
    N = len(parents)
    m = np.zeros((B, 1, N, T), bool)
    m[:, 0, :, :T - N] = True
    for r in range(N):
        a = r
        while a >= 0:
            m[:, 0, r, T - N + a] = True
            a = parents[a]
    return m


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ----------------------------------------------------------------------------------------------------- tests

SHAPES = [(1, 9, 3, 1, 40, 64), (1, 9, 3, 6, 70, 64), (2, 4, 4, 3, 17, 8), (2, 6, 2, 5, 33, 80),
          (1, 2, 1, 4, 1, 5), (3, 4, 2, 2, 130, 128)]        # (B, Hq, Hkv, N, T, D)


@pytest.mark.parametrize("B,Hq,Hkv,N,T,D", SHAPES)
def test_equals_its_numpy_reference(B, Hq, Hkv, N, T, D):
    T = max(T, N)
    rng = np.random.default_rng(3)
    masks = {"chain": chain_mask(B, N, T), "random": rng.random((B, 1, N, T)) < 0.5}
    for name, mask in masks.items():
        feeds = case(B, Hq, Hkv, N, T, D, mask)
        got = run(session(1 / np.sqrt(D)), feeds)
        want = attention_reference(*feeds.values(), 1 / np.sqrt(D))
        for g, w, what in zip(got, want, ("y", "present_key", "present_value")):
            assert same(g, w), (name, what)


def _alone(sess, feeds: dict, b: int, r: int) -> np.ndarray:
    """Row (b, r) computed alone: one batch row, one new row, a buffer holding only the keys it sees, in order."""
    T, _, Hkv, D = feeds["past_key"].shape
    N = feeds["q"].shape[1]
    keys = np.concatenate([feeds["past_key"][:T - N, b], feeds["k"][b].reshape(N, Hkv, D)])
    vals = np.concatenate([feeds["past_value"][:T - N, b], feeds["v"][b].reshape(N, Hkv, D)])
    seen = np.flatnonzero(feeds["mask"][b, 0, r])
    own = np.flatnonzero(seen == T - N + r)
    assert len(own) == 1                                        # the row sees itself
    order = np.concatenate([np.delete(seen, own), seen[own]])   # itself last: the new row of the call alone
    alone = {"q": feeds["q"][b:b + 1, r:r + 1], "k": feeds["k"][b:b + 1, r:r + 1], "v": feeds["v"][b:b + 1, r:r + 1],
             "past_key": keys[order][:, None].copy(), "past_value": vals[order][:, None].copy(),
             "mask": np.ones((1, 1, 1, len(seen)), bool)}
    assert same(keys[order][-1], feeds["k"][b, r].reshape(Hkv, D))
    return run(sess, alone)[0][0, 0]


def test_a_row_is_the_same_alone_in_a_chain_a_tree_padded_or_batched(monkeypatch):
    """The same query rows and keys, placed as a chain, as a tree with siblings between ancestors, behind batch
    padding (masked past rows) and in a batch of three: every row equals itself computed alone, on every path."""
    B, Hq, Hkv, D, P = 3, 9, 3, 64, 29
    parents = [-1, 0, 0, 1, 1, 2, 3, 6]                                # rows whose ancestors are not contiguous
    N, T = len(parents), P + len(parents)
    tree = tree_mask(parents, B, T)
    padded = tree.copy()
    padded[1, 0, :, :7] = False                                        # batch row 1: 7 rows of left padding
    padded[2, 0, :, 3:11:2] = False                                    # batch row 2: holes in its past
    for isa in runnable_isas(monkeypatch):
        sess = session(0.125, isa, monkeypatch)
        for mask in (chain_mask(B, N, T), tree, padded):
            feeds = case(B, Hq, Hkv, N, T, D, mask, seed=5)
            y = run(sess, feeds)[0].reshape(B, N, Hq * D)
            for b in range(B):
                for r in range(N):
                    if feeds["mask"][b, 0, r, T - N + r]:
                        assert same(y[b, r], _alone(sess, feeds, b, r)), (isa, b, r)


@pytest.mark.parametrize("T", [4096, 4097, 1023, 1025, 17])
def test_long_contexts_and_group_boundaries_on_every_path(T, monkeypatch):
    feeds = case(1, 9, 3, 4, T, 64, chain_mask(1, 4, T), seed=T)
    outs = {isa: run(session(0.125, isa, monkeypatch), feeds) for isa in runnable_isas(monkeypatch)}
    for isa, out in outs.items():
        assert all(same(a, b) for a, b in zip(out, outs["portable"])), isa
    if T == 17:
        want = attention_reference(*feeds.values(), 0.125)
        assert all(same(a, b) for a, b in zip(outs["portable"], want))
    sess = session(0.125)
    for r in (0, 3):
        assert same(outs["portable"][0][0, r], _alone(sess, feeds, 0, r))


def test_new_rows_are_written_in_place_into_bound_buffers():
    """Bound to the past buffers' memory, present_* are those buffers with rows T-N.. written; a caller that binds
    nothing gets the same values in new buffers."""
    B, Hq, Hkv, N, T, D = 2, 4, 2, 3, 12, 16
    feeds = case(B, Hq, Hkv, N, T, D, chain_mask(B, N, T), seed=9)
    sess = session(0.25)
    y, pk, pv = run(sess, dict(feeds))
    kbuf, vbuf = feeds["past_key"].copy(), feeds["past_value"].copy()
    binding = sess.io_binding()
    for name in ("q", "k", "v", "mask"):
        binding.bind_cpu_input(name, feeds[name])
    for name, buf in (("past_key", kbuf), ("past_value", vbuf)):
        binding.bind_input(name, "cpu", 0, np.float32, list(buf.shape), buf.ctypes.data)
    binding.bind_output("y", "cpu")
    for name, buf in (("present_key", kbuf), ("present_value", vbuf)):
        binding.bind_output(name, "cpu", 0, np.float32, list(buf.shape), buf.ctypes.data)
    sess.run_with_iobinding(binding)
    assert same(binding.copy_outputs_to_cpu()[0], y)
    assert same(kbuf, pk) and same(vbuf, pv)
    assert same(kbuf[:T - N], feeds["past_key"][:T - N])


def test_nan_inf_denormal_and_rows_that_see_nothing():
    B, Hq, Hkv, N, T, D = 2, 4, 2, 5, 20, 24
    mask = np.random.default_rng(4).random((B, 1, N, T)) < 0.7
    mask[0, 0, 0] = False                                             # sees nothing: zeros
    mask[0, 0, 1] = False
    mask[0, 0, 1, 3] = True                                           # sees one key
    feeds = case(B, Hq, Hkv, N, T, D, mask, seed=11)
    feeds["q"][0, 2, 5] = np.nan
    feeds["q"][1, 1, 7] = np.inf
    feeds["q"][1, 3, :] = F32(1e-41)
    feeds["past_key"][4, 1, 0, 3] = -np.inf
    feeds["past_key"][6, 0, 1, :] = F32(1e-40)
    feeds["past_value"][8, 1, 1, 2] = np.nan
    feeds["q"][0, 4, 0] = F32(3e38)
    got = run(session(0.2), feeds)
    want = attention_reference(*feeds.values(), 0.2)
    assert all(same(a, b) for a, b in zip(got, want))
    assert not got[0][0, 0].any()


@pytest.mark.parametrize("change,message", [
    (lambda f: f.update(mask=f["mask"][:, :, :, :-1]), "mask"),
    (lambda f: f.update(q=f["q"][:, :, :-1]), "Q "),
    (lambda f: f.update(k=f["k"][:, :1]), "K "),
    (lambda f: f.update(past_value=f["past_value"][:-1]), "past_value"),
    (lambda f: f.update(past_key=f["past_key"][:2], past_value=f["past_value"][:2],
                        mask=f["mask"][:, :, :, :2]), "cannot hold"),
])
def test_bad_shapes_are_refused_with_an_error(change, message):
    feeds = case(1, 4, 2, 3, 10, 16, chain_mask(1, 3, 10))
    change(feeds)
    with pytest.raises(Exception, match="eaglex.TreeAttention: .*" + message):
        run(session(0.25), {k: np.ascontiguousarray(v) for k, v in feeds.items()})


def test_a_bad_scale_is_refused():
    with pytest.raises(Exception, match="scale must be positive"):
        session(0.0)


def test_the_self_test_passes_under_the_build():
    test = REPO / "build" / "kernels" / "eaglex_attention_test"
    if not test.is_file():
        pytest.skip("the library comes from elsewhere (EAGLEX_KERNELS_LIB or the wheel)")
    out = subprocess.run([str(test)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stdout[-2000:]
