"""The training section of a run's model card (card.py): the run as it happened across every launch, from the
run directory's records: each launch's ``attempts/<n>/attempt.json`` (when it was launched, and ``finished_at``
once it finished), the metrics' ``attempt`` rows (one per start of the workers, with the world size it trained
at) and ``resize`` rows (an elastic run's size changes, by launch/account.py), and the summary.

    restarts     every start: step, world size, launch, cause (``timeline``)
    failures     the restarts after a failure and the shrinks (a node lost), with the Trainer's account of their
                 cost (steps trained again, downtime)
    resizes      each change of world size, with the resize row's figures
    wall, goodput  one launch: its job account's; several: summed over the launches (``training_facts``)
"""

from __future__ import annotations

import json
import time

from dutycycle.engine import io
from dutycycle.trainer.config import ATTEMPTS, attempt_numbers
from dutycycle.trainer.step.timing import USEFUL

from .rundir import ATTEMPT_FILE


def launches(run_dir: str) -> list[dict]:
    """Each launch's record (``attempts/<n>/attempt.json``) with its number, oldest first."""
    out = []
    for n in attempt_numbers(run_dir):
        uri = io.join(run_dir, ATTEMPTS, str(n), ATTEMPT_FILE)
        try:
            record = json.loads(io.read_small(uri))
        except (OSError, ValueError):
            record = {}
        out.append({**(record if isinstance(record, dict) else {}), "attempt": n, "config": _launch_workers(run_dir, n)})
    return out


def _launch_workers(run_dir: str, n: int) -> int | None:
    """The worker count launch ``n`` asked for (its config's ``parallel.num_workers``; an elastic range's max)."""
    try:
        tree = json.loads(io.read_small(io.join(run_dir, ATTEMPTS, str(n), "config.json")))
        workers = (tree.get("parallel") or {}).get("num_workers")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(workers, list) and workers:
        workers = workers[-1]
    return workers if isinstance(workers, int) else None


def timeline(runs: list[dict], rows: list[dict], summary: dict) -> list[dict]:
    """Every (re)start of the training, oldest first: ``{"step", "started", "world_size", "launch", "cause"}``,
    and ``resize`` (the ``resize`` row's figures) where the metrics hold one for it.

    A start is an ``attempt`` row of the metrics (the Trainer writes one each time it restores). Its cause:
    ``start`` (the first); ``resume`` (a new launch, ``--resume``, after the previous launch finished);
    ``resume after failure`` (a new launch after one that never finished: killed, crashed); within a launch,
    ``resize: shrink`` or ``resize: grow`` (the world size changed: an elastic run's restart at another size,
    told by the attempt rows' sizes, else by a ``resize`` row between the two starts) or ``restart after
    failure`` (Ray Train or torchrun restarting the workers at the same size). Its world size: the attempt row's
    own, else the resize row's, else (the last start) the summary's, else its launch's config.
    ``runs``: the run's launches (``launches``)."""
    starts = sorted((r for r in rows if r.get("event") == "attempt"), key=lambda r: float(r.get("started", 0.0)))
    if not starts and "attempt" in summary:
        starts = [{**summary["attempt"], "step": 0}]
    resizes = [r for r in rows if r.get("event") == "resize"]
    out: list[dict] = []
    for i, row in enumerate(starts):
        started = float(row.get("started", 0.0))
        launch = next((x for x in reversed(runs) if float(x.get("launched", 0.0)) <= started), None)
        number = launch["attempt"] if launch else None
        resize = _resize_row(resizes, row, starts[i - 1] if i else None, starts[i + 1] if i + 1 < len(starts) else None)
        size = (row.get("world_size") or (resize or {}).get("to")
                or (summary.get("world_size") if i == len(starts) - 1 else None) or (launch or {}).get("config"))
        entry = {"step": int(row.get("step", 0)), "started": started, "world_size": size, "launch": number}
        if i == 0:
            entry["cause"] = "start"
        elif number != out[-1]["launch"]:
            before = next((x for x in runs if x["attempt"] == out[-1]["launch"]), {})
            entry["cause"] = "resume" if before.get("finished_at") else "resume after failure"
        elif size and out[-1]["world_size"] and size != out[-1]["world_size"]:
            entry["cause"] = "resize: grow" if size > out[-1]["world_size"] else "resize: shrink"
        else:
            entry["cause"] = "restart after failure"
        if resize is not None and i > 0:
            entry["resize"] = {k: v for k, v in resize.items() if k not in ("event", "format", "time")}
        out.append(entry)
    return out


