"""The planned loader: plan an epoch, read it through a source and an executor, hand out batches, remember the
position.

``Loader(config, source, executor)`` is composed of two parts. The source says what rows exist and how to read
them (``CacheSource``: a transformed-sample cache; ``RawSource``: a metadata table decoded per step;
``ArraySource``: arrays in memory). The executor says where reading runs (``executor.InProcess``: the caller's
thread or a prefetch thread; ``executor.RayTasks``: Ray tasks). Everything else lives here, once for every
source: the deterministic plan (``plan``), collation into torch, augmentation, device transfer, the resumable
state (``state``) and the consumer-wait statistics, so every path yields batches of the same format from the
same plan. ``CacheLoader``, ``RawLoader`` and ``ArrayLoader`` build a ``Loader`` over their source.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from dutycycle.engine.cache.shards import ReadStats
from dutycycle.engine.errors import ConfigError, CorruptArtifactError

from . import plan
from .augment import apply_augment, resolve_normalization
from .config import LoaderConfig
from .device import DeviceMover, Normalizer, batch_bytes
from .executor import executor_for, prefetched
from .parts import Executor, Source
from .source import RawBatch
from .state import make_state, plan_mismatch, position


@dataclass
class LoaderStats(ReadStats):
    """One loader's counters: what its cache reader fetched and hashed in this process (``ReadStats``: a
    ``CacheLoader`` and its ``reader`` share this object) and how long the consumer blocked in ``__next__``
    (the trainer's data wait). ``reset()`` zeroes them all."""

    total_wait_s: float = 0.0
    count: int = 0
    last_wait_s: float = 0.0
    max_wait_s: float = 0.0
    # what collated batches carry to the device (the tensors' bytes after collate, before any copy; counted on
    # a CPU too, as what a copy would send): uint8 images with normalize_on = "device", float32 ones otherwise
    sent_bytes: int = 0
    sent_batches: int = 0

    @property
    def bytes_per_batch(self) -> float:
        """Mean bytes a batch sends host -> device (0 before the first batch)."""
        return self.sent_bytes / self.sent_batches if self.sent_batches else 0.0

    def record(self, seconds: float) -> None:
        self.total_wait_s += seconds
        self.count += 1
        self.last_wait_s = seconds
        self.max_wait_s = max(self.max_wait_s, seconds)

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)


def normalize_where(config: LoaderConfig) -> str:
    """Where a loader with ``config`` normalizes: "host" or "device" (``LoaderConfig.normalize_on`` with "auto"
    resolved: the device when batches go to a CUDA device), or "off" when it does not normalize."""
    if not config.augment.normalize:
        return "off"
    if config.normalize_on == "auto":
        device = str(config.device) if config.device is not None else ""
        return "device" if device.startswith("cuda") else "host"
    return config.normalize_on


def source_channels(source: Source) -> int:
    """Channels of a source's samples: the last axis of an HWC shape, the first of a CHW one (3 RGB, 1 grey)."""
    shape = tuple(source.shape)
    if len(shape) != 3:
        return 1
    return int(shape[-1] if source.layout == "HWC" else shape[0])


