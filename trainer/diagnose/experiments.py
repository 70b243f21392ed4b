"""The experiments behind ``dutycycle diagnose``, each short and measured on the user's own config and data.

Each experiment is a function ``(ctx: Context) -> finding`` of measured numbers (its dataclass in findings.py);
it keeps within ``ctx.seconds`` where it loops (training runs are short: ``ctx.steps`` optimizer steps). An
experiment that does not apply says so (``NotApplicable``); one that fails raises, and the runner reports it and
goes on. Each runs in a process of its own (run.py, worker.py).

1. compute   the model's step on a synthetic batch already on the device: the ceiling the loader must feed
2. loader    the loaders alone, on the run's own data: the configured source, the other path to the same data
             (a raw run's own cache, a cache's source table decoded per step), one slice held in RAM
3. contention the step alone and beside the configured loader, and the CPU the loader's threads take (cpu.py)
4. end_to_end short training runs from the cache and from raw: the data-wait share of the step
5. h2d       host-to-device copy time and whether it overlaps compute (GPU only)
6. scaling   1 vs N workers at the configured ZeRO stage, fp32 and with quantized collectives
7. checkpoint the step's stall per save, synchronous and asynchronous (when checkpoints are configured)
8. memory    model-state bytes per rank for every layout, against the device budget (layouts.py)
9. failures  a save's stall and a restart's cost, measured; the configured job's lost work and ETTR at N
             workers, modelled

Every experiment reads the run's own data (``data.source`` and its table or cache), never a path the config only
inherited: a raw config whose base config names a cache that was never materialized here measures the raw path.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Any

from dutycycle.engine import io
from dutycycle.trainer.cluster.world import World
from dutycycle.trainer.launch.inputs import Inputs
from dutycycle.trainer.parallel.dims import flat_overrides
from dutycycle.trainer.step.data import make_sources
from dutycycle.trainer.step.loop import flops_per_sample, resolve_precision
from dutycycle.trainer.step.metrics import peak_flops
from dutycycle.trainer.step.models import build_model
from dutycycle.trainer.step.optim import make_optimizer

from . import cpu, noise
from . import failures as fm
from .context import Context, data_info, share_steps, variant
from .findings import (
    CheckpointFinding,
    ComputeFinding,
    ContentionFinding,
    EndToEndFinding,
    FailuresFinding,
    H2DFinding,
    LoaderFinding,
    NotApplicable,
    ScalingFinding,
    from_dict,
)
from .layouts import memory
from .shortrun import is_flat, short_run, trainer_step
from .shortrun import synthetic as _synthetic
from .sources import loader_sources, table_of  # noqa: F401 - table_of: benchmarks read it here

# ------------------------------------------------------------------------------------------------ 1 compute


@contextlib.contextmanager
def _model_step(ctx: Context):
    """The configured model's optimizer step on a random batch already on the device (forward, backward, the
    gradient norm, the optimizer), with one worker's share of the cores (what each worker gets on this machine
    when they share it): yields ``(step, info)``, ``step()``
    running one step to completion (synchronized on GPU), ``info`` its batch, device, threads and model."""
    import torch
    import torch.nn.functional as F

    cfg = ctx.cfg
    data = data_info(ctx)
    workers = cfg.parallel.num_workers
    device = torch.device("cuda", 0) if torch.cuda.is_available() and cfg.parallel.use_gpu != "false" \
        else torch.device("cpu")
    threads_before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(cfg.parallel.threads_per_worker or max(1, (os.cpu_count() or 1) // workers))
    try:
        torch.manual_seed(0)
        model = build_model(cfg.model, data.channels, data.num_classes, data.size).to(device)
        precision = resolve_precision(device, cfg.run.precision)
        if precision == "fp64":
            model = model.double()
        opt = make_optimizer(model.parameters(), cfg.optim)
        per_worker = cfg.data.global_batch_size // workers
        dtype = torch.float64 if precision == "fp64" else torch.float32
        x = torch.rand(per_worker, data.channels, data.size, data.size, device=device, dtype=dtype)
        y = torch.randint(0, data.num_classes, (per_worker,), device=device)
        autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if precision == "bf16" else \
            contextlib.nullcontext

        def step():
            with autocast():
                loss = F.cross_entropy(model(x).float(), y)
            loss.backward()
            # the gradient norm training computes every step (clipped at optim.grad_clip, or for the step log)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or float("inf"))
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()

        for _ in range(2):  # lazy initialization, the intra-op pool's start
            step()
        yield step, {"batch_per_worker": per_worker, "device": device, "threads": torch.get_num_threads(),
                     "workers": workers, "model": model, "data": data}
    finally:
        torch.set_num_threads(threads_before)


def _step_times(step, seconds: float, least: int = 5, most: int = 200) -> list[float]:
    """Seconds of each of ``step``'s runs for ``seconds`` (at least ``least`` runs, at most ``most``)."""
    times, t0 = [], time.perf_counter()
    while len(times) < least or (time.perf_counter() - t0 < seconds and len(times) < most):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def compute(ctx: Context) -> ComputeFinding:
    """One worker's optimizer step on a random batch already on the device, with that worker's share of the
    cores: samples/s per worker, times the workers for the ideal aggregate (no communication). Then the trainer's
    own step in the configured layout on the same batch (``shortrun.trainer_step``): the ceiling is the model's,
    and the layout's work beyond it is a part of the gap the verdict explains."""
    import torch

    with _model_step(ctx) as (step, s):
        times = _step_times(step, ctx.seconds)
        per_worker, workers, device = s["batch_per_worker"], s["workers"], s["device"]
        # the median step: a ceiling, so the steps another process's burst slowed down do not count
        rate = per_worker / statistics.median(times)
        lo, hi = noise.median_interval([per_worker / t for t in times])
        out = {"samples_per_s_per_worker": rate, "samples_per_s": rate * workers, "workers": workers,
               "interval": [lo * workers, hi * workers],
               "batch_per_worker": per_worker, "device": device.type, "threads": s["threads"],
               "num_params": sum(p.numel() for p in s["model"].parameters()), "mfu": None}
        if device.type == "cuda":
            info = s["data"]
            fps, peak = flops_per_sample(s["model"], info.channels, info.size, device), peak_flops(
                torch.cuda.get_device_name(device))
            if fps and peak:
                out["mfu"] = fps * rate / peak
    for key, flat in (("trainer", False), ("trainer_flat", True)):
        if flat and is_flat(ctx.cfg.parallel):
            out[key] = out["trainer"]  # the configured layout is the flat one
            continue
        try:
            out[key] = trainer_step(ctx, per_worker, s["threads"], flat=flat)
        except Exception as e:  # noqa: BLE001 - the ceiling stands without it; the gap leaves the layout unexplained
            out[key] = {"error": f"{type(e).__name__}: {e}"}
    flat = out["trainer_flat"]
    if "compute_s" in flat and flat["compute_s"] < per_worker / rate:
        # the trainer's own flat step ran faster than the bare loop: that is the ceiling then (an upper bound the
        # run beat read "107% of the compute ceiling")
        t_lo, t_hi = flat["interval"]
        rate = per_worker / flat["compute_s"]
        out.update(bare_samples_per_s_per_worker=out["samples_per_s_per_worker"], samples_per_s_per_worker=rate,
                   samples_per_s=rate * workers, interval=[per_worker / t_hi * workers, per_worker / t_lo * workers])
    return from_dict(ComputeFinding, out)


