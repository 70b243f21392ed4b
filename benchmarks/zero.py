"""ZeRO stages side by side: bytes held per rank, logical bytes sent per step, samples/s and exposed communication.

    python benchmarks/zero.py                    # writes benchmarks/results/zero.json
    python benchmarks/zero.py --quick            # a tiny model, seconds (the smoke test)

Rows, at 2 and 4 ranks (torchrun, gloo, one process per rank on this machine): stages 0 (DDP), 1, 2, 3 (FSDP2)
and stage 3 with optimizer offload, all on the same ViT (default widened to ~22M parameters), the same synthetic
global batches, AdamW, fp32. At 2 ranks a baseline row runs the trainer's previous gradient sync: after the last
backward, gradients copied into flat 25 MB buckets, all-reduced (SUM) and divided by the world size, blocking.
Every row goes through the same step loop (``Trainer.train``); only the wrapping differs.

Micro-batches: the stage 1 and stage 2 rows accumulate over ``--micro-batches`` micro-batches per optimizer step
(default 4, ``--quick`` 2; the global batch must divide by ranks x micro-batches), the other rows take one. At one
micro-batch stages 1 and 2 produce the same torch settings (FSDP2 without reshard after forward), so a gap between
them there is noise. With accumulation they differ as trainer/parallel/plan.py maps them: stage 1 keeps parameters
(and the full gradients) unsharded across the whole accumulation window and gathers them once per step, stage 2
reshards after every micro-batch's backward and gathers again for the next forward (one gather per micro-batch);
both reduce-scatter once, at the window's end. Each row records its ``micro_batches``; the ratio
``stage1_bytes_sent_vs_stage2_{W}ranks`` is the traffic the window saves (2/(M+1) in fp32).

Offload (``stage3-offload``, ``parallel.offload = "optimizer"``: FSDP2's ``CPUOffloadPolicy``, sharded parameters,
gradients and optimizer state kept in host memory and the optimizer step run there): this benchmark runs on the
CPU, where host memory is the device's memory. The row exercises the code path and its accounting (held bytes,
traffic, convergence), and measures neither a host-device transfer nor device memory saved: its speed next to the
stage 3 row is noise plus what FSDP2's offload path costs on the CPU alone. The row says so in ``note``.

Figures per row: steady-state samples/s (the first ``--skip`` steps excluded: lazy init, the memory sampling
step), the exposed-communication share of the step (time the step waited on collectives that compute did not
hide; trainer/parallel/comm.py), logical bytes sent per step by collective kind, and model-state bytes held per
rank (parameters, gradients, optimizer state) beside the ZeRO paper's formula. Speed figures on a shared 2-core
machine are noisy and 4 ranks oversubscribe the cores; the byte figures are exact.

Activation checkpointing (``parallel.activation_checkpointing``), the ``activation-checkpointing`` row set: per
stage 0-3, the same ViT wrapped by ``parallelize`` with checkpointing off and on, one micro-batch of the global
batch per rank, forward and backward (no optimizer: activations do not depend on it). Measured per rank by
``live_bytes_mode``: every storage an operator allocates while forward and backward run, counted until freed
(views and in-place results not again; not counted: parameters, FSDP2's resized-in-place parameter storage and
bare ``torch.empty`` buffers, i.e. DDP's and FSDP2's communication buffers). Figures: ``activation_bytes`` (live
right after forward: what forward leaves for backward) and ``peak_bytes`` (the peak through backward:
activations, a block's recomputed activations, gradients that operators compute, such as FSDP2's unsharded block
gradients; not DDP's bucket-view gradients), each as the ratio checkpointed / not, and forward+backward seconds
(the recomputation's cost; noisy here). ``--merge`` keeps what ``--out`` already holds that this run did not
measure, so this part can be rerun alone::

    python benchmarks/zero.py --rows activation-checkpointing --worlds 2 --merge

Offload memory (``--rows offload-memory``, not run by default; benchmarks/zero_offload.py): stage 3 with no
offload, host offload and NVMe offload on a ViT with several GB of optimizer state, the host memory each rank
holds and the step time::

    python benchmarks/zero.py --rows offload-memory --worlds 2 --merge
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dutycycle.trainer.cluster.local import free_port

if __name__ == "__main__":  # run as `python benchmarks/zero.py`: the siblings import as `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.zero_activation import (  # noqa: E402
    ACTIVATION_ROWS,
    activation_ratios,
    activation_worker,
    run_activation_rows,
)
from benchmarks.zero_offload import OFFLOAD_ROWS, offload_ratios, run_offload_rows  # noqa: E402

# the ViT every row trains (~22M parameters) and the tiny one of --quick (with its steps); zeropp.py uses both
VIT_DEFAULTS = {"width": 512, "depth": 7, "heads": 8, "size": 16, "batch": 16, "skip": 2}
VIT_QUICK = {"width": 32, "depth": 2, "heads": 2, "size": 8, "batch": 8, "steps": 3, "skip": 1}

ROWS = [  # (name, zero_stage, offload, baseline)
    ("allreduce-manual", 0, "none", True),
    ("stage0-ddp", 0, "none", False),
    ("stage1", 1, "none", False),
    ("stage2", 2, "none", False),
    ("stage3", 3, "none", False),
    ("stage3-offload", 3, "optimizer", False),
]
ACCUMULATING = ("stage1", "stage2")  # rows run at --micro-batches: where stage 1 differs from stage 2
OFFLOAD_NOTE = ("CPU-only run: host memory is the device's memory, so offload here exercises the code path "
                "(state kept and stepped on the host) and measures no host-device transfer and no device memory "
                "saved")


# ------------------------------------------------------------------------------------------ the baseline


def manual_allreduce_parallelize(model, parallel, world, *, device, micro_batches=1, **_):
    """The trainer's gradient sync before DDP/FSDP2 (the old ``AllReduceSync``), as a Strategy: written as it
    was, bucketed (``parallel.bucket_mb``), one all-reduce per bucket after the last micro-batch's backward,
    nothing overlapped."""
    import torch
    import torch.distributed as dist
    from dutycycle.trainer.parallel.apply import Strategy
    from dutycycle.trainer.parallel.comm import CommMeter
    from dutycycle.trainer.parallel.plan import make_plan
    from dutycycle.trainer.parallel.traffic import Topology

    class ManualAllReduce(Strategy):
        @contextlib.contextmanager
        def micro_step(self, micro: int):
            yield
            if micro == self.plan.micro_batches - 1:
                with self.meter.blocking():
                    self._sync()

        def _sync(self):
            params = [p for p in self.module.parameters() if p.requires_grad]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            limit = max(1, int(parallel.bucket_mb * 1024 * 1024))
            bucket, size = [], 0
            for p in [*params, None]:
                nbytes = 0 if p is None else p.grad.numel() * p.grad.element_size()
                # a new bucket past ``bucket_mb`` or where the dtype changes (torch.cat needs one dtype)
                if bucket and (p is None or size + nbytes > limit or p.grad.dtype != bucket[0].grad.dtype):
                    flat = torch.cat([q.grad.reshape(-1) for q in bucket])
                    self.meter.count("all_reduce", flat.numel() * flat.element_size(), None, factor=2)
                    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                    flat.div_(world.size)
                    offset = 0
                    for q in bucket:
                        q.grad.copy_(flat[offset:offset + q.grad.numel()].view_as(q.grad))
                        offset += q.grad.numel()
                    bucket, size = [], 0
                if p is not None:
                    bucket.append(p)
                    size += nbytes

    meter = CommMeter(world.rank, Topology.uniform(world.size, world.size), host_timing=device.type == "cpu")
    return ManualAllReduce(model=model, module=model, plan=make_plan(0, world.size, micro_batches), meter=meter,
                           name="allreduce-manual")


# ------------------------------------------------------------------------------------------------ worker


def worker(args) -> None:
    """One rank, started by torchrun: train and (rank 0) print the row's figures as one JSON line."""
    import torch.distributed as dist
    from dutycycle.trainer.config import load_config
    from dutycycle.trainer.step.loop import WorkerContext, set_threads
    from dutycycle.trainer.step.metrics import read_metrics
    from dutycycle.trainer.step.trainer import Trainer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    model = [f"model.name={args.model}", f"model.width={args.width}", f"model.depth={args.depth}"]
    if args.model == "vit":
        model += [f"model.heads={args.heads}", "model.patch=4"]
    samples = args.samples or args.batch * (args.steps + 1)
    cfg = load_config(None, [
        "data.source=synthetic", f"data.size={args.size}", f"data.global_batch_size={args.batch}",
        f"data.synthetic_samples={samples}", *model, f"run.max_steps={args.steps}", "run.eval_every=0",
        f"run.eval_max_batches={args.eval_batches}", "run.log_every=0", "run.report=false",
        "run.save_model=false", f"run.dir={args.run_dir}", f"parallel.num_workers={world}",
        f"parallel.zero_stage={args.stage}", f"parallel.offload={args.offload}", f"optim.lr={args.lr}",
        f"optim.warmup_steps={max(2, args.steps // 20)}", f"data.augment.flip={str(args.model == 'cnn').lower()}",
        f"parallel.quant_weights={args.quant_weights}", f"parallel.quant_grads={args.quant_grads}",
        f"parallel.hpz={str(args.hpz).lower()}", f"parallel.node_size={args.node_size}",
        f"parallel.replicate={args.replicate}", f"parallel.tensor={args.tensor}",
        f"parallel.offload_dir={args.offload_dir}",
        f"parallel.error_feedback={str(args.error_feedback).lower()}", f"data.micro_batches={args.micro}",
        f"parallel.reduce_scatter={args.reduce_scatter}", f"parallel.overlap={str(not args.no_overlap).lower()}",
    ])
    set_threads(cfg, world)
    fn = manual_allreduce_parallelize if args.baseline else None
    with Trainer(cfg, WorkerContext(rank=rank, world_size=world, run_dir=args.run_dir), parallelize_fn=fn) as t:
        summary = t.train()
    if rank == 0:
        rows = [r for r in read_metrics(args.run_dir) if "loss" in r][args.skip:]
        step_s = sum(r["step_s"] for r in rows)
        out = {
            "samples_per_s": args.batch * len(rows) / step_s,
            "step_s_median": statistics.median(r["step_s"] for r in rows),
            "exposed_comm_share": sum(r["comm"] for r in rows) / step_s,
            "forward_backward_share": sum(r["forward_backward"] for r in rows) / step_s,
            "optimizer_share": sum(r["optimizer"] for r in rows) / step_s,
            "steps_measured": len(rows),
            "num_params": summary["num_params"],
            "final_loss": summary["final_loss"],
            "val_loss": summary["val_loss"],
            "val_accuracy": summary["val_accuracy"],
            "traffic": summary["parallel"]["traffic"],
            "bytes_sent_per_step": summary["parallel"]["traffic_per_step"],
            "expected_bytes_per_step": summary["parallel"]["expected_traffic_per_step"],
            # tensor parallelism's activation exchanges (inside the node), measured on the first step
            "tensor_bytes_per_step": summary["parallel"]["tensor_traffic_per_step"],
            "held_per_rank": summary["memory"]["held_per_rank"],
            "expected_held": summary["memory"]["expected"],
            "zero_formula": summary["memory"]["zero_formula"],
            "threads_per_worker": summary["threads_per_worker"],
            "host_after_steps": summary["memory"]["host_after_steps"],
            "offload_files": summary["parallel"].get("offload_files"),
        }
        print("ZERO_RESULT " + json.dumps(out), flush=True)
    dist.barrier()  # nobody tears down while a peer is still communicating
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------- driver


