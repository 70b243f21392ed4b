"""The job's time account, from launch to exit: every second under one name.

The step loop accounts for its own wall time (step/timing.py: the per-step phases, and ``restore``,
``loader_start`` and ``final_save`` once). Around it a run also pays for starting, setting up and stopping, and
for every failure. Those are measured at their boundaries, on the wall clock, by the driver and by rank 0:

    ray_start      launch -> Ray Train's fit called: config checked, Ray started or joined, placement checked
    worker_start   fit called -> the first attempt's rank 0 in the training loop's code: the worker group placed
                   and started, the process group joined, the launcher's imports and placement gather
    health_check   topology observed, layout and checkpoint place checked, the pre-flight collectives
    data_open      the loader's sources opened (the cache's index, the split, the plan)
    model_build    model built, broadcast, wrapped for its strategy; optimizer, checkpointer and timers made
    warmup         each attempt's first step beyond the median step, per phase (lazy initialization: optimizer
                   state, allocations, the loader's first batch): taken out of the per-step phases
    (the loop)     step/timing.ACCOUNT: per step, and restore, loader_start, final_save once
    failures       from the first attempt's loop start to the last attempt's, less the steps the job kept from
                   the earlier attempts: steps trained again, the time to notice the failure, the restart
    results        after the loop: the summary gathered, the model written (rank 0)
    teardown       the results reported to Ray Train, the workers stopped, the results read by the driver
    other          what none of them covers: the loop's own "other" and the gaps inside the setup

Per-step phases are what scales with a longer run; the rest is what a short run pays once (``ONE_TIME``). The
account closes by construction (its parts are intervals between measured boundaries), so ``other`` is a real
residue, not a plug. On one machine every timestamp is one clock; across nodes rank 0's clock and the driver's
differ by their synchronisation error (milliseconds under NTP), and a negative interval is clamped at zero.
"""

from __future__ import annotations

import json

from dutycycle.engine import formats, io
from dutycycle.trainer.step.timing import JOB_ONE_TIME, ONE_TIME, PHASES, USEFUL

JOB_ACCOUNT = (*PHASES, *JOB_ONE_TIME, "other")
# how the pages name each phase
NAMES = {
    "data_wait": "waiting for data", "h2d": "copy to the device", "forward_backward": "forward and backward",
    "comm": "exposed communication", "optimizer": "optimizer step", "checkpoint": "checkpoint stall",
    "eval": "evaluation", "ray_start": "Ray start", "worker_start": "worker start", "health_check": "health check",
    "data_open": "data open", "model_build": "model build", "warmup": "first-step warm-up", "restore": "restore",
    "loader_start": "loader start",
    "final_save": "final save and its wait", "failures": "lost to failures", "results": "results",
    "teardown": "teardown", "other": "other",
}