# ------------------------------------------------------------------------------------------------- 2 loader


def _rate(it, batch_size: int, seconds: float, min_batches: int = noise.MIN_ITEMS) -> tuple[float, list[float]]:
    """Samples per second of an iterator of batches, as the compute ceiling is measured: the median (of window
    rates), so a burst of other work on the machine slows one window and not the figure; and its interval. A mean
    here against a median ceiling read a busy machine's loader as 25% short of compute that it fed easily."""
    it = iter(it)
    next(it)  # the first batch carries the loader's start (opening, filling its prefetch): end_to_end counts that
    durations, t0 = [], time.perf_counter()
    last = t0
    for _ in it:
        now = time.perf_counter()
        durations.append(now - last)
        last = now
        # enough windows for a median once the time share is spent; a loader so slow that a few batches fill
        # thrice the share stops there (fewer windows, a wider interval) rather than overrun the budget
        if now - t0 >= seconds and (len(durations) >= min_batches or
                                    (now - t0 >= 3 * seconds and len(durations) >= noise.PER_WINDOW)):
            break
    return noise.rate_with_interval(durations, batch_size)


def loader(ctx: Context) -> LoaderFinding:
    """Global batches per second from each source alone, in this process, with training's augmentation; and one
    slice of the configured source's batches held in RAM (the rate no loader of this data can beat here)."""
    cfg = ctx.cfg
    gbs = cfg.data.global_batch_size
    sources, skipped = loader_sources(cfg)
    out: dict[str, Any] = {"global_batch_size": gbs, "intervals": {}}
    if skipped:
        out["not_measured"] = skipped
    cache, raw = dict(sources).get("cache"), dict(sources).get("raw")
    table = raw.data.table if raw else None
    out["paths"] = {k: v for k, v in (("table", table or None), ("cache", cache.data.cache if cache else None),
                                      ("size", cfg.data.size if cfg.data.source != "cache" else None)) if v}
    seconds = ctx.seconds / (len(sources) + 1)
    for name, c in sources:
        train, _, _ = make_sources(variant(c, "parallel.tensor=1"), World())  # one reader, the whole batch
        out[name], out["intervals"][name] = _rate(_epochs(train), gbs, seconds)
        if "in_ram" not in out:
            out["in_ram"], out["intervals"]["in_ram"] = _rate(_in_ram_batches(train, gbs), gbs, seconds)
    out["slow_ms"] = cfg.data.slow_ms
    return from_dict(LoaderFinding, out)


