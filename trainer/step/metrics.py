"""Run outputs: ``metrics.jsonl`` (one JSON object per optimizer step, plus eval rows) and ``summary.json``.

Rank 0 writes. On a local run directory each row is appended and flushed as it happens (so ``tail -f``
works); on an object store rows are buffered and the whole file is rewritten atomically at each evaluation
and at the end. ``summary.json`` is written last, with ``write_json_atomic``: a run directory with a summary
is a finished run. A resumed run keeps the rows up to the step it resumed from and appends after them
(``resume_from``): rows of steps that were lost with the failed attempt are dropped and counted.

Both carry ``"format": 1`` (``engine.formats``; in ``metrics.jsonl`` every row does, since a resumed run appends to
an earlier attempt's file), and ``read_metrics``/``read_summary`` refuse another format, naming the file.
"""

from __future__ import annotations

import json
import os
import time

from dutycycle.engine import formats, io

from .timing import ACCOUNT, ALL_PHASES, ONE_TIME, USEFUL, breakdown

# Peak dense bf16 tensor FLOP/s per GPU, for model FLOP utilization (vendor datasheets, no sparsity).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
}


def peak_flops(device_name: str) -> float | None:
    for key, value in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return value
    return None


METRICS = "metrics.jsonl"
SUMMARY = "summary.json"


class MetricsWriter:
    def __init__(self, run_dir: str, enabled: bool = True):
        self.run_dir, self.enabled = run_dir, enabled
        self.uri = io.join(run_dir, METRICS)
        self.local = io.protocol(run_dir) == "file"
        self.rows: list[dict] = []
        self._f = None  # opened at the first row, so an earlier attempt's file is there until then
        self._mode = "w"
        self.started = time.time()  # this attempt's start, wall clock: the end of a failure's downtime
        self.failure: dict | None = None  # what the failure before this attempt cost (``resume_from``)

    def _open(self) -> None:
        if self._f is None and self.enabled and self.local:
            os.makedirs(self.run_dir, exist_ok=True)
            self._f = open(self.uri, self._mode)  # noqa: SIM115 - kept open for the run, closed in close()

    def resume_from(self, step: int) -> int:
        """Continue the file of an earlier attempt: keep its rows up to ``step``, drop the later ones (steps that
        will be trained again) and return how many steps were lost (0 when there was no earlier file)."""
        if not self.enabled:
            return 0
        try:
            rows = read_metrics(self.run_dir)
        except FileNotFoundError:
            return 0
        lost = max([r["step"] - step for r in rows if "loss" in r], default=0)
        self.rows = [r for r in rows if r.get("step", 0) <= step]
        redone = [r for r in rows if "loss" in r and r["step"] > step]
        kept = [r for r in self.rows if "loss" in r]
        last_alive = max((r["time"] for r in rows if "time" in r), default=None)
        # the failed attempt's cost: its steps after the commit (trained again) and the time from its last row to
        # this attempt's start (the failure, the restart); with what the attempts before kept, for the job's goodput
        self.failure = {
            "steps_redone": len(redone),
            "redone_s": sum(r.get("step_s", 0.0) for r in redone),
            "down_s": max(0.0, self.started - last_alive) if last_alive is not None else None,
            "kept_useful_s": sum(sum(r.get(k, 0.0) for k in USEFUL) for r in kept),
        }
        # replaced in one atomic write, then appended to: a crash here leaves the old file or the new one
        io.write_bytes_atomic(self.uri, "".join(json.dumps(r) + "\n" for r in self.rows).encode())
        if self._f is not None:
            self._f.close()
            self._f = None
        self._mode = "a"
        return max(0, lost)

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        self._open()
        # wall clock: a later attempt measures a failure from it
        row = formats.stamp({**row, "time": round(time.time(), 3)})
        self.rows.append(row)
        if self._f is not None:
            self._f.write(json.dumps(row) + "\n")
            self._f.flush()

    def flush(self) -> None:
        if self.enabled and not self.local:
            io.write_bytes_atomic(self.uri, "".join(json.dumps(r) + "\n" for r in self.rows).encode())

    def close(self) -> None:
        self.flush()
        if self._f is not None:
            self._f.close()
            self._f = None


def read_metrics(run_dir: str, *, live: bool = False) -> list[dict]:
    """The rows of ``metrics.jsonl``, each checked to be of format 1. ``live``: the run may still be writing it, so
    a missing file is no rows yet and a line caught half-written is left for the next look."""
    uri = io.join(run_dir, METRICS)
    fs, path = io.filesystem(uri)
    try:
        with fs.open(path, "r") as f:
            lines = [line for line in f if line.strip()]
    except FileNotFoundError:
        if live:
            return []
        raise
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if not live:
                raise
            continue
        formats.check(row, f"run metrics {uri!r} (row {number})")
        rows.append(row)
    return rows