def job_time(summary: dict, rows: list[dict], *, launched: float, fit_called: float | None,
             closed: float) -> dict:
    """``{"wall_s", "seconds", "fractions", "per_step_s", "one_time_s", "attempts", "failures", "resize_s",
    "resizes", "world_sizes", "goodput"}`` for
    the job whose last attempt wrote
    ``summary`` (with its ``attempt`` record) and whose metrics rows are ``rows``. ``launched``: when the driver
    began; ``fit_called``: when it handed the run to Ray Train (None in-process: no Ray, no start of its own);
    ``closed``: now, the account's end."""
    last = summary["attempt"]
    # this launch's rows only: a run directory resumed by a later launch holds the earlier launches' attempts and
    # steps too, whose time is not inside this launch's wall time (counted, they made goodput exceed 1)
    rows = [r for r in rows if _at(r) is None or _at(r) >= launched]
    attempts = [r for r in rows if r.get("event") == "attempt"] or [last]
    first = min(attempts, key=lambda r: r["started"])
    loop = summary["time_breakdown"]["seconds"]
    sec = dict.fromkeys(JOB_ACCOUNT, 0.0)
    sec["ray_start"] = max(0.0, (fit_called or launched) - launched)
    sec["worker_start"] = max(0.0, first["started"] - (fit_called or launched)) + first["setup"].get("worker_init", 0)
    for name in ("health_check", "data_open", "model_build"):
        sec[name] = float(first["setup"].get(name, 0.0))
    for name in (*PHASES, *ONE_TIME, "other"):
        sec[name] += float(loop.get(name, 0.0))
    kept = _kept_earlier(rows, before=last["started"])  # nothing when there was one attempt
    for name, v in kept.items():
        sec[name] += v
    for k, v in _warmup(rows, attempts).items():  # each attempt's first step: what it took beyond a typical one
        moved = min(v, sec[k])
        sec[k] -= moved
        sec["warmup"] += moved
    sec["failures"] = max(0.0, last["loop_started"] - first["loop_started"] - sum(kept.values()))
    sec["results"] = max(0.0, float(last.get("results_s", 0.0)))
    sec["teardown"] = max(0.0, closed - (last["loop_started"] + last["loop_s"] + sec["results"]))
    wall = max(closed - launched, 1e-9)
    # the loop's "other" is in already; the residue the boundaries leave (the gaps inside the setup) joins it
    sec["other"] += max(0.0, wall - sum(sec.values()))
    redone = min(sec["failures"], float((summary.get("job") or {}).get("redone_s", 0.0)))
    sizes = [r for r in rows if r.get("event") == "resize"]
    return {
        "wall_s": wall,
        "seconds": sec,
        "fractions": {k: v / wall for k, v in sec.items()},
        "per_step_s": sum(sec[k] for k in PHASES),
        "one_time_s": sum(sec[k] for k in JOB_ONE_TIME),
        "attempts": len(attempts),
        # failures in two parts: the steps trained again, and the rest (noticing the failure, the restart)
        "failures": {"redone_s": redone, "restart_s": sec["failures"] - redone},
        # each change of world size (elastic runs), part by part, and their total (inside "failures")
        "resize_s": sum(r["total_s"] for r in sizes),
        "resizes": [{k: r[k] for k in ("from", "to", "step", "kind", "seconds", "total_s", "redone_s",
                                       "steps_redone", "stale_starts", "node_seen_s")} for r in sizes],
        # the world size of every attempt, in order (one entry for a run that never restarted)
        "world_sizes": [r.get("world_size") for r in sorted(attempts, key=lambda r: r["started"])],
        # the useful work (every kept step's forward, backward and optimizer) over the whole job's wall time
        "goodput": sum(sec[k] for k in USEFUL) / wall,
    }


def _at(row: dict) -> float | None:
    """When a metrics row happened: its ``time``, or an attempt's start; None for a row without either."""
    t = row.get("time", row.get("started"))
    return None if t is None else float(t)


STARTUP = ("ray_start", "trainer_start", "worker_start", "health_check", "data_open", "model_build", "loop_start",
           "first_step", "other")


def startup_time(summary: dict, rows: list[dict], *, launched: float, fit_called: float | None,
                 ray_ready: float | None = None, ray_reused: bool | None = None) -> dict | None:
    """Where a job's start-up went, from launch to the end of its first optimizer step (the first attempt's):
    ``{"launch_to_first_step_s", "seconds", "ray_reused"}`` with ``seconds`` split at measured boundaries:

        ray_start       launch -> Ray up (started, joined, or this process's already: ~0)
        trainer_start   Ray up -> Ray Train's fit called (the launcher's imports, placement checked)
        worker_start    fit called -> rank 0 in the training code, its imports included (Ray Train's controller
                        and worker processes, the process group); from launch when there is no Ray
        health_check, data_open, model_build   rank 0's setup, as the time account has them
        loop_start      restoring a checkpoint and the first epoch's loader start
        first_step      the first step's own wall time (its batch's wait included)
        other           the rest: gaps between the boundaries, the first row's hand-over

    None when no step finished."""
    attempts = [r for r in rows if r.get("event") == "attempt"] or ([summary["attempt"]] if "attempt" in summary else [])
    # this launch's: a run directory resumed by a later launch holds the earlier launches' attempts too
    attempts = [r for r in attempts if r["started"] >= launched]
    if not attempts:
        return None
    first = min(attempts, key=lambda r: r["started"])
    steps = [r for r in rows if "loss" in r and r.get("time", 0.0) >= first["loop_started"]]
    if not steps:
        return None
    head = min(steps, key=lambda r: r["time"])
    done = float(head["time"])
    sec = dict.fromkeys(STARTUP, 0.0)
    up = ray_ready if ray_ready is not None else launched
    begun = fit_called if fit_called is not None else up
    sec["ray_start"] = max(0.0, up - launched)
    sec["trainer_start"] = max(0.0, begun - up)
    sec["worker_start"] = max(0.0, first["started"] - begun) + float(first["setup"].get("worker_init", 0.0))
    for name in ("health_check", "data_open", "model_build"):
        sec[name] = float(first["setup"].get(name, 0.0))
    sec["first_step"] = float(head.get("step_s", 0.0))
    sec["loop_start"] = max(0.0, done - sec["first_step"] - float(first["loop_started"]))
    total = max(done - launched, 1e-9)
    sec["other"] = max(0.0, total - sum(sec.values()))
    return {"launch_to_first_step_s": total, "seconds": sec, "ray_reused": ray_reused}


