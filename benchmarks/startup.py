"""Start-up of a short job: how long from the command to the first optimizer step, and where it goes.

    python benchmarks/startup.py                         # writes benchmarks/results/startup.json
    python benchmarks/startup.py --baseline-python OLD/bin/python --repeats 3

The job is the one the issue timed: 300 optimizer steps on one worker from a small cache (1,500 training and 300
validation images at 32x32, global batch 64, the built-in CNN at width 16), evaluated every 100 steps. Each row
runs in processes of its own, as a user runs it:

- ``cli``: ``dutycycle train CONFIG`` in a new process (a new local Ray cluster, Ray Train's controller and
  worker, the worker's imports, the health check, the data, the model);
- ``cli-baseline`` (with ``--baseline-python``): the same command through another installation of dutycycle
  (e.g. the commit before the start-up work, installed into its own virtual environment): the before of a
  before/after measured in the same invocation, on the same machine state, in alternating rounds;
- ``notebook``: one Python process calling ``train`` twice, as a notebook does: the second call finds the Ray
  instance of the first (its start-up has no Ray start);
- ``local``: ``dutycycle train --local`` (no Ray: one process): the floor the Ray launch is measured against.

Figures per row: ``command_to_first_step_s`` (from starting the process to the end of the first step, read from
the first row of ``metrics.jsonl``: comparable across installations, imports included), ``command_s`` (the
process's whole wall time), and, from the run's summary, ``launch_to_first_step_s`` and its parts
(``summary["startup"]``: Ray start, trainer start, worker start, health check, data open, model build, loop start,
first step) and the job's account (``summary["launch"]``). A baseline without ``summary["startup"]`` has its parts
from its ``summary["launch"]``. Start-up moves by seconds from run to run on a shared 2-core machine, so every row
runs ``--repeats`` times in rounds and reports the median of each figure, with every run in ``runs``.

The machine's neighbours move these figures by seconds (beside other users' jobs one round's start-up took 57 s
where the others took 15): the load averages around the rows are recorded, and ``--busy N`` measures every row
again beside N busy-loop processes, a fixed load, for a comparison under contention that does not depend on
what else the machine runs (beside 1 on this 2-core machine a 300-step run takes minutes: the spinner slows
training too; beside 2, one start-up took two minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

if __name__ == "__main__":  # run as `python benchmarks/startup.py`: the siblings import as `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import docs_format as fmt  # noqa: E402
from benchmarks._common import RESULT_PREFIX, bench_env, default_out, emit, machine, write_result  # noqa: E402

PARTS = ("ray_start", "trainer_start", "worker_start", "health_check", "data_open", "model_build", "loop_start",
         "first_step", "other")
# the same boundaries in a summary without "startup" (results of the code before it): launch/account.py's names
LAUNCH_PARTS = {"ray_start": "ray_start", "worker_start": "worker_start", "health_check": "health_check",
                "data_open": "data_open", "model_build": "model_build"}


def write_config(path: str, cache: str, run_dir: str, args) -> str:
    text = (f'[data]\ncache = "{cache}"\nglobal_batch_size = {args.batch}\n'
            f'[model]\nwidth = {args.width}\n[parallel]\nnum_workers = 1\n'
            f'[run]\ndir = "{run_dir}"\nname = "startup"\nmax_steps = {args.steps}\neval_every = {args.eval_every}\n'
            f'log_every = 50\n')
    with open(path, "w") as f:
        f.write(text)
    return path


def first_step_time(run_dir: str) -> float | None:
    """The wall clock at the end of the run's first step (its metrics row)."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            times = [r["time"] for r in map(json.loads, f) if "loss" in r]
    except FileNotFoundError:
        return None
    return min(times) if times else None


