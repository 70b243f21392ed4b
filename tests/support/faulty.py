"""A device that computes wrong products, stood in for through torch's public override of tensor functions
(``TorchFunctionMode``): inside ``with FaultyMatmul(corrupt):`` every float32 matrix product is passed through
``corrupt``; float64 products (the health check's reference) and everything else are computed as usual."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.mm}


class FaultyMatmul(TorchFunctionMode):
    def __init__(self, corrupt):
        super().__init__()
        self.corrupt = corrupt

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _MATMUL and isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            out = self.corrupt(out)
        return out