def format_startup(startup: dict) -> str:
    """The start-up in one line a person reads at the end of a run."""
    sec = startup["seconds"]
    parts = ", ".join(f"{k.replace('_', ' ')} {sec[k]:.1f}s" for k in STARTUP if sec[k] >= 0.05)
    reused = " (Ray reused)" if startup.get("ray_reused") else ""
    return f"start-up: {startup['launch_to_first_step_s']:.1f} s from launch to the first step{reused}: {parts}"


def format_job(launch: dict) -> str:
    """The account in a few lines a person reads at the end of a run."""
    sec, wall = launch["seconds"], launch["wall_s"]

    def part(names) -> str:
        return ", ".join(f"{k} {sec[k]:.1f}s" for k in names if sec[k] >= 0.05) or "none"

    return (f"job: {wall:.1f} s from launch to exit, goodput {launch['goodput']:.0%}\n"
            f"  per step, {launch['per_step_s']:.1f} s: {part(PHASES)}\n"
            f"  once, {launch['one_time_s']:.1f} s: {part(JOB_ONE_TIME)}\n"
            f"  other {sec['other']:.2f} s ({sec['other'] / wall:.1%})")


def _warmup(rows: list[dict], attempts: list[dict]) -> dict:
    """Per phase, how much longer each attempt's first step took than the median step (lazy initialization:
    the optimizer's state, the allocator, the loader's first batch), for the first steps the rows keep."""
    import statistics

    steps = [r for r in rows if "loss" in r and "time" in r]
    if len(steps) < 3:
        return {}
    median = {k: statistics.median(float(r.get(k, 0.0)) for r in steps) for k in PHASES}
    starts = sorted(a["loop_started"] for a in attempts)
    out = dict.fromkeys(PHASES, 0.0)
    for i, begin in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else float("inf")
        mine = [r for r in steps if begin <= r["time"] < end]
        if mine:
            head = min(mine, key=lambda r: r["step"])
            for k in PHASES:
                out[k] += max(0.0, float(head.get(k, 0.0)) - median[k])
    return out


def _kept_earlier(rows: list[dict], *, before: float) -> dict:
    """The phases of the steps (and evaluations) that earlier attempts trained and the job kept: the rows from
    before the last attempt began that a resume did not drop."""
    out = dict.fromkeys((*PHASES, "other"), 0.0)
    for r in rows:
        if r.get("time", before) >= before:
            continue
        if "loss" in r:
            parts = {k: float(r.get(k, 0.0)) for k in PHASES}
            for k, v in parts.items():
                out[k] += v
            out["other"] += max(0.0, float(r.get("step_s", 0.0)) - sum(parts.values()))
        elif "eval_s" in r:
            out["eval"] += float(r["eval_s"])
    return out


# ----------------------------------------------------------------------------------------------- resizes

RESIZE_PARTS = ("detect", "decide", "worker_start", "setup", "restore", "first_step", "other")


