"""The step loop, the same code in every launch mode (local, Ray Train worker, torchrun).

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
mean over its slice of the global batch; with equal slices the averaged gradient is the gradient of the global
mean loss, so 1 and N workers take the same steps. Per-step losses and phase times stay on the device and are
gathered once per logging interval (steplog.py).

Around the steps: a pre-flight health check of every worker, a resume from the newest verified checkpoint
(``checkpoint.resume``), and, when a flush finds a non-finite loss, the checkpointer's recovery (roll back to the
last commit, and leave the offending global batch out), after which the steps continue from the restored one.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

from dutycycle.engine.errors import DutycycleError, TrainingDiverged

from .steplog import StepLog
from .summary import summarize_run


@dataclass
class WorkerContext:
    rank: int = 0
    world_size: int = 1
    device: Any = None  # torch.device; None = cpu
    report: Any = None  # callable(metrics: dict) -> None, e.g. ray.train.report; called by every rank
    run_dir: str = ""
    info: dict = field(default_factory=dict)  # merged into the summary (e.g. where each worker ran)
    # every rank's node label (cluster/topology.py) when the launcher has gathered them already; None: gathered here
    node_labels: list | None = None
    state: dict | None = None  # filled with {"strategy", "model", "optimizer"} at the end (in-process callers, tests)
    on_commit: Any = None  # callable(step, uri), every rank, after a checkpoint commits (Ray Train: report it)
    started: float | None = None  # wall clock when the launcher entered this worker (launch/account.py)


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


def forward_backward(strategy, x, y, micro_batches: int, autocast, sampler=None):
    """Forward and backward over ``micro_batches`` chunks of the rank batch. Returns the rank batch's mean loss
    as a 0-d tensor on the device (no host synchronization). ``sampler`` (first step only) records the model
    state held after each forward and each backward; on that step tensor parallelism's activation exchanges are
    counted too (``strategy.tensor_traffic``: they run inside forward and backward, outside FSDP2's hooks)."""
    import contextlib

    import torch

    probe = contextlib.nullcontext()
    if sampler is not None and strategy.plan.tensor > 1:
        from dutycycle.trainer.parallel.tensor import TensorTraffic

        probe = strategy.tensor_traffic = TensorTraffic()
    n = y.shape[0]
    losses = []
    with probe:
        for i, (xs, ys) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True)):
            losses.append(_micro_batch(strategy, i, xs, ys, n, autocast, sampler))
    return torch.stack(losses).sum()


def _micro_batch(strategy, i: int, xs, ys, n: int, autocast, sampler):
    """Forward and backward of micro-batch ``i``; its loss weighted by its share of the ``n`` samples."""
    import torch.nn.functional as F

    with strategy.micro_step(i):
        with autocast():
            logits = strategy.model(xs)
        loss = F.cross_entropy(_loss_input(logits), ys) * (ys.shape[0] / n)
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
    from dutycycle.trainer.parallel.apply import total_norm

    grads = [p.grad for p in strategy.module.parameters() if p.grad is not None]
    return total_norm(grads) if grads else None


def optimizer_step(strategy, optimizer, x, y, *, micro_batches: int, timer, autocast, grad_clip: float,
                   lr: float, sampler=None, inject_comm_s: float = 0.0):
    """One full optimizer step on this rank's batch. Returns ``(loss, grad_norm)``: the rank's mean loss and the
    global gradient norm before clipping (device tensors). The norm is computed without clipping too
    (``grad_clip`` = 0), so that the step log's non-finite check catches an infinite or NaN gradient at the step
    that made it, not at the next step's NaN loss (which would blame, and skip, the wrong batch)."""
    with timer.phase("forward_backward"):
        loss = forward_backward(strategy, x, y, micro_batches, autocast, sampler)
        if inject_comm_s:  # parallel.inject_comm_ms: a slower link, on purpose
            time.sleep(inject_comm_s)
            strategy.meter.add_blocked(inject_comm_s)
    timer.move("forward_backward", "comm", strategy.meter.take_blocked())
    with timer.phase("optimizer"):
        norm = strategy.clip_grad_norm_(grad_clip) if grad_clip > 0 else grad_norm(strategy)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        if sampler is not None:
            sampler.sample(strategy.module, optimizer)
        optimizer.zero_grad(set_to_none=True)
    return loss, norm


