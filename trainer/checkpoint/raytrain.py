"""Ray Train glue: committed checkpoints reported to Ray Train as pointer checkpoints.

Ray Train V2 tracks checkpoints that live under its own run storage (``RunConfig.storage_path``); dutycycle's live
under ``checkpoint.dir`` and are committed by their own manifest. Copying every checkpoint into Ray's storage would
write it twice, so each commit is reported as a *pointer*: a directory holding ``dutycycle_checkpoint.json``
(``{"uri": ..., "step": ...}``), the pattern Ray Train documents for checkpoints stored elsewhere. A Ray user then
sees them where Ray puts checkpoints (``Result.checkpoint``, ``Result.best_checkpoints``,
``ray.train.get_checkpoint()`` in a restarted worker) and resolves one with ``checkpoint_uri``.

Reports are a barrier across workers in Ray Train V2 (every worker must call ``ray.train.report`` equally often):
a commit is reported at the next point where every rank waits for the save (the next save, a rollback, the end
of training), never from the background thread, so all ranks report in the same order. The pointer itself is
handed to Ray Train asynchronously (its upload thread keeps the reports in call order).

dutycycle's commits are the source of truth, Ray Train's records are pointers to them:

- A pointer whose commit is gone (a rollback uncommitted it, retention deleted it) resolves to None, with a warning
  naming it, never to a URI that no longer holds a checkpoint.
- Ray Train's record of its pointers (``STORAGE/NAME/checkpoint_manager_snapshot.json``) is read by its controller
  when a run starts again; a damaged one (torn, bytes flipped, written by another Ray version, naming a pointer
  folder that is gone) stops the start inside Ray with an error that says nothing of the checkpoints. The driver
  checks it first (``set_aside_damaged_run_state``) and moves a damaged one aside with a warning: Ray Train
  starts a fresh record and the workers resume from the newest verified commit as they always do.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import warnings

from dutycycle.engine import formats, io

from .manifest import MANIFEST

POINTER = "dutycycle_checkpoint.json"
RUN_STATE = "checkpoint_manager_snapshot.json"  # Ray Train V2's record of reported checkpoints
MAX_RUN_STATE_BYTES = 64 << 20


class RayRunStateWarning(UserWarning):
    """Ray Train's record of a run was damaged and is set aside."""


def report_commit(step: int, uri: str, metrics: dict | None = None) -> None:
    """Report a committed checkpoint to Ray Train (call on every worker). Returns once every worker has reached
    the report (Ray Train's barrier); the pointer's upload and the hand-over to the controller run on Ray Train's
    upload thread (``CheckpointUploadMode.ASYNC``). A synchronous report waits until the controller has taken the
    previous one, and the controller looks once per health check (2 s): each report stalled training by up to
    that much (0.8 s and 1.9 s at the --small demo's last two saves), for a pointer of a few bytes."""
    import ray.train
    from ray.train import CheckpointUploadMode

    metrics = {"checkpoint_step": step, **(metrics or {})}
    if ray.train.get_context().get_world_rank() != 0:
        ray.train.report(metrics, checkpoint=None, checkpoint_upload_mode=CheckpointUploadMode.ASYNC)
        return
    # the upload thread reads the folder later, and removes it once uploaded
    d = tempfile.mkdtemp(prefix="dutycycle-pointer-")
    write_pointer(d, uri, step)
    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d),
                     checkpoint_upload_mode=CheckpointUploadMode.ASYNC, delete_local_checkpoint_after_upload=True)


def write_pointer(folder: str, uri: str, step: int) -> None:
    """The pointer file in ``folder``: the commit at ``uri`` (step ``step``), of format 1."""
    with open(os.path.join(folder, POINTER), "w") as f:
        json.dump(formats.stamp({"uri": uri, "step": step}), f)


