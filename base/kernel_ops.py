"""The contract of eaglex's ONNX Runtime custom ops (kernels/, C++), shared by the graphs' writer (export/) and
their runner (runtime/kernels.py): the op domain, its version, the op names."""

DOMAIN = "eaglex"
VERSION = 2          # bumped with any change of an op's inputs, attributes or arithmetic; engines record it
F32_OP, Q8_OP, Q4_OP = "LinearF32", "LinearQ8", "LinearQ4"
ATTENTION_OP = "TreeAttention"
OPS = (F32_OP, Q8_OP, Q4_OP, ATTENTION_OP)
