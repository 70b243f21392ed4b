"""Run the experiments within a time budget, one progress line each; a failed experiment is reported and the
others still run; then decide and write the report.

The budget is kept, not hoped for: each experiment runs in a fresh Python process (worker.py) in a process group
of its own, waited for at most what is left of the budget. One that overruns (a worker group that never starts,
a hung collective) is killed whole, its group sent SIGTERM and, after ``GRACE_S``, SIGKILL, and is reported with
a named reason; the next experiment starts. Ctrl-C (SIGINT) or SIGTERM kills the experiment in flight the same
way, writes the report of what was measured so far, and ends the command (exit 130 or 143, from the CLI).

Ray: an experiment's process joins the caller's cluster (a notebook's, or the one started here for a config on
Ray) as a driver of its own, so killing its group ends its Ray job, and Ray ends that job's actors (the Ray Train
controller and workers) by itself; the caller's own actors and its connection stay.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from dutycycle.engine import io
from dutycycle.engine.errors import ConfigError
from dutycycle.trainer.launch.train import init_ray

from . import cpu
from .context import Context
from .experiments import EXPERIMENTS
from .findings import FindingError, read, to_dict
from .projection import comm_measured_at, models
from .remedies import change_text, measured_text, predicted_text, remedies
from .report import describe, gap_text, write
from .verdict import decide

GRACE_S = 5.0  # from SIGTERM to SIGKILL for an experiment's process group
# the experiments whose short runs train, on Ray Train at several workers; the others measure in their process
TRAINING = frozenset({"end_to_end", "scaling", "checkpoint", "failures"})
WORKER = "dutycycle.trainer.diagnose.worker"


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM during a diagnosis (a KeyboardInterrupt: nothing catches it by accident, and the CLI
    exits with 128 + ``signum``)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Overran(Exception):
    """An experiment still running at its deadline (killed)."""


class Died(Exception):
    """An experiment's process that ended without writing its result (killed from outside, out of memory)."""


class ExperimentFailed(Exception):
    """An experiment that raised in its process: its error line and traceback, as it wrote them."""

    def __init__(self, error: str, traceback: str):
        super().__init__(error)
        self.error, self.traceback = error, traceback


