"""Run the experiments within a time budget, one progress line each; a failed experiment is reported and the
others still run; then decide and write the report.

The budget is kept, not hoped for: each experiment runs in a worker thread while this thread waits at most for
what is left of the budget. One that overruns (a worker group that never starts, a hung collective) is stopped
with a named reason: the Ray actors it started are killed, which ends its training run and its thread, and the
next experiment starts on the same Ray. Ctrl-C (SIGINT) or SIGTERM stops the experiment in flight the same way,
writes the report of what was measured so far, and ends the command (exit 130 or 143, from the CLI). Running
the experiments off the main thread also keeps Ray Train from taking over SIGINT while it trains.
"""

from __future__ import annotations

import signal
import threading
import time
import traceback

from dutycycle.engine import io

from .experiments import EXPERIMENTS, Context, short_run
from .remedies import measured_text, predicted_text, remedies
from .remedies import verify as check_remedy
from .report import describe, write
from .verdict import decide

GRACE_S = 10.0  # how long an abandoned experiment's thread is given to notice that its Ray work is gone
ABANDONED: list[threading.Thread] = []  # experiments stopped at a deadline or a signal whose threads still run


def leftovers() -> bool:
    """Whether an abandoned experiment still runs (with threads of its own, a loader's prefetch, that the
    interpreter would wait for at exit): the CLI then ends the process itself once the report is written."""
    return any(t.is_alive() for t in ABANDONED)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM during a diagnosis (a KeyboardInterrupt: nothing catches it by accident, and the CLI
    exits with 128 + ``signum``)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Overran(Exception):
    pass


def _live_actors() -> set[str]:
    """The ids of this process's Ray job's actors that are not dead (empty without Ray).

    Ray's public state API (``ray.util.state``) asks the dashboard, which dutycycle does not start, so the actor
    table is read from the GCS client (``ray._private.state``)."""
    try:
        import ray
    except ImportError:
        return set()
    if not ray.is_initialized():
        return set()
    from ray._private.state import state

    job = ray.get_runtime_context().get_job_id()
    return {a["ActorID"] for a in state.actor_table(None).values()
            if a["JobID"] == job and a["State"] != "DEAD" and not a["IsDetached"]}


def _kill_actors_since(before: set[str]) -> int:
    """Kill the live actors of this job that were not alive ``before`` the experiment (its Ray Train controller;
    actors of the caller, a notebook's or another experiment's, are left alone); returns how many. The driver's
    wait on a killed controller raises ActorDiedError in the experiment's thread, which then ends like any failed
    experiment; the training workers, owned by the controller, die with their owner (Ray's ownership). Killed by
    id through the core worker (what ``ray.kill`` does with a handle; the handles live in Ray Train's frames)."""
    import ray

    core = ray._private.worker.global_worker.core_worker
    killed = 0
    for actor_id in _live_actors() - before:
        try:
            core.kill_actor(ray.ActorID.from_hex(actor_id), True)  # no_restart
        except ray.exceptions.ActorHandleNotFoundError:  # another actor's (a worker of the controller's)
            continue
        killed += 1
    return killed


def _stop(worker: threading.Thread, before: set[str] | None) -> str:
    """End the experiment running in ``worker`` (past its deadline, or on a signal) and say how.

    First its Ray actors are killed, so that the thread ends with an error of its own while Ray stays up for the
    next experiment. Only if it still runs after ``GRACE_S`` is the driver disconnected (``ray.shutdown``), which
    ends the job's remaining work. Disconnecting first, the old order, let a thread still inside a Ray call make
    Ray's core worker end the whole process ("The core worker has already been shutdown ... The process will
    exit"): one of three diagnoses of the demo's config whose last experiment reached the deadline exited 1."""
    try:
        import ray
    except ImportError:
        ray = None
    end = time.perf_counter() + GRACE_S  # one grace for both steps: the command's end stays budget + GRACE_S
    how = "no Ray work to stop"
    if ray is not None and ray.is_initialized():
        if before is None:
            how = "its Ray actors could not be told from the caller's (the actor table could not be read)"
        else:
            try:
                how = f"its {_kill_actors_since(before)} Ray actors were killed"
            except Exception as e:  # noqa: BLE001 - a Ray internal that moved: disconnecting below stops the work
                how = f"its Ray actors could not be killed ({type(e).__name__}: {e})"
        # most of the grace for the kill to end the thread (about 20 ms when it works), the rest after a disconnect
        worker.join(0.7 * GRACE_S)
        if worker.is_alive() and ray.is_initialized():
            ray.shutdown()
            how += "; Ray was disconnected"
    worker.join(max(0.0, end - time.perf_counter()))
    if worker.is_alive():
        ABANDONED.append(worker)
        return how + "; the experiment was abandoned"
    return how + " and the experiment ended"


def _ray_from_main_thread(cfg) -> None:
    """Start (or join) Ray here, in the main thread, before an experiment's thread would: Ray's local daemons die
    with the thread that started them (a parent-death signal is per thread on Linux), so a cluster started by one
    experiment's thread was gone when the next experiment needed it."""
    if cfg.parallel.num_workers > 1:
        from dutycycle.trainer.launch.train import init_ray

        init_ray(cfg)