def resizes(rows: list[dict], controller: list[dict], nodes: list[dict]) -> list[dict]:
    """One record per change of world size between consecutive attempts of the rows (each attempt row carries
    its ``world_size``), ``{"event": "resize", "from", "to", "step", "kind", "seconds": {part: s}, "total_s",
    "redone_s", "steps_redone", "stale_starts", "node_seen_s"}``, split at measured boundaries:

        detect        the old group's last step -> Ray Train's controller leaves RUNNING (a worker lost: restarting;
                      a node joined: resizing)
        decide        -> the controller schedules the group at the new size (starts tried at the old size on a
                      stale view, and their placement waits, are here: ``stale_starts``)
        worker_start  -> the new group's rank 0 in the training code (Ray Train's actors, the process group)
        setup         the new group's health check, data open and model build
        restore       the newest commit loaded, resharded to the new size
        first_step    the loader's start and the first step at the new size
        other         the gaps inside the setup that none of its parts covers

    ``total_s`` is from the old group's last step to the first step at the new size; ``redone_s`` the steps of
    the old group after that commit, trained again (``steps_redone``); ``node_seen_s`` when the driver's node
    watch saw the node lost or joined, relative to the old group's last step (a node's loss shows first as the
    dead worker; Ray's node table marks it dead later). The last step of a failed group is its last metrics row
    (``down_s`` of the next attempt's ``resume`` row counts back to it)."""
    attempts = sorted((r for r in rows if r.get("event") == "attempt" and "world_size" in r),
                      key=lambda r: r["started"])
    resumes = [r for r in rows if r.get("event") == "resume"]
    steps = [r for r in rows if "loss" in r and "time" in r]
    out = []
    for a, b in zip(attempts, attempts[1:], strict=False):
        if a["world_size"] == b["world_size"]:
            continue
        resume = next((r for r in resumes if b["loop_started"] - 1.0 <= r["time"] and r["step"] == b["step"]), {})
        down = resume.get("down_s")
        # the old group's last sign of life: its last metrics row (down_s counts from it to the restore's start)
        alive = b["loop_started"] - down if down is not None else a["loop_started"]
        changes = [e for e in controller if alive - 60.0 <= e["time"] <= b["started"]]
        leave = next((e for e in changes if e["state"] in ("RESTARTING", "RESIZING") and e["time"] >= alive - 5.0),
                     None)
        detected = leave["time"] if leave else alive
        scheduled = [e for e in changes if e["state"] == "SCHEDULING" and e["time"] >= detected]
        chosen = next((e for e in reversed(scheduled) if e.get("num_workers") == b["world_size"]), None)
        decided = chosen["time"] if chosen else detected
        worker = b["started"] + float(b["setup"].get("worker_init", 0.0))
        setup = sum(float(b["setup"].get(k, 0.0)) for k in ("health_check", "data_open", "model_build"))
        restore = float(resume.get("restore_s", 0.0))
        first = min((r["time"] for r in steps if r["time"] >= b["loop_started"]), default=None)
        end = first if first is not None else b["loop_started"] + restore
        # the boundaries in order (each clamped to the one before: clocks of two processes), so the parts add up
        # to the total exactly; the setup's measured parts are "setup", the gaps between them "other"
        bounds = [alive, detected, decided, worker, b["loop_started"], b["loop_started"] + restore, end]
        for i in range(1, len(bounds)):
            bounds[i] = max(bounds[i], bounds[i - 1])
        gaps = [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]
        sec = dict.fromkeys(RESIZE_PARTS, 0.0)
        sec["detect"], sec["decide"], sec["worker_start"] = gaps[0], gaps[1], gaps[2]
        sec["setup"] = min(setup, gaps[3])
        sec["restore"], sec["first_step"] = gaps[4], gaps[5]
        sec["other"] = gaps[3] - sec["setup"]
        total = bounds[-1] - alive
        kind = "shrink" if b["world_size"] < a["world_size"] else "grow"
        seen = [e for e in nodes if e["alive"] == (kind == "grow") and e["time"] <= end]
        seen = [e for e in seen if e["time"] >= alive - 120.0]
        out.append({"event": "resize", "from": a["world_size"], "to": b["world_size"], "step": b["step"],
                    "kind": kind, "seconds": sec, "total_s": total, "last_step_time": alive,
                    "redone_s": float(resume.get("redone_s", 0.0)), "steps_redone": int(resume.get("steps_redone", 0)),
                    "stale_starts": sum(1 for e in scheduled if e.get("num_workers") not in (None, b["world_size"])),
                    "node_seen_s": (seen[-1]["time"] - alive) if seen else None})
    return out


def add_resize_rows(run_dir: str, rows: list[dict], controller: list[dict], nodes: list[dict]) -> list[dict]:
    """``rows`` with a ``resize`` row (``resizes``) before each attempt that changed the world size, written back
    to the run's ``metrics.jsonl`` (atomically) when there are any new ones; returns the rows. A row already
    there (the account closed again) is not added twice."""
    new = [r for r in resizes(rows, controller, nodes)
           if not any(o.get("event") == "resize" and o.get("last_step_time") == r["last_step_time"] for o in rows)]
    if not new:
        return rows
    out = []
    for row in rows:
        if row.get("event") == "attempt":
            out.extend(formats.stamp({**n, "time": row["loop_started"]}) for n in new if n["step"] == row["step"]
                       and n["to"] == row.get("world_size") and n["last_step_time"] < row["loop_started"])
        out.append(row)
    io.write_bytes_atomic(io.join(run_dir, "metrics.jsonl"), "".join(json.dumps(r) + "\n" for r in out).encode())
    return out