def figures(summary: dict, run_dir: str, spawned: float | None) -> dict:
    """One run's figures from its summary and metrics (``spawned``: when its process was started)."""
    out: dict = {"steps": summary.get("steps"), "loop_wall_s": summary.get("wall_s"),
                 "samples_per_s": summary.get("samples_per_s")}
    first = first_step_time(run_dir)
    if spawned is not None and first is not None:
        out["command_to_first_step_s"] = first - spawned
    launch = summary.get("launch") or {}
    if launch:
        out["launch_to_exit_s"] = launch["wall_s"]
        out["launch_seconds"] = launch["seconds"]
    startup = summary.get("startup")
    if startup:
        out["launch_to_first_step_s"] = startup["launch_to_first_step_s"]
        out["parts"] = startup["seconds"]
        out["ray_reused"] = startup.get("ray_reused")
    elif launch:  # the code before summary["startup"]: the boundaries its job account has
        out["parts"] = {k: launch["seconds"].get(v, 0.0) for k, v in LAUNCH_PARTS.items()}
    return out


def run_cli(python: str, config: str, run_dir: str, *extra: str, timeout: float) -> dict:
    """``dutycycle train CONFIG`` through ``python``, timed from the process's start."""
    env = {**bench_env(), "RAY_ADDRESS": "local"}  # a cluster of its own, never one another process left here
    spawned = time.time()
    try:
        proc = subprocess.run([python, "-m", "dutycycle.trainer.app.cli", "train", config, *extra],
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    command_s = time.time() - spawned
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: " + " | ".join((proc.stderr or proc.stdout).splitlines()[-6:])}
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    return {**figures(summary, run_dir, spawned), "command_s": command_s}


def notebook_row(config: str, run_dirs: list[str]) -> None:
    """In this process (the row's own), as a notebook: ``train`` twice; emits both runs' figures."""
    from dutycycle.trainer.config import load_config
    from dutycycle.trainer.launch.train import train

    runs = []
    for run_dir in run_dirs:  # the call's own figures are summary["startup"]'s: from train()'s start
        cfg = load_config(config, [f"run.dir={run_dir}", "run.log_every=0"])
        started = time.time()
        summary = train(cfg, quiet=True)
        runs.append({**figures(summary, run_dir, None), "call_s": time.time() - started})
    emit({"runs": runs})


def run_notebook(python: str, config: str, workdir: str, timeout: float) -> list[dict]:
    env = {**bench_env(), "RAY_ADDRESS": "local"}
    dirs = [os.path.join(workdir, f"nb-{i}") for i in range(2)]
    try:
        proc = subprocess.run([python, __file__, "--row", "notebook", "--config", config, "--run-dirs", *dirs],
                              capture_output=True, text=True, timeout=2 * timeout, env=env)
    except subprocess.TimeoutExpired:
        return [{"error": f"timed out after {2 * timeout:.0f} s"}] * 2
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])["runs"]
    return [{"error": f"exit {proc.returncode}: " + " | ".join((proc.stderr or proc.stdout).splitlines()[-6:])}] * 2


