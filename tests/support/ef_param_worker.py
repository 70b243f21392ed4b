"""Error feedback when the parameters that get gradients change between steps: the workers behind
tests/trainer/test_ef_per_parameter.py (2 gloo ranks, float64 models, int4 gradient exchange at stage 3).

A model whose block has two branches of the same shape taking turns (a residual keyed by position in the unit's
input would be sent with the other branch's gradient) and a layer frozen for the first half of the run, in the
root unit with the head (the set of parameters reduce-scattered changes when it is unfrozen). The weights stay
fixed (no optimizer step), so runs with and without error feedback exchange the same exact gradients, and a
float64 reference on the whole global batch gives the exact mean gradient of every step."""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
from torch import nn

STEPS = 8
GLOBAL_BATCH = 16
FROZEN_UNTIL = 4  # ``late`` is frozen for steps 0..3 and trains from step 4


class Branches(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.a, self.b = nn.Linear(c, c), nn.Linear(c, c)
        self.turn = 0

    def forward(self, h):
        # b's gradients are 50x smaller than a's: a residual of a's sent with b's gradient would swamp it
        return torch.tanh(self.a(h)) if self.turn % 2 == 0 else torch.tanh(self.b(h)) * 0.02


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 10)
        self.blocks = nn.Sequential(Branches(10), nn.Sequential(nn.Linear(10, 10), nn.Tanh()))
        self.late = nn.Linear(10, 10)
        self.head = nn.Linear(10, 3)

    def forward(self, x):
        h = self.blocks(torch.tanh(self.stem(x)))
        return self.head(h + torch.tanh(self.late(h)))


def _batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(GLOBAL_BATCH, 6, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)) for _ in range(STEPS)]


def _set_step(model: nn.Module, step: int) -> None:
    model.blocks[0].turn = step
    model.late.requires_grad_(step >= FROZEN_UNTIL)


