"""The planned loader: plan an epoch, execute it in a ``LoaderConfig`` mode, hand out batches, remember the position.

Subclasses say where rows come from (``CacheLoader``: a transformed-sample cache; ``RawLoader``: a metadata
table decoded per step). Everything else, the plan, the execution modes, collation into torch, augmentation,
device transfer, the resumable state and the consumer-wait statistics, lives here so both paths yield batches
of the same format from the same plan.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from dutycycle.engine import sealed
from dutycycle.engine.cache.shards import ReadStats
from dutycycle.engine.errors import ConfigError, CorruptArtifactError

from .augment import apply_augment
from .config import LoaderConfig
from .inflight import RemoteBatch, in_order
from .plan import PLAN_VERSION, RankPlan, num_steps, plan_epoch, rank_plan
from .source import RawBatch

STATE_VERSION = 2  # 1: the plan inputs compared were the fingerprint and global batch size only
STATE_DIGEST = "sha256"  # the state's own checksum field
PLAN_FIELDS = ("plan_version", "split", "fingerprint", "num_samples", "seed", "global_batch_size", "drop_last",
               "shuffle", "block_size", "window", "partitions", "block_starts_sha256")  # to resume: load_state_dict
# Plan inputs added after states were first saved, with the value every earlier state had (its plan was that one)
PLAN_FIELD_DEFAULTS = {"partitions": 1, "block_starts_sha256": None}


@dataclass
class LoaderStats(ReadStats):
    """One loader's counters: what its cache reader fetched and hashed in this process (``ReadStats``: a
    ``CacheLoader`` and its ``reader`` share this object) and how long the consumer blocked in ``__next__``
    (the trainer's data wait). ``reset()`` zeroes them all."""

    total_wait_s: float = 0.0
    count: int = 0
    last_wait_s: float = 0.0
    max_wait_s: float = 0.0

    def record(self, seconds: float) -> None:
        self.total_wait_s += seconds
        self.count += 1
        self.last_wait_s = seconds
        self.max_wait_s = max(self.max_wait_s, seconds)

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)


