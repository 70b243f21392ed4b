"""The parity check that runs during training (``parallel.check_every = N``): every N optimizer steps, the
gradient the sharded, quantized path applied is compared with a plain float64 all-reduce of the same step's
local gradients, for a sample of parameters, within a bound derived from the path's arithmetic.

Peers have shipped reductions that were silently wrong: a parameter whose gradient was never reduced because
its size equalled the bucket's (DeepSpeed #4321), a gradient whose contribution was counted once too few or too
many, a residual added to another parameter's gradient (this project's own issue 37, finding 2). Loss curves
hide such errors for a long time. The check proves, at the step it runs, that what each rank is about to apply
is the data-parallel mean of every rank's gradient.

How, on a check step (``ParityCheck.step(k)`` returns a ``StepCheck``; the loop runs the step inside it):

1. **Each rank's local gradient, captured where autograd produces it.** For every sampled parameter a forward
   pre-hook on the module that owns it reads the tensor forward actually uses (under FSDP2 the unsharded
   parameter it registers on the module for forward and backward; under DDP the parameter itself) and puts a
   tensor hook on it, once per step. The hook receives that rank's gradient of each backward, before anything
   reduces it, and adds it in float64 (plus its magnitude, for the rounding bound). Micro-batches add up;
   activation checkpointing's recompute reuses the same tensor, so nothing is counted twice. Recomputing the
   gradient on a float64 replica of the model was the other way; it is not used because it measures the
   forward/backward's own fp32 or bf16 rounding (which no reduction bound covers, and which Adam does not care
   about) and doubles the step, while the bugs above all live after backward.
2. **The reference:** those local gradients (made whole over tensor parallelism first, ``full_tensor()``)
   summed with ``dist.all_reduce`` in float64 over the data-parallel ranks (every rank under flat and hybrid
   sharding, whose replica and shard dimensions both split the batch; the ``data`` dimension under tensor
   parallelism) and divided by their number: the data-parallel mean that FSDP2 and DDP claim to compute.
3. **What was applied:** each sampled parameter's ``.grad`` after backward, before clipping (an exact common
   scale) and ``optimizer.step``: the shard each rank holds, gathered whole (``full_tensor()``) so that every
   rank compares every element and reaches the same verdict (the fail flag is all-reduced too: all ranks stop
   together, none hangs in the next collective).
4. **The bound**, per element (derivations in ``element_bound``), from what the path does: fp32 or fp64
   rounding of the accumulation and the sum, plus, for quantized gradients, the block quantization's error
   from ``qcollectives``' docstring with ``A`` the largest magnitude the quantizer saw in the parameter's FSDP2
   unit (measured at the reduce-scatter seam on this step, the residual included, over every rank), plus
   error feedback's residual term.
5. **The wire:** the bytes, calls and wire dtype of each collective kind during the step, read from the meter's
   ``Traffic`` (``dtypes`` where traffic.py records them: ``getattr(traffic, "dtypes", {})``).

The result is a ``CheckResult`` (a metrics row); an element beyond its bound raises ``ParityCheckFailed``
naming the parameter, the error, the bound and what to do. The sample is the largest parameter of each FSDP2
unit (each unit has its own reduce-scatter and residual), at most ``MAX_UNITS`` units spread evenly, chosen
from names and shapes alone: the same on every rank. Off (``check_every = 0``) nothing is installed and the
step runs exactly as before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from dutycycle.engine.errors import ParityCheckFailed
from torch import nn
from torch.distributed.tensor import DTensor

from .apply import shard_units
from .fsdp_api import ReduceScatter, fsdp_modules, own_reduce_scatters, predivide_factor
from .quant import QMAX

MAX_UNITS = 8  # parameters sampled (one per unit): the check's cost is theirs, not the model's

UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}


def sample_parameters(module: nn.Module, unit_names: list[str]) -> list[str]:
    """The parameters to check: in each unit (``unit_names``: FSDP2's sharded blocks; the root "" holds the
    rest), the one with the most elements (ties: the first in the model's order); at most ``MAX_UNITS`` units,
    evenly spread over the model. Depends only on names and shapes: the same on every rank."""
    units = sorted(unit_names, key=len, reverse=True)  # innermost first
    best: dict[str, tuple[int, str]] = {}
    order: list[str] = []
    for name, p in module.named_parameters():
        unit = next((u for u in units if name.startswith(u + ".")), "")
        if unit not in best:
            order.append(unit)
        if unit not in best or p.numel() > best[unit][0]:
            best[unit] = (p.numel(), name)
    if len(order) > MAX_UNITS:
        order = [order[round(i * (len(order) - 1) / (MAX_UNITS - 1))] for i in range(MAX_UNITS)]
    return [best[u][1] for u in order]


def unit_of(name: str, unit_names: list[str]) -> str:
    return max((u for u in unit_names if name.startswith(u + ".")), key=len, default="")


def element_bound(*, sum_abs: torch.Tensor, dp: int, micro: int, acc_dtype: torch.dtype, bits: int,
                  two_hop: bool, amax: float, residual: float, calls: int) -> torch.Tensor:
    """The largest error the reduction may make in each element of the mean gradient (float64).

    ``sum_abs``: per element, the sum over ranks and micro-batches of the local gradients' magnitudes (S);
    ``dp`` ranks (W), ``micro`` micro-batches (M), accumulated and summed in ``acc_dtype`` (unit roundoff u).

    - Rounding (every path): the mean is M*W terms added in some order, a division by W and, for DDP, a
      pre-scaling by 1/W: k = M + W + 2 rounding steps at most on any term, and a sum of n terms in floating
      point errs by at most gamma_{n-1} * sum |terms| (Higham, 2nd ed., eq. 4.4), so |err| <= gamma_k * S / W
      with gamma_k = k*u / (1 - k*u). fp32 (u = 2^-24) for fp32 runs and for bf16 parameters (FSDP2 reduces
      in fp32, reduce_dtype; the bf16 gradients come out of backward already rounded, and casting them to fp32 or
      float64 is exact, so the bf16 rounding is not the reduction's); fp64 (u = 2^-53) for fp64 runs.
    - Quantized (qgZ, ``bits`` 8 or 4; qcollectives.py): the SUM of a flat reduce-scatter errs by W*e*A, two
      hops by W*e*A*(2+e), e = 1/(2*qmax); AVG divides by W: e*A (or e*A*(2+e)) per call. ``amax`` (A) is the
      largest magnitude the quantizer saw in the unit over all ranks and all the step's calls (blocks hold
      parts of several parameters, so the unit's maximum is the one that bounds every block). ``calls``
      reduce-scatters per step (one, or M with parallel.reduce_every_micro_step) each add that error.
    - Error feedback: what is sent is x + r_old, and its quantization error is what becomes r_new; the output
      is mean(x) + mean(r_old) - mean(r_new). |r_new| is the quantization term above (A measured on x + r_old);
      mean(r_old) adds at most ``residual`` (R, the largest old residual element over ranks) per call.
    - The fp32 sum of the dequantized values rounds too: gamma_k times W terms of at most A(1+e)(2+e) + R.
    """
    u = UNIT_ROUNDOFF[acc_dtype]
    k = micro + dp + 2
    gamma = k * u / (1 - k * u)
    bound = sum_abs * (gamma / dp)
    if bits in QMAX and calls:
        # quant.py: |x - x'| <= absmax / (2 qmax), exceeded in fp32 by a relative 4 qmax 2^-24 at most (the
        # scale's, the division's and the product's rounding); normal scales assumed (absmax >= ~1.5e-36)
        e = (1 + 4 * QMAX[bits] * 2.0 ** -24) / (2 * QMAX[bits])
        per_call = e * amax * ((2 + e) if two_hop else 1.0) + residual
        bound = bound + calls * (per_call + gamma * (amax * (1 + e) * (2 + e) + residual))
    return bound


class _SeamStats(ReduceScatter):
    """A unit's reduce-scatter during a check step: the call goes to ``inner`` unchanged; before it, the largest
    magnitude of what will be quantized (input plus error feedback's residual) and of the residual."""

    def __init__(self, inner: ReduceScatter, predivide: float = 1.0):
        self.inner = inner
        # FSDP2 divides the input by this before a SUM (fp64, fp16) and the sum by W / predivide after it, where
        # fp32 and bf16 reduce with AVG (1 here): the quantizer's error, and the residual it carries, are in the
        # input's units, predivide times smaller than the mean gradient's, so both are scaled back up to the
        # mean's units that element_bound works in (W * e * A_in / (W / predivide) = e * (A_in * predivide))
        self.predivide = predivide
        self.amax = self.residual_max = 0.0
        self.calls = 0

    @property
    def residual(self):
        """The inner object's residual, for whoever reads it during the step (the memory figures)."""
        return getattr(self.inner, "residual", None)

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        x = input_tensor.detach()
        r = getattr(self.inner, "residual", None)  # comm.QuantReduceScatter's, with error feedback (None before use)
        r_max = float(r.abs().max()) * self.predivide if r is not None and r.numel() else 0.0
        self.residual_max = max(self.residual_max, r_max)
        if x.numel():
            # A over x + r_old: |x + r| <= |x| + |r| elementwise, whatever layout the residual is kept in
            self.amax = max(self.amax, float(x.abs().max()) * self.predivide + r_max)
        self.calls += 1
        return self.inner(output_tensor, input_tensor, group, op, async_op=async_op)


@dataclass
class _Capture:
    grad: torch.Tensor | None = None  # float64 sum over the step's backward passes (local to tensor parallelism)
    abs: torch.Tensor | None = None
    mesh: object = None  # the tensor-parallel DTensor layout of the captured gradient, if any
    placements: tuple = ()

    def add(self, g) -> None:
        local = g.to_local() if hasattr(g, "to_local") else g
        if hasattr(g, "device_mesh"):
            self.mesh, self.placements = g.device_mesh, tuple(g.placements)
        local = local.detach().to(torch.float64)
        self.grad = local.clone() if self.grad is None else self.grad.add_(local)
        self.abs = local.abs() if self.abs is None else self.abs.add_(local.abs())

    def whole(self, t: torch.Tensor | None, shape, device) -> torch.Tensor:
        if t is None:
            return torch.zeros(shape, dtype=torch.float64, device=device)
        t = t.to(device)
        if self.mesh is None:
            return t
        return DTensor.from_local(t, self.mesh, self.placements, run_check=False).full_tensor()


@dataclass
class CheckResult:
    """One check: its step, the worst parameter's error and bound (relative to that parameter's largest mean
    gradient element), pass or fail, the seconds it cost, per parameter figures and the step's wire record."""

    step: int
    max_rel_error: float
    bound: float
    passed: bool
    seconds: float
    params: dict = field(default_factory=dict)
    wire: dict = field(default_factory=dict)
    worst: str = ""

    def row(self) -> dict:
        return {"step": self.step, "parity_check": {
            "max_rel_error": self.max_rel_error, "bound": self.bound, "passed": self.passed,
            "seconds": self.seconds, "worst": self.worst, "params": self.params, "wire": self.wire}}


class ParityCheck:
    """``parallel.check_every`` for one strategy (parallel/apply.py's). ``at(step)`` is a ``StepCheck`` on
    check steps (every ``every``-th optimizer step, counted from 1) and None otherwise."""

    def __init__(self, strategy, every: int, *, micro_batches: int, describe: str = "", device=None):
        self.strategy, self.every, self.micro = strategy, every, micro_batches
        # where the check's collectives run: the training device (NCCL wants CUDA tensors, also under CPU offload)
        self.device = device if device is not None else torch.device("cpu")
        self.describe = describe  # the configuration in words, for the error message
        # FSDP2's units; under DDP (one bucketed all-reduce) the same blocks (apply.shard_units), so each is sampled
        self.unit_names = list(strategy.units) if strategy.name == "fsdp2" else \
            [name for name, _ in shard_units(strategy.module)[0]]
        self.names = sample_parameters(strategy.module, self.unit_names)
        self.results: list[CheckResult] = []  # this attempt's checks, in order (``record`` adds them)

    def record(self, result: CheckResult) -> None:
        self.results.append(result)

    def summary(self, step_seconds: float | None = None) -> dict:
        """The run's checks in one record: how many, whether all passed, the worst relative error and its bound,
        the seconds per check and, given the mean step's seconds, the check's cost as a share of a step."""
        rs = self.results
        worst = max(rs, key=lambda r: r.max_rel_error / r.bound if r.bound else 0.0, default=None)
        per_check = sum(r.seconds for r in rs) / len(rs) if rs else None
        return {"every": self.every, "parameters": list(self.names), "checks": len(rs),
                "steps": [r.step for r in rs], "passed": all(r.passed for r in rs),
                "max_rel_error": worst.max_rel_error if worst else None, "bound": worst.bound if worst else None,
                "seconds_per_check": per_check,
                "share_of_step": per_check / step_seconds if per_check is not None and step_seconds else None}

    def at(self, step: int, on_result=None) -> StepCheck | None:
        """The check of optimizer step ``step`` (counted from 1), or None when it is not a check step.
        ``on_result(CheckResult)`` records it (every rank calls it, before a failure is raised)."""
        if self.every <= 0 or step % self.every:
            return None
        return StepCheck(self, step, on_result)


def _traffic_snapshot(traffic) -> dict:
    return {"calls": dict(traffic.calls), "bytes": traffic.per_kind_bytes(),
            "dtypes": {k: _dtype_name(v) for k, v in dict(getattr(traffic, "dtypes", {}) or {}).items()}}


def _dtype_name(v) -> object:
    if isinstance(v, (set, frozenset, list, tuple)):
        return sorted(_dtype_name(x) for x in v)
    return str(v).replace("torch.", "")


class StepCheck:
    """One check step: ``with check.capture(): forward/backward``, then ``run()`` before clipping and the
    optimizer step: ``verify()`` (a ``CheckResult``), ``on_result`` with it, and ``ParityCheckFailed`` when an
    element is beyond its bound."""

    def __init__(self, parity: ParityCheck, step: int, on_result=None):
        self.parity, self.step, self.on_result = parity, step, on_result
        self.traffic_before: dict | None = None
        self.captures = {name: _Capture() for name in parity.names}
        self.seconds = 0.0
        self.seams: dict[str, _SeamStats] = {}

    # ------------------------------------------------------------------------------------------ capture

    def capture(self):
        return _Capturing(self)

    def _install(self) -> list:
        t0 = time.perf_counter()
        s = self.parity.strategy
        module = s.module
        handles, seen = [], set()
        for name in self.parity.names:
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            cap = self.captures[name]

            def on_grad(g, cap=cap):
                t = time.perf_counter()
                cap.add(g)
                self.seconds += time.perf_counter() - t  # the capture's part of backward counts as the check's

            def pre_hook(mod, args, leaf=leaf, on_grad=on_grad):
                t = getattr(mod, leaf)  # under FSDP2, the unsharded parameter it registered for forward
                if id(t) not in seen and t.requires_grad:
                    seen.add(id(t))
                    handles.append(t.register_hook(on_grad))

            handles.append(owner.register_forward_pre_hook(pre_hook))
        if s.name == "fsdp2":  # the quantizer's inputs, per unit: each unit's reduce-scatter wrapped for this step
            names = {m: n for n, m in s.model.named_modules()}
            for m in fsdp_modules(s.model):
                own = own_reduce_scatters(m)
                if own:  # FSDP2 gives a unit one parameter group (none without parameters)
                    assert len(own) == 1, (names[m], own)
                    seam = self.seams[names[m]] = _SeamStats(own[0], predivide_factor(m))
                    m.set_custom_reduce_scatter(seam)
        self.seconds += time.perf_counter() - t0
        return handles

    def _uninstall(self, handles: list) -> None:
        for h in handles:
            h.remove()
        s = self.parity.strategy
        names = {m: n for n, m in s.model.named_modules()} if s.name == "fsdp2" else {}
        for m, name in names.items():
            if name in self.seams:
                m.set_custom_reduce_scatter(self.seams[name].inner)

    # ------------------------------------------------------------------------------------------- verify

    def run(self) -> CheckResult:
        result = self.verify(self.traffic_before)
        if self.on_result is not None:
            self.on_result(result)
        if not result.passed:
            raise self.failure(result)
        return result

    def verify(self, traffic_before: dict | None = None) -> CheckResult:
        t0 = time.perf_counter()
        s, parity = self.parity.strategy, self.parity
        quant = s.quant
        bits = quant.grads_bits if s.name == "fsdp2" and quant.grads_all_to_all else 32
        # the quantizer's maxima over every rank: one all-reduce of every unit's figures
        units = sorted(self.seams)
        stats = torch.tensor([[self.seams[u].amax, self.seams[u].residual_max] for u in units] or [[0.0, 0.0]],
                             dtype=torch.float64, device=parity.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        unit_stats = {u: (float(stats[i, 0]), float(stats[i, 1]), self.seams[u].calls) for i, u in enumerate(units)}
        params = dict(s.module.named_parameters())
        rows, fails = {}, []
        worst, worst_ratio, worst_rel, worst_bound = "", -1.0, 0.0, 0.0
        for name in parity.names:
            p = params[name]
            cap = self.captures[name]
            group = _dp_group(p, s)
            dp = dist.get_world_size(group) if dist.is_initialized() else 1
            ref = cap.whole(cap.grad, p.shape, parity.device)
            sum_abs = cap.whole(cap.abs, p.shape, parity.device)
            if dp > 1:
                both = torch.stack([ref, sum_abs])
                dist.all_reduce(both, group=group)  # the plain float64 all-reduce
                ref, sum_abs = both[0], both[1]
            ref = ref / dp
            applied = _whole(p.grad, parity.device)
            if applied is None:
                applied = torch.zeros_like(ref)
            applied = applied.to(torch.float64)
            amax, residual, calls = unit_stats.get(unit_of(name, parity.unit_names), (0.0, 0.0, 0))
            bound = element_bound(sum_abs=sum_abs, dp=dp, micro=parity.micro, acc_dtype=_acc_dtype(p),
                                  bits=bits, two_hop=quant.two_hop, amax=amax, residual=residual, calls=calls)
            if not bool(torch.isfinite(ref).all()):
                # a NaN or infinite gradient out of backward itself (the same on every rank: ref is all-reduced):
                # nothing to compare; the loop's non-finite check handles the step (rollback or stop)
                rows[name] = {"nonfinite_gradient": True, "numel": ref.numel()}
                continue
            err = (applied - ref).abs()
            scale = float(ref.abs().max()) if ref.numel() else 0.0
            ratio = float((err / bound.clamp_min(1e-300)).max()) if err.numel() else 0.0
            if not bool(torch.isfinite(applied).all()):  # a finite gradient made NaN or infinite by the exchange
                ratio = float("inf")
            over = bool((err > bound).any()) or ratio == float("inf")
            i = int((err - bound).argmax()) if err.numel() else 0
            row = {"max_error": float(err.max()) if err.numel() else 0.0,
                   "bound": float(bound.flatten()[i]) if err.numel() else 0.0,
                   "error_at_worst": float(err.flatten()[i]) if err.numel() else 0.0,
                   "max_abs_grad": scale, "numel": ref.numel(), "error_over_bound": ratio}
            rows[name] = row
            if over:
                fails.append(name)
            if ratio > worst_ratio:
                worst, worst_ratio = name, ratio
                worst_rel = row["max_error"] / scale if scale else row["max_error"]
                worst_bound = float(bound.max()) / scale if scale else float(bound.max())
        failed = torch.tensor([1.0 if fails else 0.0], device=parity.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # one verdict: every rank stops, or none
        self.seconds += time.perf_counter() - t0
        wire = _wire(traffic_before, _traffic_snapshot(s.meter.traffic["train"])) if traffic_before else {}
        result = CheckResult(step=self.step, max_rel_error=worst_rel, bound=worst_bound,
                             passed=not bool(failed.item()), seconds=self.seconds, params=rows, wire=wire,
                             worst=worst)
        return result

    def failure(self, result: CheckResult) -> ParityCheckFailed:
        name = next((n for n, r in result.params.items() if r.get("error_over_bound", 0) > 1), result.worst)
        r = result.params.get(name, {})
        return ParityCheckFailed(
            f"parity check failed at step {result.step}: the gradient applied to {name!r} differs from a plain "
            f"float64 all-reduce of every rank's gradient by {r.get('error_at_worst', float('nan')):.3e} in one "
            f"element, beyond the bound {r.get('bound', float('nan')):.3e} derived for this path "
            f"({self.parity.describe}; largest error {r.get('max_error', float('nan')):.3e} against a largest "
            f"gradient element of {r.get('max_abs_grad', float('nan')):.3e}). The sharded/quantized gradient "
            "exchange is wrong, and training on would apply wrong updates: the step was not applied. Resume from "
            "the last commit with parallel.quant_grads = \"none\" and parallel.reduce_scatter = \"native\" (then "
            "zero_stage = 0) to find the path at fault, and report it with this message; the metrics row of this step records "
            "every sampled parameter's error and the step's collectives", step=result.step, parameter=name,
            error=r.get("error_at_worst", float("nan")), bound=r.get("bound", float("nan")))


class _Capturing:
    def __init__(self, check: StepCheck):
        self.check = check

    def __enter__(self):
        self.check.traffic_before = snapshot(self.check.parity.strategy)
        self.handles = self.check._install()
        return self.check

    def __exit__(self, *exc):
        self.check._uninstall(self.handles)


def _dp_group(p, strategy):
    """The ranks whose mean this parameter's gradient is: the ``data`` dimension under tensor parallelism, else
    every rank (None; under hybrid sharding the replica and shard dimensions both split the batch)."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is not None and "data" in (mesh.mesh_dim_names or ()):
        return mesh["data"].get_group() if mesh.ndim > 1 else mesh.get_group()
    return None


def _whole(t, device):
    """The whole gradient on ``device`` (a sharded one gathered; under CPU offload it is moved first)."""
    if t is None:
        return None
    t = t.detach().to(device)
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _acc_dtype(p) -> torch.dtype:
    """Where gradients are accumulated and summed: float64 for a float64 model, else fp32 (bf16 parameters are
    reduced in fp32: MixedPrecisionPolicy's reduce_dtype)."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _wire(before: dict, after: dict) -> dict:
    """Per collective kind during the step: calls, bytes sent by this rank, the wire dtype(s) when recorded."""
    out = {}
    for kind, calls in after["calls"].items():
        n = calls - before["calls"].get(kind, 0)
        if n:
            out[kind] = {"calls": n, "bytes": after["bytes"].get(kind, 0) - before["bytes"].get(kind, 0)}
            if kind in after["dtypes"]:
                out[kind]["dtype"] = after["dtypes"][kind]
    return out


def snapshot(strategy) -> dict:
    """The training traffic's counters now (``StepCheck.verify`` subtracts them)."""
    return _traffic_snapshot(strategy.meter.traffic["train"])
