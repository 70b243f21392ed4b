"""Pre-flight health check, per worker, before training starts.

Each worker multiplies two fixed 256x256 matrices on its device and compares the result with a float64 product
of the same inputs, timed; then all workers run an all-reduce of known values (each contributes rank + 1; the
sum must be W(W+1)/2), timed as a round trip. The results are gathered, and if any worker computed a wrong
value or took longer than ``run.health_timeout_s``, every worker raises ``HealthCheckError`` naming the bad ones
(rank, host, pid). On a real cluster the operator replaces that node; under Ray Train with
``ray.max_failures > 0`` the group is started again, possibly elsewhere. Rank 0 writes what every worker
measured to ``health.json`` in the launch's attempt folder (``RUN_DIR/attempts/<k>/``, trainer/launch/rundir.py).

The matmul tolerance: an fp32 dot product of n terms has a rounding error of at most about n * eps * sum|a_i b_i|
(eps = 2^-24 per operation, summed over n = 256 terms); a factor of 4 on top covers blocked summation orders. A
device that flips bits or returns garbage is off by far more.
"""

from __future__ import annotations

import os
import socket
import time

from dutycycle.engine import formats, io
from dutycycle.engine.errors import DutycycleError

from .world import all_gather

N = 256


class HealthCheckError(DutycycleError):
    """A worker failed the pre-flight check: its device computes wrong values, or it or the network is too slow."""


def check_device(device, timeout_s: float) -> dict:
    import torch

    g = torch.Generator().manual_seed(1234)
    a64 = torch.randn(N, N, generator=g, dtype=torch.float64)
    b64 = torch.randn(N, N, generator=g, dtype=torch.float64)
    a, b = a64.float().to(device), b64.float().to(device)
    a @ b  # warm-up (kernel selection, lazy init)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    c = a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    ref = a.double().cpu() @ b.double().cpu()  # the fp32 inputs, multiplied exactly enough in float64
    bound = 4 * N * 2.0**-24 * (a.double().cpu().abs() @ b.double().cpu().abs())
    err = (c.double().cpu() - ref).abs()
    bad = int((err > bound).sum())
    problems = []
    if bad or not torch.isfinite(c).all():
        problems.append(f"matmul wrong in {bad} of {N * N} entries (max error {float(err.max()):.3g})")
    if seconds > timeout_s:
        problems.append(f"matmul took {seconds:.3f} s (limit {timeout_s} s)")
    return {"matmul_s": seconds, "matmul_max_error": float(err.max()), "problems": problems}


def check_collective(rank: int, world: int, device, timeout_s: float) -> dict:
    import torch
    import torch.distributed as dist

    if world == 1 or not dist.is_initialized():
        return {"allreduce_s": 0.0, "problems": []}
    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t)  # warm-up: connections
    t = torch.full((4,), float(rank + 1), device=device)
    t0 = time.perf_counter()
    dist.all_reduce(t)
    got = t.cpu()
    seconds = time.perf_counter() - t0
    want = world * (world + 1) / 2
    problems = []
    if not bool((got == want).all()):
        problems.append(f"all-reduce returned {got.tolist()} instead of {want}")
    if seconds > timeout_s:
        problems.append(f"all-reduce round trip took {seconds:.3f} s (limit {timeout_s} s)")
    return {"allreduce_s": seconds, "problems": problems}


def preflight(rank: int, world: int, device, timeout_s: float, run_dir: str = "") -> list[dict]:
    """Run the check on every worker (a collective); returns every worker's record, or raises HealthCheckError
    on every worker when any failed. ``run_dir``: where rank 0 writes ``health.json`` (the attempt's folder)."""
    import torch

    device = device or torch.device("cpu")
    me = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "device": str(device)}
    dev = check_device(device, timeout_s)
    net = check_collective(rank, world, device, timeout_s)
    me.update(matmul_s=dev["matmul_s"], matmul_max_error=dev["matmul_max_error"], allreduce_s=net["allreduce_s"],
              problems=dev["problems"] + net["problems"])
    records = all_gather(me, world)
    if rank == 0 and run_dir:
        io.write_json_atomic(io.join(run_dir, "health.json"),
                             formats.stamp({"workers": records, "timeout_s": timeout_s}))
    bad = [r for r in records if r["problems"]]
    if bad:
        names = "; ".join(f"rank {r['rank']} (host {r['host']}, pid {r['pid']}, {r['device']}): "
                          + ", ".join(r["problems"]) for r in bad)
        raise HealthCheckError(f"pre-flight health check failed on {len(bad)} of {world} worker(s): {names}. "
                               "Replace the node (or raise run.health_timeout_s if the limit is too strict)")
    return records