def _run_bounded(fn, ctx: Context, seconds: float):
    """``fn(ctx)`` in a worker thread, waited for at most ``seconds``; its exception is raised here."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn(ctx)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread, which raises it
            box["error"] = e

    worker = threading.Thread(target=target, name="dutycycle-diagnose-experiment", daemon=True)
    try:
        before: set[str] | None = _live_actors()  # the caller's actors: only the experiment's are killed
    except Exception:  # noqa: BLE001 - a Ray internal that moved: an overrun then disconnects Ray instead
        before = None
    worker.start()
    end = time.perf_counter() + seconds
    try:
        # in short waits: a signal may land on another thread, and Python runs its handler only when this (the
        # main) thread next runs bytecode; one long join would hold Ctrl-C until the experiment ended
        while worker.is_alive() and time.perf_counter() < end:
            worker.join(min(0.2, max(0.0, end - time.perf_counter())))
    except BaseException:  # Interrupted, KeyboardInterrupt: stop the experiment's Ray work, then go
        _stop(worker, before)
        raise
    if worker.is_alive():
        how = _stop(worker, before)
        raise _Overran(f"stopped at its deadline: the budget had {seconds:.0f} s left for it (raise --budget-s; "
                       f"a worker group waiting for resources or a hung collective also ends here); {how}")
    if "error" in box:
        raise box["error"]
    return box["result"]


def _on_signal(signum, frame):
    raise Interrupted(signum)


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
    from dutycycle.engine.errors import ConfigError

    names = [k for k, _, _ in EXPERIMENTS]
    unknown = sorted(set(only or []) - set(names))
    if unknown:
        raise ConfigError(f"--only {','.join(unknown)}: unknown experiment; choose from {', '.join(names)}")
    if io.protocol(out) == "file":
        import os

        out = os.path.abspath(out)
    ctx = Context(cfg=cfg, workdir=io.join(out, "runs"), seconds=max(1.0, min(5.0, budget_s / 40)),
                  steps=12 if budget_s >= 180 else 8,
                  memory_budget_bytes=int(memory_budget_mb * 2**20) if memory_budget_mb else None, scale=scale)
    chosen = [(k, t, f) for k, t, f in EXPERIMENTS if not only or k in only]
    deadline = time.perf_counter() + budget_s
    findings = ctx.results  # later experiments read earlier ones' results (scaling reads end_to_end)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_signal) if main else None
    interrupted: Interrupted | None = None
    try:
        for i, (key, title, fn) in enumerate(chosen, 1):
            tag = f"[diagnose] {i}/{len(chosen)} {title}"
            left = deadline - time.perf_counter()
            if left <= 0:
                res = {"skipped": f"the budget of {budget_s:.0f} s was spent (raise --budget-s)"}
            else:
                t0 = time.perf_counter()
                try:
                    # inside the try: a signal that lands as the line is written is this experiment's (seen: the
                    # report was lost when SIGTERM came right after the line, before the try)
                    say(f"{tag} ...")
                    if main:
                        _ray_from_main_thread(cfg)
                    res = _run_bounded(fn, ctx, left)
                except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM through _on_signal
                    interrupted = e if isinstance(e, Interrupted) else Interrupted(signal.SIGINT)
                    res = {"error": f"interrupted by {interrupted}: stopped with what was measured so far"}
                except _Overran as e:
                    res = {"error": f"TimeoutError: {e}"}
                except Exception as e:  # noqa: BLE001 - one experiment's failure is reported; the others still run
                    res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
                res["seconds"] = time.perf_counter() - t0
            findings[key] = res
            say(f"{tag}: {describe(key, res)}")
            if interrupted is not None:
                break
    except KeyboardInterrupt as e:  # a signal between two experiments: stop there, the report is still written
        interrupted = e if isinstance(e, Interrupted) else Interrupted(signal.SIGINT)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    verdict = decide(findings, {"quant_grads": cfg.parallel.quant_grads, "inject_comm_ms": cfg.parallel.inject_comm_ms,
                                "scale": scale, "workers": cfg.parallel.num_workers,
                                "zero_stage": cfg.parallel.zero_stage})
    found = remedies(findings, verdict.kind)
    for r in found:
        say(f"[diagnose] remedy for {r['for']}: --set {' --set '.join(r['set'])}: predicted "
            f"{predicted_text(r)} ({r['from']})")
    if verify and found and interrupted is None:
        try:
            if main:
                _ray_from_main_thread(cfg)
            found[0] = _run_bounded(lambda c: check_remedy(c, found[0], short_run), ctx,
                                    max(60.0, deadline - time.perf_counter()))
            say(f"[diagnose] verified: {measured_text(found[0])} measured against {predicted_text(found[0])} "
                "predicted")
        except KeyboardInterrupt as e:
            interrupted = e if isinstance(e, Interrupted) else Interrupted(signal.SIGINT)
        except Exception as e:  # noqa: BLE001 - the diagnosis stands; the check is reported as failed
            found[0] = {**found[0], "verify_error": f"{type(e).__name__}: {e}"}
    result = {"config_name": config_name, "budget_s": budget_s, "findings": findings,
              "verdict": verdict.to_dict(), "remedies": found}
    if scale:
        from .projection import comm_measured_at, models

        # the verdict's shares are these workers'; each wait's model says how it was carried there
        result["projection"] = {"workers": scale, "measured_at": cfg.parallel.num_workers, "shares": verdict.shares,
                                "models": models(comm_measured_at(findings, cfg.parallel.num_workers))}
    if interrupted is not None:
        result["interrupted"] = str(interrupted)
    result["files"] = write(out, result)
    say(f"[diagnose] verdict: {verdict.headline}")
    say(f"[diagnose] report: {result['files']['html']}")
    if interrupted is not None:
        raise interrupted
    return result
