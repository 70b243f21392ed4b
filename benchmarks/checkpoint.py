"""Checkpoint cost: how long a save stalls the step, what checkpointing costs the whole run, synchronous against
asynchronous, on a local disk and on storage throttled to a stated bandwidth, how fast it writes, and how long a
run takes to come back after being killed.

    python benchmarks/checkpoint.py              # a ~57M-parameter ViT at 2 ranks (ZeRO-3); writes results/checkpoint.json
    python benchmarks/checkpoint.py --quick      # a tiny ViT, seconds (the smoke test)

Every row is a real run through the torchrun launcher (``python -m torch.distributed.run -m
dutycycle.trainer.launch.torchrun``: 2 gloo ranks, the product's step loop and checkpointer), AdamW, fp32, the same
synthetic batches:

- ``none``: no checkpoints (the step time and the run's wall time without any save);
- ``sync``: ``checkpoint.async_save = false``: the step blocks for dcp.save, the checksums and the commit;
- ``async``: the default: the step blocks for the snapshot into host memory (and for any wait the snapshot
  causes later: the next optimizer step waits until the copy is done), the write and the commit run in the
  background;
- ``sync-throttled``, ``async-throttled``: the same two, with ``checkpoint.dir`` on ``throttled://``: a folder
  whose writes are paced to ``--throttle-mb-s`` (default 200 MB/s, shared by both ranks: the path's total
  bandwidth, as a node's link to its storage; benchmarks/throttle.py), held in memory under ``/dev/shm``
  (``--throttle-backing``) so that, as with a network store, the bytes do not also pay this machine's disk. The product takes it as any fsspec URI; the
  ranks start through benchmarks/throttle.py, which registers the protocol and then runs the same launcher module;
- ``recovery``: an asynchronous run whose whole process group is SIGKILLed after its first commit (a lost node),
  then started again with the same command plus ``--resume``: the wall time from the kill to the first step after the resume.
- ``peer`` (``--rows peer`` alone merges into the results file): peer memory against storage after a lost node, on
  a local Ray cluster (``ray.cluster_utils.Cluster``: the driver and Ray Train's controller on the head, one
  1-CPU node per rank and a spare), through ``dutycycle train`` with ``ray.max_failures = 1``. Two runs, the same
  model and the same kill: ``storage`` (``checkpoint.every = --every``, no peer memory) and ``memory`` (the same,
  plus ``checkpoint.memory_every = --memory-every``). Once step ``--peer-kill-step`` is trained, the node of rank
  1 is removed (its worker and its store die); Ray Train restarts the group on the survivor and the spare. Each
  run reports where it resumed from (memory or storage, which step), the steps redone, the restore (find, fetch
  or read, verify, load) and the time from the node's removal to the first step trained after the restore, and
  what the memory copies cost while training (per copy: the snapshot into memory and the hand-over).

Stall per save is the loop's "checkpoint" phase (the slowest rank's total) divided by the saves: everything the
step waited for on account of checkpoints. Write throughput is the bytes of all ranks' files divided by the wall
time of the write (dcp.save, from the first rank starting to every rank done, as rank 0 sees it).

End-to-end cost (``overhead_s``) is what checkpointing added to the whole run: the row's wall time minus the
``none`` row's, in the same invocation. The headline wall time is the training loop's (``summary.wall_s``, rank 0:
from the resume check through every step, the final evaluation and the wait for the last save to commit), not the
process's: process start-up, imports, the process group and the model build do not depend on checkpoints and move
by seconds from run to run on a shared machine, and the loop's wall is the only figure that also holds the drain
of the last asynchronous save (it is neither stall nor a step). Beside it: ``overhead_steps_s`` (the sum of every
step's time over the same steps: stalls and the background write's contention, without that tail) and
``overhead_process_s`` (``process_wall_s``, the whole torchrun job as this script times it). ``ratios`` holds the
stall ratio and the end-to-end ratio side by side: a save can stall the step for almost nothing and still cost the
run most of a synchronous save's time, when its background write slows the steps or the run waits for it at the
end. Targets: asynchronous stall at most 0.1 of synchronous, and, on the throttled path, asynchronous end-to-end
cost at most 0.25 of synchronous. The defaults (24 steps, a save every 4, 200 MB/s) are chosen so that one save's
write (683 MB: about 3.4 s at 200 MB/s) fits in the steps between two saves (about 4.4 s): a background write that
takes longer than the save interval cannot be hidden by any policy (the next save waits for it; at 100 MB/s and a
save every 3 steps the earlier run measured 0.72x), and the save at the last step cannot be hidden at all (the run
waits for it), so with N saves the best an asynchronous save can do is about 1/N of synchronous
(``final_save_s``: that last save and its wait, measured; ``async_final_save_vs_sync_overhead``: its share of the
synchronous cost). On this 2-core machine the background write competes with training for the
cores, so the step after an asynchronous save is slower than the row's median step; both are reported (compare
them within a row: across rows the shared machine's load moves step times more). Differences of wall times are
noisy here (one async row cost 9.1 s in one invocation and 19.8 s in the next), so every row runs ``--repeats``
times (default 3) in rounds, each round's costs taken against its own ``none`` row, and the rows report the
median of each figure with every round's loop wall and cost in ``runs``; a small or negative cost says the
checkpoints cost less than the machine's noise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dutycycle.trainer.cluster.local import free_port

if __name__ == "__main__":  # run as `python benchmarks/checkpoint.py`: the siblings import as `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import docs_format as fmt  # noqa: E402
from benchmarks._common import default_out, kill_tree, machine, read_result, write_result  # noqa: E402
from benchmarks.checkpoint_peer import peer_rows  # noqa: E402
from benchmarks.checkpoint_render import signed_secs  # noqa: E402
from benchmarks.throttle import RATE_ENV, STATE_ENV  # noqa: E402

ROWS = ("none", "sync", "async", "sync-throttled", "async-throttled")
THROTTLE = Path(__file__).with_name("throttle.py")  # the ranks' entry point on the throttled path


def throttled(mode: str) -> bool:
    return mode.endswith("-throttled")


def write_config(path: Path, run_dir: Path, args, mode: str) -> Path:
    every = 0 if mode == "none" else args.every
    base = mode.removesuffix("-throttled")
    where = f'dir = "throttled://{args.throttle_root}/{mode}/checkpoints"' if throttled(mode) else ""
    text = f"""
