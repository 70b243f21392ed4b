"""Bytes of model state one rank actually holds: parameters, gradients, optimizer state, error-feedback residuals.

Counted from live tensors, not from a formula: every storage is counted once (a gradient that is a view into a
DDP bucket counts as the bucket; a sharded parameter as FSDP2's padded flat shard behind it; an unsharded
parameter as its all-gather output, 0 once freed). Sampled at the step's phase boundaries (after each forward,
after each backward, after the optimizer step) of the first optimizer step, keeping the peak per category;
transient buffers inside one forward or backward (a block gathered and freed again at stage 3, the bucket being
reduced) are not counted: they are bounded by the largest block, not by the model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .fsdp_api import held_tensors


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return (t.device.type, t.device.index, s.data_ptr()), s.nbytes()


def _sum_unique(tensors: Iterable[torch.Tensor], seen: set) -> int:
    total = 0
    for t in tensors:
        key, nbytes = _storage_key(_local(t))
        if nbytes == 0 or key in seen:
            continue
        seen.add(key)
        total += nbytes
    return total


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """``{"params", "grads", "optimizer", "residuals"}``: bytes of distinct storages held right now on this rank
    (``residuals``: error feedback's, a full fp32 gradient per rank; residuals.py)."""
    fsdp = {"sharded_param": [], "unsharded_param": [], "sharded_grad": [], "unsharded_grad": []}
    for kind, t in held_tensors(model):
        fsdp[kind].append(t)
    seen: set = set()
    params = _sum_unique([*fsdp["sharded_param"], *fsdp["unsharded_param"], *model.parameters()], seen)
    grads = _sum_unique([*fsdp["sharded_grad"], *fsdp["unsharded_grad"],
                         *(p.grad for p in model.parameters() if p.grad is not None)], seen)
    opt = 0
    if optimizer is not None:
        opt = _sum_unique([v for state in optimizer.state.values() for v in state.values()
                           if isinstance(v, torch.Tensor)], seen)
    from .residuals import held_bytes as residual_bytes

    return {"params": params, "grads": grads, "optimizer": opt, "residuals": residual_bytes(model)}


class MemorySampler:
    """Keeps the peak of ``held_bytes`` per category over the points it is asked to sample."""

    def __init__(self):
        self.peak = {"params": 0, "grads": 0, "optimizer": 0, "residuals": 0}

    def sample(self, model, optimizer=None) -> None:
        now = held_bytes(model, optimizer)
        for k, v in now.items():
            self.peak[k] = max(self.peak[k], v)

    def cuda_peak(self, device) -> int | None:
        if device is not None and getattr(device, "type", "") == "cuda":
            return int(torch.cuda.max_memory_allocated(device))
        return None
