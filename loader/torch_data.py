"""A loader as a ``torch.utils.data.IterableDataset``, for code written for torch's ``Dataset`` and ``DataLoader``
(PyTorch Lightning, a library's training loop, a hand-written one). ::

    from torch.utils.data import DataLoader
    from dutycycle.loader import CacheLoader, TorchDataset

    view = TorchDataset(CacheLoader(cache_uri, "train", rank, world_size, config))
    for epoch in range(epochs):
        view.set_epoch(epoch)                # as with DistributedSampler: needed with workers
        for batch in DataLoader(view, batch_size=None, num_workers=4, persistent_workers=True):
            ...                              # the loader's batches: {"image", "label", "sample_id"}

The items are the loader's batches, already batched and collated, so a DataLoader takes them one at a time
(``batch_size=None``). The loader's rank and world size shard them and its plan orders them: the view yields the
loader's own batches, bit for bit, with or without workers, at any world size.

``num_workers=0``: each pass over the view is a pass of the loader itself, in this process: its position and
``state_dict()``, its move to the next epoch at the end of a pass, its resume once after ``load_state_dict``, its
prefetch thread, Ray tasks and device copies.

``num_workers=W > 0``: each worker opens the loader's source again (``Source.reopen``; a cache's shards are
memory-mapped again, so the workers share one copy of the pages) and reads in its own thread. Worker ``w`` reads
steps ``s + w, s + w + W, ...`` of a pass that starts at step ``s``; the DataLoader fetches from its workers in
turn and hands results out in order, which puts the steps back into the loader's sequence. Prefetching is the
DataLoader's (``prefetch_factor``); the loader's ``device`` and ``pin_memory`` do not apply in workers (pass
``pin_memory=True`` to the DataLoader and move batches where the model is). What a user does with workers:

- Call ``view.set_epoch(epoch)`` before every epoch, as with ``DistributedSampler``: a plain DataLoader never
  tells this process that a pass ended, so the view cannot move to the next epoch by itself. ``set_epoch`` and
  ``load_state_dict`` reach the workers through shared memory, persistent workers (``persistent_workers=True``,
  which saves reopening the source every epoch) included.
- To save positions, iterate through ``view.dataloader(num_workers=W, ...)`` (``TorchDataLoader``): it follows
  the batches it hands out in this process, so its ``state_dict()`` is exact, a pass that runs to the end moves
  it to the next epoch as the loader does, and PyTorch Lightning stores its state in checkpoints.
  ``view.state_dict()`` after a plain DataLoader's workers handed out batches raises instead of returning a
  position it cannot know.
- Keep the DataLoader's in-order delivery (``in_order=True``, the default): the steps are put back in order by it.
- Any multiprocessing start method works: the view sends what opens the source (a cache URI, a table's row
  plan, arrays), never open files or threads.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from dutycycle.engine.errors import ConfigError
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .loader import Loader

# The shared record the workers read (an int64 tensor in shared memory, so it reaches forked, spawned and
# persistent workers alike): the pass they read, and whether this process follows what they hand out.
_EPOCH, _START, _UNSEEN, _FOLLOWED = range(4)


class TorchDataset(IterableDataset):
    """``loader``'s batches as a ``torch.utils.data.IterableDataset`` (see the module docstring for workers).

    ``len(view)`` is the loader's steps per epoch; ``set_epoch``, ``state_dict`` and ``load_state_dict`` are the
    loader's (a state loads at any world size); ``dataloader(**kwargs)`` is a ``TorchDataLoader`` over the view.
    """

    def __init__(self, loader: Loader):
        if not isinstance(loader, Loader):
            raise ConfigError(f"TorchDataset({loader!r}) is invalid; pass a dutycycle.loader loader (CacheLoader, "
                              "RawLoader, ArrayLoader or Loader)")
        self.loader = loader
        # what a worker opens its own loader from: the source, the config (read in the worker's thread, no
        # device copy) and this rank's place
        self._source = loader.source
        self._config = dataclasses.replace(loader.config, mode="sync", pin_memory=False, device=None)
        self.rank, self.world_size = loader.rank, loader.world_size
        self._steps = len(loader)
        self._shared = torch.zeros(4, dtype=torch.int64).share_memory_()
        self._publish(followed=False)
        self._unpickled = False  # True in a process that received the view pickled: its source is fresh
        self._worker: Loader | None = None  # a worker process's own loader
        self._worker_pid = 0

    def __len__(self) -> int:
        """Steps (batches) per epoch."""
        return self._steps

    # ---------------------------------------------------------------- position (this process)

    def set_epoch(self, epoch: int) -> None:
        """The loader's ``set_epoch``: the next pass is ``epoch`` (a no-op for the epoch the loader is in, so a
        restored position survives); reaches running persistent workers too."""
        moved = epoch != self.loader.epoch  # a position known again; the epoch it is in says nothing new
        self.loader.set_epoch(epoch)
        self._publish(followed=False, known=moved)

    def state_dict(self) -> dict[str, Any]:
        """The loader's state: the position after the last batch handed out in this process."""
        if self._shared[_UNSEEN]:
            raise ConfigError(
                "TorchDataset.state_dict(): DataLoader workers handed out batches through a plain torch DataLoader, "
                "whose consumption this process cannot see, so there is no position to save; iterate through "
                "view.dataloader(num_workers=...) (a TorchDataLoader) or with num_workers=0 to save positions, or "
                "set one with set_epoch / load_state_dict"
            )
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any], force: bool = False) -> None:
        """The loader's ``load_state_dict``: the next pass, in this process or in workers, starts at ``state``'s
        position, once."""
        self.loader.load_state_dict(state, force=force)
        self._publish(followed=False)

    def dataloader(self, **kwargs) -> TorchDataLoader:
        """A ``TorchDataLoader`` over this view (``batch_size=None``); ``kwargs`` are DataLoader's."""
        return TorchDataLoader(self, **kwargs)

    def _publish(self, followed: bool, known: bool = True) -> None:
        """Tell the workers the loader's next pass, and whether this process follows what they hand out;
        ``known``: the loader's position is right again (what unfollowed workers handed out is behind it)."""
        epoch, start = self.loader._next_pass()
        self._shared[_EPOCH], self._shared[_START], self._shared[_FOLLOWED] = epoch, start, int(followed)
        if known:
            self._shared[_UNSEEN] = 0

    def _begin_followed_pass(self) -> tuple[int, int, int]:
        """Begin the loader's next pass for workers whose batches this process follows (``TorchDataLoader``)."""
        token, epoch, start = self.loader._begin_pass()
        self._shared[_EPOCH], self._shared[_START] = epoch, start
        self._shared[_UNSEEN], self._shared[_FOLLOWED] = 0, 1
        return token, epoch, start

    # ---------------------------------------------------------------- iteration

    def __iter__(self):
        info = get_worker_info()
        if info is None:  # in this process: the loader's own pass
            batches = iter(self.loader)
            self._publish(followed=False)
            return self._publishing_after(batches)
        return self._worker_pass(info.id, info.num_workers)

    def _publishing_after(self, batches):
        try:
            yield from batches
        finally:
            self._publish(followed=False)  # a pass that ran to the end moved the loader to the next epoch

    def _worker_pass(self, worker: int, workers: int):
        loader = self._worker_loader()
        epoch, start = int(self._shared[_EPOCH]), int(self._shared[_START])
        for batch in loader.read_steps(epoch, range(start + worker, len(loader), workers)):
            if not self._shared[_FOLLOWED]:
                self._shared[_UNSEEN] = 1
            yield batch

    def _worker_loader(self) -> Loader:
        """This worker process's loader over the source opened again (once per process)."""
        if self._worker is None or self._worker_pid != os.getpid():
            source = self._source
            if not self._unpickled:  # forked: the parent's open source, whose handles and threads stay its own
                if not callable(getattr(source, "reopen", None)):
                    raise ConfigError(
                        f"TorchDataset with num_workers > 0 opens the loader's source again in each worker, and "
                        f"{type(source).__name__} has no reopen(); use num_workers=0 or give the source a reopen()"
                    )
                source = source.reopen()
            self._worker = Loader(self._config, source, rank=self.rank, world_size=self.world_size)
            self._worker_pid = os.getpid()
        return self._worker

    def __getstate__(self) -> dict[str, Any]:
        # sent to a spawned worker: the source travels as what opens it again (``CacheSource`` pickles as its URI),
        # never the open loader
        return {**self.__dict__, "loader": None, "_unpickled": True, "_worker": None, "_worker_pid": 0}


