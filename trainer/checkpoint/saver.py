"""Saving a checkpoint: snapshot, write, commit, retention; at most one save in flight.

    after optimizer step N (every rank)
      wait for the previous save, if still running      the policy: wait, and count the wait as stall
      snapshot: model + optimizer state -> host memory   DCP's DefaultStager (pinned and on a side stream on GPU);
                                                         asynchronous: a stager thread copies while the next
                                                         forward/backward runs, and the next optimizer step (and
                                                         the next forward, for models with buffers) waits for it;
                                                         state in offload files (offload = "nvme"): copies of
                                                         its files on disk instead, made by the kernel
      ── background thread, its own gloo group ─────────────────────────────────────────────────────────────
      write: dcp.save of the snapshot into step-N/       every rank its shard, hashed while written and fsynced;
                                                         rank 0 writes DCP's index once every rank has written
      commit: gather sizes + checksums (+ RNG) at 0;   rank 0 writes trainer_state.json (fsynced), fsyncs
                                                         step-N/, writes manifest.json (fsynced, renamed into
                                                         place), fsyncs step-N/ and the root: the checkpoint
                                                         exists from this moment, durably
      retention: rank 0 deletes commits beyond the newest K, and torn directories older than the commit

Synchronous saves (``checkpoint.async_save = false``) run the same steps on the caller's thread from the live
state (no snapshot copy), so the step blocks for all of it.

**What survives a power cut** (local disks; ``manifest.write_manifest`` does the syncing). Every file's bytes
are fsynced before the manifest is written (DCP's shards and ``.metadata``, ``metadata.json``,
``trainer_state.json``), the step directory is fsynced before the manifest too (the files' names), and the
manifest's bytes before its rename; after the rename the step directory, the root and the root's parent are
fsynced. So once a save's commit is reported (the Commit returned, the metrics row, Ray Train's report) it
survives a power cut with every file it names. A cut at any earlier moment leaves no ``step-N/``, or one without
a manifest: ignored (resume takes the previous commit) and deleted by the next retention. Only a disk that
acknowledges a flush it has not done (a volatile write cache without power-loss protection, which no fsync can
fix) could leave a manifest whose files are short or stale; resume verifies every checksum before loading and
falls back to the previous commit, loudly, so even then no wrong tensor is loaded. Removal is durable too: a
removed manifest is synced away before any of its files go. A cut loses the saves not yet committed: training
resumes from the last commit. Object stores (``s3://``) have no directories and no fsync: a PUT is durable and
visible when it returns, and the manifest is one PUT made after every other object's PUT has returned.

The snapshot's host buffers are reused from one save to the next (DCP's stager caches them), which is one reason
a save waits for the previous one to finish. With the optimizer state in offload files (``parallel.offload =
"nvme"``) nothing of that state is copied into memory: the snapshot copies its files on disk
(``nvme.FileSnapshot``), the write reads them through maps and drops each tensor's pages once written
(storage.py), and the rest of the state gets a stager of its own per save, freed when the save is written. Peak
host memory of an asynchronous save is then the rest of the state's copy plus one offloaded state tensor (this
rank's shard of one parameter's moment), and a synchronous save's one offloaded tensor; none of it stays
resident after the save. Background collectives go through a gloo group of their own, so they never interleave
with training's collectives. DCP's ``CheckpointException`` derives from ``BaseException``: the background
thread catches ``BaseException`` and the error is raised, as a ``DestinationError`` naming the checkpoint, on
the training thread at the next wait.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from dutycycle.engine import io
from dutycycle.engine.errors import DestinationError
from dutycycle.trainer.cluster.world import broadcast
from dutycycle.trainer.parallel import nvme

from . import manifest as mf
from .state import TrainerState
from .storage import drop_plan_cache, write_state


@dataclass
class Commit:
    """One committed checkpoint, as the saving side measured it."""

    step: int
    uri: str
    bytes: int  # all ranks' files
    snapshot_s: float  # copy into host memory (asynchronous saves: on the stager thread), and of offload files
    write_s: float  # dcp.save, from the first rank starting to every rank done
    commit_s: float  # checksums gathered, trainer state and manifest written
    retention_s: float = 0.0
    deleted: list[int] = field(default_factory=list)
    snapshot_file_bytes: int = 0  # offloaded state (parallel.offload = "nvme") snapshotted as file copies on disk


class Saver:
    """Owns the stager, the background thread and its process group. ``save`` returns the seconds the caller
    was blocked; ``wait`` finishes the save in flight and returns its ``Commit``."""

    _ids = itertools.count()

    def __init__(self, root: str, *, rank: int, world_size: int, keep: int, async_save: bool, device=None,
                 on_phase=None, keep_staging_buffers: bool = True, background_nice: int = 0):
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.root, self.rank, self.world, self.keep, self.async_save = root, rank, world_size, keep, async_save
        self.on_phase = on_phase or (lambda name: None)
        cuda = device is not None and getattr(device, "type", "cpu") == "cuda" and torch.cuda.is_available()
        # pinned memory and non-blocking copies need an accelerator (they raise on a CPU-only machine)
        options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=async_save,
                                 use_non_blocking_copy=cuda)
        self._new_stager = lambda: DefaultStager(options)
        # The stager keeps its host copy of every tensor it staged for as long as that tensor lives, to reuse it at
        # the next save (pinned on GPU). With the optimizer state in files (parallel.offload = "nvme") that copy
        # would put the whole state back in host memory between saves: such runs stage each save with a fresh
        # stager, closed (its copies freed) once the save is written.
        self.keep_staging_buffers = keep_staging_buffers
        self.stager = self._new_stager() if async_save and keep_staging_buffers else None
        # background saves talk over their own group: the training thread's collectives use the default one
        self.group = dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="dutycycle-checkpoint", initializer=_lower_priority,
                                       initargs=(background_nice,)) if async_save else None
        self.plan_cache = f"dutycycle.Saver.{next(self._ids)}"  # DCP's plans (per process), reused save to save
        self.staging: Future | None = None
        self.inflight: Future | None = None
        self.stalled_on_previous = 0  # saves that had to wait for the previous one

    # ----------------------------------------------------------------------------------------- the caller

    def save(self, step: int, state: dict, trainer_state: TrainerState, rng: dict) -> tuple[float, Commit | None]:
        """Start (asynchronous) or do (synchronous) the save of ``state`` (``{"model": ..., "optim": ...}`` from
        ``get_state_dict``) as step ``step``. Returns ``(seconds blocked, the previous save's Commit if this call
        waited for it)``."""
        t0 = time.perf_counter()
        previous = None
        if self.inflight is not None:
            self.stalled_on_previous += not self.inflight.done()
            previous = self.wait()
        self.on_phase("snapshot")
        if not self.async_save:
            commit = self._write_and_commit(step, state, trainer_state, rng, snapshot_s=0.0)
            return time.perf_counter() - t0, commit
        t_snap = time.perf_counter()
        stager = self.stager if self.stager is not None else self._new_stager()
        in_memory, in_files = split_file_backed(state) if nvme.any_mapped() else (state, [])
        staging = stager.stage(in_memory)
        # state in offload files is snapshotted as copies of its files (nvme.FileSnapshot), by the background
        # thread once the stager is done: "staged" then means both
        ready = Future() if in_files else None
        self.staging = ready or staging
        self.inflight = self.pool.submit(self._background, step, staging, ready, in_files, trainer_state, rng,
                                         t_snap, None if stager is self.stager else stager)
        return time.perf_counter() - t0, previous

    def wait_staged(self) -> float:
        """Block until the snapshot in flight is copied (the live state may change after that); returns the
        seconds blocked."""
        if self.staging is None:
            return 0.0
        t0 = time.perf_counter()
        try:
            self.staging.result()
        except BaseException:  # noqa: BLE001 - reported by wait(), where the save's error surfaces
            pass
        self.staging = None
        return time.perf_counter() - t0

    def wait(self) -> Commit | None:
        """Finish the save in flight; returns its Commit (None if none was in flight). A failed save raises."""
        if self.inflight is None:
            return None
        fut, self.inflight = self.inflight, None
        self.wait_staged()
        try:
            commit = fut.result()
        except BaseException as e:  # CheckpointException is a BaseException
            raise DestinationError(f"a checkpoint under {self.root} could not be saved ({type(e).__name__}: "
                                   f"{str(e)[:2000]}); earlier commits are intact") from e
        if self.async_save and not self.keep_staging_buffers:
            # the save's staged host copy sits in a reference cycle once its stager is closed: only the cyclic
            # collector frees it, whenever it next runs (measured: 64 MiB of a 64 MiB state still held after the
            # save, 3.7 MiB after a collection). With the state in files (offload = "nvme") that copy is the whole
            # state back in memory, so it is collected here, once per save
            import gc

            gc.collect()
        return commit

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        drop_plan_cache(self.plan_cache)
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    # ------------------------------------------------------------------------------------ background thread

    def _background(self, step, staging: Future, ready: Future | None, in_files, trainer_state, rng, t_snap,
                    own_stager=None) -> Commit:
        snapshot = None
        try:
            try:
                staged = staging.result()
                if in_files:
                    snapshot = nvme.FileSnapshot([t for _, t in in_files])
                    put_file_backed(staged, in_files, snapshot)
            except BaseException as e:  # noqa: BLE001 - the training thread waits on ready: it must complete
                if ready is not None:
                    ready.set_exception(e)
                raise
            if ready is not None:
                ready.set_result(None)
            snapshot_s = time.perf_counter() - t_snap
            return self._write_and_commit(step, staged, trainer_state, rng, snapshot_s,
                                          snapshot.bytes if snapshot is not None else 0)
        finally:
            if own_stager is not None:  # this save's stager: its host copies go with it
                own_stager.close()
            if snapshot is not None:  # the copies of the offload files
                snapshot.close()

    def _write_and_commit(self, step: int, state: dict, trainer_state: TrainerState, rng: dict,
                          snapshot_s: float, snapshot_file_bytes: int = 0) -> Commit:
        uri = io.join(self.root, mf.step_name(step))
        self.on_phase("write")
        t0 = time.perf_counter()
        # A directory already there (a torn save, or a commit being redone after a rollback) is removed first,
        # manifest first; every rank waits for that before writing into it.
        error = None
        if self.rank == 0:
            try:
                mf.remove(uri)
            except Exception as e:  # noqa: BLE001 - every rank must learn of it, so it goes through a broadcast
                error = f"{type(e).__name__}: {e}"
        error = self._broadcast(error)
        if error:
            raise DestinationError(f"could not clear {uri} before saving: {error}")
        files = write_state(state, uri, self.group, plan_cache=self.plan_cache)
        t1 = time.perf_counter()
        self.on_phase("commit")
        gathered = self._gather({"files": {k: [r.size, r.digest] for k, r in files.items()}, "rng": rng})
        error = None
        total = 0
        if self.rank == 0:
            try:
                records = {}
                for part in gathered:
                    for name, (size, digest) in part["files"].items():
                        records[mf.check_name(name, uri)] = mf.FileRecord(size, digest)
                trainer_state.rng = [part["rng"] for part in gathered]
                records[mf.TRAINER_STATE] = _write_json(io.join(uri, mf.TRAINER_STATE), trainer_state.to_json())
                total = sum(r.size for r in records.values())
                info = {"bytes": total, "strategy": trainer_state.strategy, "snapshot_s": snapshot_s,
                        "write_s": t1 - t0}
                mf.write_manifest(uri, mf.Manifest(step=step, world_size=self.world, files=records, info=info))
            except Exception as e:  # noqa: BLE001 - as above
                error = f"{type(e).__name__}: {e}"
        error, total = self._broadcast((error, total))
        if error:
            raise DestinationError(f"could not commit {uri}: {error}")
        t2 = time.perf_counter()
        self.on_phase("retention")
        deleted = mf.retention(self.root, self.keep, step) if self.rank == 0 else []
        self.on_phase("done")
        return Commit(step=step, uri=uri, bytes=total, snapshot_s=snapshot_s, write_s=t1 - t0, commit_s=t2 - t1,
                      retention_s=time.perf_counter() - t2, deleted=deleted, snapshot_file_bytes=snapshot_file_bytes)

    # ------------------------------------------------------------------------ collectives on the save group

    def _broadcast(self, obj):
        return broadcast(obj, self.world, self.group)

    def _gather(self, obj) -> list:
        if self.group is None or self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out or []


def split_file_backed(state: dict) -> tuple[dict, list[tuple[tuple, object]]]:
    """``state`` without the tensors that live in offload files (``nvme.mapped``), each replaced by None, and
    those tensors with their paths (keys and list indexes) in it."""
    found = []

    def walk(obj, path):
        if isinstance(obj, dict):
            return {k: walk(v, (*path, k)) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v, (*path, i)) for i, v in enumerate(obj)]
        if nvme.mapped(obj):
            found.append((path, obj))
            return None
        return obj

    return walk(state, ()), found


def put_file_backed(staged: dict, found: list, snapshot) -> None:
    """Put each tensor ``split_file_backed`` took out back into the staged copy, as its snapshot."""
    for path, tensor in found:
        parent = staged
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = snapshot.copy(tensor)


def _lower_priority(nice: int) -> None:
    """Run the background thread ``nice`` steps below the process (the pool's initializer, so on that thread).
    Its write, checksums and commit compete with training and with data loading for the cores; the scheduler
    should give them only what those leave. On Linux ``setpriority`` on a thread id changes that thread alone;
    raising a nice value needs no privilege (lowering it back would). Elsewhere (no setpriority) it stays as is.
    The snapshot copy is not lowered: DCP's stager has its own thread, and the next optimizer step waits for it."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


def _write_json(uri: str, obj) -> mf.FileRecord:
    import json

    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    io.write_bytes_atomic(uri, data)
    h = mf.hasher()
    h.update(data)
    return mf.FileRecord(len(data), h.hexdigest())
