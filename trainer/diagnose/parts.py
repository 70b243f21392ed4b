"""The parts of a run's step against its compute ceiling, from the experiments' findings: the step the loader's
CPU use slowed (contention), the layout's own work, the run's own compute, and the gap ``1 - run / ceiling`` split
into the step's waits, the layout, its host work outside compute (``overhead``) and ``unexplained``, which makes
them add up. Pure functions of the findings; ``verdict.py`` decides from them, ``remedies.py`` predicts from them."""

from __future__ import annotations

# the costs inside the step: its waits, and the layout's host work beyond the model's bare step (``layout_share``)
STEP_WAITS = ("data", "communication", "checkpoint", "layout")
# not waits a verdict names: the step's host work beside its compute and waits, and what no measurement explains;
# with the step's waits they add up to the gap between the run and its compute ceiling
NOT_WAITS = ("overhead", "unexplained")
SHARED = 0.25  # other processes taking this share of the cores while a diagnosis measures: the verdict says so


def contention_of(findings: dict) -> dict | None:
    """The contention experiment's finding when it measured (not failed, applicable)."""
    c = findings.get("contention") or {}
    return c if "slowdown" in c and "error" not in c else None


def shared_while_measured(cont: dict) -> bool:
    """Whether other processes took ``SHARED`` of the cores while the step was measured, alone or beside."""
    others = max((cont.get(k) or {}).get("others", 0.0) for k in ("alone", "beside"))
    return others >= SHARED * cont.get("cores", 1)


def compute_share(run: dict) -> float:
    """The share of the run's step its own compute took (forward, backward, optimizer; from its per-step phases),
    or, for a run recorded without them, what its waits leave."""
    per = run.get("per_step") or {}
    if per.get("compute") and per.get("step_s"):
        return sum(per["compute"]) / max(sum(per["step_s"]), 1e-12)
    return max(0.0, 1.0 - run["data_wait_share"] - run.get("comm_share", 0.0) - run.get("checkpoint_share", 0.0))


def contention_share(cont: dict, run: dict) -> tuple[float, list[float]]:
    """The part of the run's step that the loader's CPU use added, with its 90% interval: the run's compute is
    the step slowed by ``slowdown`` (measured beside the loader against alone, in one process minutes apart at
    most), so ``s / (1 + s)`` of it is the loader's. A ratio, not the experiment's seconds: the machine's load
    moves between experiments, and the run's own compute is what the share is of. Never below zero (a step
    measured faster beside the loader is noise, not a gain)."""
    own = compute_share(run)
    lo, hi = cont.get("slowdown_interval") or (cont["slowdown"], cont["slowdown"])
    if shared_while_measured(cont):
        # another process's CPU in both windows: the step's slowdown beside the loader is then the two together
        # (a 2-core machine with one core spinning elsewhere measured the step 36x slower beside a loader taking
        # a tenth of a core, and 0.4x in the next run), so no part of it is surely the loader's
        lo = 0.0

    def share(slowdown: float) -> float:
        s = max(0.0, slowdown)
        return own * s / (1.0 + s)

    return share(cont["slowdown"]), [share(lo), share(hi)]


def bare_step_s(compute: dict) -> tuple[float, list[float]] | None:
    """The model's bare step (the compute ceiling's), seconds per step of one worker, with its 90% interval."""
    rate, n = compute.get("samples_per_s_per_worker"), compute.get("workers", 1)
    if not rate or not compute.get("batch_per_worker"):
        return None
    b = compute["batch_per_worker"]
    lo, hi = compute.get("interval") or (rate * n, rate * n)
    return b / rate, [b / max(hi / n, 1e-9), b / max(lo / n, 1e-9)]


def flat_step_s(compute: dict) -> tuple[float, list[float]] | None:
    """The step the layout's cost is measured against, with its interval: the trainer's own at stage 0 with
    nothing quantized (``trainer_flat``, the same accounting as the configured layout's), or for a diagnosis
    recorded without it, the bare loop's."""
    f = compute.get("trainer_flat") or {}
    return (f["compute_s"], f["interval"]) if "compute_s" in f else bare_step_s(compute)


def layout_share(compute: dict, run: dict) -> tuple[float, list[float]] | None:
    """The share of the run's step that its layout's host work takes: the trainer's step at one worker in the
    configured layout (the compute experiment's ``trainer``) beyond the same step in the flat layout, over the
    run's step. Never below zero (a sharded step measured faster than the flat one is noise). None when not
    measured."""
    t, flat = compute.get("trainer") or {}, flat_step_s(compute)
    if "compute_s" not in t or not flat or not run.get("step_s"):
        return None
    (b, (b_lo, b_hi)), (t_lo, t_hi), step = flat, t["interval"], run["step_s"]
    return max(0.0, t["compute_s"] - b) / step, [max(0.0, t_lo - b_hi) / step, max(0.0, t_hi - b_lo) / step]


def gap(run: dict, compute: dict, shares: dict, iv: dict, parts: dict) -> dict:
    """The run's gap to its compute ceiling, ``1 - run / ceiling`` of its step, and the ``unexplained`` share
    that makes the step's waits add up to it (put into ``shares``); empty without both figures."""
    ceiling = compute.get("samples_per_s")
    if not run or not ceiling:
        return {}
    rate = run["samples_per_s"]
    c_lo, c_hi = compute.get("interval") or (ceiling, ceiling)
    gap, g_lo, g_hi = 1.0 - rate / ceiling, 1.0 - rate / max(c_lo, 1e-9), 1.0 - rate / max(c_hi, 1e-9)
    step = [k for k in STEP_WAITS if k in shares]
    explained = sum(shares[k] for k in step)
    per = run.get("per_step") or {}
    if per.get("compute") and per.get("step_s"):
        # the step's host work outside its compute and its waits (copies to the device, the loop's bookkeeping):
        # measured, though no wait; what is left of the gap is the run's compute slower than the ceiling's step
        # beyond what the loader's contention and the layout's work (the trainer's step alone) explain
        own = compute_share(run)
        overhead = max(0.0, 1.0 - own - run["data_wait_share"] - run["comm_share"] - run["checkpoint_share"])
        shares["overhead"], iv["overhead"] = overhead, [overhead, overhead]
        step.append("overhead")
        explained += overhead
    shares["unexplained"] = gap - explained
    iv["unexplained"] = [min(g_lo, g_hi) - sum(iv[k][1] for k in step), max(g_lo, g_hi) - sum(iv[k][0] for k in step)]
    return {"ceiling_samples_per_s": ceiling, "samples_per_s": rate, "share": gap,
            "parts": {**parts, **{k: shares[k] for k in step if k != "data"}, "unexplained": gap - explained}}
