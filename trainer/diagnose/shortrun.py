"""Short training runs of the config, as the experiments measure them: the config's own launcher (Ray Train, or
this process for one worker) for a few optimizer steps, read back from the run's per-step metrics; and the
trainer's own step with the data out of the way (``trainer_step``), in the configured layout and flat: the
layout's cost is their difference, and the flat one is the compute ceiling when it beats the bare loop."""

from __future__ import annotations

import statistics
import time

from dutycycle.engine import io
from dutycycle.trainer.launch.train import train
from dutycycle.trainer.step.metrics import read_metrics

from . import noise
from .context import Context, data_info, variant


def short_run(ctx: Context, name: str, *overrides: str, steps: int | None = None, resume: bool = False) -> dict:
    """A short training run of the config (its launcher: Ray Train, or this process for one worker) of ``steps``
    optimizer steps (default ``ctx.steps``). Its run directory is the diagnosis's own: a diagnosis written again
    into the same folder replaces it (``overwrite``), unless ``resume`` continues the run there (and its commits)."""
    run_dir = io.join(ctx.workdir, name)
    # never a resume unless asked (the failures experiment asks): a diagnosis written again into the same folder
    # would otherwise resume each run from its last commit and train nothing, reporting the old rows
    cfg = variant(ctx.cfg, f"run.dir={run_dir}", f"run.max_steps={steps or ctx.steps}", "run.eval_every=0",
                  "run.eval_max_batches=1", "run.log_every=0", "run.report=false", "run.save_model=false",
                  f"run.name=diagnose-{name}", "checkpoint.resume=none", *overrides)
    t0 = time.perf_counter()
    summary = train(cfg, local=cfg.parallel.num_workers == 1, quiet=True, resume=resume, overwrite=not resume)
    launched = time.perf_counter() - t0
    rows = steady_rows(run_dir)
    step_s = sum(r["step_s"] for r in rows) or 1e-9
    steps = [r["step_s"] for r in rows]
    return {
        "workers": cfg.parallel.num_workers,
        "samples_per_s": cfg.data.global_batch_size * len(rows) / step_s,
        "step_s": step_s / max(1, len(rows)),
        "data_wait_share": sum(r["data_wait"] for r in rows) / step_s,
        "comm_share": sum(r["comm"] for r in rows) / step_s,
        "checkpoint_share": sum(r["checkpoint"] for r in rows) / step_s,
        # how far each share moves when the steps are resampled: the verdict compares shares beyond these
        "intervals": {f"{k}_share": noise.ratio_interval([r[k] for r in rows], steps)
                      for k in ("data_wait", "comm", "checkpoint")},
        # the per-step samples behind comm_share: two runs of one exchange pool them (verdict.py)
        # and the step's own work (forward, backward, optimizer) per step: the run's compute against the ceiling's
        "per_step": {"step_s": steps, "comm": [r["comm"] for r in rows],
                     "compute": [r.get("forward_backward", 0.0) + r.get("optimizer", 0.0) for r in rows]},
        "bytes_per_step": summary["parallel"]["traffic"]["bytes"] / max(1, summary["steps"]),
        "inter_node_bytes_per_step": summary["parallel"]["traffic"]["inter_node_bytes"] / max(1, summary["steps"]),
        "comm_exposed_measured": summary["parallel"]["comm_exposed_measured"],
        # before the first step and after the last: worker group start, model build, teardown
        "launch_s": max(0.0, launched - summary["wall_s"]),
        "held_per_rank": (summary.get("memory") or {}).get("held_per_rank", []),  # model state each rank held
        "summary": {k: summary.get(k) for k in ("steps", "samples_per_s", "data_wait_fraction", "comm_fraction",
                                                 "goodput", "checkpoint")},
    }


def steady_rows(run_dir: str) -> list[dict]:
    """Per-step rows without the first two (lazy initialization, the memory-sampling step)."""
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    return rows[2:] if len(rows) > 4 else rows



def synthetic(ctx: Context, steps: int | None = None) -> list[str]:
    """Overrides for synthetic data of the configured shape, enough for a short run of ``steps`` (default
    ``ctx.steps``) in one epoch: the loader out of the way."""
    return ["data.source=synthetic", f"data.size={data_info(ctx).size}",
            f"data.synthetic_samples={max(ctx.cfg.data.global_batch_size * ((steps or ctx.steps) + 1), 256)}"]




def layout_text(p) -> str:
    """The configured layout's parts that cost host work per step at one worker, as a person reads them."""
    parts = [f"ZeRO stage {p.zero_stage}" + (" (FSDP2)" if p.zero_stage >= 1 else " (DDP)")]
    if p.quant_grads != "none":
        parts.append(f"{p.quant_grads} gradients")
    if p.quant_weights != "none":
        parts.append(f"{p.quant_weights} weight gathers")
    if p.offload != "none":
        parts.append(f"{p.offload} offload")
    return ", ".join(parts)


FLAT = ("parallel.zero_stage=0", "parallel.quant_grads=none", "parallel.quant_weights=none", "parallel.offload=none")


def is_flat(p) -> bool:
    """Whether a ``[parallel]`` section shards, quantizes and offloads nothing (the trainer's flat layout)."""
    return (p.zero_stage, p.quant_grads, p.quant_weights, p.offload) == (0, "none", "none", "none")


def trainer_step(ctx: Context, per_worker: int, threads: int, flat: bool = False) -> dict:
    """The trainer's own step (its forward-backward and optimizer phases) at one worker in the configured layout
    (ZeRO stage, quantized collectives, offload, precision), on synthetic data of the configured shape with one
    worker's batch and cores: the step with no loader beside it and no other rank to wait on. Its excess over the
    model's bare step (the compute ceiling's) is the layout's host work per step: FSDP2's hooks and sharded
    parameters, quantizing, moving state to the host. On one worker these exchange nothing and cost it all the
    same (the demo's tiny CNN: 2.9 ms bare, 8.6 ms at stage 2 with int8 gradients, 2.8 ms at stage 0). With
    ``flat``: the same step at ZeRO stage 0 with nothing quantized or offloaded, the layout's cost measured against
    the trainer's own step rather than the bare loop's (whose accounting differs: at the demo's width the trainer's
    step at stage 2 measured 79 ms against the bare loop's 95 ms)."""
    run = short_run(ctx, "compute-trainer", *synthetic(ctx), "parallel.num_workers=1",
                    f"data.global_batch_size={per_worker}", f"parallel.threads_per_worker={threads}",
                    "parallel.replicate=1", "parallel.tensor=1", "parallel.inject_comm_ms=0", "data.slow_ms=0",
                    "checkpoint.every=0", *(FLAT if flat else ()))
    times = run["per_step"]["compute"]
    return {"compute_s": statistics.median(times), "interval": noise.median_interval(times), "steps": len(times),
            "layout": "ZeRO stage 0 (DDP)" if flat else layout_text(ctx.cfg.parallel)}
