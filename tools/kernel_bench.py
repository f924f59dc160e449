"""eaglex's linear-layer kernels against ONNX Runtime's stock ops on one token's worth of a model's linear layers,
interleaved: one graph per implementation holding every linear layer of a Llama-shaped target once (by default
SmolLM2-135M's: 30 x [q|k|v 576->960, o 576->576, gate|up 576->3072, down 1536->576] + lm_head 576->49152, seeded
random weights), timed at 1..16 rows per call, outputs bound with IOBinding, medians of `--reps` interleaved runs.

    python tools/kernel_bench.py [--threads 1] [--rows 1,2,4,8,16] [--reps 9] [--layers 30]
"""
from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper


def graph(layers: int, hidden: int, inter: int, qkv: int, vocab: int):
    rng = np.random.default_rng(0)
    shapes = [(hidden, qkv), (hidden, hidden), (hidden, 2 * inter), (inter, hidden)] * layers + [(hidden, vocab)]
    nodes, inits, outs = [], [], []
    for i, (K, N) in enumerate(shapes):
        inits.append(numpy_helper.from_array((rng.standard_normal((K, N)) * 0.02).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [f"x{K}", f"w{i}"], [f"y{i}"]))
        outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    ins = [helper.make_tensor_value_info(f"x{K}", TensorProto.FLOAT, ["m", K]) for K in (hidden, inter)]
    model = helper.make_model(helper.make_graph(nodes, "linears", ins, outs, inits),
                              opset_imports=[helper.make_opsetid("", 21)])
    return model, sum(K * N for K, N in shapes)


def variants(base) -> dict:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from eaglex.export import kernel_graphs as kg

    out = {"ort MatMul fp32": base}
    for name, bits in (("ort MatMulNBits 8-bit", 8), ("ort MatMulNBits 4-bit", 4)):
        q = MatMulNBitsQuantizer(copy.deepcopy(base), bits=bits, block_size=32, is_symmetric=bits == 8,
                                 accuracy_level=4)
        q.process()
        out[name] = q.model.model
    for name, rewrite in (("eaglex LinearF32", kg.to_kernel_f32), ("eaglex LinearQ8", kg.to_kernel_q8),
                          ("eaglex LinearQ4", kg.to_kernel_q4)):
        m = copy.deepcopy(base)
        rewrite(m)
        out[name] = m
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args(argv)
    logging.disable(logging.INFO)                    # the quantizer logs a line per node
    import onnxruntime as ort

    from eaglex.runtime.ort_session import session_options, use_global_pool

    use_global_pool(args.threads)
    base, params = graph(args.layers, 576, 1536, 960, 49152)
    sessions = {k: ort.InferenceSession(m.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
                for k, m in variants(base).items()}
    rng = np.random.default_rng(1)
    print(f"{params / 1e6:.1f}M weights, {args.threads} thread(s), ms per call (median of {args.reps})")
    print(f"{'rows':>4}  " + "  ".join(f"{k:>22}" for k in sessions))
    for rows in (int(r) for r in args.rows.split(",")):
        feeds = {f"x{K}": rng.standard_normal((rows, K)).astype(np.float32) for K in (576, 1536)}
        binds = {}
        for k, s in sessions.items():
            io = s.io_binding()
            for n, v in feeds.items():
                io.bind_cpu_input(n, v)
            for o in s.get_outputs():
                io.bind_output(o.name)
            binds[k] = io
            s.run_with_iobinding(io)
        times = {k: [] for k in sessions}
        for _ in range(args.reps):
            for k, s in sessions.items():
                t = time.perf_counter()
                s.run_with_iobinding(binds[k])
                times[k].append(time.perf_counter() - t)
        print(f"{rows:>4}  " + "  ".join(f"{statistics.median(v) * 1e3:>22.2f}" for v in times.values()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
