"""Worker code for the BatchNorm tests (spawned gloo ranks import it): models with BatchNorm (a plug-in CNN for
``model.name = "tests.support.bn_worker:bn_cnn"``, a ViT with a BatchNorm stem for tensor parallelism), steps
through ``parallelize`` on batches the test chooses, and Trainer runs (parity, the warning, stop and resume)."""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

import torch
from torch import nn

from .ckpt_models import _count_forward

CLASSES = 4
GLOBAL_BATCH = 16
STEPS = 3


class BNNet(nn.Module):
    """A conv stem with BatchNorm2d, two blocks of conv, BatchNorm2d, ReLU (``blocks``: FSDP2 units), the pooled
    features through a BatchNorm1d into the head. The crash of ckpt_models.FAULTS["crash_at"] is injected too."""

    def __init__(self, in_channels: int = 3, num_classes: int = CLASSES, width: int = 8):
        super().__init__()

        def conv_bn(c_in: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(c_in, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())

        self.stem = conv_bn(in_channels)
        self.blocks = nn.Sequential(conv_bn(width), conv_bn(width))
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, num_classes)
        self.forwards = 0

    def forward(self, x):
        _count_forward(self)
        return self.head(self.norm(self.blocks(self.stem(x)).mean(dim=(2, 3))))


def bn_cnn(cfg, in_channels, num_classes, image_size):
    return BNNet(in_channels, num_classes, width=cfg.width)


def bn_vit():
    """The tensor-parallel tests' ViT (16 wide, 2 heads, 8x8 images in 4x4 patches) with a BatchNorm2d on the
    patch embedding: a replicated layer outside the tensor-parallel plan, fed the same batch on both ranks of a
    tensor group."""
    from dutycycle.trainer.step.models import TinyViT

    class BNViT(TinyViT):
        def __init__(self):
            super().__init__(3, CLASSES, 8, dim=16, depth=1, heads=2, patch=4)
            self.patch = nn.Sequential(self.patch, nn.BatchNorm2d(16))

    return BNViT()


# ------------------------------------------------------------------------------------ steps through parallelize


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches; the inputs shifted and scaled, so batch statistics are far from the initial (0, 1)."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=g, dtype=torch.float64) * 2 + 1,
             torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=g)) for _ in range(steps)]


def interleaved(x: torch.Tensor, ranks: int, micro: int) -> torch.Tensor:
    """``x`` reordered so that one process's micro-batch i is micro-batch i of every rank together (rank r's share
    is its contiguous slice; its micro-batch i the i-th chunk of that)."""
    per = x.shape[0] // ranks
    size = per // micro
    return torch.cat([x[r * per + i * size:r * per + (i + 1) * size] for i in range(micro) for r in range(ranks)])


def train_steps(rank: int, world: int, *, model: str = "cnn", stage: int = 0, micro_batches: int = 1,
                sync: bool = True, reorder_for: tuple[int, int] | None = None, node_ids: tuple = (),
                **parallel) -> dict:
    """STEPS SGD steps on this data-parallel rank's slice of each global batch (``world == 1``: one process on the
    whole batch, no process group; ``reorder_for = (ranks, micro)``: each batch ``interleaved`` first). Returns
    the global loss per step, the full model state (rank 0) and the BatchNorm warnings this rank raised."""
    from dutycycle.trainer.cluster.world import World
    from dutycycle.trainer.config import OptimSection, ParallelSection
    from dutycycle.trainer.parallel.apply import parallelize
    from dutycycle.trainer.parallel.batchnorm import BatchNormWarning
    from dutycycle.trainer.parallel.state import full_state_dict
    from dutycycle.trainer.step.loop import optimizer_step
    from dutycycle.trainer.step.optim import make_optimizer
    from dutycycle.trainer.step.timing import StepTimer

    torch.manual_seed(0)
    net = (bn_vit() if model == "vit" else BNNet()).double()
    section = ParallelSection(num_workers=world, zero_stage=stage, **parallel)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        strategy = parallelize(net, section, World(rank, world, section.node_size, node_ids=tuple(node_ids)),
                               device=torch.device("cpu"), precision="fp64", micro_batches=micro_batches,
                               sync_batchnorm=sync)
    optimizer = make_optimizer(strategy.module.parameters(), OptimSection(name="sgd", lr=0.1, momentum=0.9,
                                                                          weight_decay=0.0))
    d, n = strategy.dims.data_ranks(rank)
    per = GLOBAL_BATCH // n
    losses = []
    for x, y in batches():
        if reorder_for:
            x, y = interleaved(x, *reorder_for), interleaved(y, *reorder_for)
        loss, _ = optimizer_step(strategy, optimizer, x[d * per:(d + 1) * per], y[d * per:(d + 1) * per],
                                 micro_batches=micro_batches, timer=StepTimer(), autocast=contextlib.nullcontext,
                                 grad_clip=0.0, lr=0.1)
        losses.append(_global_mean(loss, world, strategy.tensor_rank))
    state = full_state_dict(strategy)
    return {"losses": losses, "state": {k: v.tolist() for k, v in state.items()},
            "synced": strategy.synced_batchnorm, "warnings": sum(issubclass(w.category, BatchNormWarning) for w in seen),
            "traffic": strategy.meter.traffic["train"].per_kind_bytes().get("batchnorm", 0),
            "types": sorted({type(m).__name__ for m in strategy.module.modules() if "BatchNorm" in type(m).__name__})}


