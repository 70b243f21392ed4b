"""Worker code for the tensor-parallel tests (spawned gloo ranks import it): a small ViT whose token count (17)
does not divide by the group, trained through ``parallelize`` under any layout, and DCP round trips across
layouts (tensor-parallel 2 x data-parallel 2 <-> data-parallel 4)."""

from __future__ import annotations

import torch

from .ckpt_worker import _checkpointer, _digest, _full_state, _Position, model_only
from .zero_worker import CLASSES, GLOBAL_BATCH

LAYOUTS = {"tensor 2 x data 2": {"tensor": 2}, "data 4": {}}


def vit():
    """8x8 images in 2x2 patches: 16 patches and a class token, 17 tokens (an uneven split over 2 ranks); width
    16, 4 heads, 2 blocks."""
    from dutycycle.trainer.step.models import TinyViT

    return TinyViT(3, CLASSES, 8, dim=16, depth=2, heads=4, patch=2)


def _strategy(rank: int, world: int, parallel: dict):
    import warnings

    from dutycycle.trainer.cluster.world import World
    from dutycycle.trainer.config import OptimSection, ParallelSection
    from dutycycle.trainer.parallel.apply import parallelize
    from dutycycle.trainer.step.optim import make_optimizer

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        strategy = parallelize(vit().double(), ParallelSection(zero_stage=3, **parallel), World(rank, world),
                               device=torch.device("cpu"), precision="fp64")
    return strategy, make_optimizer(strategy.module.parameters(), OptimSection(lr=0.02, weight_decay=0.1))


def _step(strategy, optimizer, rank: int, world: int, seed: int) -> None:
    import contextlib

    from dutycycle.trainer.step.loop import optimizer_step
    from dutycycle.trainer.step.timing import StepTimer

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=g)
    d, n = strategy.dims.data_ranks(rank)
    per = GLOBAL_BATCH // n
    optimizer_step(strategy, optimizer, x[d * per:(d + 1) * per], y[d * per:(d + 1) * per], micro_batches=1,
                   timer=StepTimer(), autocast=contextlib.nullcontext, grad_clip=0.05, lr=0.02)


def round_trip(rank: int, world: int, root: str) -> dict:
    """Train 3 steps tensor 2 x data 2 and save; load into data 4 and save again; load that into tensor 2 x data 2.
    Each load's full model + optimizer digest, and the full weights after one more step."""
    from dutycycle.trainer.parallel.state import full_state_dict

    def after_one_more(strategy, optimizer):
        _step(strategy, optimizer, rank, world, seed=99)
        full = full_state_dict(strategy)  # a collective: every rank, then rank 0's copy
        return {k: v.tolist() for k, v in full.items()} if rank == 0 else None

    def overrides(parallel):  # the checkpointer's config: the model it is checked against, the layout
        return ["model.name=vit", "model.width=16", f"parallel.tensor={parallel.get('tensor', 1)}"]

    strategy, optimizer = _strategy(rank, world, LAYOUTS["tensor 2 x data 2"])
    for s in range(3):
        _step(strategy, optimizer, rank, world, seed=s)
    ck = _checkpointer(f"{root}/tensor", rank, world, 3, "none", *overrides({"tensor": 2}))
    ck.maybe_save(3, strategy, optimizer, _Position().state_dict())
    ck.finalize()
    full = _full_state(strategy, optimizer)
    out = {"saved": {"digest": _digest(full) if rank == 0 else None,
                     "model_digest": _digest(model_only(full)) if rank == 0 else None,
                     "after": after_one_more(strategy, optimizer)}}
    for name, src, dst, layout in (("tensor to data", "tensor", "data", "data 4"),
                                   ("data back to tensor", "data", None, "tensor 2 x data 2")):
        parallel = LAYOUTS[layout]
        strategy, optimizer = _strategy(rank, world, parallel)
        ck = _checkpointer(f"{root}/{src}", rank, world, 3, "auto", *overrides(parallel))
        restored = ck.restore(strategy, optimizer, _Position())
        ck.close()
        full = _full_state(strategy, optimizer)
        digest = _digest(full) if rank == 0 else None
        if dst:
            again = _checkpointer(f"{root}/{dst}", rank, world, 3, "none", *overrides(parallel))
            again.maybe_save(3, strategy, optimizer, _Position().state_dict())
            again.finalize()
        out[name] = {"step": restored.step if restored else None, "digest": digest, "tensor": strategy.plan.tensor,
                     "after": after_one_more(strategy, optimizer)}
    return out
