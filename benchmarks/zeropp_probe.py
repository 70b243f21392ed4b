"""Where a ZeRO++ row's step goes, per collective: benchmarks/zeropp.py's breakdown of hpZ against stage 3.

``CommProbe(trainer)`` wraps the trainer's FSDP2 all-gather and reduce-scatter (the objects it set through
FSDP2's public ``set_custom_all_gather`` / ``set_custom_reduce_scatter``) and times, per step and per collective
kind and phase (forward, backward), the seconds this thread spent in each call and in each wait on an
asynchronous one: the exposed communication the trainer counts as ``comm``, split by what caused it. hpZ's
backward gathers are the ``all_gather_hpz`` kind (over the node-sized group FSDP2 reshards to after forward).
The wrappers add two clock reads per call and change nothing else: the same objects do the work.

Used by benchmarks/zero_worker.py's ``--breakdown``.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.distributed as dist
from dutycycle.trainer.parallel.comm import CountingAllGather, QuantAllGather
from dutycycle.trainer.parallel.fsdp_api import AllGather, ReduceScatter, custom_reduce_scatters, fsdp_modules


class _Waited(dist.Work):
    """An asynchronous collective's handle whose ``wait()`` is timed into the probe's current step."""

    def __init__(self, inner: dist.Work, probe: CommProbe, key: str):
        super().__init__()
        self.inner, self.probe, self.key = inner, probe, key

    def wait(self, timeout=None) -> bool:
        t0 = time.perf_counter()
        self.inner.wait()
        self.probe.add(self.key, "wait_s", time.perf_counter() - t0)
        return True

    def is_completed(self) -> bool:
        return self.inner.is_completed()


class _TimedGather(AllGather):
    def __init__(self, inner: CountingAllGather, probe: CommProbe):
        self.inner, self.probe = inner, probe

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        kind = "all_gather_hpz" if self.inner.secondary(group) else "all_gather"
        return self.probe.call(kind, lambda: self.inner(output_tensor, input_tensor, group, async_op))


class _TimedReduceScatter(ReduceScatter):
    def __init__(self, inner: ReduceScatter, probe: CommProbe):
        self.inner, self.probe = inner, probe

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return self.probe.call("reduce_scatter",
                               lambda: self.inner(output_tensor, input_tensor, group, op, async_op))


class CommProbe:
    """Per training step (one forward with gradients on): forward seconds, and per ``"<phase> <kind>"`` the
    calls, the seconds spent issuing or running them (``call_s``: a synchronous collective's whole time, an
    asynchronous one's start) and the seconds waited on asynchronous ones (``wait_s``)."""

    def __init__(self, trainer, hpz: bool):
        strategy = trainer.strategy
        model, quant = strategy.module, strategy.quant
        # the trainer's own all-gather, built as apply.parallelize builds it (FSDP2 has no public getter)
        gather = QuantAllGather(strategy.meter, quant.weights_bits, quant.block, hpz=hpz) \
            if quant.weights_bits < 32 else CountingAllGather(strategy.meter, hpz=hpz)
        modules, scatters = fsdp_modules(model), custom_reduce_scatters(model)
        assert len(modules) == len(scatters), (len(modules), len(scatters))
        timed_gather = _TimedGather(gather, self)
        for module, scatter in zip(modules, scatters, strict=True):
            module.set_custom_all_gather(timed_gather)
            module.set_custom_reduce_scatter(_TimedReduceScatter(scatter, self))
        self.steps: list[dict] = []
        self._phase = "backward"
        self._t_forward = 0.0
        # the root's pre-forward hook runs first (before FSDP2's own unshard), its post-forward hook last
        model.register_forward_pre_hook(self._pre_forward, prepend=True)
        model.register_forward_hook(self._post_forward)

    def _pre_forward(self, module, args):
        if not torch.is_grad_enabled():  # evaluation: its gathers belong to no step
            self._phase = "eval"
            return
        self.steps.append({"forward_s": 0.0, "collectives": defaultdict(lambda: defaultdict(float))})
        self._phase, self._t_forward = "forward", time.perf_counter()

    def _post_forward(self, module, args, output):
        if self._phase == "forward":
            self.steps[-1]["forward_s"] += time.perf_counter() - self._t_forward
            self._phase = "backward"

    def add(self, key: str, what: str, seconds: float) -> None:
        if self.steps and not key.startswith("eval"):
            self.steps[-1]["collectives"][key][what] += seconds

    def call(self, kind: str, run):
        key = f"{self._phase} {kind}"
        t0 = time.perf_counter()
        out = run()
        self.add(key, "call_s", time.perf_counter() - t0)
        self.add(key, "calls", 1)
        return _Waited(out, self, key) if isinstance(out, dist.Work) else out

    def summary(self, skip: int) -> dict:
        """Means over the steps after the first ``skip``: ``forward_s`` and, per collective, calls, ``call_s``,
        ``wait_s`` and ``blocked_s`` (their sum: what this thread was held by that collective)."""
        steps = self.steps[skip:] or self.steps
        n = len(steps)
        keys = sorted({k for s in steps for k in s["collectives"]})
        per = {}
        for key in keys:
            sums = {w: sum(s["collectives"][key][w] for s in steps) / n for w in ("calls", "call_s", "wait_s")}
            per[key] = {**sums, "blocked_s": sums["call_s"] + sums["wait_s"]}
        return {"steps": n, "forward_s": sum(s["forward_s"] for s in steps) / n, "collectives": per}


def secondary_copy_seconds(strategy, node_size: int, repeats: int = 5) -> float:
    """hpZ's post-forward reshard, measured apart: FSDP2 keeps this rank's 1/node_size slice of each unit's
    gathered parameters as a copy (``clone``) once per forward. The median time of copying that many bytes of
    the model's dtype here, in one tensor (the real reshard is one copy per parameter: no faster)."""
    numel = sum(p.numel() for p in strategy.module.parameters()) // node_size  # the full model's 1/n
    src = torch.empty(numel, dtype=strategy.compute_dtype).fill_(1.0)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.clone()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