def evaluate(strategy, source, device, autocast, max_batches: int = 0, index: int = 0) -> tuple[float, float, int]:
    """Accuracy and mean loss over the validation source, summed over all ranks: ``(acc, loss, count)``.

    Each evaluation is a fresh pass (``set_epoch(index)``, a new index each time) so a pass capped at
    ``max_batches`` starts from the first batch again rather than where the last one stopped; the
    validation plan is unshuffled and unaugmented, so every pass sees the same batches. Collectives issued by
    the forward passes (FSDP2 gathers) are counted as evaluation traffic, not training traffic."""
    import torch
    import torch.nn.functional as F

    from .timing import gather_stats

    source.set_epoch(index)
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


def train_worker(cfg, ctx: WorkerContext, checkpointer=None, parallelize_fn=None) -> dict:
    """Train on this rank until ``max_steps`` / ``epochs``; rank 0 writes metrics and returns the summary.

    ``parallelize_fn`` (same signature as ``parallel.apply.parallelize``) replaces how the model is wrapped:
    benchmarks use it to run a baseline strategy through the same loop."""
    import faulthandler

    import torch
    from dutycycle.trainer.checkpoint.manifest import check_shared, checkpoint_root
    from dutycycle.trainer.cluster.topology import check_layout, observe
    from dutycycle.trainer.parallel.apply import parallelize
    from dutycycle.trainer.parallel.memory import MemorySampler, host_memory

    from . import metrics as M
    from .data import make_sources, take
    from .models import build_model, count_parameters
    from .optim import make_optimizer
    from .timing import StepTimer

    if not faulthandler.is_enabled():  # a rank that dies of a signal (SIGSEGV in a collective) names its stack
        faulthandler.enable()
    now = time.time()
    started = ctx.started if ctx.started is not None else now
    # launch/account.py: the attempt's one-time phases before the loop, in seconds; "worker_init" is the
    # launcher's part (imports, its own gathers) between entering the worker and this call
    setup = {"worker_init": max(0.0, now - started)}
    t_phase = time.perf_counter()
    # where every rank runs, as the ranks report it (a collective), and what that layout allows
    world = observe(ctx.rank, ctx.world_size, cfg.parallel.node_size, labels=ctx.node_labels)
    check_layout(world, cfg.parallel)
    check_shared(cfg, world, checkpoint_root(cfg, ctx.run_dir))
    device = ctx.device or torch.device("cpu")
    precision = resolve_precision(device, cfg.run.precision)
    health = None
    if cfg.run.health_check:
        from dutycycle.trainer.cluster.health import preflight

        health = preflight(world.rank, world.size, device, cfg.run.health_timeout_s, ctx.run_dir)
    setup["health_check"] = time.perf_counter() - t_phase
    t_phase = time.perf_counter()
    torch.manual_seed(cfg.run.seed)
    train_src, val_src, info = make_sources(cfg, world)
    setup["data_open"] = time.perf_counter() - t_phase
    t_phase = time.perf_counter()
    model = build_model(cfg.model, info.channels, info.num_classes, info.size).to(device)
    if precision == "fp64":
        model = model.double()
    num_params = count_parameters(model)
    is_cuda = device.type == "cuda"
    fps = flops_per_sample(model, info.channels, info.size, device) if is_cuda else None
    peak = M.peak_flops(torch.cuda.get_device_name(device)) if is_cuda else None
    _broadcast_parameters(model, world.size)
    strategy = (parallelize_fn or parallelize)(model, cfg.parallel, world, device=device, precision=precision,
                                               micro_batches=cfg.data.micro_batches)
    optimizer = make_optimizer(strategy.module.parameters(), cfg.optim)
    offload_store = None
    if cfg.parallel.offload == "nvme":  # the optimizer state in files on local disk (parallel/nvme.py)
        from dutycycle.trainer.parallel import nvme

        from .summary import optimizer_state_tensors

        offload_store = nvme.FileStore(nvme.offload_root(cfg.parallel), nvme.run_key(ctx.run_dir), world.rank)
        nvme.attach(optimizer, offload_store, state_per_param=optimizer_state_tensors(cfg.optim) or 2)
    autocast = autocast_for(device, precision, fsdp=strategy.plan.fsdp)
    steps_per_epoch = len(train_src)
    if steps_per_epoch == 0:
        raise DutycycleError(
            f"the training split has fewer samples ({info.train_samples}) than one global batch "
            f"(data.global_batch_size = {cfg.data.global_batch_size}); lower it or add data"
        )
    total = cfg.run.max_steps or max(1, math.ceil(cfg.run.epochs * steps_per_epoch))

    writer = M.MetricsWriter(ctx.run_dir, enabled=(world.rank == 0 and bool(ctx.run_dir)))
    if checkpointer is None:
        from dutycycle.trainer.checkpoint import make_checkpointer

        checkpointer = make_checkpointer(cfg, ctx, total_steps=total, data_info=info, writer=writer)
    timer = StepTimer(device)
    log = StepLog(timer, writer, log_every=cfg.run.log_every, total_steps=total,
                  verbose=world.rank == 0 and cfg.run.log_every > 0, base_lr=cfg.optim.lr)
    sampler = MemorySampler()
    eval_totals = 0.0
    n_evals = 0
    once = {"restore": 0.0, "loader_start": 0.0, "final_save": 0.0}  # timing.ONE_TIME, outside the steps
    t_start = time.perf_counter()
    setup["model_build"] = t_start - t_phase
    attempt = {"started": started, "setup": setup, "loop_started": time.time()}
    restored = checkpointer.restore(strategy, optimizer, train_src)
    once["restore"] += time.perf_counter() - t_start
    # every attempt's record, kept across restarts (its step is where it began): the job's account reads them
    writer.log({"step": restored.step if restored else 0, "event": "attempt", **attempt})
    step, epoch = (restored.step, restored.epoch) if restored else (0, 0)
    first_step = step
    val_acc = val_loss = None
    val_samples = 0

    def run_eval() -> None:
        nonlocal val_acc, val_loss, eval_totals, n_evals, val_samples
        log.flush()
        t0 = time.perf_counter()
        val_acc, val_loss, n_val = evaluate(strategy, val_src, device, autocast, cfg.run.eval_max_batches, n_evals)
        val_samples = n_val
        n_evals += 1
        dt = time.perf_counter() - t0
        eval_totals += dt
        writer.log({"step": step, "epoch": epoch, "val_accuracy": val_acc, "val_loss": val_loss,
                    "val_samples": n_val, "eval_s": dt})
        writer.flush()
        if world.rank == 0 and cfg.run.log_every > 0:
            print(f"[rank 0] step {step}/{total}: val accuracy {val_acc:.3f}, val loss {val_loss:.4f}", flush=True)
        if ctx.report is not None:
            ctx.report({"step": step, "val_accuracy": val_acc, "val_loss": val_loss, "loss": log.last_loss})

    def run_steps() -> None:
        nonlocal step, epoch
        while step < total:
            t0 = time.perf_counter()
            train_src.set_epoch(epoch)
            it = iter(train_src)
            once["loader_start"] += time.perf_counter() - t0
            while step < total:
                timer.start_step()
                with timer.phase("data_wait", host=True):
                    batch, index = take(it, train_src, checkpointer.skipped)
                if batch is None:
                    break
                with timer.phase("h2d"):
                    x = batch["image"].to(device, dtype=strategy.compute_dtype, non_blocking=True)
                    y = batch["label"].to(device, non_blocking=True)
                lr = lr_at(step, total, cfg.optim)
                loss, grad_norm = optimizer_step(strategy, optimizer, x, y, micro_batches=cfg.data.micro_batches,
                                                 timer=timer, autocast=autocast, grad_clip=cfg.optim.grad_clip,
                                                 lr=lr, sampler=sampler if step == first_step else None,
                                                 inject_comm_s=cfg.parallel.inject_comm_ms / 1000.0)
                checkpointer.account(timer)
                step += 1
                # samples weigh each rank's loss in the global one: a tensor-parallel group's are counted once
                own = int(y.shape[0]) if strategy.tensor_rank == 0 else 0
                log.add(step, epoch, lr, loss, own, timer.end_step(), grad_norm, batch=index,
                        sample_ids=batch.get("sample_id"))
                if checkpointer.due(step):
                    # Every loss up to this step is checked and this step's row written (a collective: a rank lost
                    # here leaves no row and no commit) before the save starts, so a commit never holds an
                    # unchecked update and a resume from it finds its row. The save stalls the next step.
                    log.flush()
                    with timer.between("checkpoint"):
                        checkpointer.maybe_save(step, strategy, optimizer, train_src.state_dict())
                    writer.log({"step": step, "checkpoint_saved": True})
                if cfg.run.eval_every and step % cfg.run.eval_every == 0 and step < total:
                    run_eval()
            epoch += 1
        log.flush()
        timer.close()

    strategy.module.train()
    try:
        while True:
            try:
                run_steps()
                # between steps, after the last: what this rank holds in host memory (the offload files' pages).
                # Reading smaps walks every mapping (10-20 ms with torch loaded): a result of the run, so its time
                # is counted under "results", not left in the loop's "other"
                t_probe = time.perf_counter()
                host = host_memory(offload_store.dir if offload_store is not None else None)
                probe_s = time.perf_counter() - t_probe
                break
            except TrainingDiverged as err:  # roll back to the last commit (or raise, per checkpoint.on_nonfinite)
                t0 = time.perf_counter()
                restored = checkpointer.recover(err, strategy, optimizer, train_src)
                once["restore"] += time.perf_counter() - t0
                step, epoch = restored.step, restored.epoch
        run_eval()
        t_final = time.perf_counter()
        checkpointer.finalize()
    finally:
        checkpointer.close()
        if offload_store is not None:
            offload_stats = {"dir": offload_store.dir, "state_bytes": offload_store.file_bytes(),
                             "bytes_written": offload_store.bytes_written}
            offload_store.close()
    once["final_save"] += time.perf_counter() - t_final  # the last save, its background write, the close
    wall = time.perf_counter() - t_start - probe_s  # the memory probe's time goes to results_s below

    summary = summarize_run(cfg, ctx, strategy, optimizer, sampler, timer, log, M, info=info, wall=wall,
                         eval_s=eval_totals, steps=step, epochs=epoch, steps_per_epoch=steps_per_epoch,
                         num_params=num_params, precision=precision, fps=fps, peak=peak, val=(val_acc, val_loss),
                         once=once)
    summary["checkpoint"] = checkpointer.summary()
    summary["health"] = health
    summary["val_samples"] = val_samples  # the last validation pass's samples, each counted once
    summary["memory"]["host_after_steps"] = host
    if offload_store is not None:  # this rank's state files: their size, and what the steps wrote to them
        summary["parallel"]["offload_files"] = offload_stats
    from dutycycle.trainer.cluster.world import all_gather

    summary["data_reads"] = all_gather(train_src.reads(), world.size)  # each rank's shards: what locality gave
    writer.close()
    # after the loop: the summary gathered and the model written (the write of summary.json itself is left out)
    summary["attempt"] = {**attempt, "loop_s": wall, "results_s": time.perf_counter() - t_start - wall}
    if world.rank == 0 and ctx.run_dir:
        from dutycycle.engine import io

        if cfg.run.save_model:
            summary["model"] = io.join(ctx.run_dir, "model.safetensors")
        io.write_json_atomic(io.join(ctx.run_dir, "summary.json"), summary)
    ctx.state = {"strategy": strategy, "model": strategy.module, "optimizer": optimizer}
    return summary


def _broadcast_parameters(model, world_size: int) -> None:
    """Start every rank from rank 0's weights (they are seeded alike; this makes it a guarantee)."""
    import torch.distributed as dist

    if world_size > 1 and dist.is_available() and dist.is_initialized():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