def median_of(runs: list[dict]) -> dict:
    """The median of every figure over the runs that did not fail (parts and launch seconds per key)."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"] if runs else "no runs"}
    out: dict = {"runs_ok": len(ok)}
    for key in ("command_to_first_step_s", "launch_to_first_step_s", "command_s", "launch_to_exit_s", "loop_wall_s",
                "samples_per_s", "call_s"):
        vals = [r[key] for r in ok if r.get(key) is not None]
        if vals:
            out[key] = statistics.median(vals)
    for group in ("parts", "launch_seconds"):
        keys = {k for r in ok for k in (r.get(group) or {})}
        if keys:
            out[group] = {k: statistics.median((r.get(group) or {}).get(k, 0.0) for r in ok) for k in sorted(keys)}
    if any("ray_reused" in r for r in ok):
        out["ray_reused"] = ok[0].get("ray_reused")
    return out


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300, the issue's job)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--n", type=int, default=1500, help="training images (default 1500; validation: a fifth)")
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="rounds of every row (default 3); medians reported")
    p.add_argument("--baseline-python", default=None,
                   help="the python of another dutycycle installation, run as the cli-baseline row")
    p.add_argument("--baseline-label", default="another installation",
                   help="what the baseline is, for the docs (e.g. 'the commit before the start-up work')")
    p.add_argument("--busy", type=int, nargs="+", default=[0],
                   help="background loads to measure under: busy-loop processes beside the rows (default 0)")
    p.add_argument("--rows", nargs="+", default=["cli", "notebook", "local"], choices=["cli", "notebook", "local"])
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run before it counts as failed")
    p.add_argument("--out", default=default_out("startup"))
    p.add_argument("--workdir", default=None, help="keep the cache and the runs here")
    # internal: one row's process
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--run-dirs", nargs="*", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


@contextmanager
def busy(processes: int):
    """``processes`` busy loops beside the rows (a shared machine's neighbours, the same in every round), stopped
    after."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def rounds(args, cache: str, workdir: str, tag: str) -> dict[str, list[dict]]:
    """Every row ``args.repeats`` times, in alternating rounds; each row's runs."""
    python = sys.executable
    runs: dict[str, list[dict]] = {}
    plan = [(name, None) for name in args.rows if name != "notebook"]
    if args.baseline_python:
        plan.insert(0, ("cli-baseline", args.baseline_python))
    for rnd in range(args.repeats):
        for name, other in plan:
            run_dir = os.path.join(workdir, "runs", f"{tag}{name}-{rnd}")
            config = write_config(os.path.join(workdir, f"{tag}{name}-{rnd}.toml"), cache, run_dir, args)
            extra = ("--local",) if name == "local" else ()
            r = run_cli(other or python, config, run_dir, *extra, timeout=args.timeout)
            runs.setdefault(name, []).append(r)
            print(f"{tag}round {rnd + 1} {name}: " + (r.get("error") or
                  f"{r['command_to_first_step_s']:.1f} s to the first step, {r['command_s']:.1f} s in all"), flush=True)
        if "notebook" in args.rows:
            config = write_config(os.path.join(workdir, f"{tag}nb-{rnd}.toml"), cache,
                                  os.path.join(workdir, "runs", "unused"), args)
            first, second = run_notebook(python, config, os.path.join(workdir, "runs", f"{tag}notebook-{rnd}"),
                                         args.timeout)
            runs.setdefault("notebook-first", []).append(first)
            runs.setdefault("notebook-second", []).append(second)
            print(f"{tag}round {rnd + 1} notebook: " + (second.get("error") or
                  f"{first.get('launch_to_first_step_s', 0):.1f} s, then {second['launch_to_first_step_s']:.1f} s "
                  "to the first step"), flush=True)
    return runs


def ratios_of(by: dict) -> dict:
    ok = {name: r for name, r in by.items() if "error" not in r}
    out = {}
    if "cli-baseline" in ok and "cli" in ok:
        out["cli_first_step_baseline_over_now"] = ok["cli-baseline"]["command_to_first_step_s"] / ok["cli"][
            "command_to_first_step_s"]
        out["cli_command_baseline_over_now"] = ok["cli-baseline"]["command_s"] / ok["cli"]["command_s"]
    if "notebook-second" in ok and "notebook-first" in ok:
        out["notebook_second_over_first"] = (ok["notebook-second"]["launch_to_first_step_s"]
                                             / ok["notebook-first"]["launch_to_first_step_s"])
    return out


def run(args) -> dict:
    from dutycycle.engine.synth import synthesize_cache

    load_before = os.getloadavg()
    rows, ratios = [], {}
    with tempfile.TemporaryDirectory(prefix="dc-startup-") as tmp:
        workdir = args.workdir or tmp
        cache = synthesize_cache(os.path.join(workdir, "cache"), n_train=args.n, n_val=args.n // 5, size=args.size,
                                 seed=1)
        for level in args.busy:
            with busy(level):
                runs = rounds(args, cache, workdir, f"busy{level}-" if level else "")
            by = {name: {"name": name, "busy": level, **median_of(rs), "runs": rs} for name, rs in runs.items()}
            rows += by.values()
            ratios[str(level)] = ratios_of(by)
    return {
        "benchmark": "startup",
        # the machine is shared: how busy it was besides (1-, 5- and 15-minute load averages) around the rows
        "machine": {**machine(), "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "settings": {k: v for k, v in vars(args).items() if k not in ("row", "config", "run_dirs", "out", "workdir")},
        "rows": rows,
        "ratios": ratios,  # per background load: busy processes -> ratios
        "notes": "medians over the rounds, which alternate the rows. Command to first step counts from the "
                 "process's start, imports included; launch to first step from train()'s start (summary.json's "
                 "startup). Busy: that many busy-loop processes run beside the rows, as a shared machine's "
                 "neighbours do",
    }


# -- the docs' blocks (benchmarks/render_docs.py writes them between a page's render markers) --------------------------

LABELS = {"cli-baseline": "`dutycycle train`, before", "cli": "`dutycycle train`",
          "notebook-first": "notebook, first `train`", "notebook-second": "notebook, second `train` (Ray reused)",
          "local": "`dutycycle train --local`"}


def render(d: dict) -> str:
    s = d["settings"]
    caption = (f"A {s['steps']}-step job on one worker from a cache of {fmt.count(s['n'])} training images at "
               f"{s['size']}x{s['size']} (global batch {s['batch']}, the CNN at width {s['width']}), on a "
               f"{d['machine']['cpus']}-core machine; the median of {s['repeats']} rounds per row.")
    loaded = any(r.get("busy") for r in d["rows"])
    if loaded:
        caption += " Busy: that many busy-loop processes beside the rows (0: the machine as it was)."
    if s.get("baseline_python"):
        caption += f" Before: {s.get('baseline_label') or 'another installation'}, the same command."
    headers = ["run", *(["busy"] if loaded else []), "command to first step", "launch to first step", "Ray start",
               "worker start", "model build", "launch to exit"]
    rows = []
    for r in d["rows"]:
        name = [LABELS.get(r["name"], r["name"]), *([str(r.get("busy", 0))] if loaded else [])]
        if "error" in r:
            rows.append([*name, "failed", None, None, None, None, None])
            continue
        parts = r.get("parts") or {}
        rows.append([*name,
                     fmt.secs(r["command_to_first_step_s"]) if "command_to_first_step_s" in r else None,
                     fmt.secs(r["launch_to_first_step_s"]) if "launch_to_first_step_s" in r else None,
                     fmt.secs(parts["ray_start"]) if parts.get("ray_start", 0.0) >= 0.01 else "none",
                     fmt.secs(parts.get("worker_start", 0.0)),
                     fmt.secs(parts.get("model_build", 0.0)),
                     fmt.secs(r["launch_to_exit_s"]) if "launch_to_exit_s" in r else None])
    out = [fmt.para(caption), fmt.table(headers, rows)]
    names = {"cli_first_step_baseline_over_now": "command to first step, before over now",
             "cli_command_baseline_over_now": "the whole command, before over now",
             "notebook_second_over_first": "notebook: second `train` over first, to the first step"}
    ratio_rows = [[names[k], *([level] if loaded else []), fmt.times(v)]
                  for level, ratios in d["ratios"].items() for k, v in ratios.items()]
    if ratio_rows:
        out.append(fmt.table(["ratio", *(["busy"] if loaded else []), "value"], ratio_rows))
    out += [fmt.para(fmt.sentence(d["notes"])), fmt.source("startup")]
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.row == "notebook":
        notebook_row(args.config, args.run_dirs)
        return 0
    write_result(args.out, run(args), ("ratios",))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
