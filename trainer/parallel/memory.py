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
from .fsdp_api import local_tensor as _local
from .nvme import FILE_BACKED
from .residuals import held_bytes as residual_bytes


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
    """``{"params", "grads", "optimizer", "residuals", "optimizer_file"}``: bytes of distinct storages held right
    now on this rank (``residuals``: error feedback's, a full fp32 gradient per rank; residuals.py;
    ``optimizer_file``: optimizer state in offload files, nvme.py, not counted in ``optimizer``)."""
    fsdp = {"sharded_param": [], "unsharded_param": [], "sharded_grad": [], "unsharded_grad": []}
    for kind, t in held_tensors(model):
        fsdp[kind].append(t)
    seen: set = set()
    params = _sum_unique([*fsdp["sharded_param"], *fsdp["unsharded_param"], *model.parameters()], seen)
    grads = _sum_unique([*fsdp["sharded_grad"], *fsdp["unsharded_grad"],
                         *(p.grad for p in model.parameters() if p.grad is not None)], seen)
    opt = opt_file = 0
    if optimizer is not None:
        state = [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        in_file = [v for v in state if _local(v).untyped_storage().data_ptr() in FILE_BACKED]
        opt_file = _sum_unique(in_file, seen)  # offload = "nvme": pages of a file, not host memory (nvme.py)
        opt = _sum_unique(state, seen)

    return {"params": params, "grads": grads, "optimizer": opt, "residuals": residual_bytes(model),
            "optimizer_file": opt_file}


class MemorySampler:
    """Keeps the peak of ``held_bytes`` per category over the points it is asked to sample."""

    def __init__(self):
        self.peak = {"params": 0, "grads": 0, "optimizer": 0, "residuals": 0, "optimizer_file": 0}

    def sample(self, model, optimizer=None) -> None:
        now = held_bytes(model, optimizer)
        for k, v in now.items():
            self.peak[k] = max(self.peak[k], v)

    def cuda_peak(self, device) -> int | None:
        if device is not None and getattr(device, "type", "") == "cuda":
            return int(torch.cuda.max_memory_allocated(device))
        return None


def host_memory(files_under: str | None = None) -> dict[str, int] | None:
    """This process's host memory now, from the kernel's accounting (Linux; None elsewhere): ``rss`` (resident),
    ``private`` (resident pages no other process maps: what this rank alone costs the node), ``peak_rss``
    (the high-water mark, VmHWM) and, with ``files_under``, ``files_resident``: the resident pages of its
    mappings of files in that directory (the offload state files: 0 when they are on disk only)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line and not line[0].isdigit())
        with open("/proc/self/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None

    def kib(text: str) -> int:
        return int(text.split()[0]) * 1024

    out["rss"] = kib(fields["Rss"])
    out["private"] = kib(fields["Private_Clean"]) + kib(fields["Private_Dirty"])
    out["peak_rss"] = kib(status["VmHWM"])
    if files_under:
        total, inside = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                    inside = files_under in line
                elif inside and line.startswith("Rss:"):
                    total += kib(line.split(":", 1)[1])
        out["files_resident"] = total
    return out
