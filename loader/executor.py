"""Where a loader's reads run: in the consumer's process (the caller's thread, or a prefetch thread) or in Ray
tasks. An executor turns the plan's steps into ``RawBatch``es in plan order; the loader collates them.

``executor_for`` picks one from ``LoaderConfig.mode`` once, when the loader is built: ``"ray"`` gets Ray tasks,
every other mode reads in this process, and ``"auto"`` adds a prefetch thread only when it overlaps work
(collation beyond a gather, or reads that wait on a remote cache).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .config import LoaderConfig
from .inflight import in_order
from .parts import Source
from .source import RawBatch


class InProcess:
    """Reads in this process: in the caller's thread, or (``background``) in a prefetch thread."""

    description = None

    def __init__(self, background: bool):
        self.background = background

    def raws(self, source: Source, indices: Callable[[int], np.ndarray], steps: range) -> Iterator[RawBatch]:
        for step in steps:
            yield source.read(indices(step))


class RayTasks:
    """One Ray task per rank batch, ``prefetch`` in flight, collected in plan order; each retried up to
    ``max_retries`` times if its worker dies. A prefetch thread augments what they return."""

    background = True
    description = "ray tasks"

    def __init__(self, prefetch: int, max_retries: int):
        self.prefetch, self.max_retries = prefetch, max_retries

    def raws(self, source: Source, indices: Callable[[int], np.ndarray], steps: range) -> Iterator[RawBatch]:
        return in_order(lambda step: source.submit(indices(step), self.max_retries), steps, self.prefetch)


def executor_for(config: LoaderConfig, source: Source) -> InProcess | RayTasks:
    mode = config.mode
    if mode == "ray":
        return RayTasks(config.prefetch, config.ray_max_retries)
    overlaps = needs_batch_work(config) or source.reads_block  # what "auto" runs a prefetch thread for
    return InProcess(mode in ("thread", "memory") or (mode == "auto" and overlaps))


def needs_batch_work(config: LoaderConfig) -> bool:
    """Whether collating a batch costs CPU beyond gathering its rows (then a prefetch thread overlaps it)."""
    return config.augment.random or config.augment.normalize or config.pin_memory or config.device is not None


_END = object()


def prefetched(items: Iterator[Any], prefetch: int) -> Iterator[Any]:
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