class PlannedLoader:
    """Per-rank batches of a deterministic plan. Subclasses implement ``_read_local`` and, for ``mode="ray"``,
    ``_submit_remote``."""

    layout = "HWC"

    def __init__(self, num_samples: int, fingerprint: str, rank: int, world_size: int, config: LoaderConfig,
                 stats: LoaderStats | None = None):
        if not isinstance(config, LoaderConfig):
            raise ConfigError(f"config={config!r} is invalid; pass a dutycycle.loader.LoaderConfig")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank={rank} with world_size={world_size} is invalid; use 0 <= rank < world_size")
        if config.global_batch_size % world_size:
            raise ConfigError(
                f"global_batch_size={config.global_batch_size} is not divisible by world_size={world_size}; "
                "choose a global batch size that is a multiple of the world size"
            )
        if config.drop_last and num_samples < config.global_batch_size:
            raise ConfigError(
                f"the split has {num_samples} samples, fewer than global_batch_size={config.global_batch_size}, "
                "so drop_last leaves no batch; lower the batch size or set drop_last=False"
            )
        import torch  # noqa: F401  (loaded here so its import time never counts as the consumer's data wait)

        self.config = config
        self.rank, self.world_size = rank, world_size
        self.batch_size = config.global_batch_size // world_size
        self.num_samples, self.fingerprint = num_samples, fingerprint
        self.epoch, self.step = 0, 0
        self.stats = stats if stats is not None else LoaderStats()
        self._plan_cache: tuple[int, RankPlan] | None = None  # (epoch, this rank's plan for it)
        self._mover = None
        # Where rows come from and whether a prefetch thread collates them; "auto" decides here, once.
        mode = config.mode
        self.memory_refused: str | None = None  # why an opted-in in-RAM split was not granted
        self.in_memory = mode == "memory" and self._hold_in_memory()
        self.background = mode in ("thread", "ray", "memory") or (
            mode == "auto" and (self._needs_batch_work() or self._reads_block())
        )
        source = "ray tasks" if mode == "ray" else self._memory_source if self.in_memory else self._local_source
        if self.memory_refused:
            source += " (memory refused)"
        self.execution = f"{mode}: {source}, {'prefetch thread' if self.background else 'caller thread'}"
        self._block_starts()  # block_size = 0 without a cache's chunks is refused here, not at the first batch

    # ---------------------------------------------------------------- execution

    _local_source = "per-batch reads"  # what _read_local does when the split is not in memory (for `execution`)
    _memory_source = "memory"

    def _hold_in_memory(self) -> bool:
        """Whether ``mode="memory"`` may hold the split in RAM (subclasses that can, decide; the base cannot)."""
        return False

    def _reads_block(self) -> bool:
        """Whether reading a batch waits on I/O that a prefetch thread should overlap (e.g. a remote cache)."""
        return True

    def _needs_batch_work(self) -> bool:
        """Whether collating a batch costs CPU beyond gathering its rows (then a prefetch thread overlaps it)."""
        c = self.config
        return c.augment.random or c.augment.normalize or c.pin_memory or c.device is not None

    # ---------------------------------------------------------------- plan

    def __len__(self) -> int:
        """Steps (global batches) per epoch."""
        return num_steps(self.num_samples, self.config.global_batch_size, self.config.drop_last)

    def global_batches(self, epoch: int | None = None) -> list[np.ndarray]:
        """The epoch's global batches (split indices), identical on every rank and at every world size. O(N): for
        tools and tests; reading uses this rank's own plan (``rank_plan``)."""
        c = self.config
        return plan_epoch(self.num_samples, c.seed, self.epoch if epoch is None else epoch, self.fingerprint,
                          c.global_batch_size, c.drop_last, shuffle=c.shuffle, block_size=c.block_size,
                          window=c.window, partitions=c.partitions, block_starts=self._block_starts())

    def rank_plan(self, epoch: int | None = None) -> RankPlan:
        """This rank's samples for every step of the epoch, computed from the partitions it reads (cached per
        epoch: O(N / world size) when there are at least as many partitions as ranks)."""
        epoch = self.epoch if epoch is None else epoch
        if self._plan_cache is None or self._plan_cache[0] != epoch:
            c = self.config
            plan = rank_plan(self.num_samples, c.seed, epoch, self.fingerprint, c.global_batch_size, c.drop_last,
                             self.rank, self.world_size, shuffle=c.shuffle, block_size=c.block_size,
                             window=c.window, partitions=c.partitions, block_starts=self._block_starts())
            self._plan_cache = (epoch, plan)
        return self._plan_cache[1]

    def _block_starts(self) -> np.ndarray | None:
        """Where the plan's shuffle blocks start when ``block_size = 0`` (a cache's chunks: a cache loader knows
        them); None otherwise. A loader over no cache has no chunks to cut at."""
        if self.config.block_size == 0:
            raise ConfigError(f"block_size=0 cuts shuffle blocks at a cache's checksum chunks, and this "
                              f"{type(self).__name__} reads no cache; use a block_size >= 1")
        return None

    def rank_indices(self, step: int, epoch: int | None = None) -> np.ndarray:
        """This rank's split indices at ``step`` of ``epoch``."""
        return self.rank_plan(epoch).indices(step)

    # ---------------------------------------------------------------- position and state

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch``; a no-op when already in it (so a resumed position survives)."""
        if epoch != self.epoch:
            self.epoch, self.step = int(epoch), 0

    def _split_name(self) -> str | None:
        """The split this loader plans over, for the state (``CacheLoader`` and ``RawLoader`` set ``split``)."""
        split = getattr(self, "split", None)
        return split if isinstance(split, str) else None

    def _plan_inputs(self) -> dict[str, Any]:
        """Everything the sequence of global batches depends on (``plan.plan_epoch``'s arguments but the epoch,
        and the plan's own version), as plain JSON values."""
        c = self.config
        starts = self._block_starts()
        return {
            "plan_version": PLAN_VERSION,
            "split": self._split_name(),
            "fingerprint": str(self.fingerprint),
            "num_samples": int(self.num_samples),
            "seed": int(c.seed),
            "global_batch_size": int(c.global_batch_size),
            "drop_last": bool(c.drop_last),
            "shuffle": bool(c.shuffle),
            "block_size": int(c.block_size),
            "window": int(c.window),
            "partitions": int(c.partitions),
            # block_size = 0: where the cache's chunks cut the blocks (a layout the fingerprint does not name)
            "block_starts_sha256": None if starts is None else hashlib.sha256(starts.tobytes()).hexdigest(),
        }

    def state_dict(self) -> dict[str, Any]:
        """The position after the batches already handed out (not those prefetched), every input of the plan
        (``PLAN_FIELDS``), and a sha256 of the rest (``STATE_DIGEST``), so a state edited or damaged after it was
        made is refused rather than resumed somewhere else. Plain JSON values throughout."""
        state = {
            "version": STATE_VERSION,
            "epoch": int(self.epoch),
            "step": int(self.step),  # index of the next global batch to yield in `epoch`
            **self._plan_inputs(),
            "world_size": int(self.world_size),  # informational: a state loads at any world size
        }
        return sealed.seal(state, STATE_DIGEST)

    def load_state_dict(self, state: dict[str, Any], force: bool = False) -> None:
        """Continue from ``state``'s position (epoch and next global batch), at any world size.

        Every plan input saved in the state must equal this loader's (``PLAN_FIELDS``: split, cache fingerprint,
        sample count, seed, global batch size, drop_last, shuffle, block size, window, plan version); otherwise
        the saved position would index another sequence of batches, and the state is refused with a
        ``ConfigError`` naming each differing field, its saved value and this loader's. A state saved before
        these fields were recorded (state version 1) lacks some of them and is refused the same way, naming the
        missing fields: nothing shows that they match. ``force=True`` loads the position anyway, with a
        warning, and continues this loader's own plan (its config, seed included) from there; the step is
        clamped to this loader's epoch length.

        A malformed state (not a mapping, a missing or invalid epoch or step, a newer state version) or one
        whose ``sha256`` does not match its content (edited or damaged after ``state_dict()`` made it) raises
        ``CorruptArtifactError``, with or without ``force``. A state with no ``sha256`` (made by hand) is
        checked field by field only.
        """
        epoch, step = _position(state)
        mine = self._plan_inputs()
        problems, missing = [], False
        saved = {**PLAN_FIELD_DEFAULTS, **state}  # compared only: the digest below covers the state as saved
        for key in PLAN_FIELDS:
            if key not in saved:
                problems.append(f"{key} is missing (this loader has {key}={mine[key]!r})")
                missing = True
            elif not _same(saved[key], mine[key]):
                problems.append(f"{key}={saved[key]!r} but this loader has {key}={mine[key]!r}")
        if problems:
            older = ""
            if missing and state["version"] < STATE_VERSION:
                older = (f"; it was saved before the loader recorded every plan input (state version "
                         f"{state['version']}), so nothing shows that the missing ones match")
            elif missing:
                older = f"; a state of version {STATE_VERSION} records them all, so this one is damaged"
            msg = (f"loader state has {'; '.join(problems)}{older}. The saved position refers to another sequence "
                   "of batches: resume with the same cache, split and loader config (the saved values above), or "
                   "pass force=True to continue this loader's own plan from the saved position")
            if not force:
                raise ConfigError(msg)
        try:
            whole = sealed.intact(state, STATE_DIGEST)
        except (TypeError, ValueError) as e:
            raise CorruptArtifactError(f"loader state cannot be serialized to check its {STATE_DIGEST} "
                                       f"({type(e).__name__}: {e}); the state is refused") from None
        if not whole:
            raise CorruptArtifactError(
                f"loader state fails its {STATE_DIGEST} check (its content was changed after state_dict() made it: "
                "corrupted, or edited by hand); the state is refused. Use an intact state; a state edited on purpose "
                f"must drop its {STATE_DIGEST!r} field"
            )
        if problems:
            warnings.warn(f"{msg}. force=True was passed: continuing this loader's plan at epoch {epoch}, step "
                          f"{min(step, len(self))}", UserWarning, stacklevel=2)
        elif step > len(self):
            raise CorruptArtifactError(f"loader state has step={step} but an epoch of this plan has {len(self)} "
                                       "steps; the state is refused")
        self.epoch = epoch
        self.step = min(step, len(self))

    # ---------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Yield this rank's batches from the current position to the end of the epoch, then move to the next."""
        if self.step >= len(self):
            self.epoch, self.step = self.epoch + 1, 0
        epoch, start, stop = self.epoch, self.step, len(self)
        produced = self._produce(epoch, range(start, stop))
        mover = self._device_mover()
        try:
            for step in range(start, stop):
                t0 = time.perf_counter()
                batch = next(produced)
                if mover is not None:
                    batch = mover.wait(batch)
                self.stats.record(time.perf_counter() - t0)
                self.step = step + 1  # consumed from here on: a state saved now resumes after this batch
                yield batch
            self.epoch, self.step = epoch + 1, 0
        finally:
            produced.close()

    def _produce(self, epoch: int, steps: range) -> Iterator[dict[str, Any]]:
        if self.config.mode == "ray":  # Ray tasks, ``prefetch`` in flight, collected in plan order
            raws = in_order(lambda step: self._submit_remote(self.rank_indices(step, epoch), step), steps,
                            self.config.prefetch)
        else:  # sync, thread, memory, auto
            raws = self._read_all_local(epoch, steps)
        batches = self._finished(epoch, raws)
        return _background(batches, self.config.prefetch) if self.background else batches

    def _read_all_local(self, epoch: int, steps: range) -> Iterator[RawBatch]:
        plan = self.rank_plan(epoch)  # what rank_indices does per step, looked up once
        for step in steps:
            yield self._read_local(plan.indices(step))

    def _finished(self, epoch: int, raws: Iterator[RawBatch]) -> Iterator[dict[str, Any]]:
        try:
            for raw in raws:
                yield self.collate(raw, epoch)
        finally:
            raws.close()

    def collate(self, raw: RawBatch, epoch: int) -> dict[str, Any]:
        """numpy rows -> a batch dict of torch tensors (augmented, optionally pinned / on the device)."""
        import torch

        images = raw.images
        aug = self.config.augment
        if images.flags.writeable and images.ndim == 4 and not aug.random and not aug.normalize:
            # uint8 out, nothing to compute: the zero-copy view apply_augment would return, minus its overhead
            # (a warnings guard for read-only arrays, which a fresh batch array is not)
            x = torch.from_numpy(images)
            x = x.permute(0, 3, 1, 2) if self.layout == "HWC" else x
        else:
            if not images.flags.writeable and not aug.normalize and not aug.crop_padding:
                images = images.copy()  # the tensor would alias read-only (object store) memory
            x = apply_augment(images, aug, self.config.seed, epoch, raw.sample_ids, self.layout)
        batch = {
            "image": x,
            "label": torch.from_numpy(np.array(raw.labels, dtype=np.int64)),  # tiny; a writable copy
            "sample_id": raw.sample_ids,  # a list from every source (``RawBatch``)
        }
        mover = self._device_mover()
        return mover.move(batch) if mover is not None else batch

    def _device_mover(self):
        if self.config.pin_memory or self.config.device is not None:
            if self._mover is None:
                from .device import DeviceMover

                self._mover = DeviceMover(self.config.pin_memory, self.config.device)
            return self._mover
        return None

    def close(self) -> None:
        """Release resources held between epochs (thread pools); iterating again reopens them."""

    # ---------------------------------------------------------------- subclass hooks

    def _read_local(self, indices: np.ndarray) -> RawBatch:
        raise NotImplementedError

    def _submit_remote(self, indices: np.ndarray, step: int) -> RemoteBatch:
        """Start a Ray task reading these split indices (``ray_exec.submit_read`` / ``submit_decode``)."""
        raise NotImplementedError


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same JSON type (``True`` is not ``1``, ``1.0`` is not ``1``)."""
    return type(a) is type(b) and a == b


def _position(state: Any) -> tuple[int, int]:
    """``(epoch, step)`` of a loader state, or ``CorruptArtifactError`` naming what is wrong with it."""
    if not isinstance(state, Mapping):
        raise CorruptArtifactError(f"loader state is a {type(state).__name__}, not a mapping; pass what "
                                   "state_dict() returned")
    version = state.get("version")
    if type(version) is not int or version < 1:
        raise CorruptArtifactError(f"loader state has version={version!r}; expected an integer from 1 to "
                                   f"{STATE_VERSION} (the state is malformed)")
    if version > STATE_VERSION:
        raise CorruptArtifactError(f"loader state has version={version}, newer than this dutycycle's "
                                   f"{STATE_VERSION}; resume with the dutycycle that saved it")
    out = []
    for key in ("epoch", "step"):
        v = state.get(key)
        if type(v) is not int or v < 0:
            raise CorruptArtifactError(f"loader state has {key}={v!r}; expected an integer >= 0 (the state is "
                                       "malformed)")
        out.append(v)
    return out[0], out[1]


_END = object()


def _background(items: Iterator[Any], prefetch: int) -> Iterator[Any]:
    """Run ``items`` on a daemon thread, at most ``prefetch`` results ahead of the consumer.

    An exception in the producer is re-raised in the consumer as itself (e.g. ``CorruptArtifactError`` naming
    the shard). Closing this generator stops the producer and drops what it had queued.
    """
    q: queue.Queue = queue.Queue(maxsize=prefetch)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def run():
        try:
            for item in items:
                if not put((True, item)):
                    return
            put((True, _END))
        except BaseException as e:  # handed to the consumer, which raises it
            put((False, e))
        finally:
            items.close()

    thread = threading.Thread(target=run, name="dutycycle-loader", daemon=True)
    thread.start()
    try:
        while True:
            ok, item = q.get()
            if not ok:
                raise item
            if item is _END:
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():
            try:
                q.get(timeout=0.05)
            except queue.Empty:
                pass
        thread.join()
