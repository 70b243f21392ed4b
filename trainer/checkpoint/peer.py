"""Peer memory: every K steps each rank's newest state is kept in memory on its own node and on another node, so a
restarted or resized worker group resumes from there instead of from storage, and a lost node costs at most K
steps of redone work (``checkpoint.memory_every = K``; Gemini's peer memory, CheckFreq's snapshot without the
persist).

    every K steps (every rank, once the steps' losses are checked, as before a storage save)
      settle:    wait for this rank's previous copy (its parts are then whole in both stores, or failed)
      snapshot:  DCP's stager copies model, optimizer and residuals into host buffers: all the step waits for
      ── background thread, its own gloo group ──────────────────────────────────────────────────────────────
      write:     dcp.save of the snapshot into this process's memory (memory://), each file hashed (BLAKE3) as
                 it is written; DCP's collectives mean every rank has settled its previous copy
      retention: rank 0 drops every part older than the previous step from every store of the run (the previous
                 step is whole everywhere now; the new one is not yet)
      hand-over: this rank's part (its files, their sizes and checksums, its RNG state; rank 0's part also the
                 DCP index as JSON and the trainer state) put into two stores, its own node's and the next
                 node's (nodes of the group in a ring), and waited for; the process's copy is freed
    on every (re)start, before storage is looked at
      rank 0 asks every live store of the run what it holds and has each store check its copies' checksums; a
      step counts when every rank of the world that saved it has a verified part in some live store, as a
      manifest makes a commit; the newest such step is used when it is at least as new as the newest committed
      storage checkpoint. Each rank fetches the files its shards need (DCP's load plan), checks every blob's size
      and checksum again on arrival, and loads through DCP: resharded to this world size, no pickle (the JSON
      index, tensors and values with ``weights_only``).

**Where the memory lives.** One store per node and run: a detached Ray actor pinned to its node
(``NodeAffinitySchedulingStrategy``, not soft) that holds the bytes. It outlives the worker group Ray Train tears
down on a restart or a resize (the workers are other processes) and dies with its node, as the node's memory
would. A part is one actor call: a store holds it whole or not at all. Stores are named per run and launch
(``key``): a new ``dutycycle train`` of the same run does not see a previous launch's memory (it resumes from
storage), and the stores are killed when the run ends (rank 0 after the last step; the driver whatever happened,
``release``). Memory: each store holds, per rank of its node and of the node before it in the ring, at most two
steps (the newest, and the one before while the newest is handed over): four times a rank's shard of the state
per rank, at most.

**What a lost node costs.** Its ranks' parts survive in the next node's store; with every node's copy elsewhere,
any one node may go. Two nodes lost at once (or a one-node group: no peer, a warning) lose the parts they held
alone, and the restart falls back to storage. The memory never replaces storage: a storage commit is the only
state that survives the whole cluster (or a new launch).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

from dutycycle.engine import io
from dutycycle.engine.errors import ConfigError, CorruptArtifactError
from dutycycle.trainer.cluster.world import all_gather, broadcast

from . import manifest as mf
from .manifest import METADATA_JSON, FileRecord, Manifest
from .peerstore import (
    CALL_TIMEOUT_S,
    NAMESPACE,
    Candidate,
    check_blobs,
    choose,
    gather_calls,
    live_stores,
    open_store,
    release,
    run_key,
)
from .resume import Selected, load
from .state import TrainerState
from .storage import _Reader, drop_plan_cache, write_state

__all__ = ["DEFAULT_EVERY", "PeerMemory", "release", "resolve_every", "run_key"]

_MEM = "memory://dutycycle-peer"  # this process's memory file system: a copy is written and read through it


def resolve_every(cfg, under_ray: bool) -> int:
    """``checkpoint.memory_every`` as this run uses it: an explicit K, or (unset) ``DEFAULT_EVERY`` for an elastic
    Ray Train run (``parallel.num_workers = [min, max]``) and 0 otherwise. An elastic run expects to lose and gain
    nodes as a matter of course, so the copies' cost buys something at every resize; a fixed-size run restarts
    only after a failure (rare: the Llama 3 report's 419 in 54 days on 16,384 GPUs), and keeps storage alone
    unless it asks (``checkpoint.memory_every = K`` with ``ray.max_failures > 0``)."""
    k = cfg.checkpoint.memory_every
    if k is not None:
        if k > 0 and not under_ray:
            raise ConfigError(f"checkpoint.memory_every = {k} keeps the state in Ray actors on the run's nodes, and "
                              "this run is not under Ray (--local, torchrun): set checkpoint.memory_every = 0, or "
                              "train on Ray")
        return k
    return DEFAULT_EVERY if under_ray and bool(getattr(cfg.parallel, "elastic", False)) else 0


# The default K: a lost node redoes at most K steps (K/2 on average) instead of up to a storage interval, and a
# copy blocks its step only for the snapshot (as an asynchronous storage save's), but its background write and
# hand-over take CPU from training: on this project's 2-core test machine a copy of a 7M-parameter ViT's state
# (43 MB per rank) took ~0.1 s of snapshot and ~1.3 s of background work, and a copy every second step made the
# median step 2.7x longer (benchmarks/checkpoint.py --rows peer). Every 5 steps spreads that work over 5 steps
# while bounding the redone work at 5, well under the usual storage interval (50-500 steps); on a GPU node, whose
# CPU cores idle while the accelerator trains, K = 1 costs about the snapshot alone.
DEFAULT_EVERY = 5


# ---------------------------------------------------------------------------------------------- one rank


class PeerMemory:
    """One rank's side: ``save`` every K steps, ``candidate`` and ``load`` on a (re)start, ``drop`` on a
    rollback, ``finish`` at the end (``close`` on any other way out).

    A copy blocks the step only for the snapshot: DCP's stager copies the state into host buffers (reused from
    copy to copy, as the storage saver's), then a background thread writes it with DCP into this process's memory
    over a gloo group of its own (training's collectives use the default one), hands it to the two stores and
    waits until both hold it. The next copy first waits for that thread (one copy in flight, as one save in
    flight). Retention rides on the ordering: a copy's DCP write is a collective on every rank's background
    thread, which each rank starts only after its previous copy is held by its stores, so when rank 0 drops
    everything older than the previous step, right after that write, every part of the previous step is whole."""

    def __init__(self, key: str, *, rank: int, world: int, every: int, device=None):
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.key, self.rank, self.world, self.every = key, rank, world, every
        self.own = self.peer = None
        self.peer_node: str | None = None
        self.previous: int | None = None  # the step of the last copy started
        self.saves: list[dict] = []
        self.problems: list[str] = []  # copies a store did not take (it died meanwhile)
        self.warned = False
        self.plan_cache = f"dutycycle.PeerMemory.{key}"
        cuda = device is not None and getattr(device, "type", "cpu") == "cuda" and torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=cuda))
        self.group = dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="dutycycle-peer-memory")
        self.job: Future | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def _open(self) -> None:
        """This rank's two stores: its node's and the next node's in the ring of the group's nodes (a
        collective, at the first save)."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        nodes = sorted(set(all_gather(node, self.world)))
        self.own = open_store(self.key, node)
        if len(nodes) > 1:
            self.peer_node = nodes[(nodes.index(node) + 1) % len(nodes)]
            self.peer = open_store(self.key, self.peer_node)
        elif self.rank == 0 and not self.warned:
            self.warned = True
            print("[checkpoint] peer memory: every rank is on one node, so its memory is kept on that node only: "
                  "a restarted worker resumes from it, a lost node from storage", file=sys.stderr, flush=True)

    def settle(self) -> float:
        """Wait for the copy in flight (its stores hold it, or said why not); returns the seconds waited. A
        failed copy is reported, never raised: training goes on, and that step is not whole in memory."""
        if self.job is None:
            return 0.0
        t0 = time.perf_counter()
        job, self.job = self.job, None
        try:
            self.saves.append(job.result())
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            self.problems.append(f"step {self.previous}: {type(e).__name__}: {str(e)[:300]}")
            print(f"[checkpoint] rank {self.rank}: the peer-memory copy of step {self.previous} failed: "
                  f"{self.problems[-1]}", file=sys.stderr, flush=True)
        return time.perf_counter() - t0

    def save(self, step: int, tensors: dict, state: TrainerState, rng: dict) -> dict:
        """Start keeping step ``step`` in memory (every rank): the snapshot here, the rest in the background.
        Returns what the step waited for (seconds)."""
        t0 = time.perf_counter()
        if self.own is None:
            self._open()
        waited = self.settle()
        staged = self.stager.stage(tensors)
        if isinstance(staged, Future):
            staged = staged.result()
        previous, self.previous = self.previous, step
        self.job = self.pool.submit(self._background, step, staged, state.to_json() if self.rank == 0 else None,
                                    rng, previous, time.perf_counter() - t0 - waited)
        return {"step": step, "waited_s": waited, "snapshot_s": time.perf_counter() - t0 - waited}

    def _background(self, step: int, staged: dict, state: dict | None, rng: dict, previous: int | None,
                    snapshot_s: float) -> dict:
        import ray

        t0 = time.perf_counter()
        uri = f"{_MEM}/{self.key}/save/{self.rank}/{mf.step_name(step)}"
        fs, path = _memory_fs(uri)
        try:
            files = write_state(staged, uri, self.group, plan_cache=self.plan_cache)
            blobs = {name: fs.cat_file(f"{path}/{name}") for name in files if name != ".metadata"}
        finally:
            if fs.exists(path):
                fs.rm(path, recursive=True)
        # every rank's background thread is past the write's collectives, so past its previous copy: the
        # previous step is whole in the stores, and older ones can go
        if self.rank == 0 and previous is not None:
            for handle in live_stores(self.key).values():
                handle.drop.remote(below=previous)
        record = {"step": step, "world": self.world, "rank": self.rank, "rng": rng, "created": time.time(),
                  "files": {n: [files[n].size, files[n].digest] for n in blobs}}
        if state is not None:
            record["state"] = state
        t1 = time.perf_counter()
        ref = ray.put(blobs)  # one copy into the object store, for both stores
        puts = [("own node", self.own.put.remote(record, ref))]
        if self.peer is not None:
            puts.append((f"node {self.peer_node}", self.peer.put.remote(record, ref)))
        problems = []
        for where, put in puts:
            try:
                ray.get(put, timeout=CALL_TIMEOUT_S * 4)
            except Exception as e:  # noqa: BLE001 - that copy is lost; the other may hold
                problems.append(f"{where}: {type(e).__name__}: {str(e)[:200]}")
        if problems:
            raise RuntimeError(f"not stored on {'; '.join(problems)}")
        return {"step": step, "bytes": sum(len(b) for b in blobs.values()), "snapshot_s": snapshot_s,
                "write_s": t1 - t0, "handover_s": time.perf_counter() - t1, "copies": len(puts)}

    def candidate(self, at_least: int) -> Candidate | None:
        """(Every rank) the step to restore from memory, the same on every rank, or None."""
        found = choose(self.key, at_least) if self.rank == 0 else None
        return broadcast(found, self.world)

    def load(self, cand: Candidate, strategy, optimizer, source, *, device, force_loader_state: bool,
             check=None) -> TrainerState:
        """Load ``cand`` into this rank's model, optimizer, residuals, loader and RNG (every rank), resharded to
        this world size. ``check(state, where)``: refuse an incompatible state before any tensor is touched."""
        where = f"peer memory of step {cand.step} (saved at {cand.world} ranks)"
        state = TrainerState.from_json({**cand.records[0]["state"], "rng": [r["rng"] for r in cand.records]}, where)
        if check is not None:
            check(state, where)
        uri = f"{_MEM}/{self.key}/load/{self.rank}/{mf.step_name(cand.step)}"
        fs, path = _memory_fs(uri)
        files = cand.files
        manifest = Manifest(step=cand.step, world_size=cand.world,
                            files={n: FileRecord(size, digest) for n, (_, size, digest) in files.items()})
        fetcher = _Fetcher(self.key, cand, fs, path)
        try:
            fetcher([METADATA_JSON])
            load(Selected(cand.step, uri, manifest, []), strategy, optimizer, source, rank=self.rank,
                 world=self.world, device=device, state=state, force_loader_state=force_loader_state,
                 reader=lambda u, allowed: _PeerReader(u, allowed, fetcher))
        finally:
            if fs.exists(path):
                fs.rm(path, recursive=True)
        self.fetched_bytes = fetcher.bytes
        return state

    def drop(self, below: int | None = None, above: int | None = None) -> None:
        """(Rank 0) forget steps in every store of the run: a rollback's distrusted steps (``above``), the steps a
        restart will never use again."""
        calls = {n: h.drop.remote(below=below, above=above) for n, h in live_stores(self.key).items()}
        gather_calls(calls)

    def finish(self) -> None:
        """At the end of the run (every rank): the last copy settled, then rank 0 frees every store."""
        self.close()
        if self.rank == 0:
            release(self.key)

    def close(self) -> None:
        """The copy in flight finished, the thread and the staging buffers released (the stores are left: a
        restarted group may resume from them). Safe to repeat."""
        self.settle()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
            self.stager.close()
            drop_plan_cache(self.plan_cache)

    def summary(self) -> dict:
        saves = self.saves

        def mean(key: str) -> float:
            return sum(s[key] for s in saves) / len(saves) if saves else 0.0

        return {"every": self.every, "saves": len(saves), "peer_node": self.peer_node,
                "bytes_per_save": saves[-1]["bytes"] if saves else 0,
                # what the step waited for (the snapshot), and what ran in the background (DCP's write into
                # memory, the hand-over to both stores)
                "snapshot_s_mean": mean("snapshot_s"), "write_s_mean": mean("write_s"),
                "handover_s_mean": mean("handover_s"), "failed": self.problems, "last_step": self.previous}


def _memory_fs(uri: str):
    return io.filesystem(uri)


class _Fetcher:
    """Fetches files of a candidate step into this process's memory file system, each blob checked against its
    record (size and checksum) on arrival; a copy that fails is passed over for the next store's."""

    def __init__(self, key: str, cand: Candidate, fs, path: str):
        self.key, self.cand, self.fs, self.path = key, cand, fs, path
        self.have: set[str] = set()
        self.bytes = 0

    def __call__(self, names) -> None:
        import ray

        wanted: dict[int, list[str]] = {}
        for name in names:
            if name in self.have:
                continue
            if name not in self.cand.files:
                raise CorruptArtifactError(f"peer memory of step {self.cand.step} has no file {name!r}")
            wanted.setdefault(self.cand.files[name][0], []).append(name)
        for rank, part in wanted.items():
            record = self.cand.records[rank]
            tried = []
            for store in self.cand.sources[rank]:
                try:
                    handle = ray.get_actor(store, namespace=NAMESPACE)
                    blobs = ray.get(handle.fetch.remote(self.cand.step, rank, part), timeout=CALL_TIMEOUT_S * 4)
                except Exception as e:  # noqa: BLE001 - the store went away: try the other copy
                    tried.append(f"{store}: {type(e).__name__}")
                    continue
                problems = check_blobs(record, blobs) + [f"{n} missing" for n in part if n not in blobs]
                if problems:
                    tried.append(f"{store}: {'; '.join(problems)}")
                    continue
                for name in part:
                    self.fs.pipe_file(f"{self.path}/{name}", blobs[name])
                    self.bytes += len(blobs[name])
                self.have.update(part)
                break
            else:
                raise CorruptArtifactError(f"peer memory of step {self.cand.step}: no store holds a sound copy of "
                                           f"{', '.join(part)} (rank {rank}): {'; '.join(tried)}")


def _PeerReader(uri: str, allowed: set[str], fetch):  # noqa: N802 - makes the class below
    """The storage reader over this process's memory, fetching the files the load plan reads first."""

    class PeerReader(_Reader):
        def __init__(self):
            super().__init__(uri, allowed)

        def read_data(self, plan, planner):
            fetch(sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}))
            return super().read_data(plan, planner)

    return PeerReader()