class BlocksOnly(nn.Module):
    """Every parameter inside ``blocks``: the root unit has none of its own (and no reduce-scatter)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3))

    def forward(self, x):
        return self.blocks(x)


def _build(rank: int, world: int, error_feedback: bool, model_fn=Branchy):
    from dutycycle.trainer.cluster.world import World
    from dutycycle.trainer.config import ParallelSection
    from dutycycle.trainer.parallel.apply import parallelize

    torch.manual_seed(0)
    model = model_fn().double()
    parallel = ParallelSection(zero_stage=3, quant_grads="int4", quant_block=16, error_feedback=error_feedback)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return parallelize(model, parallel, World(rank, world, 0), device=torch.device("cpu"), precision="fp64")


def _exchanged(strategy, rank: int, world: int, step: int, x, y) -> dict[str, torch.Tensor]:
    """One forward/backward on this rank's slice of the global batch: each parameter's applied (averaged,
    exchanged) gradient, whole; a parameter without one: zeros."""
    _set_step(strategy.model, step)
    per = GLOBAL_BATCH // world
    loss = nn.functional.cross_entropy(strategy.model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
    loss.backward()
    out = {}
    for name, p in strategy.model.named_parameters():
        out[name] = torch.zeros(p.shape, dtype=torch.float64) if p.grad is None else p.grad.full_tensor().clone()
        p.grad = None
    return out


def _exact(step: int, x, y) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    ref = Branchy().double()
    _set_step(ref, step)
    nn.functional.cross_entropy(ref(x), y).backward()
    return {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in ref.named_parameters()}


def _pending(strategy, world: int) -> dict[str, torch.Tensor]:
    """The correction error feedback still owes each parameter: ``f / W * sum over ranks`` of its residual
    (residuals.py), gathered from every rank."""
    import torch.distributed as dist
    from dutycycle.trainer.parallel import residuals
    from dutycycle.trainer.parallel.fsdp_api import predivide_factor

    out = {}
    for h in residuals.holders(strategy):
        pre = predivide_factor(h.unit)
        for i, s in enumerate(h.slots):
            mine = residuals.to_param(h.param_residual(i), s.shape, s.shard_dim).to(torch.float64)
            dist.all_reduce(mine)
            out[s.fqn] = mine * (pre / world)
    return out


def changing_params(rank: int, world: int, ckpt: str) -> dict:
    """(a) the accumulated gradient error over STEPS with and without error feedback; the telescoping identity
    (the accumulated error is exactly the pending correction) per parameter; the frozen layer's residual while
    frozen; (b) the residuals through DCP: at the same world size bit for bit, then at one rank redistributed."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from dutycycle.trainer.parallel import residuals

    batches = _batches()
    runs = {"ef": _build(rank, world, True), "plain": _build(rank, world, False)}
    acc = {k: {} for k in runs}
    exact_sum: dict[str, torch.Tensor] = {}
    scale: dict[str, float] = {}
    late_residual_while_frozen = []
    for step, (x, y) in enumerate(batches):
        exact = _exact(step, x, y)
        for n, g in exact.items():
            exact_sum[n] = exact_sum.get(n, 0) + g
            scale[n] = scale.get(n, 0.0) + float(g.abs().max())
        for key, strategy in runs.items():
            for n, g in _exchanged(strategy, rank, world, step, x, y).items():
                acc[key][n] = acc[key].get(n, 0) + g
        if step == FROZEN_UNTIL - 1:
            late_residual_while_frozen = [float(h.param_residual(i).abs().max())
                                          for h in residuals.holders(runs["ef"])
                                          for i, s in enumerate(h.slots) if s.fqn.startswith("late.")]
    pending = _pending(runs["ef"], world)
    blocks_only = _build(rank, world, True, BlocksOnly)
    blocks_only.model(batches[0][0]).sum().backward()
    out = {"late_residual_while_frozen": late_residual_while_frozen, "params": {},
           "blocks_only": sorted(residuals.layout(blocks_only, world)["params"])}
    for n, total in exact_sum.items():
        out["params"][n] = {
            "norm": float(total.norm()), "scale": scale[n],
            "err_ef": float((acc["ef"][n] - total).norm()), "err_plain": float((acc["plain"][n] - total).norm()),
            # exchanged sum + pending correction = exact sum (error feedback's telescoping), per element
            "telescoping": float((acc["ef"][n] + pending[n] - total).abs().max()),
            "pending": float(pending[n].abs().max()),
        }

    # (b) save this rank's residuals (parameter-shaped, keyed by rank and name) with DCP, then read them back at
    # the same world size into a fresh model: bit for bit
    ef = runs["ef"]
    saved_layout = residuals.layout(ef, world)
    dcp.save(residuals.state_dict(ef, rank), checkpoint_id=ckpt)
    fresh = _build(rank, world, True)
    targets, why = residuals.load_targets(fresh, saved_layout, rank, world)
    dcp.load(residuals.tensors(targets), checkpoint_id=ckpt)
    residuals.apply(fresh, targets, rank, why, ckpt)
    live = [h.residual for h in residuals.holders(ef)]
    back = [h.residual for h in residuals.holders(fresh)]
    out["same_world"] = {"why": why, "equal": all(torch.equal(a, b) for a, b in zip(live, back, strict=True)),
                         "nonzero": sum(int(a.count_nonzero()) for a in live)}
    # the correction still owed, in float64, to compare at one rank
    out["pending"] = {n: t.tolist() for n, t in pending.items()} if rank == 0 else {}
    dist.barrier()

    # at one rank: a process group of its own (rank 0 loads; rank 1 only keeps the harness's teardown happy)
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if rank != 0:
        return out
    one = _build(0, 1, True)
    targets, why = residuals.load_targets(one, saved_layout, 0, 1)
    dcp.load(residuals.tensors(targets), checkpoint_id=ckpt)
    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
        residuals.apply(one, targets, 0, why, ckpt)
    out["one_rank"] = {"why": why, "sources": targets[residuals.PLAN]["sources"],
                       "pending": {n: t.tolist() for n, t in _pending_one(one).items()}}
    return out


def _pending_one(strategy) -> dict[str, torch.Tensor]:
    from dutycycle.trainer.parallel import residuals
    from dutycycle.trainer.parallel.fsdp_api import predivide_factor

    return {s.fqn: residuals.to_param(h.param_residual(i), s.shape, s.shard_dim).to(torch.float64)
            * predivide_factor(h.unit) for h in residuals.holders(strategy) for i, s in enumerate(h.slots)}