[data]
source = "synthetic"
size = {args.size}
global_batch_size = {args.batch}
synthetic_samples = {args.batch * (args.steps + 2)}
[model]
name = "vit"
width = {args.width}
depth = {args.depth}
heads = {args.heads}
patch = 4
[optim]
warmup_steps = 2
[parallel]
zero_stage = {args.stage}
threads_per_worker = 1
[run]
dir = "{run_dir}"
max_steps = {args.steps}
eval_every = 0
eval_max_batches = 1
log_every = 1
report = false
save_model = false
[checkpoint]
every = {every}
async_save = {"false" if base == "sync" else "true"}
{where}
"""
    path.write_text(text)
    return path


def launch(config: Path, args, throttle_state: Path | None = None, resume: bool = False,
           **kwargs) -> subprocess.Popen:
    """The torchrun job; with ``throttle_state``, its ranks start through throttle.py (which registers
    ``throttled://`` and runs the same module), pacing their writes together to ``--throttle-mb-s``; ``resume``
    continues the run in its run directory (a new launch into a run is refused without it)."""
    entry = ["-m"] if throttle_state is None else [str(THROTTLE)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if throttle_state is not None:
        env.update({RATE_ENV: str(args.throttle_mb_s), STATE_ENV: str(throttle_state)})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), "--master-port",
           str(free_port()), *entry, "dutycycle.trainer.launch.torchrun", str(config), *(["--resume"] if resume else [])]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, **kwargs)


def metrics(run_dir: Path) -> list[dict]:
    """The rows written so far (the run is still writing: a half-written last line waits for the next look)."""
    from dutycycle.trainer.step.metrics import read_metrics

    return read_metrics(str(run_dir), live=True)


def run_row(mode: str, args, workdir: Path) -> dict:
    run_dir = workdir / mode
    config = write_config(workdir / f"{mode}.toml", run_dir, args, mode)
    settle(args.quick)
    t0 = time.perf_counter()
    cpu0 = _children_cpu_s()
    proc = launch(config, args, workdir / f"{mode}.throttle" if throttled(mode) else None)
    out, _ = proc.communicate(timeout=args.timeout)
    wall = time.perf_counter() - t0
    cpu = _children_cpu_s() - cpu0
    if proc.returncode != 0:
        return {"name": mode, "error": out[-8000:]}
    s = json.loads((run_dir / "summary.json").read_text())
    ck = s["checkpoint"]
    rows = [r for r in metrics(run_dir) if "loss" in r]
    saves = set(ck["committed"])
    after_save = {step + 1 for step in saves}  # the step during which a background write runs (at least)
    plain = [r["step_s"] for r in rows[args.skip:] if r["step"] not in saves and r["step"] not in after_save]
    during = [r["step_s"] for r in rows[args.skip:] if r["step"] in after_save]
    n = max(1, ck["saves"])
    return {
        "name": mode, "storage": f"throttled://, {args.throttle_mb_s:g} MB/s for both ranks together, backed by "
        f"{args.throttle_backing or 'the local disk'}" if throttled(mode) else "local disk",
        "num_params": s["num_params"], "steps": s["steps"], "saves": ck["saves"],
        "stall_s_per_save": s["time_breakdown"]["max_seconds"]["checkpoint"] / n if ck["saves"] else 0.0,
        "stall_s_per_save_in_maybe_save": ck["stall_s"]["mean"],
        "waited_for_previous_save": ck["waited_for_previous_save"],
        "bytes_per_save": ck["bytes_per_save"], "write_s_per_save": ck["write_s_mean"],
        "write_mb_per_s": ck["write_mb_per_s"], "snapshot_s": ck["snapshot_s_mean"],
        "step_s_median": statistics.median(plain) if plain else None,
        "step_s_median_after_save": statistics.median(during) if during else None,
        # the run's wall times (module docstring): the loop's (the headline), every step's sum, the process's
        "loop_wall_s": s["wall_s"], "steps_s_sum": sum(r["step_s"] for r in rows),
        # the last save and the wait for its write and commit (rank 0, whose loop wall this is): nothing hides it,
        # so with one save in N at the end of a run it is the floor of asynchronous end-to-end cost
        "final_save_s": s["time_breakdown"]["seconds"].get("final_save", 0.0),
        "process_wall_s": wall,
        "cpu_s": cpu,  # user + system seconds of the whole launch (torchrun and both ranks, every thread)
    }


def settle(quick: bool = False) -> None:
    """Flush the page cache's dirty pages before a row starts: a local-disk row leaves GBs of checkpoints to be
    written back, and the kernel's writeback then took CPU from whichever row ran next (async-throttled, run after
    them, measured 38-59 s of loop wall from one invocation to the next). ``--quick``'s saves are about a MB and
    its figures are not read: no second's wait for the writeback to end."""
    os.sync()
    if not quick:
        time.sleep(1.0)