def run_row(name, stage, offload, baseline, world, args, workdir) -> dict:
    run_dir = os.path.join(workdir, f"{name}-{world}")
    micro = args.micro_batches if name in ACCUMULATING else 1
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
           "--master-port", str(free_port()), __file__, "--worker", "--stage", str(stage), "--offload", offload,
           "--run-dir", run_dir, "--micro", str(micro), *(["--baseline"] if baseline else []), *_shared_args(args)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ZERO_RESULT ")), None)
    if proc.returncode != 0 or line is None:
        # torchrun's own summary comes last; the ranks' tracebacks and C++ aborts come before it
        return {"name": name, "world_size": world, "micro_batches": micro, "returncode": proc.returncode,
                "error": (proc.stdout + proc.stderr)[-12000:]}
    return {"name": name, "world_size": world, "zero_stage": stage, "offload": offload, "micro_batches": micro,
            **({"note": OFFLOAD_NOTE} if offload != "none" else {}), "process_wall_s": wall,
            **json.loads(line.removeprefix("ZERO_RESULT "))}


def _shared_args(args) -> list[str]:
    return ["--width", str(args.width), "--depth", str(args.depth), "--heads", str(args.heads), "--size",
            str(args.size), "--batch", str(args.batch), "--steps", str(args.steps), "--skip", str(args.skip)]


