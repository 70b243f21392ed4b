"""The step loop, the same code in every launch mode (local, Ray Train worker, torchrun).

One optimizer step on one rank:

    batch = next(loader)                      data_wait
    x, y = batch -> device                    h2d
    for each micro-batch:                     forward_backward  (grads accumulate locally, no communication)
        param_gather.gather(model)            comm  (no-op in the data-parallel baseline; ZeRO-3 gathers here)
        loss = model(x_i, y_i) * |i| / |batch|; backward
    grad_sync.sync(model)                     comm  (once, at the accumulation boundary)
    clip, optimizer.step, lr schedule         optimizer
    checkpointer.maybe_save(...)              checkpoint

Each rank's loss is the mean over its slice of the global batch; with equal slices the synchronized gradient
is the gradient of the global mean loss, so 1 and N workers take the same steps.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

from dutycycle.engine.errors import DutycycleError

from .timing import ALL_PHASES, PHASES


class TrainingDiverged(DutycycleError):
    """The loss became NaN or infinite: the run stops instead of training on garbage."""


@dataclass
class WorkerContext:
    rank: int = 0
    world_size: int = 1
    device: Any = None  # torch.device; None = cpu
    report: Any = None  # callable(metrics: dict) -> None, e.g. ray.train.report; called by every rank
    run_dir: str = ""
    info: dict = field(default_factory=dict)  # merged into the summary (e.g. where each worker ran)
    state: dict | None = None  # filled with {"model", "optimizer"} at the end (in-process callers, tests)


@dataclass
class StepHooks:
    """The replaceable synchronization points (see sync.py)."""

    grad_sync: Any
    param_gather: Any
    checkpointer: Any
    extra: dict = field(default_factory=dict)


def lr_at(step: int, total: int, optim) -> float:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr`` (or constant)."""
    if optim.warmup_steps and step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return optim.lr
    progress = (step - optim.warmup_steps) / max(1, total - optim.warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    return optim.lr * (optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model, optim):
    import torch

    # no weight decay on norms and biases (1-d parameters), as usual
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if optim.name == "sgd":
        return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum)
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2))


