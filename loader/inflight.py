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
    alone when the driver already holds the labels and ids (the raw path's decode tasks: only pixels travel)."""

    ref: Any
    labels: np.ndarray | None = None
    sample_ids: list[str] | None = None

    def result(self) -> RawBatch:
        if self.labels is None:
            return RawBatch(*get(self.ref))
        return RawBatch(get(self.ref), self.labels, self.sample_ids)


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
            cancel([b.ref for b in pending])


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


def cancel(refs: list) -> None:
    """Cancel tasks the consumer no longer needs, and collect their outcome so Ray does not log it as unhandled."""
    import ray

    for ref in refs:
        try:
            ray.cancel(ref)
        except Exception:  # already finished or gone: nothing to cancel
            pass
    for ref in refs:
        try:
            ray.get(ref, timeout=5)
        except Exception:  # cancelled, failed or slow: either way nobody needs the result
            pass
