"""Fault injection for demonstrations and tests: kill one training worker mid-run, as a failing machine would, and
time how the run comes back.

``KillOneWorker`` runs beside ``train()`` in the driver. It waits until a checkpoint has committed and training has
logged ``after_step``, reads the workers' PIDs from the newest attempt's ``health.json``
(``RUN_DIR/attempts/<k>/``, written by the pre-flight health check), SIGKILLs one rank, and then watches
``metrics.jsonl`` for the restarted group's ``resume`` row. Ray Train restarts the group (``ray.max_failures``)
and the new workers resume from the newest verified commit by themselves; nothing here helps them. Only rows
logged after it was made count: it may start before ``train(..., overwrite=True)`` has removed an earlier run's
files (the demo's). Local run directories only (it reads files and kills local processes).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

from dutycycle.engine import formats
from dutycycle.engine.errors import FormatError
from dutycycle.trainer.checkpoint import manifest as mf
from dutycycle.trainer.config import newest_attempt_file
from dutycycle.trainer.launch.rundir import HEALTH_FILE
from dutycycle.trainer.step.metrics import read_metrics


@dataclass
class KillReport:
    killed_rank: int | None = None
    killed_pid: int | None = None
    killed_at_step: int | None = None  # the newest step in metrics.jsonl when the kill happened
    resumed_from_step: int | None = None
    steps_lost: int | None = None  # steps computed after that commit and done again
    recovery_s: float | None = None  # from the kill to the restarted group's resume
    error: str | None = None
    _t_kill: float = field(default=0.0, repr=False)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


class KillOneWorker(threading.Thread):
    def __init__(self, run_dir: str, checkpoint_dir: str, after_step: int, rank: int = 1, timeout_s: float = 600,
                 since: float | None = None):
        super().__init__(name="dutycycle-chaos", daemon=True)
        self.run_dir, self.checkpoint_dir = run_dir, checkpoint_dir
        self.after_step, self.rank, self.timeout_s = after_step, rank, timeout_s
        self.report = KillReport()
        self._halt = threading.Event()  # not `_stop`: threading.Thread has its own
        self.since = time.time() if since is None else since  # rows logged before it are an earlier run's

    def stop(self) -> None:
        self._halt.set()

    def _wait(self, ready, what: str) -> bool:
        deadline = time.monotonic() + self.timeout_s
        while not self._halt.is_set():
            if ready():
                return True
            if time.monotonic() > deadline:
                self.report.error = f"gave up waiting for {what} after {self.timeout_s:.0f} s"
                return False
            time.sleep(0.05)
        return False

    def _rows(self) -> list[dict]:
        return [r for r in read_metrics(self.run_dir, live=True) if r.get("time", 0.0) >= self.since]

    def run(self) -> None:

        def newest_step() -> int:
            return max((r["step"] for r in self._rows() if "loss" in r), default=-1)

        def trained_past_a_commit() -> bool:
            # a manifest is the commit; verifying checksums here would only compete with training for the cores
            return newest_step() >= self.after_step and any(
                mf.is_committed(uri) for _, uri in mf.list_steps(self.checkpoint_dir))

        if not self._wait(trained_past_a_commit, f"a commit and step {self.after_step}"):
            return
        health = newest_attempt_file(self.run_dir, HEALTH_FILE) or os.path.join(self.run_dir, HEALTH_FILE)
        try:
            with open(health) as f:
                record = json.load(f)
            formats.check(record, health)
            workers = record["workers"]
            victim = next(w for w in workers if w["rank"] == self.rank)
        except (OSError, KeyError, StopIteration, json.JSONDecodeError, FormatError) as e:
            self.report.error = f"no PID for rank {self.rank} in {health}: {e}"
            return
        self.report.killed_at_step = newest_step()
        print(f"[chaos] killing rank {self.rank} (pid {victim['pid']}, SIGKILL) after step "
              f"{self.report.killed_at_step}; the errors that follow are Ray Train and the surviving rank noticing, "
              "then the group restarts and resumes from the last commit", flush=True)
        self.report._t_kill = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        self.report.killed_rank, self.report.killed_pid = self.rank, victim["pid"]
        resume_rows: list[dict] = []

        def resumed() -> bool:
            resume_rows[:] = [r for r in self._rows() if r.get("event") == "resume"]
            return bool(resume_rows)

        if self._wait(resumed, "the restarted workers to resume"):
            self.report.recovery_s = time.monotonic() - self.report._t_kill
            row = resume_rows[0]
            self.report.resumed_from_step = row["step"]
            self.report.steps_lost = self.report.killed_at_step - row["step"]
