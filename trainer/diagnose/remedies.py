"""Each remedy a verdict can name, as a config change with the samples/s it should give, predicted from the
measured components; ``dutycycle diagnose --verify`` then runs the top one and records what it gave.

The predictions, each a small model over numbers the experiments measured:

- data (raw -> cache): the step without its data wait, ``samples/s / (1 - data wait share)``, capped by the
  cache loader's rate alone: the cache removes the decode, not the compute or the exchange.
- communication (fp32 -> int8 collectives): the step's exposed communication scaled by the bytes the quantized
  format sends (8 bits per element plus one fp32 scale per block) against fp32's, the rest of the step unchanged.
- checkpoint (synchronous -> asynchronous saves): the step time with the asynchronous runs' step in place of the
  synchronous runs' (the checkpoint experiment's, which save every other step: the stall and the background
  write's contention for the cores), spread over ``checkpoint.every`` steps.

Memory (a stage that fits) has no rate to predict (the run does not fit as configured): its prediction is the
model-state bytes per rank at that stage, and --verify reads what the ranks held. Failures predict an ETTR, which
``failures.py`` gives, not a rate a short run could verify.
"""

from __future__ import annotations

from typing import Any

from dutycycle.engine.numbers import megabytes

from .context import share_steps
from .verdict import layout_settings


def _run(findings: dict) -> dict:
    e2e = findings.get("end_to_end") or {}
    return e2e.get(e2e.get("configured", ""), {}) if "error" not in e2e else {}


def data_remedy(findings: dict) -> dict | None:
    run, loaders = _run(findings), findings.get("loader") or {}
    if not run or (findings.get("end_to_end") or {}).get("configured") != "raw":
        return None
    cache = loaders.get("cache")
    if not isinstance(cache, float):
        return None
    free = run["samples_per_s"] / max(1e-9, 1.0 - run["data_wait_share"])
    return {"for": "data", "set": ["data.source=cache"], "predicted_samples_per_s": min(free, cache),
            "from": f"the step without its data wait ({free:,.0f} samples/s), capped by the cache loader alone "
                    f"({cache:,.0f})"}


def comm_remedy(findings: dict) -> dict | None:
    scaling = findings.get("scaling") or {}
    many, q = scaling.get("many"), scaling.get("quantized")
    if not many or not q:
        return None
    block = scaling.get("quant_block", 256)  # parallel.quant_block: one fp32 scale per block
    ratio = (8 + 32 / block) / 32  # int8 elements and one fp32 scale per block, against fp32
    run = _run(findings)
    # the configured data's end-to-end run when it exchanges (what --verify runs), else the synthetic one
    base = run if run.get("comm_share", 0.0) > 0 and run.get("workers", 1) > 1 else many
    step = base["step_s"]
    predicted_step = step * (1 - base["comm_share"]) + step * base["comm_share"] * ratio
    gbs = base["samples_per_s"] * step
    return {"for": "communication", "set": [*q["settings"], f"parallel.zero_stage={q['zero_stage']}"],
            "predicted_samples_per_s": gbs / predicted_step,
            "from": f"exposed communication ({base['comm_share']:.0%} of the step) scaled by the bytes int8 sends "
                    f"against fp32 ({ratio:.2f}x)"}


def checkpoint_remedy(findings: dict) -> dict | None:
    ckpt, run = findings.get("checkpoint") or {}, _run(findings)
    sync, asyn, every = ckpt.get("sync"), ckpt.get("async"), ckpt.get("configured_every")
    if not run or not sync or not asyn or not every or ckpt.get("configured_async"):
        return None
    # the whole step's difference between the experiment's asynchronous and synchronous runs (the same data, a
    # save every ``saved_every`` steps), not the stalls alone: a background write also competes with compute for
    # the cores, which shows in the step and not in the stall (on one 2-core worker the stalls alone predicted
    # 1.2-1.3x what async gave)
    saved_every = ckpt.get("every", 2)
    delta = (asyn["step_s"] - sync["step_s"]) * saved_every / every
    step = run["step_s"] + delta
    gbs = run["samples_per_s"] * run["step_s"]
    return {"for": "checkpoint", "set": ["checkpoint.async_save=true"],
            "predicted_samples_per_s": gbs / max(step, 1e-9),
            "from": f"the step with the asynchronous save's step ({asyn['step_s'] * 1e3:.0f} ms, stall "
                    f"{asyn['stall_s_per_save']:.3f} s per save) in place of the synchronous one's "
                    f"({sync['step_s'] * 1e3:.0f} ms, {sync['stall_s_per_save']:.3f} s), a save every {every} steps"}


