"""benchmarks/zero.py's activation-checkpointing rows: the memory forward leaves for backward, with
``parallel.activation_checkpointing`` off and on, per ZeRO stage (zero.py's docstring says what is measured)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dutycycle.trainer.cluster.local import free_port

WORKER = Path(__file__).with_name("zero_worker.py")  # the ranks start there, with --activation
ACTIVATION_ROWS = "activation-checkpointing"  # the --rows name of the activation-memory rows (stages 0-3, off/on)
ACTIVATION_REPEAT = 3  # measured forward+backward passes per configuration, after ACTIVATION_WARMUP
# unmeasured first passes: FSDP2's lazy init and first all-gather buffers, DDP's bucket rebuild (its 2nd forward)
ACTIVATION_WARMUP = 2


def live_bytes_mode():
    """A ``TorchDispatchMode`` (built on first use: torch is imported in the workers only) that counts the bytes
    of every storage an operator returns, once per storage, from allocation until the storage is freed (a
    finalizer on its Python object, which torch keeps alive as long as the storage is). Bare allocations
    (``torch.empty``) are not counted: activations come out of computing operators, while DDP's buckets and
    FSDP2's all-gather and reduce-scatter buffers are bare ``empty`` calls, the same with checkpointing on or off,
    whose lifetime depends on prefetching (counted, they moved the figures by one block's parameters between
    passes)."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    bare = {torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.new_empty,
            torch.ops.aten.new_empty_strided}

    def storages(tree):
        for t in tree_flatten(tree)[0]:
            if isinstance(t, torch.Tensor):
                s = getattr(t, "_local_tensor", t).untyped_storage()  # a DTensor's shard on this rank
                yield (s.data_ptr(), s.nbytes()), s

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live: dict = {}
            self.now = self.peak = 0

        def _freed(self, key):
            self.now -= self.live.pop(key, 0)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in bare:
                return out
            inputs = {key for key, _ in storages((args, kwargs))}  # a view or in-place result is not new memory
            for key, s in storages(out):
                if key[1] and key not in inputs and key not in self.live:
                    self.live[key] = key[1]
                    self.now += key[1]
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(s, self._freed, key)
            return out

    return LiveBytes()


def activation_worker(args) -> None:
    """One rank: per stage, the benchmark ViT with activation checkpointing off and on; (rank 0) prints the
    per-rank maxima as one JSON line."""
    import torch
    import torch.distributed as dist
    from dutycycle.trainer.cluster.world import World
    from dutycycle.trainer.config import ParallelSection
    from dutycycle.trainer.parallel.apply import parallelize
    from dutycycle.trainer.step.models import TinyViT

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    g = torch.Generator().manual_seed(rank)
    per = args.batch // world
    x = torch.randn(per, 3, args.size, args.size, generator=g)
    y = torch.randint(0, 10, (per,), generator=g)
    rows = []
    for stage in (0, 1, 2, 3):
        for ac in (False, True):
            torch.manual_seed(0)
            model = TinyViT(3, 10, args.size, dim=args.width, depth=args.depth, heads=args.heads, patch=4)
            strategy = parallelize(model, ParallelSection(num_workers=world, zero_stage=stage,
                                                          activation_checkpointing=ac),
                                   World(rank, world), device=torch.device("cpu"))
            act, peak, secs = [], [], []
            for i in range(ACTIVATION_WARMUP + ACTIVATION_REPEAT):
                model.zero_grad(set_to_none=True)
                mode = live_bytes_mode()
                t0 = time.perf_counter()
                with strategy.micro_step(0), mode:
                    loss = torch.nn.functional.cross_entropy(strategy.model(x), y)
                    after_forward = mode.now
                    loss.backward()
                    del loss
                if i >= ACTIVATION_WARMUP:
                    secs.append(time.perf_counter() - t0)
                    act.append(after_forward)
                    peak.append(mode.peak)
            local = torch.tensor([max(act), max(peak)], dtype=torch.float64)
            dist.all_reduce(local, op=dist.ReduceOp.MAX)  # the rank that holds the most
            rows.append({"name": f"stage{stage}-{'ac' if ac else 'no-ac'}", "world_size": world, "zero_stage": stage,
                         "activation_checkpointing": ac, "activation_bytes": int(local[0]),
                         "peak_bytes": int(local[1]), "forward_backward_s_median": statistics.median(secs)})
            del strategy, model
    if rank == 0:
        print("ACT_RESULT " + json.dumps(rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run_activation_rows(world, args, shared_args: list[str]) -> list[dict]:
    """The activation rows at ``world`` ranks: zero_worker.py with ``--activation`` under torchrun."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
           str(free_port()), str(WORKER), "--activation", *shared_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ACT_RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return [{"name": ACTIVATION_ROWS, "world_size": world, "returncode": proc.returncode,
                 "error": (proc.stdout + proc.stderr)[-12000:]}]
    return json.loads(line.removeprefix("ACT_RESULT "))


def activation_ratios(rows: list[dict]) -> dict:
    by = {(r["zero_stage"], r["world_size"], r["activation_checkpointing"]): r for r in rows if "error" not in r}
    out = {}
    for (stage, world, ac), on in sorted(by.items()):
        off = by.get((stage, world, False))
        if ac and off:
            for key in ("activation_bytes", "peak_bytes"):
                out[f"stage{stage}_{key}_checkpointed_vs_not_{world}ranks"] = on[key] / off[key]
            out[f"stage{stage}_forward_backward_s_checkpointed_vs_not_{world}ranks"] = (
                on["forward_backward_s_median"] / off["forward_backward_s_median"])
    return out