class TorchDataLoader(DataLoader):
    """A ``torch.utils.data.DataLoader`` over a ``TorchDataset`` (``batch_size=None``) that follows the batches it
    hands out in this process, with workers or without, as torchdata's ``StatefulDataLoader`` does.

    ``state_dict()`` is the position after the last batch it handed out (the loader's state: loads at any world
    size, into a loader or a view); ``load_state_dict()`` makes its next iteration start there; ``set_epoch`` is
    the view's. An iteration that runs to the end moves to the next epoch, so ``set_epoch`` is not needed
    between whole epochs; one left part-way is started over by the next iteration, as the loader's passes are.
    PyTorch Lightning keeps its state in checkpoints (it has ``state_dict`` / ``load_state_dict``).
    """

    def __init__(self, dataset: TorchDataset, **kwargs):
        if not isinstance(dataset, TorchDataset):
            raise ConfigError(f"TorchDataLoader needs a TorchDataset, got {type(dataset).__name__}; wrap the loader "
                              "first: TorchDataset(loader)")
        if kwargs.get("batch_size") is not None:
            raise ConfigError(f"TorchDataLoader(batch_size={kwargs['batch_size']!r}) is invalid: the view yields "
                              "whole batches already (the loader's global_batch_size / world_size); leave it None")
        if kwargs.get("in_order", True) is not True:
            raise ConfigError("TorchDataLoader(in_order=False) is invalid: the workers' steps are put back into "
                              "the loader's sequence by the DataLoader's in-order delivery")
        super().__init__(dataset, **{**kwargs, "batch_size": None})

    def __iter__(self):
        if self.num_workers == 0:
            return super().__iter__()  # the view's pass in this process is the loader's own, which follows itself
        token, epoch, start = self.dataset._begin_followed_pass()
        return self._following(super().__iter__(), token, epoch, start)

    def _following(self, batches, token: int, epoch: int, start: int):
        loader = self.dataset.loader
        for step, batch in enumerate(batches, start):
            loader._handed_out(token, epoch, step)  # from here on a saved state resumes after this batch
            yield batch

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any], force: bool = False) -> None:
        self.dataset.load_state_dict(state, force=force)