def compute_remedy(findings: dict) -> dict | None:
    """Workers that share one machine's cores add no compute (the scaling experiment's efficiency below 0.7):
    one worker with all the cores, at the rate the scaling experiment measured for one worker against N, applied
    to the configured run's rate."""
    scaling, run = findings.get("scaling") or {}, _run(findings)
    one, many = scaling.get("one"), scaling.get("many")
    if not run or not one or not many or scaling.get("efficiency", 1.0) >= 0.7 or run.get("workers", 1) < 2:
        return None
    ratio = one["samples_per_s"] / max(many["samples_per_s"], 1e-9)
    flat = ["parallel.replicate=1"] if scaling.get("replicate", 1) != 1 else []  # one worker has no groups
    flat += ["parallel.tensor=1"] if scaling.get("tensor", 1) != 1 else []
    return {"for": "compute", "set": ["parallel.num_workers=1", *flat],
            "predicted_samples_per_s": run["samples_per_s"] * ratio,
            "from": f"the configured run's rate times one worker's over {scaling['workers']} workers' in the "
                    f"scaling experiment ({ratio:.2f}x): they share the cores, one has them all"}


def memory_remedy(findings: dict) -> dict | None:
    """The least-sharded stage that fits, with the model-state bytes per rank it should hold (the memory
    experiment's formula); --verify runs it and reads what its ranks held."""
    mem = findings.get("memory") or {}
    mine = mem.get("configured")
    if not mine or mine["fits"]:
        return None
    fitting = [r for r in mem["rows"] if r["fits"]]
    if not fitting:
        return None
    best = fitting[0]
    sets = [f"{k}={v}" for k, v in layout_settings(best, mine)]
    return {"for": "memory", "set": sets, "predicted_bytes_per_rank": best["device_bytes"],
            "from": f"stage {best['zero_stage']}'s parameters, gradients and optimizer state per rank at "
                    f"{mem['workers']} workers, against the budget of {megabytes(mem['budget_bytes'])}"}


def remedies(findings: dict, kind: str) -> list[dict[str, Any]]:
    """The remedies with a prediction (a rate; for memory, the bytes per rank), the verdict's ``kind``'s first."""
    found = [r for r in (data_remedy(findings), comm_remedy(findings), checkpoint_remedy(findings),
                         memory_remedy(findings), compute_remedy(findings)) if r]
    top = kind.split("-")[0]
    return sorted(found, key=lambda r: r["for"] != top)


def predicted_text(r: dict) -> str:
    """A remedy's prediction as a person reads it."""
    if "predicted_bytes_per_rank" in r:
        return f"{megabytes(r['predicted_bytes_per_rank'])} of model state per rank"
    return f"{r['predicted_samples_per_s']:,.0f} samples/s"


def measured_text(r: dict) -> str | None:
    """What --verify measured, against the prediction; None before it ran."""
    if "measured_bytes_per_rank" in r:
        return f"{megabytes(r['measured_bytes_per_rank'])} per rank ({r['measured_over_predicted']:.2f}x)"
    if "measured_samples_per_s" in r:
        return f"{r['measured_samples_per_s']:,.0f} samples/s ({r['measured_over_predicted']:.2f}x)"
    return None


def verify(ctx, remedy: dict, short_run) -> dict:
    """Run the config with ``remedy``'s settings as a short run (``short_run``: ``experiments.short_run``) and
    record measured against predicted. It takes the steps of the run the prediction came from."""
    got = short_run(ctx, f"verify-{remedy['for']}", *remedy["set"], steps=share_steps(ctx))
    if "predicted_bytes_per_rank" in remedy:  # memory: what the most loaded rank held (its model state)
        held = max(sum(r.get(k, 0.0) for k in ("params", "grads", "optimizer")) for r in got["held_per_rank"])
        return {**remedy, "measured_bytes_per_rank": held,
                "measured_over_predicted": held / max(remedy["predicted_bytes_per_rank"], 1e-9)}
    measured = got["samples_per_s"]
    return {**remedy, "measured_samples_per_s": measured,
            "measured_over_predicted": measured / max(remedy["predicted_samples_per_s"], 1e-9)}
