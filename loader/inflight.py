"""Ray read tasks in flight: wait for them in plan order, surface their errors as themselves, cancel the rest.

``ray`` is imported only when a result is awaited or a task cancelled, so the planned loader can use this module
without making Ray a dependency of the modes that never start a task; the tasks themselves are in ``ray_exec``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .source import RawBatch


@dataclass
class RemoteBatch:
    """One rank batch a Ray task is producing. ``ref`` resolves to ``(images, labels, ids)``, or to the images
    alone when the driver already holds the labels and ids (the raw path's decode tasks: only pixels travel).
    The images are an array, or a ``shm.SharedBatch`` the task left in ``folder`` (mapped here, no copy)."""

    ref: Any
    labels: np.ndarray | None = None
    sample_ids: list[str] | None = None
    folder: Any = None  # the consumer's shm.BatchFolder the task may leave its pixels in
    handoff: Any = None  # the shm.Handoff the task was given: the file it may leave, by name

    def result(self) -> RawBatch:
        if self.labels is None:
            images, labels, ids = get(self.ref)
            return RawBatch(self._pixels(images), labels, ids)
        return RawBatch(self._pixels(get(self.ref)), self.labels, self.sample_ids)

    def _pixels(self, images):
        if isinstance(images, np.ndarray):
            return images
        return self.folder.open(images)

    def drop(self, value) -> None:
        """A finished result nobody will use: remove the file it left, if any."""
        images = value[0] if isinstance(value, tuple) else value
        if self.folder is not None and not isinstance(images, np.ndarray):
            self.folder.discard(images)

    def drop_file(self) -> None:
        """The task ended without a result anyone will use (cancelled, failed, or done after the consumer left):
        remove the file it was told to leave, which a cancel between its write and its return leaves behind."""
        if self.folder is not None and self.handoff is not None and self.handoff.name:
            self.folder.discard_path(self.handoff.path)


def in_order(submit: Callable[[int], RemoteBatch], steps: Iterable[int], depth: int) -> Iterator[RawBatch]:
    """The batches of ``steps`` in order, with ``submit(step)`` keeping ``depth`` tasks in flight (bounded, so
    memory is too). Closing the iterator early cancels the tasks still running."""
    pending: deque[RemoteBatch] = deque()
    todo = iter(steps)

    def submit_next() -> None:
        step = next(todo, None)
        if step is not None:
            pending.append(submit(step))

    try:
        for _ in range(depth):
            submit_next()
        while pending:
            batch = pending.popleft()
            submit_next()
            yield batch.result()
    finally:
        if pending:
            cancel(list(pending))


def get(ref):
    """``ray.get``, with a task's error raised as the original exception (e.g. ``CorruptArtifactError``)."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise


def cancel(batches: list[RemoteBatch]) -> None:
    """Cancel tasks the consumer no longer needs, and collect their outcome so Ray does not log it as unhandled
    (a batch one left in shared memory is removed; one still being written goes with its folder)."""
    import ray

    for b in batches:
        try:
            ray.cancel(b.ref)
        except Exception:  # already finished or gone: nothing to cancel
            pass
    for b in batches:
        try:
            b.drop(ray.get(b.ref, timeout=5))
        except ray.exceptions.GetTimeoutError:  # still running: drop what it leaves when it ends
            if b.folder is not None:
                b.ref.future().add_done_callback(lambda f, b=b: b.drop_file())
        except Exception:  # cancelled or failed: nobody needs the result, nor a file it wrote before the cancel
            b.drop_file()