def _resize_row(resizes: list[dict], row: dict, before: dict | None, after: dict | None) -> dict | None:
    """The ``resize`` row of the start ``row``: one written after the previous start began and before the next
    one did, the one at ``row``'s step first (it restored there)."""
    if before is None:
        return None
    lo = float(before.get("started", 0.0))
    hi = float(after.get("started", float("inf"))) if after is not None else float("inf")
    inside = [r for r in resizes if lo < float(r.get("time", lo)) <= hi]
    return next((r for r in inside if r.get("step") == row.get("step")), inside[0] if inside else None)


FAILURE_CAUSES = ("resume after failure", "restart after failure", "resize: shrink")


def launch_walls(runs: list[dict], rows: list[dict]) -> list[dict]:
    """Each launch's wall time: from its launch to its ``finished_at``; for a launch that never finished (killed,
    crashed), to its last metrics row (the last moment it is known to have trained)."""
    out = []
    for i, run in enumerate(runs):
        begin = float(run.get("launched") or 0.0)
        end = run.get("finished_at")
        if end is None:
            until = float(runs[i + 1].get("launched") or 0.0) if i + 1 < len(runs) else float("inf")
            times = [float(r["time"]) for r in rows if "time" in r and begin <= float(r["time"]) < until]
            end = max(times, default=begin)
        out.append({"launch": run["attempt"], "launched": begin, "finished_at": run.get("finished_at"),
                    "resumed_from": run.get("resumed_from"), "wall_s": max(0.0, float(end) - begin)})
    return out


def training_facts(cfg, summary: dict, restarts: list[dict], rows: list[dict], runs: list[dict]) -> dict:
    """The training as it happened across every launch of the run. ``wall_s`` sums the launches' wall times
    (the gaps between launches, when nothing ran, are not the run's). ``goodput``: a run of one launch, its job
    account's (launch/account.py: the useful work over the wall time from launch to exit, the page's figure);
    a run of several launches, the useful work of every step it kept (forward, backward, optimizer:
    step/timing.USEFUL, from the metrics rows, each step once) over the launches' summed wall time (each launch's
    account covers that launch alone)."""
    launch = summary.get("launch") or {}
    job = summary.get("job") or {}
    walls = launch_walls(runs, rows)
    if len(walls) <= 1:
        wall = launch.get("wall_s") or summary.get("wall_s")
        goodput = launch.get("goodput", summary.get("goodput"))
    else:
        wall = sum(w["wall_s"] for w in walls)
        useful = sum(float(r.get(k, 0.0)) for r in rows if "loss" in r for k in USEFUL)
        goodput = useful / wall if wall else None
    parallel = summary.get("parallel") or {}
    resizes = []
    for before, after in zip(restarts, restarts[1:], strict=False):
        if before["world_size"] and after["world_size"] and before["world_size"] != after["world_size"]:
            # the launch slice's figures of the resize (its parts: detection, restart, restore, ...), when recorded
            parts = {k: v for k, v in (after.get("resize") or {}).items() if k not in ("step", "from", "to")}
            resizes.append({"step": after["step"], "from": before["world_size"], "to": after["world_size"],
                            "cause": after["cause"], **parts})
    failures = [r for r in restarts if r["cause"] in FAILURE_CAUSES]
    first = restarts[0]["started"] if restarts else None
    return {
        "config": cfg.to_dict(),
        "steps": summary.get("steps"), "epochs": summary.get("epochs"), "samples": summary.get("samples"),
        "global_batch_size": summary.get("global_batch_size"), "micro_batches": summary.get("micro_batches"),
        "world_size": summary.get("world_size"), "precision": parallel.get("precision"),
        "zero_stage": parallel.get("zero_stage"), "strategy": parallel.get("strategy"),
        "first_loss": summary.get("first_loss"), "final_loss": summary.get("final_loss"),
        "wall_s": wall, "launches": walls, "loop_s": summary.get("wall_s"),
        "elapsed_s": (time.time() - first) if first else None,
        "goodput": goodput,
        "failures_survived": len(failures),
        # the Trainer's job account across attempts (step/metrics.job_account): steps trained again and the time
        # from a failed attempt's last row to the next attempt's start
        "failures": {"at_steps": [r["step"] for r in failures], "lost_s": job.get("failures_s"),
                     "redone_s": job.get("redone_s"), "down_s": job.get("down_s"),
                     "steps_redone": job.get("steps_redone")},
        "resizes": resizes,
        "world_sizes": [r["world_size"] for r in restarts],
        "restarts": restarts,
        "checkpoints": list((summary.get("checkpoint") or {}).get("committed") or []),
    }