def _children_cpu_s() -> float:
    """CPU seconds of every child process waited for so far (a launch's tree once it has exited)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def add_overheads(rows: list[dict]) -> None:
    """Each checkpointing row's end-to-end cost: its wall times minus the ``none`` row's (same invocation)."""
    none = next((r for r in rows if r["name"] == "none" and "error" not in r), None)
    for r in rows:
        if none is None or r is none or "error" in r or r["name"] == "recovery":
            continue
        r["overhead_s"] = r["loop_wall_s"] - none["loop_wall_s"]
        r["overhead_steps_s"] = r["steps_s_sum"] - none["steps_s_sum"]
        r["overhead_process_s"] = r["process_wall_s"] - none["process_wall_s"]
        r["overhead_cpu_s"] = r["cpu_s"] - none["cpu_s"]  # what the saves cost in CPU, all threads together


def merge_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One row per mode: the median of each figure over the rounds (each round's costs were taken against its own
    ``none`` row: the machine's load moves whole runs by seconds, and a cost is a difference of two runs), with
    every round's loop wall and cost kept in ``runs``. A row that failed in any round is that round's error."""
    out = []
    for i, first in enumerate(rounds[0]):
        same = [rows[i] for rows in rounds]
        failed = next((r for r in same if "error" in r), None)
        if failed is not None:
            out.append(failed)
            continue
        row = dict(first)
        for key, value in first.items():
            values = [r.get(key) for r in same]
            if isinstance(value, (int, float)) and not isinstance(value, bool) and None not in values:
                row[key] = statistics.median(values)
        row["runs"] = {key: [r[key] for r in same] for key in ("loop_wall_s", "overhead_s") if key in first}
        out.append(row)
    return out