def read_summary(run_dir: str) -> dict:
    """``summary.json`` of a finished run, checked to be of format 1."""
    uri = io.join(run_dir, SUMMARY)
    summary = io.read_json(uri)
    formats.check(summary, f"run summary {uri!r}")
    return summary


def summarize(*, steps: int, samples: int, first_loss: float | None, final_loss: float | None,
              val_accuracy: float | None, val_loss: float | None, wall_s: float, per_rank_totals: list[dict],
              world_size: int, device: str, num_params: int, flops_per_sample: float | None = None,
              peak_flops_per_device: float | None = None, extra: dict | None = None,
              rows: list[dict] | None = None, one_time: dict | None = None) -> dict:
    """The run summary. ``per_rank_totals`` holds each rank's phase seconds; the breakdown is their mean, and
    ``max`` shows the slowest rank per phase (a straggler shows up as max >> mean). ``rows``: the metrics rows
    (rank 0's), from which ``job`` accounts every attempt; ``goodput`` is the job's, over its whole wall time
    (``goodput_attempt``: this attempt's alone)."""
    mean = {k: sum(t.get(k, 0.0) for t in per_rank_totals) / len(per_rank_totals) for k in ALL_PHASES}
    mx = {k: max(t.get(k, 0.0) for t in per_rank_totals) for k in ALL_PHASES}
    # "other" is whatever the named phases (per step, and once per run: ``one_time``, rank 0's) do not cover
    once = {k: float((one_time or {}).get(k, 0.0)) for k in ONE_TIME}
    named = sum(v for k, v in mean.items() if k != "other") + sum(once.values())
    mean["other"] = max(0.0, wall_s - named)
    bd = breakdown({**mean, **once}, wall_s, ACCOUNT)
    train_s = max(wall_s - mean["eval"], 1e-9)
    summary = {
        formats.KEY: formats.FORMAT,
        "steps": steps,
        "samples": samples,
        "world_size": world_size,
        "device": device,
        "num_params": num_params,
        "first_loss": first_loss,
        "final_loss": final_loss,
        "val_accuracy": val_accuracy,
        "val_loss": val_loss,
        "wall_s": wall_s,
        "samples_per_s": samples / train_s,
        "time_breakdown": {"seconds": bd["seconds"], "fractions": bd["fractions"], "max_seconds": mx},
        "goodput": sum(bd["fractions"][k] for k in USEFUL),
        "data_wait_fraction": bd["fractions"]["data_wait"],
        "comm_fraction": bd["fractions"]["comm"],
        "mfu": None,
    }
    summary["goodput_attempt"] = summary["goodput"]
    if rows is not None:
        useful_s = sum(bd["seconds"][k] for k in USEFUL)
        summary["job"] = job_account(rows, wall_s, useful_s)
        summary["goodput"] = summary["job"]["goodput"]
    if flops_per_sample and peak_flops_per_device:
        summary["mfu"] = flops_per_sample * samples / train_s / (peak_flops_per_device * world_size)
    summary.update(extra or {})
    return summary


def job_account(rows: list[dict], wall_s: float, useful_s: float) -> dict:
    """Every attempt of a run, from the rows its metrics keep: the failures' cost (steps trained again, and the
    downtime from a failed attempt's last row to the next attempt's start; the restore is inside the attempt's
    own time), the job's wall time (from the first kept step's start to now) and its goodput (useful time of
    the kept steps of every attempt over that wall time). One attempt: its own figures."""
    resumes = [r for r in rows if r.get("event") == "resume" and r.get("down_s") is not None]
    if not resumes:
        return {"attempts": 1, "wall_s": wall_s, "failures_s": 0.0, "redone_s": 0.0, "down_s": 0.0,
                "steps_redone": 0, "failures_fraction": 0.0, "goodput": useful_s / wall_s if wall_s > 0 else 0.0}
    redone = sum(r["redone_s"] for r in resumes)
    down = sum(r["down_s"] for r in resumes)
    starts = [r["time"] - r.get("step_s", 0.0) for r in rows if "loss" in r and "time" in r]
    wall = max(wall_s, time.time() - min(starts)) if starts else wall_s
    useful = useful_s + resumes[-1].get("kept_useful_s", 0.0)  # the latest resume kept every earlier step
    return {"attempts": 1 + len(resumes), "wall_s": wall, "failures_s": redone + down, "redone_s": redone,
            "down_s": down, "steps_redone": sum(r["steps_redone"] for r in resumes),
            "failures_fraction": (redone + down) / wall if wall > 0 else 0.0,
            "goodput": useful / wall if wall > 0 else 0.0}


def format_breakdown(summary: dict) -> str:
    """A few lines a person reads at the end of a run."""
    bd = summary["time_breakdown"]
    parts = [f"{k} {bd['seconds'][k]:.1f}s ({bd['fractions'][k]:.0%})" for k in ACCOUNT
             if bd["seconds"].get(k, 0) > 0]
    return "time: " + ", ".join(parts)