def _epochs(source):
    """Batches of one epoch after another, each epoch's start included as training meets it: a small split's epoch
    can be shorter than a measuring loop, and one epoch alone was all prefetched batches, handed over at once."""
    epoch = 0
    while True:
        source.set_epoch(epoch)
        yield from source
        epoch += 1


def _in_ram_batches(source, gbs: int, hold: int = 8):
    """One slice of the data (``hold`` batches) copied into RAM as uint8, then batches gathered from it at random
    and converted to float as training's loader does: the rate no loader can beat on this machine."""
    import numpy as np
    import torch

    source.set_epoch(0)
    held = [b["image"] for _, b in zip(range(hold), source, strict=False)]
    images = (torch.cat(held) * 255).round().to(torch.uint8).numpy()  # [N, C, H, W], as it would sit in RAM
    rng = np.random.default_rng(0)
    buf = np.empty((gbs, *images.shape[1:]), np.uint8)
    while True:
        np.take(images, rng.integers(0, len(images), gbs), axis=0, out=buf)
        yield torch.from_numpy(buf).float().div_(255.0)


# --------------------------------------------------------------------------------------------- 3 contention


def contention(ctx: Context) -> ContentionFinding | NotApplicable:
    """One worker's step (as the compute ceiling measures it) alone, then beside the configured loader, then alone
    again, in this process: the loader runs as in training (its prefetch thread and decode pool, one batch taken
    per step, batches discarded, the step on its own random batch), and the CPU time of its threads and processes
    and of the step's own threads is read from the OS (``cpu.py``). A step slowed by the loader's CPU use is a
    data cost that no wait timer sees (on CPU the decode threads take the cores the step needs)."""
    cfg = ctx.cfg
    if cfg.data.source == "synthetic":
        return NotApplicable("synthetic batches are drawn in the step's own thread: no loader runs beside it")
    measured = cpu.available()
    with _model_step(ctx) as (step, s):
        step_threads = set(cpu.thread_seconds()) if measured else set()  # the main thread and the intra-op pool
        workers = s["workers"]
        # one worker's loader (its share of each global batch) beside one worker's step
        train_src, _, _ = make_sources(variant(cfg, "parallel.tensor=1"), World(0, workers))
        window = ctx.seconds / 4
        a0 = cpu.snapshot() if measured else None
        alone = _step_times(step, window, least=noise.PER_WINDOW)  # twice: before and after, so 6 at least
        a1 = cpu.snapshot() if measured else None
        it = _epochs(train_src)
        next(it)  # the loader's start (opening, filling its prefetch) is the end-to-end run's to count
        b0 = cpu.snapshot() if measured else None
        beside, waits, t0 = [], [], time.perf_counter()
        while True:
            t = time.perf_counter()
            next(it)
            waits.append(time.perf_counter() - t)
            t = time.perf_counter()
            step()
            beside.append(time.perf_counter() - t)
            spent = time.perf_counter() - t0
            # twice the minimum where a step is slow and the time allows: a slowdown's interval from 16 steps
            # beside (the demo's raw config on one worker) spanned 11% to 75%, and read inconclusive
            if (spent >= 2 * window and len(beside) >= 2 * noise.MIN_ITEMS) or \
                    (spent >= 4 * window and len(beside) >= noise.MIN_ITEMS) or \
                    (spent >= 6 * window and len(beside) >= noise.PER_WINDOW):
                break
        b1 = cpu.snapshot() if measured else None
        it.close()  # the prefetch thread stops
        a2 = cpu.snapshot() if measured else None
        alone += _step_times(step, window, least=noise.PER_WINDOW)
        a3 = cpu.snapshot() if measured else None
    # trimmed means, not medians: beside a decoding pool the step is slow one step in two or so, and the median
    # of 30 such steps jumped between the modes (the demo's raw config: +46%, its interval 2% to 52%)
    a_step, b_step = float(noise.trimmed_mean(alone)), float(noise.trimmed_mean(beside))
    lo, hi = noise.trimmed_ratio_interval(beside, alone)
    out: dict[str, Any] = {
        "source": cfg.data.source, "loader_mode": cfg.data.loader_mode, "raw_threads": cfg.data.raw_threads,
        "prefetch": cfg.data.prefetch, "workers": workers, "batch_per_worker": s["batch_per_worker"],
        "threads": s["threads"], "cores": cpu.cores_available(), "steps_alone": len(alone),
        "steps_beside": len(beside), "alone_step_s": a_step, "beside_step_s": b_step,
        "slowdown": b_step / a_step - 1.0, "slowdown_interval": [lo - 1.0, hi - 1.0],
        "wait_s_per_batch": statistics.fmean(waits)}
    if measured:
        first, second, near = cpu.cores(a0, a1, step_threads), cpu.cores(a2, a3, step_threads), \
            cpu.cores(b0, b1, step_threads)
        out["alone"] = {k: (first[k] * first["wall_s"] + second[k] * second["wall_s"]) /
                        (first["wall_s"] + second["wall_s"]) for k in ("step", "loader", "others")}
        out["beside"] = {k: near[k] for k in ("step", "loader", "others", "loader_threads", "loader_processes")}
    return from_dict(ContentionFinding, out)


