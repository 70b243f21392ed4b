"""The peer rows of benchmarks/checkpoint.py: a node lost under Ray Train, its run restored from storage against
from the survivors' peer memory (``checkpoint.memory_every``), and their block of the docs. Run through
``python benchmarks/checkpoint.py --rows peer``."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from dutycycle.trainer.step.metrics import read_metrics

from benchmarks import docs_format as fmt

PEER_MODES = ("storage", "memory")

PEER_SCRIPT = """
import json, sys, threading, time
import psutil
import ray
from ray.cluster_utils import Cluster
from dutycycle.trainer.config import load_config
from dutycycle.trainer.launch.train import train
from dutycycle.trainer.step.metrics import read_metrics

root, settings, ranks, kill_step, mem = sys.argv[1], json.loads(sys.argv[2]), *map(int, sys.argv[3:6])
run = root + "/run"
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "labels": {"zone": "c"},
                                                        "object_store_memory": mem})
out = {}
try:
    nodes = [cluster.add_node(num_cpus=1, labels={"zone": "w"}, object_store_memory=mem) for _ in range(ranks + 1)]
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    cfg = load_config(None, [*settings, "ray.max_failures=1", 'ray.label_selector={zone = "w"}', "run.dir=" + run])

    def fit():
        try:
            out["summary"] = train(cfg, quiet=True)
        except BaseException as e:
            out["error"] = f"{type(e).__name__}: {e}"

    def trained(rows):
        return [r for r in rows if "loss" in r]

    thread = threading.Thread(target=fit)
    thread.start()
    reached = 0
    while thread.is_alive() and reached < kill_step:
        time.sleep(0.02)
        reached = max([r["step"] for r in trained(read_metrics(run, live=True))], default=0)
    assert reached >= kill_step, out.get("error") or "the run ended before the kill step"
    with open(run + "/attempts/1/health.json") as f:
        pid = next(w["pid"] for w in json.load(f)["workers"] if w["rank"] == 1)
    parents = {p.pid for p in psutil.Process(pid).parents()}
    victim = next(n for n in nodes if n.all_processes["raylet"][0].process.pid in parents)
    removed = time.time()
    cluster.remove_node(victim)
    try:  # a lost node's processes go with it (a worker outlives its raylet's graceful stop for a moment)
        psutil.Process(pid).kill()
    except psutil.NoSuchProcess:
        pass
    first = None
    while thread.is_alive() and first is None:
        time.sleep(0.02)
        rows = read_metrics(run, live=True)
        resumes = [r for r in rows if r.get("event") == "resume"]
        if resumes and any(r["step"] > resumes[-1]["step"] for r in trained(rows[rows.index(resumes[-1]):])):
            first = time.time()
    thread.join()
    out.update(killed_after_step=reached, removed=removed, first_step_after_s=(first or time.time()) - removed)
finally:
    ray.shutdown()
    cluster.shutdown()
