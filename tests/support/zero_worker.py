"""Worker code for the ZeRO tests (spawned gloo ranks import it): a model with every awkward feature, global
batches, and a driver that trains the same steps through ``parallelize`` under any stage."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

STEPS = 4
GLOBAL_BATCH = 16
CLASSES = 4


class TiedMix(nn.Module):
    """A block whose channel-mixing weight is also used by the root (tied weights)."""

    def __init__(self, c: int):
        super().__init__()
        self.lin = nn.Linear(c, c, bias=False)

    def forward(self, h):
        return torch.tanh(torch.einsum("bchw,dc->bdhw", h, self.lin.weight))


class Quirky(nn.Module):
    """Parameter first dimensions of 5 and 7 (not divisible by 2 or 4), a frozen layer, a layer used only on some
    steps (no gradient on the others), a weight tied between a block and the root, and ``blocks`` to shard."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 5, 3, padding=1)
        self.blocks = nn.Sequential(nn.Sequential(nn.Conv2d(5, 7, 3, padding=1), nn.Tanh(),
                                                  nn.Conv2d(7, 5, 1)), TiedMix(5))
        self.proj = self.blocks[1].lin  # tied: one parameter, two owners
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)
        self.sometimes = nn.Linear(5, 5)
        self.head = nn.Linear(5, CLASSES)
        self.use_sometimes = True

    def forward(self, x):
        h = self.blocks(torch.tanh(self.stem(x))).mean(dim=(2, 3))
        h = torch.tanh(self.proj(h)) + self.frozen(h)
        if self.use_sometimes:
            h = h + self.sometimes(h)
        return self.head(h)


def make_batches(dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=g, dtype=dtype),
             torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=g)) for _ in range(STEPS)]


def full_params(strategy) -> dict[str, torch.Tensor]:
    from dutycycle.trainer.parallel.state import full_state_dict

    sd = full_state_dict(strategy)
    return {k: v.clone() for k, v in sd.items()}


@contextlib.contextmanager
def _quiet():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def train(rank: int, world: int, *, stage: int, micro_batches: int = 1, offload: bool | str = False,
          reduce_every: bool = False, find_unused: bool = False, dtype=torch.float64, grad_clip: float = 0.05,
          model_fn=Quirky, strategy_cls=None, optim_name: str = "adamw", optim_kwargs: dict | None = None,
          steps: int = STEPS, node_ids: tuple = (), nvme_chunk_bytes: int = 4096, precision: str | None = None,
          **parallel_kwargs):
    """Train STEPS AdamW steps on rank ``rank``'s slice of each global batch; returns the strategy and optimizer.
    ``world == 1`` with no process group is the single-process reference on the full batch. ``parallel_kwargs``
    are further parallel config keys (``node_size``, ``hpz``, ``quant_grads``, ``replicate``, ...); ``node_ids``
    each rank's node, as ranks would report it (default: ``node_size`` consecutive ranks per node). ``offload``:
    True (host memory) or a ``parallel.offload`` value ("nvme": state files stepped in ``nvme_chunk_bytes``).
    ``precision``: parallelize's (default "fp64" for float64, else "fp32"; "bf16" with ``dtype`` float32)."""
    from dutycycle.trainer.cluster.world import World
    from dutycycle.trainer.config import OptimSection, ParallelSection
    from dutycycle.trainer.parallel.apply import parallelize
    from dutycycle.trainer.parallel.dims import ParallelDims
    from dutycycle.trainer.parallel.memory import MemorySampler
    from dutycycle.trainer.step.loop import optimizer_step
    from dutycycle.trainer.step.optim import make_optimizer
    from dutycycle.trainer.step.timing import StepTimer

    torch.manual_seed(0)
    model = model_fn().to(dtype)
    parallel = ParallelSection(zero_stage=stage, reduce_every_micro_step=reduce_every,
                               offload=offload if isinstance(offload, str) else ("optimizer" if offload else "none"),
                               find_unused_parameters=find_unused, **parallel_kwargs)
    placed = World(rank, world, parallel.node_size, node_ids=tuple(node_ids))
    with _quiet():
        strategy = parallelize(model, parallel, placed, device=torch.device("cpu"),
                               precision=precision or ("fp64" if dtype == torch.float64 else "fp32"),
                               micro_batches=micro_batches)
    if strategy_cls is not None:
        strategy.__class__ = strategy_cls
    optimizer = make_optimizer(strategy.module.parameters(),
                               OptimSection(**{"name": optim_name, "lr": 0.02, "weight_decay": 0.1, "momentum": 0.9,
                                               **(optim_kwargs or {})}))
    if parallel.offload == "nvme":  # as the Trainer attaches it; small chunks, so a step has several
        import os

        from dutycycle.trainer.parallel import nvme

        store = nvme.FileStore(nvme.offload_root(parallel), f"zero-worker-{os.getppid()}", rank)
        nvme.CHUNK_BYTES = nvme_chunk_bytes  # this worker process's steps cut small chunks
        nvme.attach(optimizer, store)
    sampler = MemorySampler()
    # the data-parallel ranks split each global batch (a tensor-parallel group's ranks take the same slice)
    rank_d, world_d = ParallelDims.build(parallel, placed, validate=False).data_ranks()
    per = GLOBAL_BATCH // world_d
    norms = []
    for step, (x, y) in enumerate(make_batches(dtype)[:steps]):
        if isinstance(strategy.module, Quirky):
            strategy.module.use_sometimes = step % 2 == 0
        xs, ys = x[rank_d * per:(rank_d + 1) * per], y[rank_d * per:(rank_d + 1) * per]
        _, norm = optimizer_step(strategy, optimizer, xs, ys, micro_batches=micro_batches, timer=StepTimer(),
                                 autocast=contextlib.nullcontext, grad_clip=grad_clip,
                                 lr=optimizer.param_groups[0]["lr"],
                                 sampler=sampler if step == 0 else None)
        norms.append(float(norm) if norm is not None else None)
    return strategy, optimizer, sampler, norms