# --------------------------------------------------------------------------------------------- 4 end to end


def end_to_end(ctx: Context) -> EndToEndFinding:
    """Short runs of the config as it is (and from raw, when a table is known): where the step's time goes."""
    cfg = ctx.cfg
    out = {"configured": cfg.data.source,
           cfg.data.source: short_run(ctx, f"e2e-{cfg.data.source}", steps=share_steps(ctx))}
    if cfg.data.source == "cache":  # the same data decoded per step, from the cache's own source table
        raw = dict(loader_sources(cfg)[0]).get("raw")
        if raw is not None:
            out["raw"] = short_run(ctx, "e2e-raw", "data.source=raw", f"data.table={raw.data.table}",
                                   f"data.size={raw.data.size}")
    return from_dict(EndToEndFinding, out)


# ----------------------------------------------------------------------------------------------------- 5 h2d


def h2d(ctx: Context) -> H2DFinding | NotApplicable:
    import torch

    if not torch.cuda.is_available() or ctx.cfg.parallel.use_gpu == "false":
        return NotApplicable("a CPU run has no host-to-device copy")
    info = data_info(ctx)
    x = torch.empty(ctx.cfg.data.global_batch_size // ctx.cfg.parallel.num_workers, info.channels, info.size,
                    info.size).pin_memory()
    dev = torch.device("cuda", 0)
    for _ in range(3):
        x.to(dev, non_blocking=True)
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < min(1.0, ctx.seconds):
        x.to(dev, non_blocking=True)
        n += 1
    torch.cuda.synchronize()
    per_batch = (time.perf_counter() - t0) / n
    e2e = ctx.results.get("end_to_end", {}).get(ctx.cfg.data.source, {})
    return H2DFinding(applicable=True, copy_s_per_batch=per_batch, gb_per_s=x.numel() * 4 / per_batch / 1e9,
                      share_of_step=per_batch / e2e["step_s"] if e2e.get("step_s") else None)


# ------------------------------------------------------------------------------------------------- 6 scaling


