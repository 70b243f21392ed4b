"""Per-step time accounting: where did each second of a step go?

Phases (seconds per step, per rank):
  data_wait         blocked on the loader for the next batch
  h2d               host-to-device copy
  forward_backward  forward, loss and backward of every micro-batch
  comm              gradient synchronization (GradSync) and parameter gathering
  optimizer         clipping, optimizer step, zero_grad, schedule
  checkpoint        time the loop stalled for the checkpointer
  eval              validation passes
  other             the rest of the step's wall time (logging, metric reduction, Python)

On CPU each phase is a monotonic-clock interval; every phase boundary is a synchronous point (CPU kernels and
gloo collectives return when done), so the intervals are honest. On GPU, kernels are asynchronous: phases are
recorded with CUDA events and resolved once per step after a single synchronize, so timing does not itself
serialize the GPU inside the step.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

PHASES = ("data_wait", "h2d", "forward_backward", "comm", "optimizer", "checkpoint", "eval")
ALL_PHASES = (*PHASES, "other")
# Phases that do the model's useful work: goodput is their share of wall time.
USEFUL = ("forward_backward", "optimizer")


class StepTimer:
    """Times the phases of one step at a time. ``phase(name)`` is a context manager; ``end_step()`` returns
    ``{phase: seconds}`` including ``other`` and ``step`` (the step's wall time)."""

    def __init__(self, device=None):
        import torch

        self.cuda = device is not None and getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available()
        self._events: list[tuple[str, object, object]] = []
        self._cpu: dict[str, float] = {}
        self.start_step()
        self.totals: dict[str, float] = dict.fromkeys((*ALL_PHASES, "step"), 0.0)
        self.steps = 0

    def start_step(self) -> None:
        self._events.clear()
        self._cpu = dict.fromkeys(PHASES, 0.0)
        self._start = time.perf_counter()

    @contextmanager
    def phase(self, name: str, host: bool = False):
        """Time a phase. ``host=True`` forces the wall clock even on GPU (e.g. waiting for the loader, which is
        host work that does not enqueue kernels)."""
        assert name in PHASES, name
        if self.cuda and not host:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((name, start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._cpu[name] += time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        """Attribute time measured elsewhere (e.g. the loader's own wait counter) to a phase."""
        self._cpu[name] += seconds

    def current(self) -> dict[str, float]:
        """Phase seconds so far in this step (on GPU: synchronizes once and resolves the recorded events)."""
        if self.cuda and self._events:
            import torch

            torch.cuda.synchronize()
            for name, start, end in self._events:
                self._cpu[name] += start.elapsed_time(end) / 1000.0
            self._events.clear()
        return dict(self._cpu)

    def end_step(self) -> dict[str, float]:
        self.current()
        wall = time.perf_counter() - self._start
        out = dict(self._cpu)
        out["other"] = max(0.0, wall - sum(out.values()))
        out["step"] = wall
        for k, v in out.items():
            self.totals[k] += v
        self.steps += 1
        return out


def gather_stats(values: list[float]):
    """All-gather a small vector of floats from every rank; returns a [world, len] tensor (one row per rank).

    Works without an initialized process group (local mode): the single row is this process's values."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t.unsqueeze(0)
    backend = dist.get_backend()
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    t = t.to(dev)
    out = torch.empty(dist.get_world_size() * len(values), dtype=torch.float64, device=dev)
    # all_gather_single is the newer name (torch >= 2.10 deprecates all_gather_into_tensor)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t)
    return out.view(-1, len(values)).cpu()


def breakdown(totals: dict[str, float], wall: float) -> dict[str, dict[str, float]]:
    """Seconds and fractions of ``wall`` per phase."""
    seconds = {k: float(totals.get(k, 0.0)) for k in ALL_PHASES}
    fractions = {k: (v / wall if wall > 0 else 0.0) for k, v in seconds.items()}
    return {"seconds": seconds, "fractions": fractions}
