"""The two parts a ``Loader`` is built from: a source (what rows exist and how to read them) and an executor
(where reading runs). Small protocols: ``cache_loader.CacheSource``, ``raw.RawSource`` and ``arrays.ArraySource``
are sources; ``executor.InProcess`` and ``executor.RayTasks`` are executors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np

from .inflight import RemoteBatch
from .source import RawBatch


class Source(Protocol):
    """What rows exist and how to read them: a cache, a metadata table decoded per step, arrays in memory.

    ``num_samples`` rows named by split index ``0..num_samples-1``; ``read`` returns the given split indices in
    the given order. ``submit`` starts a Ray task that reads them (sources that cannot run in Ray refuse
    ``mode="ray"`` when built). ``block_starts`` says where the plan's shuffle blocks start for ``block_size = 0``
    (a cache's chunks), or raises ``ConfigError`` when the source has no chunks. ``reopen`` gives the same rows
    for another process (a ``TorchDataset``'s DataLoader workers): its own handles and threads, none shared; a
    source without it serves a ``TorchDataset`` in the main process only (``num_workers=0``)."""

    num_samples: int
    fingerprint: str
    split: str | None  # recorded in the state; None when the fingerprint alone names the data
    layout: str
    shape: tuple[int, ...]
    reads_block: bool  # reading waits on I/O that a prefetch thread should overlap
    description: str  # how rows are read here, for ``Loader.execution``
    in_memory: bool  # the rows were copied into RAM (``mode="memory"``)
    memory_refused: str | None  # why an opted-in copy into RAM was not made
    # the dataset's per-channel statistics ({"mean", "std", "samples", "split"}, a cache manifest's
    # ``channel_stats``) that normalization defaults to, or None; ``no_stats`` says why there are none
    channel_stats: dict | None
    no_stats: str

    def read(self, indices: np.ndarray) -> RawBatch: ...

    def submit(self, indices: np.ndarray, max_retries: int) -> RemoteBatch: ...

    def block_starts(self) -> np.ndarray: ...

    def close(self) -> None: ...

    def reopen(self) -> Source: ...


class Executor(Protocol):
    """``raws`` reads ``source`` at each of ``steps`` (``indices(step)``: this rank's split indices there) and
    yields the ``RawBatch``es in plan order; closing it stops the reads still under way."""

    background: bool  # a prefetch thread collates ahead of the consumer
    description: str | None  # where reads run, when not the source's own description (for ``Loader.execution``)

    def raws(self, source: Source, indices: Callable[[int], np.ndarray], steps: range) -> Iterator[RawBatch]: ...