def compute_ratios(rows: list[dict]) -> dict:
    by = {r["name"]: r for r in rows if "error" not in r}
    out = {}
    for suffix in ("", "-throttled"):
        a, b = by.get(f"async{suffix}"), by.get(f"sync{suffix}")
        key = suffix.replace("-", "_")
        if a and b and b["stall_s_per_save"] > 0:
            out[f"async_stall_vs_sync{key}"] = a["stall_s_per_save"] / b["stall_s_per_save"]
        for kind in ("", "_steps", "_process"):
            # a ratio of costs only means something when synchronous saves cost the run something measurable
            if a and b and f"overhead{kind}_s" in a and b[f"overhead{kind}_s"] > 0:
                out[f"async_overhead{kind}_vs_sync{key}"] = a[f"overhead{kind}_s"] / b[f"overhead{kind}_s"]
        if a and b and "final_save_s" in a and b.get("overhead_s", 0) > 0:
            # the share of synchronous cost that the last save's drain alone takes in the asynchronous run
            out[f"async_final_save_vs_sync_overhead{key}"] = a["final_save_s"] / b["overhead_s"]
        if a and a["step_s_median"] and a["step_s_median_after_save"]:
            out[f"async_step_after_save_vs_median_step{key}"] = a["step_s_median_after_save"] / a["step_s_median"]
    return out


def recovery_row(args, workdir: Path) -> dict:
    """Kill the whole job after its first commit, start it again, time the way back."""
    run_dir = workdir / "recovery"
    config = write_config(workdir / "recovery.toml", run_dir, args, "async")
    proc = launch(config, args)
    first = run_dir / "checkpoints" / f"step-{args.every:08d}" / "manifest.json"
    deadline = time.time() + args.timeout
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    if not first.exists():
        proc.kill()
        return {"name": "recovery", "error": (proc.communicate()[0] or "")[-8000:] or "no commit before timeout"}
    reached = max([r["step"] for r in metrics(run_dir) if "loss" in r], default=0)
    kill_tree(proc.pid)  # the whole job: torchrun's agent and both ranks, as a lost node would
    killed = time.perf_counter()
    proc.wait()
    again = launch(config, args, resume=True)
    first_step_at = None
    while again.poll() is None and first_step_at is None:
        rows = metrics(run_dir)
        resumed = next((r for r in rows if r.get("event") == "resume"), None)
        if resumed and any("loss" in r and r["step"] > resumed["step"] for r in rows):
            first_step_at = time.perf_counter()
        time.sleep(0.02)
    out, _ = again.communicate(timeout=args.timeout)
    if again.returncode != 0:
        return {"name": "recovery", "error": out[-8000:]}
    s = json.loads((run_dir / "summary.json").read_text())
    res = s["checkpoint"]["resumed"] or {}
    return {
        "name": "recovery", "killed_after_step": reached, "resumed_from_step": res.get("step"),
        "steps_lost": res.get("steps_lost"), "restore_s": res.get("restore_s"),
        "recovery_s": (first_step_at or time.perf_counter()) - killed,
        "steps": s["steps"], "num_params": s["num_params"],
    }