def autocast_for(device, precision: str):
    """bf16 autocast on GPU (precision auto/bf16), fp32 on CPU unless bf16 is asked for explicitly."""
    import torch

    dev_type = getattr(device, "type", "cpu") if device is not None else "cpu"
    if precision == "bf16" or (precision == "auto" and dev_type == "cuda"):
        return lambda: torch.autocast(dev_type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def forward_backward(model, x, y, micro_batches: int, hooks: StepHooks, timer, autocast) -> float:
    """Forward and backward over ``micro_batches`` chunks of the rank batch; gradients accumulate in
    ``.grad`` with no communication. Returns the rank batch's mean loss (a Python float, fp32)."""
    import torch.nn.functional as F

    n = y.shape[0]
    total = 0.0
    losses = []
    for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
        with timer.phase("comm"):
            hooks.param_gather.gather(model)
        with timer.phase("forward_backward"):
            with autocast():
                logits = model(xs)
                loss = F.cross_entropy(logits.float(), ys) * (ys.shape[0] / n)
            loss.backward()
            losses.append(loss.detach())
    with timer.phase("forward_backward"):
        total = float(sum(losses))  # one host sync per step, after all micro-batches
    return total


def optimizer_step(model, optimizer, x, y, *, micro_batches: int, hooks: StepHooks, timer, autocast,
                   grad_clip: float, lr: float) -> float:
    """One full optimizer step on this rank's batch. Returns the rank's mean loss."""
    import torch

    loss = forward_backward(model, x, y, micro_batches, hooks, timer, autocast)
    with timer.phase("comm"):
        hooks.grad_sync.sync(model)  # the accumulation boundary: the only gradient exchange of the step
    with timer.phase("optimizer"):
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss


def evaluate(model, source, device, autocast, max_batches: int = 0, index: int = 0) -> tuple[float, float, int]:
    """Accuracy and mean loss over the validation source, summed over all ranks: ``(acc, loss, count)``.

    Each evaluation is a fresh pass (``set_epoch(index)``, a new index each time) so a pass capped at
    ``max_batches`` starts from the first batch again rather than where the last one stopped; the
    validation plan is unshuffled and unaugmented, so every pass sees the same batches."""
    import torch
    import torch.nn.functional as F

    from .timing import gather_stats

    source.set_epoch(index)
    model.eval()
    correct = loss_sum = count = 0.0
    with torch.no_grad():
        for i, batch in enumerate(source):
            if max_batches and i >= max_batches:
                break
            x = batch["image"].to(device, non_blocking=True)
            y = batch["label"].to(device, non_blocking=True)
            with autocast():
                logits = model(x).float()
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += float((logits.argmax(1) == y).sum())
            count += y.shape[0]
    model.train()
    tot = gather_stats([correct, loss_sum, count]).sum(0).tolist()
    if tot[2] == 0:
        return float("nan"), float("nan"), 0
    return tot[0] / tot[2], tot[1] / tot[2], int(tot[2])


def flops_per_sample(model, channels: int, size: int, device) -> float | None:
    """Forward+backward FLOPs per sample (3x the forward), counted by torch's FLOP counter."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    try:
        x = torch.zeros(1, channels, size, size, device=device)
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model(x)
        return 3.0 * counter.get_total_flops()
    except Exception:  # a plug-in model with ops the counter does not know: MFU is simply not reported
        return None


def set_threads(cfg, world_size_on_node: int) -> int:
    """Intra-op threads per worker: explicit, or this node's cores shared evenly among its workers (two
    workers with two threads each on two cores would thrash)."""
    import torch

    n = cfg.parallel.threads_per_worker or max(1, (os.cpu_count() or 1) // max(1, world_size_on_node))
    torch.set_num_threads(n)
    return n


def train_worker(cfg, ctx: WorkerContext, hooks: StepHooks | None = None) -> dict:
    """Train on this rank until ``max_steps`` / ``epochs``; rank 0 writes metrics and returns the summary."""
    import torch

    from . import metrics as M
    from .data import make_sources
    from .models import build_model, count_parameters
    from .sync import Checkpointer, ParamGather, make_grad_sync
    from .timing import StepTimer, gather_stats

    rank, world = ctx.rank, ctx.world_size
    device = ctx.device or torch.device("cpu")
    torch.manual_seed(cfg.run.seed)
    train_src, val_src, info = make_sources(cfg, rank, world)
    model = build_model(cfg.model, info.channels, info.num_classes, info.size).to(device)
    _broadcast_parameters(model, world)
    optimizer = make_optimizer(model, cfg.optim)
    hooks = hooks or StepHooks(
        grad_sync=make_grad_sync(cfg.parallel.grad_sync, world, cfg.parallel.bucket_mb),
        param_gather=ParamGather(),
        checkpointer=Checkpointer(),
    )
    autocast = autocast_for(device, cfg.run.precision)
    steps_per_epoch = len(train_src)
    if steps_per_epoch == 0:
        raise DutycycleError(
            f"the training split has fewer samples ({info.train_samples}) than one global batch "
            f"(data.global_batch_size = {cfg.data.global_batch_size}); lower it or add data"
        )
    total = cfg.run.max_steps or max(1, math.ceil(cfg.run.epochs * steps_per_epoch))
    is_cuda = device.type == "cuda"
    fps = flops_per_sample(model, info.channels, info.size, device) if is_cuda else None
    peak = M.peak_flops(torch.cuda.get_device_name(device)) if is_cuda else None

    writer = M.MetricsWriter(ctx.run_dir, enabled=(rank == 0 and bool(ctx.run_dir)))
    timer = StepTimer(device)
    eval_totals = 0.0
    n_evals = 0
    step = samples = epoch = 0
    first_loss = last_loss = None
    val_acc = val_loss = None
    t_start = time.perf_counter()
    log = rank == 0 and cfg.run.log_every > 0

    def run_eval() -> None:
        nonlocal val_acc, val_loss, eval_totals, n_evals
        t0 = time.perf_counter()
        val_acc, val_loss, n_val = evaluate(model, val_src, device, autocast, cfg.run.eval_max_batches, n_evals)
        n_evals += 1
        dt = time.perf_counter() - t0
        eval_totals += dt
        writer.log({"step": step, "epoch": epoch, "val_accuracy": val_acc, "val_loss": val_loss,
                    "val_samples": n_val, "eval_s": dt})
        writer.flush()
        if log:
            print(f"[rank 0] step {step}/{total}: val accuracy {val_acc:.3f}, val loss {val_loss:.4f}", flush=True)
        if ctx.report is not None:
            ctx.report({"step": step, "val_accuracy": val_acc, "val_loss": val_loss, "loss": last_loss})

    model.train()
    while step < total:
        train_src.set_epoch(epoch)
        it = iter(train_src)
        while step < total:
            timer.start_step()
            with timer.phase("data_wait", host=True):
                batch = next(it, None)
            if batch is None:
                break
            with timer.phase("h2d"):
                x = batch["image"].to(device, non_blocking=True)
                y = batch["label"].to(device, non_blocking=True)
            lr = lr_at(step, total, cfg.optim)
            loss = optimizer_step(model, optimizer, x, y, micro_batches=cfg.data.micro_batches, hooks=hooks,
                                  timer=timer, autocast=autocast, grad_clip=cfg.optim.grad_clip, lr=lr)
            saved = False
            with timer.phase("checkpoint"):
                saved = hooks.checkpointer.maybe_save(step + 1, model, optimizer, train_src.state_dict())
            # One small all-gather per step: every rank learns the global loss (so all stop together on a
            # non-finite loss) and rank 0 learns each rank's phase times (mean and max per step).
            phases = timer.current()
            stats = gather_stats([loss, float(y.shape[0])] + [phases[k] for k in PHASES])
            global_loss = float((stats[:, 0] * stats[:, 1]).sum() / stats[:, 1].sum())
            step_samples = int(stats[:, 1].sum())
            t = timer.end_step()
            step += 1
            samples += step_samples
            if not math.isfinite(global_loss):
                raise TrainingDiverged(
                    f"loss became {global_loss} at step {step} (epoch {epoch}); lower optim.lr "
                    f"(now {cfg.optim.lr}) or set optim.grad_clip"
                )
            first_loss = global_loss if first_loss is None else first_loss
            last_loss = global_loss
            row = {"step": step, "epoch": epoch, "loss": global_loss, "lr": lr, "samples": samples,
                   "step_s": t["step"], "checkpoint_saved": saved}
            for i, k in enumerate(PHASES):
                row[k] = float(stats[:, 2 + i].mean())
                row[k + "_max"] = float(stats[:, 2 + i].max())
            writer.log(row)
            if log and (step % cfg.run.log_every == 0 or step == 1):
                print(f"[rank 0] step {step}/{total} epoch {epoch} loss {global_loss:.4f} lr {lr:.2e} "
                      f"data_wait {row['data_wait']*1000:.0f}ms step {t['step']*1000:.0f}ms", flush=True)
            if cfg.run.eval_every and step % cfg.run.eval_every == 0 and step < total:
                run_eval()
        epoch += 1
    run_eval()
    hooks.checkpointer.finalize()
    wall = time.perf_counter() - t_start

    totals = dict(timer.totals)
    totals["eval"] = totals.get("eval", 0.0) + eval_totals
    per_rank = gather_stats([totals[k] for k in ALL_PHASES])
    per_rank_totals = [dict(zip(ALL_PHASES, row.tolist(), strict=True)) for row in per_rank]
    summary = M.summarize(
        steps=step, samples=samples, first_loss=first_loss, final_loss=last_loss, val_accuracy=val_acc,
        val_loss=val_loss, wall_s=wall, per_rank_totals=per_rank_totals, world_size=world,
        device=str(device.type), num_params=count_parameters(model), flops_per_sample=fps,
        peak_flops_per_device=peak,
        extra={
            "epochs": epoch, "steps_per_epoch": steps_per_epoch, "global_batch_size": cfg.data.global_batch_size,
            "micro_batches": cfg.data.micro_batches, "data_source": cfg.data.source,
            "data_fingerprint": info.fingerprint, "grad_sync": {
                "name": type(hooks.grad_sync).__name__, "calls": hooks.grad_sync.stats.calls,
                "collectives": hooks.grad_sync.stats.collectives, "bytes": hooks.grad_sync.stats.bytes},
            "threads_per_worker": torch.get_num_threads(),
            "weights_sha256": weights_digest(model),
            **ctx.info,
        },
    )
    writer.close()
    if rank == 0 and ctx.run_dir:
        from dutycycle.engine import io

        io.write_json_atomic(io.join(ctx.run_dir, "summary.json"), summary)
    ctx.state = {"model": model, "optimizer": optimizer}
    return summary


def weights_digest(model) -> str:
    """sha256 over every parameter's bytes: equal digests mean bit-identical weights."""
    import hashlib

    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _broadcast_parameters(model, world_size: int) -> None:
    """Start every rank from rank 0's weights (they are seeded alike; this makes it a guarantee)."""
    import torch.distributed as dist

    if world_size > 1 and dist.is_available() and dist.is_initialized():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
