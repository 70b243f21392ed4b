"""``dutycycle diagnose`` keeps its budget and its signals: a worker group that cannot be placed is refused at once
with the request and the cluster named, an experiment that overruns is stopped at the deadline with a named reason
(and the others still run), and SIGINT / SIGTERM end the command with 130 / 143 after writing what was measured.

The signal and deadline cases run the CLI in a subprocess, as a person does; the overrun beside a caller's actor
runs an experiment on the test session's cluster, as a notebook would."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from dutycycle.engine.errors import ConfigError
from dutycycle.trainer.config import load_config
from dutycycle.trainer.diagnose import diagnose
from dutycycle.trainer.launch.fits import check_fits, workers_that_fit

BASE = ["data.source=synthetic", "data.size=8", "data.synthetic_samples=128", "data.global_batch_size=16",
        "data.eval_batch_size=16", "model.width=8", "optim.warmup_steps=1", "run.log_every=0"]


def test_workers_that_fit_count_whole_workers_per_node():
    nodes = [{"CPU": 2.0}, {"CPU": 5.0, "GPU": 1.0}]
    assert workers_that_fit(nodes, {"CPU": 2}, "PACK") == 1 + 2
    assert workers_that_fit(nodes, {"CPU": 2}, "STRICT_PACK") == 2
    assert workers_that_fit(nodes, {"CPU": 2}, "STRICT_SPREAD") == 2
    assert workers_that_fit(nodes, {"CPU": 1, "GPU": 1}, "SPREAD") == 1
    assert workers_that_fit(nodes, {"CPU": 0.5}, "PACK") == 4 + 10
    cfg = load_config(None, [*BASE, "parallel.num_workers=2", "parallel.cpus_per_worker=8"])
    with pytest.raises(ConfigError, match=r"parallel.cpus_per_worker = 8 CPUs.*2 nodes \(2 CPU; 5 CPU, 1 GPU\), "
                                          r"room for 0 such workers"):
        check_fits(cfg, nodes, {"CPU": 8})
    check_fits(cfg, nodes, {"CPU": 2})  # 3 fit: no error


@pytest.mark.ray
def test_a_group_that_cannot_be_placed_is_named_in_the_diagnosis_at_once(ray_cluster, tmp_path):
    # 2 workers of 8 CPUs on the session's 2-CPU cluster: Ray Train would wait for them forever
    cfg = load_config(None, [*BASE, f"run.dir={tmp_path / 'run'}", "parallel.num_workers=2",
                             "parallel.cpus_per_worker=8"])
    t0 = time.perf_counter()
    out = diagnose(cfg, out=str(tmp_path / "d"), budget_s=120, only=["end_to_end", "scaling"], say=lambda _: None)
    took = time.perf_counter() - t0
    for key in ("end_to_end", "scaling"):
        err = out["findings"][key]["error"]
        assert err.startswith("ConfigError") and "parallel.cpus_per_worker = 8 CPUs" in err and "room for 0" in err
    assert out["verdict"]["kind"] == "unknown"
    assert took < 100, took  # refused before any wait (Ray Train's own start timeout is 60 s, retried forever)


def hang_on_an_actor(ctx, pids: str):
    """An experiment hung on an actor of its own (as on a collective that never completes), in its own process:
    it joins the caller's cluster (RAY_ADDRESS, set by the runner), writes its pid and its actor's, then waits."""
    import ray

    @ray.remote(num_cpus=0)
    class Sleeper:
        def pid(self) -> int:
            return os.getpid()

        def sleep(self, s: float) -> str:
            time.sleep(s)
            return "awake"

    ray.init(log_to_driver=False)
    actor = Sleeper.remote()
    tmp = pids + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"experiment": os.getpid(), "actor": ray.get(actor.pid.remote())}, f)
    os.replace(tmp, pids)
    return ray.get(actor.sleep.remote(600))


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


OVERRUN_TEST = "test_an_overrun_kills_the_experiments_process_group_and_leaves_the_callers_actor"


def _overrun(ray, folder) -> dict:
    """An experiment hung on an actor, run past its deadline on the session's cluster beside a caller's own actor
    (one created before, as a notebook's): what each try raised, where the experiment wrote its pids, and the
    caller's actor. Runs beside the CLI diagnoses (``cli_runs``): after its Python's start it only waits."""
    from dutycycle.trainer.diagnose import run
    from dutycycle.trainer.diagnose.context import Context

    @ray.remote(num_cpus=0)
    class Sleeper:
        def sleep(self, s: float) -> str:
            time.sleep(s)
            return "awake"

    callers = Sleeper.remote()
    ray.get(callers.sleep.remote(0))
    # The deadline must come after the experiment's Python, its imports and its actor have started (it writes its
    # pids before it hangs: the test reads them): 7-10 s alone with the machine six times oversubscribed, and here
    # the CLI diagnoses start their Pythons, Ray and their compute loops at the same moment. 30 s first, about as
    # long as the longest CLI diagnosis beside it takes (the fixture's 36 s in the last clean run), so the wait
    # costs nothing; where it had not written them by then, once more with 60 s.
    raised = []
    for seconds in (30.0, 60.0):
        pids = folder / f"pids-{seconds:.0f}.json"
        job = {**run.job_for(Context(cfg=load_config(None, BASE), workdir=str(folder / "runs"))),
               "kwargs": {"pids": str(pids)}}
        try:
            run.run_bounded(f"{__name__}:hang_on_an_actor", job, seconds, ray=ray.get_runtime_context().gcs_address)
            raised.append(None)
        except run.Overran as e:
            raised.append(str(e))
        if pids.exists():
            break
    return {"raised": raised, "pids": pids, "callers": callers}


@pytest.mark.long
@pytest.mark.ray
def test_an_overrun_kills_the_experiments_process_group_and_leaves_the_callers_actor(ray_cluster, cli_runs):
    """An experiment past its deadline is killed whole: its process group is gone, and Ray, seeing its driver
    gone, ends its actor; a notebook's own actor (here, one created before) still answers and the caller stays
    connected."""
    import ray

    got = cli_runs["overrun"].result()
    for r in got["raised"]:  # every try ended at its deadline, killed whole
        assert r is not None and re.search(r"stopped at its deadline.*its process group was sent SIGTERM", r), r
    started = json.loads(got["pids"].read_text())  # written before the deadline: the experiment was hung, not starting
    assert not _alive(started["experiment"])
    with pytest.raises(ProcessLookupError):
        os.killpg(started["experiment"], 0)  # nothing is left in its process group
    t0 = time.time()
    while _alive(started["actor"]) and time.time() - t0 < 60:
        time.sleep(0.5)
    assert not _alive(started["actor"]), "Ray did not end the killed experiment's actor"
    callers = got["callers"]
    assert ray.is_initialized() and ray.get(callers.sleep.remote(0), timeout=30) == "awake"
    ray.kill(callers)


def die(ctx):
    """An experiment whose process is killed from outside (the kernel's OOM killer, a person) before it writes."""
    os.kill(os.getpid(), signal.SIGKILL)


def fail(ctx):
    raise RuntimeError("the cache is not there")


def test_an_experiment_that_dies_or_fails_in_its_process_is_reported(tmp_path):
    from dutycycle.trainer.diagnose import run
    from dutycycle.trainer.diagnose.context import Context

    job = run.job_for(Context(cfg=load_config(None, BASE), workdir=str(tmp_path / "runs")))
    with pytest.raises(run.Died, match="was killed by SIGKILL without writing its result"):
        run.run_bounded(f"{__name__}:die", job, 60.0)
    with pytest.raises(run.ExperimentFailed, match="RuntimeError: the cache is not there") as e:
        run.run_bounded(f"{__name__}:fail", job, 60.0)
    assert "in fail" in e.value.traceback


def _cli(tmp_path, budget_s: float, *overrides: str, only: str = "compute,end_to_end") -> subprocess.Popen:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "DAFT_ANALYTICS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    config = tmp_path / "c.toml"
    config.write_text("# every setting comes from --set\n")
    sets = [a for kv in (*BASE, f"run.dir={tmp_path / 'run'}", *overrides) for a in ("--set", kv)]
    args = [sys.executable, "-m", "dutycycle.trainer", "diagnose", str(config), "--out", str(tmp_path / "d"),
            "--only", only, "--budget-s", str(budget_s), *sets]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _wait_for(proc: subprocess.Popen, text: str, timeout: float = 120) -> str:
    seen, t0 = [], time.time()
    while time.time() - t0 < timeout:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return "".join(seen)
    proc.kill()
    raise AssertionError(f"never printed {text!r}: {''.join(seen)[-2000:]}")


# what each CLI diagnosis below runs: (its test, --budget-s, --set overrides, --only, how long it may take; after
# its signal where it gets one)
CLI_RUNS = {
    # the loader sleeps 2 s per batch: the end-to-end run is in flight when the signal comes
    "SIGINT": ("test_a_signal_stops_the_diagnosis_and_writes_what_was_measured", 300, ["data.slow_ms=2000"],
               "compute,end_to_end", 60),
    "SIGTERM": ("test_a_signal_stops_the_diagnosis_and_writes_what_was_measured", 300, ["data.slow_ms=2000"],
                "compute,end_to_end", 60),
    # 30 s per batch: the end-to-end run cannot finish inside a 12 s budget (alone: each experiment's process
    # starts Python and torch, seconds of the budget on a busy machine, and compute first could spend it all)
    "deadline": ("test_an_experiment_past_the_deadline_is_stopped_with_a_reason", 12, ["data.slow_ms=30000"],
                 "end_to_end", 120),
    # 2 workers on Ray Train (the CLI's own local Ray, started once), cut at the deadline while the group starts
    # or trains
    "ray deadline": ("test_a_ray_experiment_past_the_deadline_is_killed_and_the_diagnosis_ends", 20,
                     ["data.slow_ms=30000", "parallel.num_workers=2"], "end_to_end", 180),
}


def _one_cli(folder, budget_s, overrides, only, timeout, sig) -> dict:
    """One diagnosis through the CLI: signalled ``sig`` as soon as its end-to-end run is in flight (None: left to
    end by itself); its exit code, all it printed and its seconds from start to exit."""
    t0 = time.time()
    proc = _cli(folder, budget_s, *overrides, only=only)
    try:
        seen = ""
        if sig is not None:
            seen = _wait_for(proc, "2/2 end to end ...")
            proc.send_signal(sig)
        out, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return {"returncode": proc.returncode, "out": seen + out, "seconds": time.time() - t0, "folder": folder}


@pytest.fixture(scope="module")
def cli_runs(request, tmp_path_factory):
    """The CLI diagnoses of the selected tests below, and the overrun above, run side by side: each mostly waits
    on its slow loader, its deadline or its Python's and Ray's start, and one after the other they left a core idle
    most of the time (SIGINT and SIGTERM alone: 54.0 s apart, 39.3 s together). Only the selected tests' runs
    start (``-m "not ray"`` starts no Ray). {name in CLI_RUNS, or "overrun": a finished future of _one_cli's
    result (or _overrun's), or of its error}"""
    selected = {item.originalname for item in request.session.items
                if getattr(item, "module", None) is not None and item.module.__name__ == __name__}
    root = tmp_path_factory.mktemp("cli")
    runs = {}
    with ThreadPoolExecutor(len(CLI_RUNS) + 1) as pool:  # waits for every run on leaving
        if OVERRUN_TEST in selected:  # beside them too: once started, it waits for its deadline
            (root / "overrun").mkdir()
            runs["overrun"] = pool.submit(_overrun, request.getfixturevalue("ray_cluster"), root / "overrun")
        for name, (test, budget_s, overrides, only, timeout) in CLI_RUNS.items():
            if test in selected:
                (root / name).mkdir()
                sig = getattr(signal, name, None)
                runs[name] = pool.submit(_one_cli, root / name, budget_s, overrides, only, timeout, sig)
    return runs


@pytest.mark.long
@pytest.mark.slow
def test_a_signal_stops_the_diagnosis_and_writes_what_was_measured(cli_runs):
    """SIGINT and SIGTERM, each to its own diagnosis, each signalled as soon as its own end-to-end run is in
    flight: the exit code says which, and what was measured before it is written."""
    for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        r = cli_runs[sig.name].result()
        assert r["returncode"] == code, r["out"][-3000:]
        saved = json.loads((r["folder"] / "d" / "diagnosis.json").read_text())
        assert saved["interrupted"] == signal.Signals(sig).name
        assert "samples_per_s" in saved["findings"]["compute"]  # measured before the signal, kept
        assert "interrupted by" in saved["findings"]["end_to_end"]["error"]


@pytest.mark.long
@pytest.mark.slow
def test_an_experiment_past_the_deadline_is_stopped_with_a_reason(cli_runs):
    r = cli_runs["deadline"].result()
    assert r["returncode"] == 0, r["out"][-3000:]
    saved = json.loads((r["folder"] / "d" / "diagnosis.json").read_text())
    assert "stopped at its deadline" in saved["findings"]["end_to_end"].get("error", ""), saved["findings"]
    assert "verdict" in saved
    # the budget, plus the grace a killed experiment gets and the process's own start (imports)
    assert r["seconds"] < 12 + 10 + 40, r["out"][-2000:]


@pytest.mark.ray
@pytest.mark.long
@pytest.mark.slow
def test_a_ray_experiment_past_the_deadline_is_killed_and_the_diagnosis_ends(cli_runs):
    """2 workers on Ray Train (the CLI's own local Ray, started once), 30 s per batch: the end-to-end run is cut at
    the deadline (20 s) while its group starts or trains. Its process group is killed, Ray ends its job, and the
    diagnosis writes its report and exits 0 (disconnecting Ray under a thread still inside a Ray call once ended a
    whole diagnosis with exit 1: "The core worker has already been shutdown ... The process will exit")."""
    r = cli_runs["ray deadline"].result()
    assert r["returncode"] == 0, r["out"][-3000:]
    findings = json.loads((r["folder"] / "d" / "diagnosis.json").read_text())["findings"]
    err = findings["end_to_end"].get("error", f"no error: {findings}")
    assert "stopped at its deadline" in err and "its process group was sent SIGTERM" in err, err
    # the budget, the grace, Ray's own start in the CLI's process and the process's imports
    assert r["seconds"] < 20 + 10 + 60, r["out"][-2000:]