def scaling(ctx: Context) -> ScalingFinding | NotApplicable:
    """1 vs N workers on synthetic data of the same shape (the loader out of the picture), at the configured ZeRO
    stage, then with quantized collectives (stage >= 1: int8 gradients, and int8 weight gathers at stage 3)."""
    cfg = ctx.cfg
    n = cfg.parallel.num_workers
    if n == 1:
        return NotApplicable("parallel.num_workers = 1: nothing to scale")
    steps = share_steps(ctx)  # each run's rate and shares decide the verdict or predict a remedy's gain
    synth = _synthetic(ctx, steps)
    one = short_run(ctx, "scale-1", *synth, "parallel.num_workers=1", "parallel.zero_stage=0",
                    "parallel.replicate=1", "parallel.tensor=1", "parallel.offload=none",
                    "parallel.quant_weights=none", "parallel.quant_grads=none", "parallel.hpz=false",
                    "parallel.error_feedback=false", steps=steps)
    many = short_run(ctx, f"scale-{n}", *synth, steps=steps)
    out = {"workers": n, "zero_stage": cfg.parallel.zero_stage, "replicate": cfg.parallel.replicate,
           "tensor": cfg.parallel.tensor, "quant_grads": cfg.parallel.quant_grads,
           "quant_block": cfg.parallel.quant_block,
           "one": one, "many": many,
           "speedup": many["samples_per_s"] / one["samples_per_s"]}
    out["efficiency"] = out["speedup"] / n
    quant = ["parallel.quant_grads=int8"] + (["parallel.quant_weights=int8"] if cfg.parallel.zero_stage == 3 else [])
    quant += flat_overrides(cfg.parallel)  # hybrid sharding and tensor parallelism do not combine with it
    stage = max(1, cfg.parallel.zero_stage)
    already = cfg.parallel.quant_grads != "none"
    if not already:
        q = short_run(ctx, f"scale-{n}-int8", *synth, f"parallel.zero_stage={stage}", *quant, steps=steps)
        out["quantized"] = {"zero_stage": stage, "settings": quant, **q,
                            "speedup": q["samples_per_s"] / one["samples_per_s"]}
    return from_dict(ScalingFinding, out)


# ---------------------------------------------------------------------------------------------- 7 checkpoint


def checkpoint(ctx: Context) -> CheckpointFinding:
    """Stall per save, synchronous and asynchronous, from short runs that save every other step (synthetic data of
    the same shape, so the loader does not blur the stall) to the configured checkpoint storage."""
    cfg = ctx.cfg
    synth = _synthetic(ctx)
    out: dict[str, Any] = {"configured_every": cfg.checkpoint.every, "configured_async": cfg.checkpoint.async_save,
                           "every": 2}
    # the storage the run saves to (a folder of its own there), when one is configured: a save's stall is mostly
    # that storage's write time
    where = cfg.checkpoint.dir or ctx.workdir
    for mode in ("sync", "async"):
        folder = io.join(where, "diagnose-ckpt-" + mode)
        try:
            run = short_run(ctx, f"ckpt-{mode}", *synth, f"checkpoint.dir={folder}",
                            f"checkpoint.every={out['every']}",
                            f"checkpoint.async_save={str(mode == 'async').lower()}", "checkpoint.resume=none",
                            "ray.max_failures=0")
        finally:
            if cfg.checkpoint.dir:  # the user's storage keeps nothing of the diagnosis
                fs, path = io.filesystem(folder)
                if fs.exists(path):
                    fs.rm(path, recursive=True)
        stall = (run["summary"].get("checkpoint") or {}).get("stall_s", {})
        saves = stall.get("per_save", [])
        out[mode] = {"stall_s_per_save": stall.get("mean", 0.0), "saves": len(saves),
                     "stall_interval": noise.ratio_interval(saves, [1.0] * len(saves)) if saves else [0.0, 0.0],
                     **run}
    return from_dict(CheckpointFinding, out)


# ------------------------------------------------------------------------------------------------ 9 failures


