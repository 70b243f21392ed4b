"""Checkpoint cost: how long a save stalls the step, synchronous against asynchronous, how fast it writes, and how
long a run takes to come back after being killed.

    python benchmarks/checkpoint.py              # a ~57M-parameter ViT at 2 ranks (ZeRO-3); writes results/checkpoint.json
    python benchmarks/checkpoint.py --quick      # a tiny ViT, seconds (the smoke test)

Every row is a real run through the torchrun launcher (``python -m torch.distributed.run -m
dutycycle.trainer.launch.torchrun``: 2 gloo ranks, the product's step loop and checkpointer), AdamW, fp32, the same
synthetic batches:

- ``none``: no checkpoints (the step time without any save);
- ``sync``: ``checkpoint.async_save = false``: the step blocks for dcp.save, the checksums and the commit;
- ``async``: the default: the step blocks for the snapshot into host memory (and for any wait the snapshot
  causes later: the next optimizer step waits until the copy is done), the write and the commit run in the
  background;
- ``recovery``: an asynchronous run whose whole process group is SIGKILLed after its first commit (a lost node),
  then started again with the same command: the wall time from the kill to the first step after the resume.

Stall per save is the loop's "checkpoint" phase (the slowest rank's total) divided by the saves: everything the
step waited for on account of checkpoints. Write throughput is the bytes of all ranks' files divided by the wall
time of the write (dcp.save, from the first rank starting to every rank done, as rank 0 sees it). Target:
asynchronous stall at most 0.1 of synchronous, in the same run. On this 2-core machine the background write
competes with training for the cores, so the step after an asynchronous save is slower than the row's median step;
both are reported (compare them within a row: across rows the shared machine's load moves step times more).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dutycycle.trainer.cluster.local import free_port

ROWS = ("none", "sync", "async")


def write_config(path: Path, run_dir: Path, args, mode: str) -> Path:
    every = 0 if mode == "none" else args.every
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
async_save = {"false" if mode == "sync" else "true"}
"""
    path.write_text(text)
    return path


def launch(config: Path, args, **kwargs) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), "--master-port",
           str(free_port()), "-m", "dutycycle.trainer.launch.torchrun", str(config)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, **kwargs)


def metrics(run_dir: Path) -> list[dict]:
    """The rows written so far (the run is still writing: a half-written last line waits for the next look)."""
    from dutycycle.trainer.step.metrics import read_metrics

    return read_metrics(str(run_dir), live=True)


def run_row(mode: str, args, workdir: Path) -> dict:
    run_dir = workdir / mode
    config = write_config(workdir / f"{mode}.toml", run_dir, args, mode)
    t0 = time.perf_counter()
    proc = launch(config, args)
    out, _ = proc.communicate(timeout=args.timeout)
    wall = time.perf_counter() - t0
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
        "name": mode, "num_params": s["num_params"], "steps": s["steps"], "saves": ck["saves"],
        "stall_s_per_save": s["time_breakdown"]["max_seconds"]["checkpoint"] / n if ck["saves"] else 0.0,
        "stall_s_per_save_in_maybe_save": ck["stall_s"]["mean"],
        "waited_for_previous_save": ck["waited_for_previous_save"],
        "bytes_per_save": ck["bytes_per_save"], "write_s_per_save": ck["write_s_mean"],
        "write_mb_per_s": ck["write_mb_per_s"], "snapshot_s": ck["snapshot_s_mean"],
        "step_s_median": statistics.median(plain) if plain else None,
        "step_s_median_after_save": statistics.median(during) if during else None,
        "process_wall_s": wall,
    }


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (torchrun starts each rank in a session of its own, so a process
    group kill would leave the ranks running)."""
    import psutil

    me = psutil.Process(pid)
    for p in [*me.children(recursive=True), me]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


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
    again = launch(config, args)
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


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    lines = ["| row | saves | stall per save (s) | write (MB/s) | MB per save | median step (s) | step after a save (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["name"] == "recovery" or "error" in r:
            continue
        lines.append(f"| {r['name']} | {r['saves']} | {_fmt(r['stall_s_per_save'], '.3f')} | "
                     f"{_fmt(r['write_mb_per_s'], '.0f')} | {_fmt(r['bytes_per_save'] / 1e6 if r['saves'] else None, '.0f')} | "
                     f"{_fmt(r['step_s_median'], '.2f')} | {_fmt(r['step_s_median_after_save'], '.2f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=768, help="ViT width (768 at depth 8: ~57M parameters)")
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--size", type=int, default=16, help="image side (16: 17 tokens of 4x4 patches)")
    p.add_argument("--batch", type=int, default=4, help="global batch size")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=3, help="checkpoint.every")
    p.add_argument("--stage", type=int, default=3, help="ZeRO stage")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--skip", type=int, default=1, help="first steps left out of the step-time medians")
    p.add_argument("--rows", nargs="+", default=[*ROWS, "recovery"], choices=[*ROWS, "recovery"])
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--quick", action="store_true", help="a tiny ViT and few steps: seconds, for the smoke test")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "checkpoint.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.heads, args.size, args.batch, args.steps, args.every = 32, 2, 2, 8, 4, 8, 3
    rows = []
    with tempfile.TemporaryDirectory() as d:
        workdir = Path(d)
        for mode in [m for m in ROWS if m in args.rows]:
            r = run_row(mode, args, workdir)
            rows.append(r)
            print(f"{mode}: " + ("error\n" + r["error"] if "error" in r else
                                 f"stall/save {r['stall_s_per_save']:.3f} s, write {r['write_mb_per_s'] or 0:.0f} MB/s, "
                                 f"median step {r['step_s_median'] or 0:.2f} s"), flush=True)
        if "recovery" in args.rows:
            r = recovery_row(args, workdir)
            rows.append(r)
            print("recovery: " + ("error\n" + r["error"] if "error" in r else
                                  f"{r['recovery_s']:.1f} s from the kill to the first resumed step "
                                  f"(restore {r['restore_s']:.2f} s, {r['steps_lost']} steps lost)"), flush=True)
    by = {r["name"]: r for r in rows if "error" not in r}
    ratios = {}
    if "sync" in by and "async" in by and by["sync"]["stall_s_per_save"] > 0:
        ratios["async_stall_vs_sync"] = by["async"]["stall_s_per_save"] / by["sync"]["stall_s_per_save"]
    if "async" in by and by["async"]["step_s_median"] and by["async"]["step_s_median_after_save"]:
        ratios["async_step_after_save_vs_median_step"] = (
            by["async"]["step_s_median_after_save"] / by["async"]["step_s_median"])
    result = {
        "benchmark": "checkpoint",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "settings": vars(args), "rows": rows, "ratios": ratios,
        "target": {"async_stall_vs_sync": 0.1},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(table(rows))
    print(json.dumps(ratios, indent=2))
    print(f"wrote {args.out}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