def ratios(rows: list[dict]) -> dict:
    by = {(r["name"], r["world_size"]): r for r in rows if "error" not in r}
    out = {}
    for world in sorted({w for _, w in by}):
        s0 = by.get(("stage0-ddp", world))
        if s0 is None:
            continue
        o0 = s0["held_per_rank"][0]["optimizer"]
        for name in ("stage1", "stage2", "stage3", "stage3-offload"):
            r = by.get((name, world))
            if r:
                held = max(h["optimizer"] for h in r["held_per_rank"])
                out[f"{name}_optimizer_bytes_vs_stage0_over_N_{world}ranks"] = held / (o0 / world)
        r1, r2 = by.get(("stage1", world)), by.get(("stage2", world))
        if r1 and r2 and r1.get("micro_batches", 1) == r2.get("micro_batches", 1):
            out[f"stage1_bytes_sent_vs_stage2_{world}ranks"] = (
                sum(r1["bytes_sent_per_step"].values()) / sum(r2["bytes_sent_per_step"].values()))
        r3 = by.get(("stage3", world))
        if r3:
            out[f"stage3_bytes_sent_vs_stage0_{world}ranks"] = (
                sum(r3["bytes_sent_per_step"].values()) / sum(s0["bytes_sent_per_step"].values()))
        base = by.get(("allreduce-manual", world))
        if base:
            out[f"stage0_samples_per_s_vs_manual_allreduce_{world}ranks"] = s0["samples_per_s"] / base["samples_per_s"]
            out[f"manual_allreduce_exposed_comm_share_{world}ranks"] = base["exposed_comm_share"]
            out[f"stage0_exposed_comm_share_{world}ranks"] = s0["exposed_comm_share"]
    return out


