"""Ray Train glue: committed checkpoints reported to Ray Train as pointer checkpoints.

Ray Train V2 tracks checkpoints that live under its own run storage (``RunConfig.storage_path``); dutycycle's live
under ``checkpoint.dir`` and are committed by their own manifest. Copying every checkpoint into Ray's storage would
write it twice, so each commit is reported as a *pointer*: a directory holding ``dutycycle_checkpoint.json``
(``{"uri": ..., "step": ...}``), the pattern Ray Train documents for checkpoints stored elsewhere. A Ray user then
sees them where Ray puts checkpoints (``Result.checkpoint``, ``Result.best_checkpoints``,
``ray.train.get_checkpoint()`` in a restarted worker) and resolves one with ``checkpoint_uri``.

Reports are a barrier across workers in Ray Train V2 (every worker must call ``ray.train.report`` equally often):
a commit is reported at the next point where every rank waits for the save (the next save, a rollback, the end
of training), never from the background thread, so all ranks report in the same order.
"""

from __future__ import annotations

import json
import os
import tempfile

POINTER = "dutycycle_checkpoint.json"


def report_commit(step: int, uri: str, metrics: dict | None = None) -> None:
    """Report a committed checkpoint to Ray Train (call on every worker)."""
    import ray.train

    metrics = {"checkpoint_step": step, **(metrics or {})}
    if ray.train.get_context().get_world_rank() != 0:
        ray.train.report(metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory(prefix="dutycycle-pointer-") as d:
        with open(os.path.join(d, POINTER), "w") as f:
            json.dump({"uri": uri, "step": step}, f)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))


def checkpoint_uri(checkpoint) -> dict | None:
    """``{"uri", "step"}`` of the dutycycle checkpoint a Ray Train ``Checkpoint`` points to (None if it is not a
    dutycycle pointer)."""
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as d:
        path = os.path.join(d, POINTER)
        if not os.path.exists(path) or os.path.getsize(path) > 1 << 16:
            return None
        with open(path) as f:
            data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("uri"), str):
        return None
    return {"uri": data["uri"], "step": int(data.get("step", -1))}


def latest_reported() -> dict | None:
    """In a (restarted) Ray Train worker: the last checkpoint this run reported to Ray Train, if any."""
    import ray.train

    return checkpoint_uri(ray.train.get_checkpoint())
