"""Test harness: multi-process torch.distributed runs on gloo (ranks forked from a server that imported torch once,
a free port each, a join timeout)."""

from __future__ import annotations

import os
import sys
import time
import traceback

from dutycycle.trainer.cluster.local import free_port

# ---------------------------------------------------------------------------------------------------------
# multi-process torch.distributed


def _dist_entry(rank, world_size, port, fn, args, result_dir):
    import json

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    path = os.path.join(result_dir, f"rank{rank}.json")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        with open(path, "w") as f:
            json.dump({"ok": True, "result": out}, f)
    except BaseException:
        with open(path, "w") as f:
            json.dump({"ok": False, "error": traceback.format_exc()}, f)
        raise


# Ranks start from multiprocessing's fork server, which imports these once per test session: a spawned rank
# imported them again every time, about 2.7 s of CPU per rank on this 2-core machine, and the suite starts some
# 35 sets of ranks. A rank is still a fresh process (forked from the server, never from pytest, which may hold
# Ray and threads), started with the caller's environment as it is at the call (``_entry``).
PRELOAD = ["torch", "torch.distributed", "dutycycle.trainer.step.trainer", "dutycycle.trainer.parallel.apply",
           "dutycycle.trainer.checkpoint.checkpointer",
           # FSDP2's first step imports these (0.6 s of CPU per rank); they start no thread
           "torch._dynamo", "torch._functorch.aot_autograd",
           # every Trainer reads its node's label through Ray (cluster/topology.py: node_label), which imports
           # it: 0.3 s of CPU per rank; the import starts no thread and connects nowhere
           "ray"]


def _context():
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call in a session)
    return ctx


def _entry(env, target, *args):
    """A rank in the caller's environment: the fork server's is the one it started with."""
    os.environ.clear()
    os.environ.update(env)
    if "ray" in sys.modules:
        # the server imported Ray (PRELOAD), which reads its config once, at import: RAY_AUTH_MODE among it. The
        # caller may have chosen token authentication since (the session's cluster started after the server:
        # trainer/cluster/local.py), and a rank that joins that cluster with the server's config is refused
        # (InvalidAuthToken); read it again from this environment, as local.py does in the caller
        from ray._raylet import Config

        Config.initialize("")
    target(*args)


def spawn_ranks(target, world_size: int, *args, timeout: float = 120.0):
    """Start ``target(rank, world_size, port, *args)`` in ``world_size`` new processes sharing a free port;
    join them within ``timeout`` and kill those still running. Returns ``(processes, ranks that hung)``."""
    port = free_port()
    ctx = _context()
    env = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(env, target, r, world_size, port, *args), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.time() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.time()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return procs, hung


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned gloo processes; return per-rank results.

    ``fn`` must be importable (module level) and return JSON-serializable data. A rank that raises or hangs
    fails the call with that rank's traceback.
    """
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as result_dir:
        procs, hung = spawn_ranks(_dist_entry, world_size, fn, args, result_dir, timeout=timeout)
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(result_dir, f"rank{r}.json")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode})")
                results.append(None)
                continue
            with open(path) as f:
                rec = json.load(f)
            if rec["ok"]:
                results.append(rec["result"])
            else:
                errors.append(f"rank {r} failed:\n{rec['error']}")
                results.append(None)
        if hung:
            errors.insert(0, f"ranks {hung} did not finish within {timeout}s")
        if errors:
            raise AssertionError("\n".join(errors))
        return results


# ---------------------------------------------------------------------------------------------------------
# several workloads on one set of ranks


def _calls(rank, world_size, calls):
    """Each ``(name, "module:function", args)`` in turn on these ranks, with the environment restored after each
    (a workload that names its node through DUTYCYCLE_NODE_ID must not place the next one)."""
    import importlib

    out = {}
    for name, ref, args in calls:
        module, fn = ref.split(":")
        saved = dict(os.environ)
        try:
            out[name] = getattr(importlib.import_module(module), fn)(rank, world_size, *args)
        except BaseException as e:
            raise RuntimeError(f"workload {name!r} ({ref}) failed on rank {rank}") from e
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return out


def run_calls(world_size: int, calls: list[tuple[str, str, tuple]], timeout: float = 120.0) -> dict[str, list]:
    """Several ``run_distributed`` workloads in one set of ``world_size`` spawned gloo ranks: starting the ranks
    (a Python with torch each, and the process group) costs more than many a workload on a 2-core machine.
    ``calls``: ``(name, "module:function", args)``, each called as ``function(rank, world_size, *args)`` in
    order; returns ``{name: per-rank results}``. A workload that fails fails them all, naming it."""
    per_rank = run_distributed(_calls, world_size, calls, timeout=timeout)
    return {name: [r[name] for r in per_rank] for name, _, _ in calls}