def table(rows: list[dict]) -> str:
    lines = ["| ranks | row | micro-batches | samples/s | exposed comm | sent per step (MB) | params / grads / "
             "optimizer held per rank (MB) | ZeRO formula (MB) |", "|---|---|---|---|---|---|---|---|"]
    mb = 1024 * 1024
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['world_size']} | {r['name']} | {r.get('micro_batches', 1)} | error | | | | |")
            continue
        h = r["held_per_rank"][0]
        z = r["zero_formula"]
        lines.append(
            f"| {r['world_size']} | {r['name']} | {r.get('micro_batches', 1)} | {r['samples_per_s']:.1f} | "
            f"{r['exposed_comm_share']:.0%} | "
            f"{sum(r['bytes_sent_per_step'].values()) / mb:.0f} | {h['params'] / mb:.0f} / {h['grads'] / mb:.0f} / "
            f"{h['optimizer'] / mb:.0f} | {z['params'] / mb:.0f} / {z['grads'] / mb:.0f} / {z['optimizer'] / mb:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--offload", default="none", help=argparse.SUPPRESS)
    p.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--micro", type=int, default=1, help=argparse.SUPPRESS)  # the worker's data.micro_batches
    p.add_argument("--activation-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    # worker options shared with benchmarks/zeropp.py
    p.add_argument("--model", default="vit", choices=["vit", "cnn"], help=argparse.SUPPRESS)
    p.add_argument("--quant-weights", default="none", help=argparse.SUPPRESS)
    p.add_argument("--quant-grads", default="none", help=argparse.SUPPRESS)
    p.add_argument("--hpz", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--replicate", type=int, default=1, help=argparse.SUPPRESS)  # hybrid sharding's groups
    p.add_argument("--tensor", type=int, default=1, help=argparse.SUPPRESS)  # tensor-parallel group size
    p.add_argument("--offload-dir", default="", help=argparse.SUPPRESS)  # offload = "nvme": the state files
    p.add_argument("--error-feedback", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--reduce-scatter", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--no-overlap", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--node-size", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--samples", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--eval-batches", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--lr", type=float, default=0.003, help=argparse.SUPPRESS)
    v = VIT_DEFAULTS
    p.add_argument("--width", type=int, default=v["width"],
                   help="ViT width (default 512: ~22M parameters at depth 7)")
    p.add_argument("--depth", type=int, default=v["depth"])
    p.add_argument("--heads", type=int, default=v["heads"])
    p.add_argument("--size", type=int, default=v["size"],
                   help="image side (default 16: 17 tokens of 4x4 patches)")
    p.add_argument("--batch", type=int, default=v["batch"], help="global batch size (default 16)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per row (default 10)")
    p.add_argument("--skip", type=int, default=v["skip"],
                   help="first steps excluded from speed figures (default 2)")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches per optimizer step of the stage 1 and 2 rows (default 4, --quick 2; the "
                        "other rows take one): at one, stages 1 and 2 run the same torch settings")
    p.add_argument("--rows", nargs="+", default=[r[0] for r in ROWS] + [ACTIVATION_ROWS],
                   choices=[r[0] for r in ROWS] + [ACTIVATION_ROWS, OFFLOAD_ROWS],
                   help=f"rows to run (default: all but {OFFLOAD_ROWS!r}, which needs ~10 GB of RAM and "
                        "benchmarks/zero_offload.py's ViT of ~303M parameters)")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows (and the activation section) already in --out that this run does not measure")
    p.add_argument("--repeat", type=int, default=3,
                   help="run the baseline and stage 0 at 2 ranks this many times, alternating (default 3): the "
                        "speed ratio is the median of the pairs, which holds when the machine's speed drifts")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--quick", action="store_true", help="a tiny ViT and few steps: seconds, for the smoke test")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "zero.json"))
    args = p.parse_args(argv)
    if args.worker:
        activation_worker(args) if args.activation_worker else worker(args)
        return 0
    if args.quick:
        vars(args).update(VIT_QUICK, repeat=1)
    if args.micro_batches is None:
        args.micro_batches = 2 if args.quick else 4
    rows, pairs = [], []
    with tempfile.TemporaryDirectory() as workdir:
        if 2 in args.worlds and {"allreduce-manual", "stage0-ddp"} <= set(args.rows):
            for i in range(args.repeat - 1):  # the extra alternations; the last pair runs with the table below
                a = run_row(*ROWS[0], 2, args, os.path.join(workdir, f"pair{i}"))
                b = run_row(*ROWS[1], 2, args, os.path.join(workdir, f"pair{i}"))
                pairs.append((a, b))
        for world in args.worlds:
            for name, stage, offload, baseline in ROWS:
                if (baseline and world != 2) or name not in args.rows:
                    continue
                r = run_row(name, stage, offload, baseline, world, args, workdir)
                rows.append(r)
                if "error" in r:
                    print(f"{world} ranks {name}: error\n{r['error']}", flush=True)
                else:
                    print(f"{world} ranks {name:17s} {r['samples_per_s']:8.1f} samples/s at {r['micro_batches']} "
                          f"micro-batch(es), exposed comm {r['exposed_comm_share']:.0%}, sent/step "
                          f"{sum(r['bytes_sent_per_step'].values()) / 2**20:.0f} MB, "
                          f"optimizer held {r['held_per_rank'][0]['optimizer'] / 2**20:.0f} MB"
                          + (f"\n    ({r['note']})" if "note" in r else ""), flush=True)
        act_rows = []
        for world in args.worlds if ACTIVATION_ROWS in args.rows else ():
            new = run_activation_rows(world, args, _shared_args(args))
            act_rows += new
            for r in new:
                print(f"{world} ranks {r['name']:17s} " + (f"error\n{r['error']}" if "error" in r else (
                      f"activations {r['activation_bytes'] / 2**20:.2f} MB, peak {r['peak_bytes'] / 2**20:.2f} MB, "
                      f"forward+backward {r['forward_backward_s_median']:.3f} s")), flush=True)
        off_rows = []
        for world in args.worlds if OFFLOAD_ROWS in args.rows else ():
            new = run_offload_rows(world, args, workdir)
            off_rows += new
            for r in new:
                print(f"{world} ranks {r['name']:24s} " + (f"error\n{r['error']}" if "error" in r else (
                      f"step {r['step_s_median']:.2f} s, optimizer state {r['optimizer_state_bytes'] / 2**20:.0f} MB, "
                      f"resident {r['optimizer_state_resident_bytes'] / 2**20:.1f} MB, private "
                      f"{r['host_after_steps']['private'] / 2**20:.0f} MB")), flush=True)
    by = {(r["name"], r["world_size"]): r for r in rows}
    if ("allreduce-manual", 2) in by and ("stage0-ddp", 2) in by:
        pairs.append((by["allreduce-manual", 2], by["stage0-ddp", 2]))
    pairs = [(a, b) for a, b in pairs if "error" not in a and "error" not in b]
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}
    settings = {k: v for k, v in vars(args).items() if k in ("width", "depth", "heads", "size", "batch", "steps",
                                                             "skip", "worlds", "rows", "repeat", "quick",
                                                             "micro_batches")}
    old = json.loads(Path(args.out).read_text()) if args.merge and Path(args.out).exists() else {}
    if old and not rows:  # only the activation or offload rows ran: the other rows' settings stay theirs
        machine, settings = old.get("machine", machine), old.get("settings", settings)
    if old:
        measured = {(r["name"], r["world_size"]) for r in rows}
        rows = [r for r in old.get("rows", []) if (r["name"], r["world_size"]) not in measured] + rows
    result = {
        "benchmark": "zero",
        "machine": machine,
        "settings": settings,
        "rows": rows,
        "ratios": ratios(rows),
    }
    if act_rows:
        result["activation_checkpointing"] = {
            "settings": {k: v for k, v in vars(args).items() if k in ("width", "depth", "heads", "size", "batch",
                                                                       "worlds", "quick")},
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "rows": act_rows, "ratios": activation_ratios(act_rows)}
    elif "activation_checkpointing" in old:
        result["activation_checkpointing"] = old["activation_checkpointing"]
    if off_rows:
        result["offload_memory"] = {
            "settings": {k: v for k, v in vars(args).items() if k in ("size", "batch", "worlds", "quick")},
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "rows": off_rows, "ratios": offload_ratios(off_rows)}
    elif "offload_memory" in old:
        result["offload_memory"] = old["offload_memory"]
    if not pairs and "stage0_vs_manual_pairs" in old:
        result["stage0_vs_manual_pairs"] = old["stage0_vs_manual_pairs"]
        key = "stage0_samples_per_s_vs_manual_allreduce_2ranks_median_of_pairs"
        if key in old.get("ratios", {}):
            result["ratios"][key] = old["ratios"][key]
    if pairs:
        result["stage0_vs_manual_pairs"] = [
            {"manual_samples_per_s": a["samples_per_s"], "ddp_samples_per_s": b["samples_per_s"],
             "ratio": b["samples_per_s"] / a["samples_per_s"], "manual_exposed_comm_share": a["exposed_comm_share"],
             "ddp_exposed_comm_share": b["exposed_comm_share"]} for a, b in pairs]
        result["ratios"]["stage0_samples_per_s_vs_manual_allreduce_2ranks_median_of_pairs"] = statistics.median(
            p["ratio"] for p in result["stage0_vs_manual_pairs"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(table(rows))
    print(json.dumps(result["ratios"], indent=2))
    if act_rows:
        print(json.dumps(result["activation_checkpointing"]["ratios"], indent=2))
    if off_rows:
        print(json.dumps(result["offload_memory"]["ratios"], indent=2))
    print(f"wrote {args.out}")
    return 1 if any("error" in r for r in rows + act_rows + off_rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