def table(rows: list[dict]) -> str:
    """The rows as this run printed them (the docs' table is ``render``'s)."""
    def cost(v: float | None) -> str | None:
        return None if v is None else signed_secs(v)

    body = [[r["name"], r["saves"], fmt.secs(r["stall_s_per_save"]),
             f"{r['write_mb_per_s']:.0f}" if r["write_mb_per_s"] is not None else None,
             fmt.nbytes(r["bytes_per_save"]) if r["saves"] else None, fmt.secs(r["step_s_median"]),
             fmt.secs(r["step_s_median_after_save"]), fmt.secs(r["loop_wall_s"]), cost(r.get("overhead_s")),
             cost(r.get("overhead_steps_s")), cost(r.get("overhead_process_s"))]
            for r in rows if r["name"] != "recovery" and "error" not in r]
    return fmt.table(["row", "saves", "stall per save", "write (MB/s)", "per save", "median step",
                      "step after a save", "loop wall", "end-to-end cost", "... by step sum", "... by process wall"],
                     body)


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=768, help="ViT width (768 at depth 8: ~57M parameters)")
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--size", type=int, default=16, help="image side (16: 17 tokens of 4x4 patches)")
    p.add_argument("--batch", type=int, default=4, help="global batch size")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=4, help="checkpoint.every")
    p.add_argument("--stage", type=int, default=3, help="ZeRO stage")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--skip", type=int, default=1, help="first steps left out of the step-time medians")
    p.add_argument("--rows", nargs="+", default=[*ROWS, "recovery", "peer"], choices=[*ROWS, "recovery", "peer"],
                   help="which rows; `peer` alone is merged into the results file's other rows")
    p.add_argument("--memory-every", type=int, default=1, help="checkpoint.memory_every of the peer rows")
    p.add_argument("--peer-slow-ms", type=float, default=None,
                   help="data.slow_ms of the peer rows: --quick's steps (0.1 s) would end the run before the node "
                        "is removed (default 0; --quick: 150)")
    p.add_argument("--peer-kill-step", type=int, default=None,
                   help="the peer rows lose a node once this step is trained (default: --every + --every // 2 + 1, "
                        "past a commit and mid-way to the next)")
    p.add_argument("--throttle-mb-s", type=float, default=None,
                   help="write bandwidth of the throttled rows' storage, 10^6 bytes/s for all ranks together "
                        "(default 200; --quick: 10, which adds ~0.1 s to each of its ~0.9 MB saves)")
    p.add_argument("--throttle-backing", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else "",
                   help="where the throttled path's bytes land (default /dev/shm: memory, as a network store's leave "
                        "the machine; '' = the temporary folder on disk, which adds the disk's own cost)")
    p.add_argument("--repeats", type=int, default=None,
                   help="rounds of every row (each round's costs against its own `none`; rows report medians): "
                        "3, or 1 with --quick")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--quick", action="store_true", help="a tiny ViT and few steps: seconds, for the smoke test")
    p.add_argument("--out", default=default_out("checkpoint"))
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.heads, args.size, args.batch, args.steps, args.every = 32, 2, 2, 8, 4, 8, 3
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.peer_slow_ms is None:
        args.peer_slow_ms = 150.0 if args.quick else 0.0
    if args.peer_kill_step is None:
        args.peer_kill_step = args.every + args.every // 2 + 1
    if args.throttle_mb_s is None:
        args.throttle_mb_s = 10.0 if args.quick else 200.0
    return args


def run(args) -> dict:
    if args.rows == ["peer"]:  # the peer rows alone, beside the other rows already measured
        with tempfile.TemporaryDirectory() as d:
            return {**read_result(args.out), "peer": peer_rows(args, Path(d))}
    rounds = []
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory(
            prefix="dc-throttled-", dir=args.throttle_backing or None) as throttle_root:
        for k in range(args.repeats):
            # a fresh run folder and throttled folder each round: a row must never resume the last round's commits
            workdir = Path(d) / f"round{k}"
            workdir.mkdir()
            args.throttle_root = os.path.join(throttle_root, f"round{k}")
            rows = []
            for mode in [m for m in ROWS if m in args.rows]:
                r = run_row(mode, args, workdir)
                rows.append(r)
                shutil.rmtree(workdir / mode / "checkpoints", ignore_errors=True)  # GBs a later row would share
                print(f"round {k + 1}/{args.repeats} {mode}: " + (
                    "error\n" + r["error"] if "error" in r else
                    f"stall/save {r['stall_s_per_save']:.3f} s, write {r['write_mb_per_s'] or 0:.0f} MB/s, "
                    f"median step {r['step_s_median'] or 0:.2f} s, loop wall {r['loop_wall_s']:.2f} s"), flush=True)
            add_overheads(rows)
            rounds.append(rows)
            shutil.rmtree(args.throttle_root, ignore_errors=True)  # ~2.7 GB of commits in memory per round
        rows = merge_rounds(rounds)
        if "recovery" in args.rows:
            r = recovery_row(args, Path(d))
            rows.append(r)
            print("recovery: " + ("error\n" + r["error"] if "error" in r else
                                  f"{r['recovery_s']:.1f} s from the kill to the first resumed step "
                                  f"(restore {r['restore_s']:.2f} s, {r['steps_lost']} steps lost)"), flush=True)
        peer = peer_rows(args, Path(d)) if "peer" in args.rows else read_result(args.out).get("peer")
    return {
        **({"peer": peer} if peer else {}),
        "benchmark": "checkpoint",
        "machine": machine(),
        "settings": vars(args), "rows": rows, "ratios": compute_ratios(rows),
        "target": {"async_stall_vs_sync": 0.1, "async_overhead_vs_sync_throttled": 0.25},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    write_result(args.out, result, ("ratios",))
    print(table(result.get("rows", [])))
    if result.get("peer"):
        print(json.dumps(result["peer"]["ratios"]))
    return 1 if any("error" in r for r in result.get("rows", []) + (result.get("peer") or {}).get("rows", [])) else 0


if __name__ == "__main__":
    raise SystemExit(main())