def checkpoint_uri(checkpoint) -> dict | None:
    """``{"uri", "step"}`` of the dutycycle checkpoint a Ray Train ``Checkpoint`` points to (None if it is not a
    dutycycle pointer, or, with a warning, if that commit is gone)."""
    data = _pointer(checkpoint)
    if data is None:
        return None
    if not data["committed"]:
        warnings.warn(f"Ray Train's checkpoint {checkpoint.path} points to {data['uri']}, which is no longer "
                      "committed (a rollback or retention removed it); use a newer one, or "
                      "dutycycle.trainer.checkpoint.find_latest(checkpoint.dir)", RayRunStateWarning, stacklevel=2)
        return None
    return {"uri": data["uri"], "step": data["step"]}


def _pointer(checkpoint) -> dict | None:
    """What a pointer checkpoint says (``uri``, ``step``) and whether that commit still exists (``committed``)."""
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as d:
        path = os.path.join(d, POINTER)
        if not os.path.exists(path) or os.path.getsize(path) > 1 << 16:
            return None
        with open(path) as f:
            data = json.load(f)
    formats.check(data, path)
    if not isinstance(data.get("uri"), str):
        return None
    return {"uri": data["uri"], "step": int(data["step"]),
            "committed": io.exists(io.join(data["uri"], MANIFEST))}


def latest_reported() -> dict | None:
    """In a (restarted) Ray Train worker: the last checkpoint this run reported to Ray Train, if any, as a record
    for the summary (``committed`` false: retention or a rollback has removed it since; Ray's pointer lags the
    newest commit by one save, so with ``checkpoint.keep = 2`` it can name one retention just deleted)."""
    import ray.train

    return _pointer(ray.train.get_checkpoint())


def run_state_problem(run_storage: str) -> str | None:
    """What is wrong with Ray Train's record in ``run_storage`` (``STORAGE/NAME``), or None (sound, or absent)."""

    uri = io.join(run_storage, RUN_STATE)
    if not io.exists(uri):
        return None
    try:
        state = json.loads(io.read_capped(uri, MAX_RUN_STATE_BYTES).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, OSError) as e:  # (a too-large file is a SourceError, a ValueError)
        return f"it cannot be read as JSON ({type(e).__name__}: {str(e)[:200]})"
    if not isinstance(state, dict):
        return f"it holds a JSON {type(state).__name__}, not an object"
    import ray

    if state.get("ray_version") != ray.__version__:
        return f"it was written by Ray {state.get('ray_version')!r} and this is Ray {ray.__version__}"
    try:  # Ray's own schema (a private class: if it moves, the checks below still run)
        from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import _CheckpointManagerState

        _CheckpointManagerState.parse_obj(state)
    except ImportError:
        pass
    except Exception as e:  # noqa: BLE001 - pydantic's ValidationError, whatever its version
        return f"it does not match Ray Train's schema ({type(e).__name__}: {str(e)[:200]})"
    results = state.get("checkpoint_results")
    if not isinstance(results, list):
        return "it has no list of checkpoint results"
    for result in results:
        name = result.get("checkpoint_dir_name") if isinstance(result, dict) else None
        if not isinstance(name, str) or not io.exists(io.join(run_storage, name)):
            return f"it names the checkpoint folder {name!r}, which is not in {run_storage}"
    return None


def set_aside_damaged_run_state(storage: str, name: str) -> str | None:
    """Before Ray Train starts run ``name`` under ``storage``: move a damaged record of its pointer checkpoints aside
    (renamed ``...json.damaged-<unix time>``), with a warning; returns where it went, or None when it was sound or
    absent."""

    run_storage = io.join(storage, name)
    problem = run_state_problem(run_storage)
    if problem is None:
        return None
    uri = io.join(run_storage, RUN_STATE)
    aside = f"{uri}.damaged-{int(time.time())}"
    fs, path = io.filesystem(uri)
    fs.mv(path, io.filesystem(aside)[1])
    msg = (f"Ray Train's record of run {name!r} ({uri}) is damaged: {problem}. It is set aside as {aside}; Ray Train "
           "starts a new record, and the run resumes from the newest verified dutycycle commit (checkpoint.resume)")
    warnings.warn(msg, RayRunStateWarning, stacklevel=2)
    print(f"[checkpoint] {msg}", file=sys.stderr, flush=True)
    return aside