class Loader:
    """This rank's batches of the deterministic plan over ``source``, read where ``executor`` says (by default
    the one ``config.mode`` names, ``executor.executor_for``).

    ``config.augment``'s ``mean`` and ``std`` are the values applied, one per channel: an empty mean/std (the
    default) is resolved here from the source's statistics (a cache's ``channel_stats``), or 0.5 when it has
    none; ``normalize_from`` says which.

    Torch's habits: each ``for batch in loader`` is one pass, an epoch from its start (or, once after
    ``load_state_dict``, from the restored position); a pass run to the end moves to the next epoch, so
    ``for e in range(E): for batch in loader`` trains E different epochs; ``set_epoch`` works as
    ``DistributedSampler``'s; ``len(loader)`` is the steps per epoch; ``peek()`` shows the next pass's first
    batch without consuming it. ``TorchDataset(loader)`` (``torch_data``) is the same batches as a torch
    ``IterableDataset``."""

    def __init__(self, config: LoaderConfig, source: Source, executor: Executor | None = None, rank: int = 0,
                 world_size: int = 1, stats: LoaderStats | None = None):
        if not isinstance(config, LoaderConfig):
            raise ConfigError(f"config={config!r} is invalid; pass a dutycycle.loader.LoaderConfig")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank={rank} with world_size={world_size} is invalid; use 0 <= rank < world_size")
        if config.global_batch_size % world_size:
            raise ConfigError(
                f"global_batch_size={config.global_batch_size} is not divisible by world_size={world_size}; "
                "choose a global batch size that is a multiple of the world size"
            )
        if config.drop_last and source.num_samples < config.global_batch_size:
            raise ConfigError(
                f"the split has {source.num_samples} samples, fewer than global_batch_size="
                f"{config.global_batch_size}, so drop_last leaves no batch; lower the batch size or set drop_last=False"
            )
        import torch  # noqa: F401  (loaded here so its import time never counts as the consumer's data wait)

        # The normalization applied, resolved once: the config's mean/std, else the source's statistics, else 0.5.
        # The effective values go into this loader's own config, so ``config.augment`` is what batches get.
        # (read with defaults: a source written before these attributes existed has no statistics)
        augment, self.normalize_from = resolve_normalization(
            config.augment, source_channels(source), getattr(source, "channel_stats", None),
            getattr(source, "no_stats", f"a {type(source).__name__} records none"))
        if augment != config.augment:
            config = dataclasses.replace(config, augment=augment)
        if config.partitions == 0:  # sized for this world (a trainer resolves it for every size a run may take)
            config = dataclasses.replace(config, partitions=plan.default_partitions([world_size],
                                                                                   config.global_batch_size))
        self.config, self.source = config, source
        self.executor = executor if executor is not None else executor_for(config, source)
        self.rank, self.world_size = rank, world_size
        self.batch_size = config.global_batch_size // world_size
        self.epoch, self.step = 0, 0  # the position: the next batch to hand out (``state_dict``)
        self._resume: int | None = None  # a restored step (``load_state_dict``): where the next pass starts, once
        self._pass = 0  # the latest pass's number: an older pass still yields, but no longer moves the position
        self.stats = stats if stats is not None else LoaderStats()
        self._plan_cache: tuple[int, plan.RankPlan] | None = None  # (epoch, this rank's plan for it)
        moves = config.pin_memory or config.device is not None
        self._mover = DeviceMover(config.pin_memory, config.device) if moves else None
        # normalization after the copy (normalize_on): batches are collated as uint8 and normalized on the
        # consumer's thread where the copy put them (``_deliver``)
        self.normalize_on = normalize_where(config)
        self._normalizer = None
        self._collate_augment = config.augment
        if self.normalize_on == "device":
            self._normalizer = Normalizer(augment.mean, augment.std, source_channels(source))
            self._collate_augment = dataclasses.replace(augment, normalize=False)
        self._block_starts()  # block_size = 0 without a cache's chunks is refused here, not at the first batch

    # ---------------------------------------------------------------- what the source holds

    @property
    def num_samples(self) -> int:
        return self.source.num_samples

    @property
    def fingerprint(self) -> str:
        return self.source.fingerprint

    @property
    def split(self) -> str | None:
        return self.source.split

    @property
    def layout(self) -> str:
        return self.source.layout

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def in_memory(self) -> bool:
        return self.source.in_memory

    @property
    def memory_refused(self) -> str | None:
        """Why an opted-in in-RAM split was not granted (``mode="memory"``), or None."""
        return self.source.memory_refused

    @property
    def background(self) -> bool:
        return self.executor.background

    @property
    def delivery(self) -> dict[str, Any]:
        """How batches reach the consumer, for a run's log: where they are normalized (``normalize_on``),
        whether they are pinned and copied to a device on a side stream (ahead of the consumer when a prefetch
        thread collates), and the mean bytes a batch sends host -> device (``LoaderStats.bytes_per_batch``:
        what a copy would send, on a CPU too)."""
        m = self._mover
        return {"normalize_on": self.normalize_on, "device": None if m is None or m.device is None else str(m.device),
                "pinned": bool(m is not None and m.pin), "side_stream": bool(m is not None and m.stream is not None),
                "copy_ahead": bool(m is not None and m.active and self.background),
                "bytes_per_batch": self.stats.bytes_per_batch}

    @property
    def execution(self) -> str:
        """What the mode chose: where rows come from and which thread collates them."""
        where = self.executor.description or self.source.description
        if self.memory_refused:
            where += " (memory refused)"
        return f"{self.config.mode}: {where}, {'prefetch thread' if self.background else 'caller thread'}"

    # ---------------------------------------------------------------- plan

    def __len__(self) -> int:
        """Steps (global batches) per epoch."""
        return plan.num_steps(self.num_samples, self.config.global_batch_size, self.config.drop_last)

    def global_batches(self, epoch: int | None = None) -> list[np.ndarray]:
        """The epoch's global batches (split indices), identical on every rank and at every world size. O(N): for
        tools and tests; reading uses this rank's own plan (``rank_plan``)."""
        c = self.config
        return plan.plan_epoch(self.num_samples, c.seed, self.epoch if epoch is None else epoch, self.fingerprint,
                               c.global_batch_size, c.drop_last, shuffle=c.shuffle, block_size=c.block_size,
                               window=c.window, partitions=c.partitions, block_starts=self._block_starts())

    def rank_plan(self, epoch: int | None = None) -> plan.RankPlan:
        """This rank's samples for every step of the epoch, computed from the partitions it reads (cached per
        epoch: O(N / world size) when there are at least as many partitions as ranks)."""
        epoch = self.epoch if epoch is None else epoch
        if self._plan_cache is None or self._plan_cache[0] != epoch:
            c = self.config
            got = plan.rank_plan(self.num_samples, c.seed, epoch, self.fingerprint, c.global_batch_size,
                                 c.drop_last, self.rank, self.world_size, shuffle=c.shuffle, block_size=c.block_size,
                                 window=c.window, partitions=c.partitions, block_starts=self._block_starts())
            self._plan_cache = (epoch, got)
        return self._plan_cache[1]

    def rank_indices(self, step: int, epoch: int | None = None) -> np.ndarray:
        """This rank's split indices at ``step`` of ``epoch``."""
        return self.rank_plan(epoch).indices(step)

    def _block_starts(self) -> np.ndarray | None:
        """Where the plan's shuffle blocks start when ``block_size = 0`` (the source's chunks); None otherwise."""
        return self.source.block_starts() if self.config.block_size == 0 else None

    # ---------------------------------------------------------------- position and state

    def set_epoch(self, epoch: int) -> None:
        """The next pass is ``epoch``, as ``DistributedSampler.set_epoch`` makes it: another epoch moves the
        position to its start (a pass already under way keeps yielding its own epoch, and no longer moves the
        position). The epoch the loader is in is a no-op: a restored position survives a training loop that calls
        ``set_epoch`` at the start of every epoch, and a pass already begun (Lightning begins one before its
        epoch-start hooks) keeps counting. Not needed between whole passes: each one that runs to the end moves to
        the next epoch by itself."""
        if isinstance(epoch, bool) or not isinstance(epoch, int | np.integer) or epoch < 0:
            raise ConfigError(f"set_epoch({epoch!r}) is invalid; pass an integer >= 0")
        if epoch != self.epoch:
            self._pass += 1
            self.epoch, self.step, self._resume = int(epoch), 0, None

    def _plan_inputs(self) -> dict[str, Any]:
        """Everything the sequence of global batches depends on (``plan.plan_epoch``'s arguments but the epoch,
        and the plan's own version), as plain JSON values."""
        c = self.config
        starts = self._block_starts()
        return {
            "plan_version": plan.PLAN_VERSION,
            "split": self.split,
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
        """The position after the batches already handed out (not those prefetched) and every input of the plan
        (``state.PLAN_FIELDS``), as plain JSON values (``state``)."""
        return make_state(self.epoch, self.step, self._plan_inputs(), self.world_size)

    def load_state_dict(self, state: dict[str, Any], force: bool = False) -> None:
        """Continue from ``state``'s position (epoch and next global batch), at any world size: the next pass
        (``for batch in loader``) starts there, once; the passes after it are whole epochs again.

        Every plan input saved in the state must equal this loader's (``state.PLAN_FIELDS``: split, cache
        fingerprint, sample count, seed, global batch size, drop_last, shuffle, block size, window, partitions,
        plan version); otherwise the saved position would index another sequence of batches, and the state is
        refused with a ``ConfigError`` naming each differing or missing field, its saved value and this loader's.
        ``force=True`` loads the position anyway, with a warning, and continues this loader's own plan (its
        config, seed included) from there; the step is clamped to this loader's epoch length.

        A malformed state (not a mapping, a missing or invalid epoch or step, a ``format`` other than
        ``state.STATE_FORMAT``, a step past this plan's epoch) raises ``CorruptArtifactError``, with or without
        ``force``.
        """
        epoch, step = position(state)
        msg = plan_mismatch(state, self._plan_inputs())
        if msg is not None and not force:
            raise ConfigError(msg)
        if msg is not None:
            warnings.warn(f"{msg}. force=True was passed: continuing this loader's plan at epoch {epoch}, step "
                          f"{min(step, len(self))}", UserWarning, stacklevel=2)
        elif step > len(self):
            raise CorruptArtifactError(f"loader state has step={step} but an epoch of this plan has {len(self)} "
                                       "steps; the state is refused")
        self._pass += 1  # a pass under way no longer moves the restored position
        step = min(step, len(self))
        # after an epoch's last batch is the next epoch's start (what ``state_dict`` itself records there)
        self.epoch, self.step = (epoch + 1, 0) if step >= len(self) > 0 else (epoch, step)
        self._resume = self.step

    # ---------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """One pass: this rank's batches of the current epoch from its start or, once after ``load_state_dict``,
        from the restored position, to the end of the epoch.

        The position (``epoch``, ``step``, ``state_dict()``) follows the batches handed out, never those
        prefetched: after a batch it is the next one, and after the epoch's last batch it is the next epoch's
        start, so a pass that runs to the end has moved to the next epoch. A pass left part-way (a ``break``)
        leaves the position after its last batch, for a checkpoint, but the next ``for`` starts the epoch over
        (torchdata's ``StatefulDataLoader`` does the same); load a state to continue from it instead.
        """
        return self._pass_batches(*self._begin_pass())

    def _next_pass(self) -> tuple[int, int]:
        """``(epoch, first step)`` of the pass the next ``for`` runs."""
        return self.epoch, self._resume if self._resume is not None else 0

    def _begin_pass(self) -> tuple[int, int, int]:
        """Begin the next pass (the restored position is used up): its ``(token, epoch, first step)``. Only the
        latest pass moves the position (``_handed_out``)."""
        epoch, start = self._next_pass()
        self._pass += 1
        self._resume, self.step = None, start
        return self._pass, epoch, start

    def _pass_batches(self, token: int, epoch: int, start: int) -> Iterator[dict[str, Any]]:
        produced = self._produce(epoch, range(start, len(self)))
        try:
            for step in range(start, len(self)):
                t0 = time.perf_counter()
                batch = self._deliver(next(produced))
                self.stats.record(time.perf_counter() - t0)
                self._handed_out(token, epoch, step)  # from here on a saved state resumes after this batch
                yield batch
        finally:
            produced.close()

    def _handed_out(self, token: int, epoch: int, step: int) -> None:
        """Move the position past ``step`` of ``epoch``, if pass ``token`` is still the latest one."""
        if token == self._pass:
            self.epoch, self.step = (epoch, step + 1) if step + 1 < len(self) else (epoch + 1, 0)

    def peek(self) -> dict[str, Any]:
        """The batch the next ``for`` yields first (the restored position's batch after ``load_state_dict``),
        read now and handed out by nothing: the position, ``state_dict()`` and the consumer-wait statistics stay
        as they were, and the next pass yields an identical batch (reading it again). For a model's input shape
        or a look at the data before training."""
        epoch, start = self._next_pass()
        if start >= len(self):
            raise ConfigError(f"peek() has no batch to show: the split has {self.num_samples} samples and an epoch "
                              "of this loader has no steps")
        batches = self.read_steps(epoch, range(start, start + 1))
        try:
            return next(batches)
        finally:
            batches.close()

    def read_steps(self, epoch: int, steps: range) -> Iterator[dict[str, Any]]:
        """This rank's batches at ``steps`` of ``epoch``, read now and outside the position (nothing counts as
        handed out): what ``peek`` and the workers of a ``TorchDataset`` read."""
        produced = self._produce(epoch, steps)
        try:
            for batch in produced:
                yield self._deliver(batch)
        finally:
            produced.close()

    def _produce(self, epoch: int, steps: range) -> Iterator[dict[str, Any]]:
        raws = self.executor.raws(self.source, lambda step: self.rank_plan(epoch).indices(step), steps)
        batches = self._finished(epoch, raws)
        return prefetched(batches, self.config.prefetch) if self.background else batches

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
        aug = self._collate_augment
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
        self.stats.sent_bytes += batch_bytes(batch)  # the producer thread's own counters (the consumer reads)
        self.stats.sent_batches += 1
        return self._mover.move(batch) if self._mover is not None else batch

    def _deliver(self, batch: dict[str, Any]) -> dict[str, Any]:
        """On the consumer's thread: wait for the batch's copy (its stream), then normalize it where it is when
        ``normalize_on`` is "device"."""
        if self._mover is not None:
            batch = self._mover.wait(batch)
        if self._normalizer is not None:
            batch["image"] = self._normalizer(batch["image"])
        return batch

    def close(self) -> None:
        """Release what the source holds between epochs (thread pools); iterating again reopens them."""
        self.source.close()