def failures(ctx: Context) -> FailuresFinding:
    """What a failure costs this run, measured, and what failures cost the configured job at the configured (or
    ``--scale``) worker count, modelled (``failures.py``): a short run that commits every other step (the stall
    per save, in the configured mode), then the same run started again, which resumes from its newest commit as a
    restarted worker group does (the restart: launch to the first step, restore included). The job is the
    configured run's steps (``job_steps``) at the configured end-to-end run's step when that experiment ran
    (else this one's), saves left out: at ``--scale`` N the same steps at the same step time fail N / workers
    times as often (a job that N workers finish sooner fails less: an upper bound then)."""
    cfg = ctx.cfg
    mode = str(cfg.checkpoint.async_save).lower()
    common = (*_synthetic(ctx), f"checkpoint.dir={io.join(ctx.workdir, 'fail-ckpt')}", "checkpoint.every=2",
              f"checkpoint.async_save={mode}", "ray.max_failures=0")
    first = short_run(ctx, "fail-first", *common, "checkpoint.resume=none")
    again = short_run(ctx, "fail-again", *common, "checkpoint.resume=auto", f"run.max_steps={ctx.steps + 2}",
                      resume=True)
    saved = first["summary"].get("checkpoint") or {}
    resumed = (again["summary"].get("checkpoint") or {}).get("resumed") or {}
    if not resumed:
        raise RuntimeError("the second run did not resume from the first one's commit")
    steps, job_from = job_steps(ctx)
    step_s, step_from = _job_step(ctx, first)
    detect, detect_from = detect_s(cfg)
    costs = fm.FailureCosts(save_s=(saved.get("stall_s") or {}).get("mean", 0.0),
                            restart_s=again["launch_s"] + resumed.get("restore_s", 0.0), step_s=step_s,
                            detect_s=detect, rate_per_worker_hour=cfg.checkpoint.failures_per_worker_hour)
    workers = ctx.scale or cfg.parallel.num_workers
    out = {"measured": {"save_s": costs.save_s, "launch_s": again["launch_s"],
                        "restore_s": resumed.get("restore_s", 0.0), "restart_s": costs.restart_s,
                        "step_s": first["step_s"], "async": cfg.checkpoint.async_save},
           "configured_every": cfg.checkpoint.every, "job_from": f"{job_from}, at {step_from}",
           "detect_from": detect_from,
           **fm.assess(costs, workers, cfg.checkpoint.every, steps)}
    out["to_reach_97"] = fm.to_reach(0.97, costs, workers, steps)
    return from_dict(FailuresFinding, out)


def job_steps(ctx: Context) -> tuple[int, str]:
    """The configured run's length in optimizer steps, as the trainer counts it, and where it comes from."""
    cfg = ctx.cfg
    if cfg.run.max_steps:
        return cfg.run.max_steps, f"run.max_steps = {cfg.run.max_steps}"
    samples = data_info(ctx).train_samples
    steps = Inputs(train_samples=samples).total_steps(cfg)
    return steps, (f"run.epochs = {cfg.run.epochs:g} of {samples:,} training samples at "
                   f"{cfg.data.global_batch_size:,} per step")


def _job_step(ctx: Context, own: dict) -> tuple[float, str]:
    """One step of the job without its saves: the configured end-to-end run's (the data the job reads) when that
    experiment ran in this diagnosis, else ``own`` (this experiment's synthetic run)."""
    e2e = ctx.results.get("end_to_end") or {}
    run = e2e.get(e2e.get("configured", "")) if "error" not in e2e else None
    if isinstance(run, dict) and run.get("step_s"):
        return run["step_s"] * (1 - run.get("checkpoint_share", 0.0)), "the end-to-end run's step"
    return own["step_s"] * (1 - own.get("checkpoint_share", 0.0)), "the failures run's step (synthetic data)"


def detect_s(cfg) -> tuple[float, str]:
    """Seconds from a failure to Ray Train acting on it: ``checkpoint.failure_detect_s``, else a lost node as Ray
    notices it (``failures.default_detect_s``)."""
    if cfg.checkpoint.failure_detect_s is not None:
        return cfg.checkpoint.failure_detect_s, "checkpoint.failure_detect_s"
    poll = cfg.ray.health_check_interval_s
    return fm.default_detect_s(poll), (f"a lost node: Ray's health check ({fm.RAY_NODE_CHECK_FAILURES} missed "
                                       f"checks {fm.RAY_NODE_CHECK_PERIOD_S:g} s apart) and the Train controller's "
                                       f"next poll (ray.health_check_interval_s = {poll:g} s)")


EXPERIMENTS = (
    ("compute", "compute ceiling", compute),
    ("loader", "loader alone", loader),
    ("contention", "step beside the loader", contention),
    ("end_to_end", "end to end", end_to_end),
    ("h2d", "host-to-device", h2d),
    ("scaling", "scaling", scaling),
    ("checkpoint", "checkpoint stall", checkpoint),
    ("memory", "memory per rank", memory),  # before failures: instant, and it decides first
    ("failures", "failures and recovery", failures),
)
