"""Host memory of checkpoint saves while the optimizer state lives in offload files (``parallel.offload =
"nvme"``), measured in a fresh process so that nothing else has raised its peak: ``python -m
tests.support.nvme_save WORKDIR [MIB_PER_TENSOR TENSORS]`` prints one JSON object.

The state is built as the offload leaves it between steps: every tensor in its own file (``FileStore.back``),
written back and out of the process (``release``). An asynchronous save, then a synchronous one, each with the
kernel's high-water mark (VmHWM) reset first (``/proc/self/clear_refs``), so each peak is that save's own (the
synchronous one saves the first ``sync_count`` tensors: the same behaviour, less time). Between
the asynchronous save's snapshot and its commit the live state changes (as the next optimizer step would): the
checkpoint must hold the values of the save's step, and the next save those after the change.
"""

from __future__ import annotations

import json
import os
import sys


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def measure(workdir: str, mib: int = 32, count: int = 16, sync_count: int = 4) -> dict:
    import torch
    from dutycycle.trainer.checkpoint import manifest as mf
    from dutycycle.trainer.checkpoint.saver import Saver
    from dutycycle.trainer.checkpoint.state import TrainerState
    from dutycycle.trainer.checkpoint.storage import read_state
    from dutycycle.trainer.parallel import nvme

    numel = mib * 2**20 // 4
    store = nvme.FileStore(os.path.join(workdir, "offload"), "rss", 0)
    live = []
    for i in range(count):
        t = torch.full((numel,), float(i))
        store.back(t)
        store.release([t])
        live.append(t)

    def state(n: int) -> dict:
        return {"model": {"w": torch.arange(1000, dtype=torch.float32)},
                "optim": {"state": {f"p{i}": {"exp_avg": live[i], "step": torch.tensor(3.0)} for i in range(n)},
                          "param_groups": [{"lr": 0.1, "params": [f"p{i}" for i in range(n)]}]}}

    def trainer_state(step: int) -> TrainerState:
        return TrainerState(step=step, epoch=0, loader={}, rng=[], world_size=1)

    # a small save first: imports, DCP's first-use set-up and the thread pools are not what is measured
    warm = Saver(os.path.join(workdir, "warm"), rank=0, world_size=1, keep=2, async_save=True,
                 keep_staging_buffers=False)
    warm.save(1, {"model": {"w": torch.ones(8)}}, trainer_state(1), {})
    warm.wait()
    warm.close()
    nvme.return_freed_memory()

    out = {"state_bytes": count * numel * 4, "sync_state_bytes": sync_count * numel * 4,
           "largest_tensor_bytes": numel * 4}
    base = _status("VmRSS")
    _reset_peak()
    saver = Saver(os.path.join(workdir, "async"), rank=0, world_size=1, keep=2, async_save=True,
                  keep_staging_buffers=False)
    saver.save(1, state(count), trainer_state(1), {})
    saver.wait_staged()
    for t in live:  # the next optimizer step changes the state in its files (one element: one page each)
        t[0] += 100.0
        store.release([t])
    commit = saver.wait()
    saver.close()
    out["async"] = {"peak": _status("VmHWM") - base, "after": _status("VmRSS") - base,
                    "snapshot_s": commit.snapshot_s, "write_s": commit.write_s}
    nvme.return_freed_memory()

    base = _status("VmRSS")
    _reset_peak()
    saver = Saver(os.path.join(workdir, "sync"), rank=0, world_size=1, keep=2, async_save=False,
                  keep_staging_buffers=False)
    _, sync_commit = saver.save(2, state(sync_count), trainer_state(2), {})
    saver.close()
    out["sync"] = {"peak": _status("VmHWM") - base, "after": _status("VmRSS") - base}
    out["offload_files"] = sorted(os.listdir(store.dir))  # the save's copies are gone, the live files stay

    for name, uri, last in (("async", commit.uri, count - 1), ("sync", sync_commit.uri, sync_count - 1)):
        got = {"optim": {"state": {f"p{i}": {"exp_avg": torch.zeros(numel)} for i in (0, last)}}}
        read_state(got, uri, set(mf.read_manifest(uri).files))
        out[name]["values"] = {str(i): [got["optim"]["state"][f"p{i}"]["exp_avg"][j].item() for j in (0, 1, -1)]
                               for i in (0, last)}
    store.close()
    return out


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[2:]]
    print(json.dumps(measure(sys.argv[1], *args)))