def _global_mean(loss: torch.Tensor, world: int, tensor_rank: int) -> float:
    """The mean of the data-parallel ranks' losses (equal slices): a tensor group's ranks counted once."""
    import torch.distributed as dist

    if world == 1:
        return float(loss)
    t = torch.stack([loss.detach() * (tensor_rank == 0), torch.tensor(float(tensor_rank == 0), dtype=loss.dtype)])
    dist.all_reduce(t)
    return float(t[0] / t[1])


def layouts(rank: int, world: int) -> dict:
    """The layouts whose data-parallel group is not simply every rank's default group, at 4 ranks: tensor
    parallel 2 x data parallel 2 (a tensor group's two ranks read one slice: statistics over the data dimension
    only) and hybrid sharding (2 replica groups of 2 shards: every rank reads its own slice)."""
    return {"tensor": train_steps(rank, world, model="vit", stage=3, tensor=2),
            "hybrid": train_steps(rank, world, stage=3, replicate=2, node_size=2)}


# ------------------------------------------------------------------------------------------------ Trainer runs


def trainer_cfg(run_dir: str, *extra: str):
    from dutycycle.trainer.config import load_config

    return load_config(None, [
        "data.source=synthetic", "data.size=8", "data.global_batch_size=16", "data.synthetic_samples=96",
        "model.name=tests.support.bn_worker:bn_cnn", "model.width=8", "run.max_steps=8", "run.eval_every=0",
        f"run.dir={run_dir}", "run.log_every=1", "run.precision=fp64", "run.report=false", "optim.name=sgd",
        "optim.lr=0.05", "optim.warmup_steps=0", "optim.grad_clip=0", "checkpoint.every=3",
        "parallel.threads_per_worker=1", *extra])


def run_trainer(run_dir: str, *extra: str, rank: int = 0, world: int = 1) -> dict:
    """One Trainer run: the summary's losses and validation, this rank's BatchNorm warnings, the strategy's
    synced layers."""
    from dutycycle.trainer.parallel.batchnorm import BatchNormWarning
    from dutycycle.trainer.step.loop import WorkerContext
    from dutycycle.trainer.step.trainer import Trainer

    torch.set_num_threads(1)
    cfg = trainer_cfg(run_dir, f"parallel.num_workers={world}", *extra)
    ctx = WorkerContext(rank=rank, world_size=world, run_dir=run_dir)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Trainer(cfg, ctx) as trainer:
            summary = trainer.train()
    return {"val_loss": summary["val_loss"], "final_loss": summary["final_loss"],
            "resumed": summary["checkpoint"].get("resumed"), "synced": ctx.state["strategy"].synced_batchnorm,
            "warnings": [str(w.message) for w in seen if issubclass(w.category, BatchNormWarning)]}


def trainer_runs(rank: int, world: int, root: str) -> dict:
    """Through the Trainer: synced BatchNorm under FSDP2 (stage 3); the same run stopped by a crash at step 7 and
    started again (it resumes from the commit of step 6); unsynced, 3 steps (the warning)."""
    from . import ckpt_models as cm

    synced = ("model.sync_batchnorm=true", "parallel.zero_stage=3")
    out = {"synced": run_trainer(f"{root}/synced", *synced, rank=rank, world=world)}
    cm.FAULTS["crash_at"] = 7
    try:
        run_trainer(f"{root}/resumed", *synced, rank=rank, world=world)
        out["crashed"] = False
    except cm.InjectedCrash:
        out["crashed"] = True
    cm.reset()
    out["resumed"] = run_trainer(f"{root}/resumed", *synced, rank=rank, world=world)
    out["unsynced"] = run_trainer(f"{root}/unsynced", "parallel.zero_stage=3", "run.max_steps=3", rank=rank,
                                  world=world)
    return out


def two_ranks(rank: int, world: int, root: str) -> dict:
    """Everything the 2-rank test checks, in one spawn: steps through ``parallelize`` (synced under DDP; synced
    under FSDP2 with 2 micro-batches; unsynced under DDP), the layer on its own in low precision, and the Trainer
    runs."""
    return {"ddp": train_steps(rank, world, stage=0), "fsdp_micro": train_steps(rank, world, stage=3, micro_batches=2),
            "ddp_unsynced": train_steps(rank, world, stage=0, sync=False), "precision": low_precision(rank, world),
            **trainer_runs(rank, world, root)}


def low_precision(rank: int, world: int) -> dict:
    """The synced layer on this rank's half of a batch whose channels sit far from zero (mean 1000, std 1): in
    float32 (the statistics of a sum of squares minus a squared sum would lose every digit of the variance there)
    and in bf16 (statistics summed in float32), against one process's nn.BatchNorm2d in float64 on the whole
    batch. Returns the largest output error in each."""
    from dutycycle.trainer.parallel.batchnorm import convert_batchnorm

    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 4, 3, 3, generator=g, dtype=torch.float64) + 1000
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        low = x.to(dtype)
        with torch.no_grad():
            want = nn.BatchNorm2d(4).double()(low.double())[rank * 4:(rank + 1) * 4]  # of the values the layer gets
            one = nn.BatchNorm2d(4).to(dtype)(low)[rank * 4:(rank + 1) * 4]  # torch's layer, one process
        layer = convert_batchnorm(nn.BatchNorm2d(4).to(dtype), device=torch.device("cpu"))
        got = layer(low[rank * 4:(rank + 1) * 4]).detach()
        out[str(dtype)] = {"dtype": str(got.dtype), "error": float((got.double() - want).abs().max()),
                           "torch_error": float((one.double() - want).abs().max()), "largest": float(want.abs().max())}
    return out


def loss_rows(run_dir: str) -> dict[int, float]:
    """Each step's loss as metrics.jsonl holds it (a resumed run's rewritten rows replace the lost ones)."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}
