"""Test harness: free ports, a local S3-compatible server, and a multi-process torch.distributed runner."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def moto_server():
    """Run a moto S3 server on 127.0.0.1 and yield its endpoint URL; stopped on exit."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint + "/", timeout=1).read()
                break
            except Exception:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


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


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned gloo processes; return per-rank results.

    ``fn`` must be importable (module level) and return JSON-serializable data. A rank that raises or hangs
    fails the call with that rank's traceback.
    """
    import json
    import tempfile

    import torch.multiprocessing as mp

    port = free_port()
    with tempfile.TemporaryDirectory() as result_dir:
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_dist_entry, args=(r, world_size, port, fn, args, result_dir), daemon=False)
            for r in range(world_size)
        ]
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
