"""Weight layout for export: every nn.Linear becomes a MatMul over a weight stored [in, out].

nn.Linear keeps W as [out, in] and the exporter emits `MatMul(x, Transpose(W))`; its optimizer then folds the
Transpose into a *new* initializer, so the export would briefly hold every weight twice. Transposing here, one
matrix at a time and dropping the original, keeps the peak at the weights plus one matrix, and the ONNX MatMul
reads the initializer as is (what ORT's MLAS GEMM wants).
"""
from __future__ import annotations

import torch
from torch import nn


class LinearT(nn.Module):
    """y = x @ weight_t (+ bias); weight_t [in, out]. Same numbers as the nn.Linear it replaces (up to rounding)."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight_t = nn.Parameter(weight_t, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """[out, in] view, for code that reads `.weight` (dtype checks, shapes)."""
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


def to_matmul_layout(module: nn.Module) -> int:
    """Replace every nn.Linear under `module` in place; returns how many were replaced.

    A weight shared with an embedding (tied lm_head) is copied, since Gather needs [V, H] and MatMul [H, V].
    """
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                w = child.weight.detach()
                wt = w.t().contiguous()                 # the one extra matrix alive at a time
                b = None if child.bias is None else child.bias.detach()
                child.weight = None                      # drop our reference before the next matrix
                setattr(parent, name, LinearT(wt, b))
                count += 1
    return count