def _ended(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` has ended, left unreaped: while its zombie holds the pid, the id of its process group cannot
    be taken by a new process, so signalling the group never reaches a stranger."""
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _wait(proc: subprocess.Popen, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``proc`` to end (unreaped), in short sleeps: Python runs a signal's handler
    (Ctrl-C, SIGTERM) between them. Whether it ended."""
    end = time.perf_counter() + seconds
    while not _ended(proc):
        if time.perf_counter() >= end:
            return False
        time.sleep(min(0.2, max(0.0, end - time.perf_counter())))
    return True


def _end_group(proc: subprocess.Popen) -> str:
    """End ``proc``'s process group and reap ``proc``: SIGTERM, ``GRACE_S`` for its leader to go, then SIGKILL for
    whatever is left in the group (a loader's worker processes, a hung child); says how it went."""
    how = "its process group was sent SIGTERM"
    os.killpg(proc.pid, signal.SIGTERM)
    if not _wait(proc, GRACE_S):
        how += f", then SIGKILL after {GRACE_S:.0f} s"
    os.killpg(proc.pid, signal.SIGKILL)  # the leader, unreaped, still holds the group's id
    proc.wait()
    return how + ", and ended"


def ray_address(cfg) -> str | None:
    """The Ray cluster an experiment's process joins (its GCS address), or None for a config off Ray. A config
    on Ray (several workers) without a cluster in the caller gets one started here, once: each experiment's
    process then joins it rather than start and stop a cluster of its own."""
    if cfg.parallel.num_workers <= 1:
        return None
    import ray

    init_ray(cfg)  # a no-op when the caller (a notebook) is connected already
    return ray.get_runtime_context().gcs_address


def run_bounded(call: str, job: dict, seconds: float, *, ray: str | None = None):
    """``call`` (``module:function``) run in a process of its own with ``job`` (worker.py's keys but ``call`` and
    ``result``), waited for at most ``seconds``; returns the function's result (a dict) or raises
    ``ExperimentFailed`` (its error, as the experiment's process wrote it), ``Overran`` or ``Died``. ``ray``: the
    GCS address of the cluster it joins."""
    with tempfile.TemporaryDirectory(prefix="dutycycle-diagnose-") as tmp:
        result = os.path.join(tmp, "result.json")
        spec = os.path.join(tmp, "job.json")
        with open(spec, "w") as f:
            json.dump({**job, "call": call, "result": result}, f)
        env = dict(os.environ)
        if ray:
            env["RAY_ADDRESS"] = ray
        proc = subprocess.Popen([sys.executable, "-m", WORKER, spec], env=env, start_new_session=True)
        try:
            done = _wait(proc, seconds)
        except BaseException:  # Interrupted, KeyboardInterrupt: the experiment goes too
            _end_group(proc)
            raise
        how = _end_group(proc)  # after a finished experiment: whatever it left running in its group
        if not done:
            raise Overran(f"stopped at its deadline: the budget had {seconds:.0f} s left for it (raise --budget-s; "
                          f"a worker group waiting for resources or a hung collective also ends here); {how}")
        if not os.path.exists(result):
            rc = proc.returncode
            how = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}"
            raise Died(f"the experiment's process {how} without writing its result")
        with open(result) as f:
            got = json.load(f)
    if "error" in got:
        raise ExperimentFailed(got["error"], got.get("traceback", ""))
    return got["result"]


def job_for(ctx: Context) -> dict:
    return {"config": ctx.cfg.to_dict(), "workdir": ctx.workdir, "seconds": ctx.seconds, "steps": ctx.steps,
            "memory_budget_bytes": ctx.memory_budget_bytes, "scale": ctx.scale, "results": ctx.results}


def _experiment(key: str, fn, ctx: Context, seconds: float, ray: str | None) -> dict:
    """One experiment's result as its finding's dict, or ``{"error": ...}``."""
    try:
        got = run_bounded(f"{fn.__module__}:{fn.__name__}", job_for(ctx), seconds, ray=ray)
        return to_dict(read(key, got))
    except Overran as e:
        return {"error": f"TimeoutError: {e}"}
    except Died as e:
        return {"error": f"Died: {e}"}
    except ExperimentFailed as e:
        return {"error": e.error, "traceback": e.traceback}
    except FindingError as e:
        return {"error": f"FindingError: {e}"}


def _on_signal(signum, frame):
    raise Interrupted(signum)


def _as_interrupt(e: KeyboardInterrupt) -> Interrupted:
    return e if isinstance(e, Interrupted) else Interrupted(signal.SIGINT)


def _measure(chosen: list, ctx: Context, deadline: float, budget_s: float, say) -> Interrupted | None:
    """Each chosen experiment in turn, into ``ctx.results``, a line said for each; the signal that stopped them,
    if one did (the experiment in flight is then recorded as interrupted)."""
    findings, cluster = ctx.results, None
    try:
        for i, (key, title, fn) in enumerate(chosen, 1):
            tag = f"[diagnose] {i}/{len(chosen)} {title}"
            interrupted = None
            left = deadline - time.perf_counter()  # Ray's start (below, once) is not the experiment's time
            if left <= 0:
                res = {"skipped": f"the budget of {budget_s:.0f} s was spent (raise --budget-s)"}
            else:
                t0 = time.perf_counter()
                try:
                    # inside the try: a signal that lands as the line is written is this experiment's (seen: the
                    # report was lost when SIGTERM came right after the line, before the try)
                    say(f"{tag} ...")
                    if key in TRAINING:
                        cluster = cluster or ray_address(ctx.cfg)
                    res = _experiment(key, fn, ctx, left, cluster if key in TRAINING else None)
                except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM through _on_signal
                    interrupted = _as_interrupt(e)
                    res = {"error": f"interrupted by {interrupted}: stopped with what was measured so far"}
                except Exception as e:  # noqa: BLE001 - Ray would not start: this experiment fails, the others run
                    res = {"error": f"{type(e).__name__}: {e}"}
                res["seconds"] = time.perf_counter() - t0
            findings[key] = res
            say(f"{tag}: {describe(key, res)}")
            if interrupted is not None:
                return interrupted
    except KeyboardInterrupt as e:  # a signal between two experiments: stop there, the report is still written
        return _as_interrupt(e)
    return None


def _verify(ctx: Context, remedy: dict, deadline: float, say) -> dict:
    """``remedy`` with what its settings measured in a short run (or why that failed)."""
    try:
        got = run_bounded(f"{WORKER}:verify", {**job_for(ctx), "kwargs": {"remedy": remedy}},
                          max(60.0, deadline - time.perf_counter()), ray=ray_address(ctx.cfg))
    except Exception as e:  # noqa: BLE001 - the diagnosis stands; the check is reported as failed
        name = "TimeoutError" if isinstance(e, Overran) else type(e).__name__
        return {**remedy, "verify_error": f"{name}: {e}"}
    say(f"[diagnose] verified: {measured_text(got)} measured against {predicted_text(got)} predicted")
    return got


def context(cfg, out: str, budget_s: float, memory_budget_mb: float | None = None,
            scale: int | None = None) -> Context:
    """The experiments' context of a diagnosis of ``cfg`` into ``out`` within ``budget_s``: its measuring loops'
    share of the budget and its short runs' steps (``tune`` builds the same one to verify a remedy of it)."""
    return Context(cfg=cfg, workdir=io.join(out, "runs"), seconds=max(1.0, min(5.0, budget_s / 40)),
                   steps=12 if budget_s >= 180 else 8,
                   memory_budget_bytes=int(memory_budget_mb * 2**20) if memory_budget_mb else None, scale=scale)


def diagnose(cfg, *, out: str, budget_s: float = 300.0, memory_budget_mb: float | None = None,
             only: list[str] | None = None, say=print, config_name: str = "", scale: int | None = None,
             verify: bool = False) -> dict:
    """Diagnose ``cfg`` (a TrainConfig); write ``diagnosis.json/.png/.html`` under ``out``; return the result.

    ``budget_s`` bounds the whole diagnosis: measuring loops get a share of it and short training runs take
    fewer steps when it is small; each experiment may use what is left of it and is stopped there; one that would
    start after the budget is spent is skipped (said so). ``only``: run just these experiments (names as in
    ``experiments.EXPERIMENTS``). ``scale``: the worker count the failures experiment projects to (what it costs
    to lose work on a cluster of that size; the other shares are measured at the configured count). ``verify``:
    run the top remedy's settings as a short run and record its measured rate beside the predicted one. Raises
    ``Interrupted`` on SIGINT or SIGTERM, after writing the report."""
    names = [k for k, _, _ in EXPERIMENTS]
    unknown = sorted(set(only or []) - set(names))
    if unknown:
        raise ConfigError(f"--only {','.join(unknown)}: unknown experiment; choose from {', '.join(names)}")
    if io.protocol(out) == "file":
        out = os.path.abspath(out)
    ctx = context(cfg, out, budget_s, memory_budget_mb, scale)
    chosen = [(k, t, f) for k, t, f in EXPERIMENTS if not only or k in only]
    deadline = time.perf_counter() + budget_s
    findings = ctx.results  # later experiments read earlier ones' results (scaling reads end_to_end)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_signal) if main else None
    try:
        # the machine's other work while the experiments ran: another process's CPU moves every figure here
        before = cpu.others() if cpu.available() else None
        interrupted = _measure(chosen, ctx, deadline, budget_s, say)
        after = cpu.others() if before else None
        load = {"others": cpu.others_cores(before, after), "cores": cpu.cores_available(),
                "wall_s": after.at - before.at} if before else None
        verdict = decide(findings, {"quant_grads": cfg.parallel.quant_grads,
                                    "inject_comm_ms": cfg.parallel.inject_comm_ms, "scale": scale,
                                    "workers": cfg.parallel.num_workers, "zero_stage": cfg.parallel.zero_stage,
                                    "budget_s": budget_s,
                                    "others_cores": load["others"] if load else None,
                                    "cores": load["cores"] if load else None})
        found = remedies(findings, verdict.kind)
        for r in found:
            say(f"[diagnose] remedy for {r['for']}: {change_text(r)}: predicted {predicted_text(r)} ({r['from']})")
        if verify and found and found[0]["set"] and interrupted is None:  # a node (no setting) cannot be run
            try:
                found[0] = _verify(ctx, found[0], deadline, say)
            except KeyboardInterrupt as e:
                interrupted = _as_interrupt(e)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    result = {"config_name": config_name, "budget_s": budget_s, "findings": findings,
              "machine_load": {k: load[k] for k in ("others", "cores", "wall_s")} if load else None,
              "verdict": verdict.to_dict(), "remedies": found}
    if scale:
        # the verdict's shares are these workers'; each wait's model says how it was carried there
        result["projection"] = {"workers": scale, "measured_at": cfg.parallel.num_workers, "shares": verdict.shares,
                                "models": models(comm_measured_at(findings, cfg.parallel.num_workers))}
    if interrupted is not None:
        result["interrupted"] = str(interrupted)
    result["files"] = write(out, result)
    gap = gap_text(verdict.to_dict())
    if gap:
        say(f"[diagnose] gap: {gap}")
    say(f"[diagnose] verdict: {verdict.headline}")
    say(f"[diagnose] report: {result['files']['html']}")
    if interrupted is not None:
        raise interrupted
    return result