print("RESULT " + json.dumps(out))
"""


def peer_settings(args, mode: str) -> list[str]:
    return ["data.source=synthetic", f"data.size={args.size}", f"data.global_batch_size={args.batch}",
            f"data.synthetic_samples={args.batch * (args.steps + 2)}", "model.name=vit", f"model.width={args.width}",
            f"model.depth={args.depth}", f"model.heads={args.heads}", "model.patch=4", "optim.warmup_steps=2",
            f"parallel.num_workers={args.ranks}", f"parallel.zero_stage={args.stage}", "parallel.threads_per_worker=1",
            f"run.max_steps={max(args.steps, args.peer_kill_step + 3 * args.every)}", "run.eval_every=0", "run.eval_max_batches=1", "run.log_every=1",
            "run.report=false", "run.save_model=false", f"checkpoint.every={args.every}", "checkpoint.shared_fs=true",
            f"data.slow_ms={args.peer_slow_ms}",
            f"checkpoint.memory_every={args.memory_every if mode == 'memory' else 0}"]


def peer_row(mode: str, args, workdir: Path) -> dict:
    """One run of ``PEER_SCRIPT``: a node lost after step ``--peer-kill-step``, restored from ``mode``."""
    root = workdir / f"peer-{mode}"
    root.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    mem = max(80 << 20, 8 * args.width * args.width * args.depth * 16)  # object store: a few copies of a shard
    proc = subprocess.run([sys.executable, "-c", PEER_SCRIPT, str(root), json.dumps(peer_settings(args, mode)),
                           str(args.ranks), str(args.peer_kill_step), str(mem)],
                          capture_output=True, text=True, env=env, timeout=args.timeout)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    out = json.loads(line[-1][len("RESULT "):]) if line else {}
    if proc.returncode != 0 or "error" in out or not line:
        return {"name": mode, "error": out.get("error") or (proc.stdout + proc.stderr)[-8000:]}
    s = out["summary"]
    ck, res = s["checkpoint"], s["checkpoint"]["resumed"] or {}
    mem_sum = ck.get("memory") or {}
    rows = [r for r in read_metrics(str(root / "run")) if "loss" in r]
    return {
        "name": mode, "num_params": s["num_params"], "steps": s["steps"], "every": args.every,
        "memory_every": args.memory_every if mode == "memory" else 0,
        "killed_after_step": out["killed_after_step"], "resumed_from": res.get("source"),
        "resumed_from_step": res.get("step"), "steps_redone": out["killed_after_step"] - (res.get("step") or 0),
        "steps_lost": res.get("steps_lost"), "restore_s": res.get("restore_s"),
        "first_step_after_loss_s": out["first_step_after_s"], "down_s": res.get("down_s"),
        "memory_copies": mem_sum.get("saves", 0), "memory_bytes_per_copy": mem_sum.get("bytes_per_save", 0),
        "memory_snapshot_s": mem_sum.get("snapshot_s_mean", 0.0),
        "memory_write_s": mem_sum.get("write_s_mean", 0.0), "memory_handover_s": mem_sum.get("handover_s_mean", 0.0),
        "storage_stall_s_per_save": ck["stall_s"]["mean"], "bytes_per_save": ck["bytes_per_save"],
        "step_s_median": statistics.median(r["step_s"] for r in rows[args.skip:]) if rows[args.skip:] else None,
    }


def peer_rows(args, workdir: Path) -> dict:
    rows = {}
    for mode in PEER_MODES:
        rows[mode] = peer_row(mode, args, workdir)
        r = rows[mode]
        print(f"peer {mode}: " + ("error\n" + r["error"] if "error" in r else
                                  f"not resumed: {r}" if r["restore_s"] is None else
                                  f"resumed from {r['resumed_from']} step {r['resumed_from_step']} after step "
                                  f"{r['killed_after_step']}: {r['steps_redone']} steps redone, restore "
                                  f"{r['restore_s']:.2f} s, {r['first_step_after_loss_s']:.1f} s from the loss to "
                                  "the next step"), flush=True)
    m, st = rows["memory"], rows["storage"]
    ok = "error" not in m and "error" not in st
    ratios = {"restore_memory_vs_storage": m["restore_s"] / st["restore_s"] if ok and st["restore_s"] else None,
              "redone_memory_vs_storage": m["steps_redone"] / st["steps_redone"]
              if ok and st["steps_redone"] else None}
    return {"settings": {"kill_step": args.peer_kill_step, "every": args.every, "memory_every": args.memory_every,
                         "ranks": args.ranks},
            "rows": list(rows.values()), "ratios": ratios}


def render_peer(p: dict) -> list[str]:
    """The peer rows: a lost node restored from storage against from peer memory."""
    rows = {r["name"]: r for r in p["rows"] if "error" not in r}
    if set(rows) != set(PEER_MODES):
        return []
    st, m = rows["storage"], rows["memory"]
    caption = (f"A lost node (`benchmarks/checkpoint.py --rows peer`): a ViT of {m['num_params'] / 1e6:.1f}M parameters "
               f"at {p['settings']['ranks']} ranks on a local Ray cluster (one 1-CPU node per rank and a spare), a "
               f"commit every {st['every']} steps; the node of rank 1 removed once step {p['settings']['kill_step']} "
               f"is trained; Ray Train restarts the group (`ray.max_failures = 1`). With "
               f"`checkpoint.memory_every = {m['memory_every']}` the restart resumes from peer memory.")
    body = [[f"{r['name']}", f"{r['resumed_from']} step {r['resumed_from_step']}", str(r["killed_after_step"]),
             str(r["steps_redone"]), fmt.secs(r["restore_s"]), fmt.secs(r["first_step_after_loss_s"])]
            for r in (st, m)]
    ratios = p["ratios"]
    facts = [
        ["restore from memory over restore from storage", fmt.times(ratios["restore_memory_vs_storage"])
         if ratios.get("restore_memory_vs_storage") else "-"],
        ["steps redone, memory over storage", fmt.times(ratios["redone_memory_vs_storage"])
         if ratios.get("redone_memory_vs_storage") is not None else "-"],
        ["a memory copy: the snapshot (the step waits)", fmt.secs(m["memory_snapshot_s"])],
        ["a memory copy: DCP's write into memory, then the hand-over to both stores (background)",
         f"{fmt.secs(m.get('memory_write_s', 0.0))}, then {fmt.secs(m['memory_handover_s'])}"],
        ["a memory copy: bytes (every rank together)", fmt.nbytes(m["memory_bytes_per_copy"] * p["settings"]["ranks"])],
        [f"median step: storage only, with a memory copy every {m['memory_every']}",
         f"{fmt.secs(st['step_s_median'])}, {fmt.secs(m['step_s_median'])}"],
    ]
    return [fmt.para(caption),
            fmt.table(["restore from", "resumed from", "node lost after step", "steps redone", "restore",
                       "node loss to the next step"], body),
            fmt.table(["measured", "value"], facts)]
