"""The pieces of a step that the Trainer (trainer.py) runs, the same in every launch mode.

One optimizer step on one rank:

    batch = next(loader)                      data_wait
    x, y = batch -> device                    h2d
    for each micro-batch i:                   forward_backward
        with strategy.micro_step(i):          (DDP no_sync / FSDP2 sync and reshard switches: parallel/apply.py)
            loss = model(x_i, y_i) * |i| / |batch|; backward
                                              comm: collectives that blocked forward/backward (exposed
                                              communication), moved out of forward_backward
    clip (exact across shards), optimizer.step, lr schedule   optimizer
    if a save is due: the step's row, then   checkpoint, counted in the next step (trainer/checkpoint/: snapshot
    checkpointer.maybe_save(...)              now, write in background), so no commit lacks its step's row

Gradients are exchanged at the accumulation boundary (or every micro-batch if asked). Each rank's loss is the
mean over its slice of the global batch (micro-batches weighted by their share: they may differ by one sample);
with equal slices the averaged gradient is the gradient of the global mean loss, so 1 and N workers take the
same steps (trainer/config_batch.py: the same global batches at every size of an elastic run). Per-step losses and phase times stay on the device and are
gathered once per logging interval (steplog.py).

Also here: the learning-rate schedule (``lr_at``), precision and autocast, a validation pass, the FLOP count,
threads per worker, the worker's context (``WorkerContext``) and the checkpointer interface (``NoCheckpoint``).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

from dutycycle.engine.errors import TrainingDiverged
from dutycycle.trainer.parallel.apply import total_norm
from dutycycle.trainer.parallel.tensor import TensorTraffic

from .timing import gather_stats

__all__ = ["TrainingDiverged", "WorkerContext", "NoCheckpoint", "lr_at", "optimizer_step", "validation_pass"]


@dataclass
class WorkerContext:
    rank: int = 0
    world_size: int = 1
    device: Any = None  # torch.device; None = cpu
    report: Any = None  # callable(metrics: dict) -> None, e.g. ray.train.report; called by every rank
    run_dir: str = ""
    # this launch's folder in the run directory (launch/rundir.py: RUN_DIR/attempts/<k>), where rank 0 records the
    # health check; "" = run_dir
    attempt_dir: str = ""
    info: dict = field(default_factory=dict)  # merged into the summary (e.g. where each worker ran)
    # every rank's node label (cluster/topology.py) when the launcher has gathered them already; None: gathered here
    node_labels: list | None = None
    state: dict | None = None  # filled with {"strategy", "model", "optimizer"} at the end (in-process callers, tests)
    on_commit: Any = None  # callable(step, uri), every rank, after a checkpoint commits (Ray Train: report it)
    started: float | None = None  # wall clock when the launcher entered this worker (launch/account.py)
    # rank 0's progress sink: callable(rows: list[dict]), never blocking (launch/progress.py); None = no rows
    progress: Any = None


class NoCheckpoint:
    """The checkpointer interface (``checkpoint.checkpointer.Checkpointer`` is the real one), keeping nothing:
    ``restore`` before the first step (a resumed step and epoch, or None), ``account`` and ``maybe_save`` after
    each optimizer step (``due`` says whether a save comes; its blocking time is the "checkpoint" phase),
    ``recover`` on a non-finite loss (roll back, or raise), ``finalize`` at the end, ``close`` on any exit."""

    skipped: frozenset = frozenset()  # (epoch, global batch) pairs the data loop leaves out

    def restore(self, strategy, optimizer, source):
        return None

    def due(self, step: int) -> bool:
        return False

    def maybe_save(self, step: int, strategy, optimizer, loader_state: dict | None) -> bool:
        return False

    def account(self, timer) -> None:
        return None

    def recover(self, err, strategy, optimizer, source):
        raise err

    def finalize(self) -> None:
        return None

    def close(self) -> None:
        return None

    def summary(self) -> dict:
        return {}


def lr_at(step: int, total: int, optim) -> float:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr`` (or constant)."""
    if optim.warmup_steps and step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return optim.lr
    progress = (step - optim.warmup_steps) / max(1, total - optim.warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    return optim.lr * (optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def resolve_precision(device, precision: str) -> str:
    """``auto`` is bf16 on GPU and fp32 on CPU; anything else is what was asked for."""
    if precision == "auto":
        return "bf16" if getattr(device, "type", "cpu") == "cuda" else "fp32"
    return precision


def autocast_for(device, precision: str, fsdp: bool = False):
    """bf16 autocast for a resolved precision of bf16, except under FSDP2, whose mixed-precision policy already
    runs forward in bf16 with fp32 master weights and reductions."""
    import torch

    if precision == "bf16" and not fsdp:
        dev_type = getattr(device, "type", "cpu") if device is not None else "cpu"
        return lambda: torch.autocast(dev_type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def _loss_input(logits):
    """Cross-entropy in at least fp32 (bf16 logits are upcast; float64 stays float64)."""
    import torch

    return logits if logits.dtype == torch.float64 else logits.float()


def forward_backward(strategy, x, y, micro_batches: int, autocast, sampler=None, per_sample: list | None = None):
    """Forward and backward over ``micro_batches`` contiguous chunks of the rank batch (as even as they go). Returns the rank batch's mean loss
    as a 0-d tensor on the device (no host synchronization). ``sampler`` (first step only) records the model
    state held after each forward and each backward; on that step tensor parallelism's activation exchanges are
    counted too (``strategy.tensor_traffic``: they run inside forward and backward, outside FSDP2's hooks).
    ``per_sample`` (``run.record_sample_loss``): each micro-batch's per-sample losses are appended to it, device
    tensors in micro-batch order (provenance.py)."""
    import torch

    probe = contextlib.nullcontext()
    if sampler is not None and strategy.plan.tensor > 1:
        probe = strategy.tensor_traffic = TensorTraffic()
    n = y.shape[0]
    losses = []
    with probe:
        # exactly micro_batches pieces, as even as they go (sizes differ by at most one; torch.chunk could give
        # fewer): the strategy's switches count on the last one (trainer/config_batch.py: uneven at some sizes)
        pieces = zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches), strict=True)
        for i, (xs, ys) in enumerate(pieces):
            losses.append(_micro_batch(strategy, i, xs, ys, n, autocast, sampler, per_sample))
    return torch.stack(losses).sum()


def _micro_batch(strategy, i: int, xs, ys, n: int, autocast, sampler, per_sample: list | None = None):
    """Forward and backward of micro-batch ``i``; its loss weighted by its share of the ``n`` samples."""
    import torch.nn.functional as F

    with strategy.micro_step(i):
        with autocast():
            logits = strategy.model(xs)
        loss = F.cross_entropy(_loss_input(logits), ys) * (ys.shape[0] / n)
        if per_sample is not None:  # apart from the loss that trains: the step's arithmetic stays as it is
            per_sample.append(F.cross_entropy(_loss_input(logits).detach(), ys, reduction="none"))
        if sampler is not None:
            sampler.sample(strategy.module)
        loss.backward()
    if sampler is not None:
        sampler.sample(strategy.module)
    return loss.detach()


def grad_norm(strategy):
    """The global 2-norm over all gradients without clipping them, exact across shards as
    ``strategy.clip_grad_norm_`` computes it: FSDP2 gradients are DTensors whose norm is a partial value per
    rank, combined by ``full_tensor()`` (a collective every rank joins); DDP gradients are already reduced. A 0-d
    device tensor (no host synchronization), or None when no parameter has a gradient."""
    grads = [p.grad for p in strategy.module.parameters() if p.grad is not None]
    return total_norm(grads) if grads else None


def optimizer_step(strategy, optimizer, x, y, *, micro_batches: int, timer, autocast, grad_clip: float,
                   lr: float, sampler=None, inject_comm_s: float = 0.0, check=None, per_sample: list | None = None):
    """One full optimizer step on this rank's batch. Returns ``(loss, grad_norm)``: the rank's mean loss and the
    global gradient norm before clipping (device tensors). The norm is computed without clipping too
    (``grad_clip`` = 0), so that the step log's non-finite check catches an infinite or NaN gradient at the step
    that made it, not at the next step's NaN loss (which would blame, and skip, the wrong batch).

    ``check`` (a ``parallel.check.StepCheck`` on a ``parallel.check_every`` step): forward and backward run with
    its capture installed, and it verifies the reduced gradients before clipping and the optimizer step (its
    own time falls in the step's "other"); a failed check raises ``ParityCheckFailed`` before anything is
    applied, after ``on_check`` has recorded its result."""
    with timer.phase("forward_backward"), check.capture() if check is not None else contextlib.nullcontext():
        loss = forward_backward(strategy, x, y, micro_batches, autocast, sampler, per_sample)
        if inject_comm_s:  # parallel.inject_comm_ms: a slower link, on purpose
            time.sleep(inject_comm_s)
            strategy.meter.add_blocked(inject_comm_s)
    timer.move("forward_backward", "comm", strategy.meter.take_blocked())
    if check is not None:
        check.run()
    with timer.phase("optimizer"):
        norm = strategy.clip_grad_norm_(grad_clip) if grad_clip > 0 else grad_norm(strategy)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        if sampler is not None:
            sampler.sample(strategy.module, optimizer)
        optimizer.zero_grad(set_to_none=True)
    return loss, norm


def validation_pass(strategy, source, device, autocast, max_batches: int = 0) -> tuple[float, float, int]:
    """Accuracy and mean loss over the validation source, summed over all ranks: ``(acc, loss, count)``.

    Each evaluation is a fresh pass from the first batch (every ``for`` over a loader is), so a pass capped at
    ``max_batches`` sees the same first batches each time rather than going on where the last one stopped; the
    validation plan is unshuffled and unaugmented, so every pass sees the same batches. Collectives issued by
    the forward passes (FSDP2 gathers) are counted as evaluation traffic, not training traffic."""
    import torch
    import torch.nn.functional as F

    model = strategy.module  # DDP's inner module: no gradient hooks needed; FSDP2's root itself
    model.eval()
    correct = loss_sum = count = 0.0
    with torch.no_grad(), strategy.meter.phase("eval"):
        for i, batch in enumerate(source):
            if max_batches and i >= max_batches:
                break
            x = batch["image"].to(device, dtype=strategy.compute_dtype, non_blocking=True)
            y = batch["label"].to(device, non_blocking=True)
            with autocast():
                logits = _loss_input(model(x))
            if strategy.tensor_rank == 0:  # a tensor-parallel group's ranks saw the same samples: count them once
                loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
                correct += float((logits.argmax(1) == y).sum())
                count += y.shape[0]
        strategy.after_eval()
    strategy.meter.take_blocked()  # evaluation's collectives are not a training step's exposed communication
    model.train()
    tot = gather_stats([correct, loss_sum, count]).sum(0).tolist()
    if tot[2] == 0:
        return float("nan"), float("nan"), 0
    return tot[0] / tot[2], tot[1] / tot[2], int(tot[2])


def flops_per_sample(model, channels: int, size: int, device) -> float | None:
    """Forward+backward FLOPs per sample (3x the forward), counted by torch's FLOP counter."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    # in eval mode: a training forward would move BatchNorm's running statistics towards this zero batch (and a
    # BatchNorm1d refuses one sample per channel); the FLOPs are the same
    was_training = model.training
    model.eval()
    try:
        x = torch.zeros(1, channels, size, size, device=device)
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model(x)
        return 3.0 * counter.get_total_flops()
    except Exception:  # a plug-in model with ops the counter does not know: MFU is simply not reported
        return None
    finally:
        model.train(was_training)


def set_threads(cfg, world_size_on_node: int) -> int:
    """Intra-op threads per worker: explicit, or this node's cores shared evenly among its workers (two
    workers with two threads each on two cores would thrash)."""
    import torch

    n = cfg.parallel.threads_per_worker or max(1, (os.cpu_count() or 1) // max(1, world_size_on_node))
    torch.set_num_threads(n)
    return n


def broadcast_parameters(model, world_size: int) -> None:
    """Start every rank from rank 0's weights (they are seeded alike; this makes it a guarantee)."""
    import torch.distributed as dist

    if world_size > 1 and dist.is_available() and dist.is_initialized():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
