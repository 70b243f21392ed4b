"""One rank of the ZeRO benchmarks (benchmarks/zero.py, benchmarks/zeropp.py, and zero.py's activation and offload
rows), started by torchrun or benchmarks/netns.py's launcher: it trains through the product's step loop
(``Trainer.train``) with the flags it is given and (rank 0) prints the row's figures as one JSON line (several
rows, ``--next-row`` between their flags: each in turn, one line each).

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/zero_worker.py --stage 3 --run-dir DIR ...

``--activation`` runs benchmarks/zero_activation.py's worker instead (forward and backward per stage, no steps).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as `python benchmarks/zero_worker.py`: the siblings import as `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.zero_activation import activation_worker  # noqa: E402

WORKER = Path(__file__).resolve()  # what the drivers start under torchrun
RESULT_PREFIX = "ZERO_RESULT "
ROW_SEPARATOR = "--next-row"  # between two rows' flags: one launch trains both in turn (the drivers' --quick)

# the ViT every row trains (~22M parameters) and the tiny one of --quick (with its steps); zero.py and zeropp.py
# use both
VIT_DEFAULTS = {"width": 512, "depth": 7, "heads": 8, "size": 16, "batch": 16, "skip": 2}
VIT_QUICK = {"width": 32, "depth": 2, "heads": 2, "size": 8, "batch": 8, "steps": 3, "skip": 1}
STEPS = 10  # optimizer steps per row unless a driver says otherwise


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


def worker(rows: list[argparse.Namespace]) -> None:
    """One rank, started by torchrun: train each row in turn and (rank 0) print each row's figures as one JSON
    line, in the rows' order. A driver's ``--quick`` passes several rows (``ROW_SEPARATOR`` between their flags):
    one launch and one process group for all of them instead of a launch each, as the loader benchmark's
    ``--quick`` shares its processes (only that the rows run, and their exact byte counts, matter there)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for args in rows:
        _row(args)
    dist.barrier()  # nobody tears down while a peer is still communicating
    dist.destroy_process_group()


def _row(args) -> None:
    """One row in this rank's process group: its Trainer built, trained and closed."""
    import torch.distributed as dist
    from dutycycle.trainer.config import load_config
    from dutycycle.trainer.step.loop import WorkerContext, set_threads
    from dutycycle.trainer.step.metrics import read_metrics
    from dutycycle.trainer.step.trainer import Trainer

    from benchmarks.zeropp_probe import CommProbe, secondary_copy_seconds  # torch (heavy): drivers import us

    rank, world = dist.get_rank(), dist.get_world_size()
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
    dist.barrier()
    t0 = time.perf_counter()
    with Trainer(cfg, WorkerContext(rank=rank, world_size=world, run_dir=args.run_dir), parallelize_fn=fn) as t:
        init_s = time.perf_counter() - t0  # the model built, sharded (hpZ: its node groups created), restored
        probe = CommProbe(t, args.hpz) if args.breakdown else None
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
            "init_s": init_s,
        }
        if probe is not None:  # where the step goes, per collective and phase (benchmarks/zeropp_probe.py)
            out["breakdown"] = {**probe.summary(args.skip), "step_s_mean": step_s / len(rows),
                                "optimizer_s_mean": sum(r["optimizer"] for r in rows) / len(rows)}
            if args.hpz:
                out["breakdown"]["secondary_copy_s"] = secondary_copy_seconds(t.strategy, args.node_size)
        print(RESULT_PREFIX + json.dumps(out), flush=True)
    dist.barrier()  # the next row (or the teardown) starts when every rank is done with this one


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--activation", action="store_true", help="run the activation-checkpointing worker")
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--offload", default="none")
    p.add_argument("--baseline", action="store_true", help="the hand-written all-reduce instead of DDP/FSDP2")
    p.add_argument("--micro", type=int, default=1, help="data.micro_batches")
    p.add_argument("--run-dir", default="")
    p.add_argument("--model", default="vit", choices=["vit", "cnn"])
    p.add_argument("--quant-weights", default="none")
    p.add_argument("--quant-grads", default="none")
    p.add_argument("--hpz", action="store_true")
    p.add_argument("--replicate", type=int, default=1, help="hybrid sharding's groups")
    p.add_argument("--tensor", type=int, default=1, help="tensor-parallel group size")
    p.add_argument("--offload-dir", default="", help='offload = "nvme": the state files')
    p.add_argument("--error-feedback", action="store_true")
    p.add_argument("--reduce-scatter", default="auto")
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument("--breakdown", action="store_true",
                   help="time each collective kind per phase (benchmarks/zeropp_probe.py)")
    p.add_argument("--node-size", type=int, default=0)
    p.add_argument("--samples", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.003)
    for name, default in VIT_DEFAULTS.items():
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--steps", type=int, default=STEPS)
    return p.parse_args(argv)


def split_rows(argv: list[str]) -> list[list[str]]:
    """The rows' flags, ``ROW_SEPARATOR`` between two rows."""
    rows: list[list[str]] = [[]]
    for a in argv:
        rows.append([]) if a == ROW_SEPARATOR else rows[-1].append(a)
    return rows


def main(argv: list[str] | None = None) -> int:
    rows = [parse_args(flags) for flags in split_rows(sys.argv[1:] if argv is None else argv)]
    if any(r.activation for r in rows):
        if len(rows) > 1:
            raise SystemExit("--activation runs one row per launch")
        activation_worker(rows[0])
    else:
        worker(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
