"""``TorchDataset``: a loader as a torch ``IterableDataset``. ``DataLoader(view, batch_size=None)`` yields the
loader's own batches bit for bit, without workers (the loader itself) and with them (worker w reads steps w,
w + W, ... of its own reopened source, and the DataLoader's in-order fetch puts them back), forked, spawned or
persistent; ``TorchDataLoader`` follows what it hands out, so its state resumes exactly, at another world size."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from dutycycle.engine.errors import ConfigError
from dutycycle.loader import (
    ArrayLoader,
    AugmentConfig,
    CacheLoader,
    Loader,
    LoaderConfig,
    TorchDataLoader,
    TorchDataset,
)
from dutycycle.loader.arrays import ArraySource
from torch.utils.data import DataLoader, get_worker_info

from .test_loader import as_arrays, assert_same

# the shared ``cache`` fixture is tests/loader/conftest.py's (162 training samples: 10 batches of 16)

AUG = AugmentConfig(crop_padding=2, flip=True, normalize=True)


def cfg(**kw) -> LoaderConfig:
    return LoaderConfig(**{"global_batch_size": 16, "seed": 9, "mode": "thread", "augment": AUG, **kw})


def epoch_of(cache, epoch: int, rank: int = 0, world_size: int = 1):
    loader = CacheLoader(cache, "train", rank, world_size, cfg(mode="sync"))
    loader.set_epoch(epoch)
    return as_arrays(loader)


def ids(batches) -> list[list[str]]:
    return [list(b["sample_id"]) for b in batches]


def tag_worker(batch):
    """The DataLoader's collate step (it runs in the worker): which worker read the batch, in which process, and
    whether that worker's loader reads a source of its own."""
    info = get_worker_info()
    own = info.dataset._worker.source is not info.dataset._source  # forked: the parent's source was reopened
    return {**batch, "worker": info.id, "pid": os.getpid(), "own_source": own}


def test_a_dataloader_without_workers_is_the_loader_itself(cache):
    view = TorchDataset(CacheLoader(cache, "train", config=cfg()))
    dl = DataLoader(view, batch_size=None)
    assert len(dl) == len(view) == len(view.loader) == 10
    assert_same(as_arrays(dl), epoch_of(cache, 0))
    assert view.loader.epoch == 1  # a pass run to the end moved on, as the loader's own does
    taken = []
    for batch in dl:
        taken.append(batch)
        if len(taken) == 4:
            break
    state = json.loads(json.dumps(view.state_dict()))
    assert (state["epoch"], state["step"]) == (1, 4) and state == view.loader.state_dict()
    resumed = TorchDataset(CacheLoader(cache, "train", config=cfg(mode="sync")))
    resumed.load_state_dict(state)
    assert_same(as_arrays(taken) + as_arrays(DataLoader(resumed, batch_size=None)), epoch_of(cache, 1))
    assert_same(as_arrays(dl), epoch_of(cache, 1))  # the next pass starts epoch 1 over


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")  # more than 2 cores: fine here
@pytest.mark.parametrize("workers, persistent", [(2, False), (3, True)])
def test_workers_read_every_wth_step_and_the_dataloader_puts_them_back_in_order(cache, workers, persistent):
    view = TorchDataset(CacheLoader(cache, "train", 1, 2, cfg()))  # rank 1 of 2: the loader's sharding
    dl = DataLoader(view, batch_size=None, num_workers=workers, persistent_workers=persistent,
                    collate_fn=tag_worker)
    for epoch in (0, 1):
        view.set_epoch(epoch)  # with workers, as with DistributedSampler (persistent workers see it too)
        got = list(dl)
        assert_same(as_arrays(got), epoch_of(cache, epoch, 1, 2))
        assert [b["worker"] for b in got] == [s % workers for s in range(len(view))]
        assert all(b["own_source"] and b["pid"] != os.getpid() for b in got)
        assert len({b["pid"] for b in got}) == workers
    # a restored position: the workers split the rest of the epoch the same way, from the restored step
    view.load_state_dict(dict(view.loader.state_dict(), epoch=4, step=3))
    got = list(dl)
    assert_same(as_arrays(got), epoch_of(cache, 4, 1, 2)[3:])
    assert [b["worker"] for b in got] == [s % workers for s in range(len(view) - 3)]


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_a_torch_dataloader_follows_its_batches_and_resumes_at_another_world_size(cache):
    view = TorchDataset(CacheLoader(cache, "train", config=cfg()))
    dl = view.dataloader(num_workers=2, persistent_workers=True)
    assert isinstance(dl, TorchDataLoader) and len(dl) == 10
    assert_same(as_arrays(dl), epoch_of(cache, 0))
    assert dl.state_dict()["epoch"] == 1  # no set_epoch needed: it saw the pass run to the end
    taken = []
    for batch in dl:
        taken.append(batch)
        if len(taken) == 4:
            break
    state = json.loads(json.dumps(dl.state_dict()))
    assert (state["epoch"], state["step"]) == (1, 4)
    # restored at world size 2: rank 0 through a TorchDataLoader with workers, rank 1 in this process
    halves = []
    for rank, workers in ((0, 3), (1, 0)):
        other = TorchDataLoader(TorchDataset(CacheLoader(cache, "train", rank, 2, cfg())), num_workers=workers)
        other.load_state_dict(state)
        halves.append(as_arrays(other))
        assert other.state_dict()["epoch"] == 2
    rest = [(np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]]), a[2] + b[2])
            for a, b in zip(*halves, strict=True)]
    assert_same(as_arrays(taken) + rest, epoch_of(cache, 1))
    assert_same(as_arrays(dl), epoch_of(cache, 1))  # its next iteration starts epoch 1 over, as the loader's
    assert dl.state_dict()["epoch"] == 2
    for bad, words in (({"batch_size": 4}, "batch_size=4"), ({"in_order": False}, "in_order=False")):
        with pytest.raises(ConfigError, match=words):
            view.dataloader(**bad)
    with pytest.raises(ConfigError, match="needs a TorchDataset"):
        TorchDataLoader(view.loader)
    with pytest.raises(ConfigError, match="pass a dutycycle.loader loader"):
        TorchDataset(dl)


class NoReopen:
    """A user's source that cannot open itself again: everything but ``reopen`` is the wrapped source's."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        if name == "reopen":
            raise AttributeError(name)
        return getattr(self.inner, name)


def test_a_plain_dataloaders_workers_leave_no_position_to_save():
    images = np.stack([np.full((4, 4, 1), i, np.uint8) for i in range(40)])
    config = cfg(global_batch_size=4, mode="sync", augment=AugmentConfig(flip=True, normalize=False))
    expected = ids(ArrayLoader(images, np.arange(40) % 2, config=config))
    view = TorchDataset(ArrayLoader(images, np.arange(40) % 2, config=config))
    batches = iter(DataLoader(view, batch_size=None, num_workers=2))
    assert [list(next(batches)["sample_id"]) for _ in range(3)] == [list(map(int, b)) for b in expected[:3]]
    with pytest.raises(ConfigError, match=r"cannot see.*view\.dataloader\(num_workers=\.\.\.\)"):
        view.state_dict()
    del batches
    view.set_epoch(0)  # the epoch it is in: the position after what the workers handed out is still unknown
    with pytest.raises(ConfigError, match="cannot see"):
        view.state_dict()
    view.set_epoch(1)  # a position set again is a position known again
    assert (view.state_dict()["epoch"], view.state_dict()["step"]) == (1, 0)
    # a source that cannot open itself again serves workers never, and says so
    lone = TorchDataset(Loader(config, NoReopen(ArraySource(images, np.arange(40) % 2, np.arange(40), "a", "HWC"))))
    assert len(list(DataLoader(lone, batch_size=None))) == 10
    with pytest.raises(ConfigError, match="NoReopen has no reopen\\(\\); use num_workers=0"):
        list(DataLoader(lone, batch_size=None, num_workers=1))


def test_spawned_workers_open_the_cache_where_they_land(cache):
    """Sent to a spawned process the view carries what opens the cache (its URI), never open mappings, and the
    shared record still reaches the worker (set_epoch between epochs). One worker: a spawned process imports torch
    afresh (about 2 s of CPU), and the fork tests above cover how several split a pass."""
    view = TorchDataset(CacheLoader(cache, "train", config=cfg()))
    dl = DataLoader(view, batch_size=None, num_workers=1, multiprocessing_context="spawn", persistent_workers=True)
    for epoch in (0, 1):
        view.set_epoch(epoch)
        assert_same(as_arrays(dl), epoch_of(cache, epoch))
    assert torch.equal(view._shared[:2], torch.tensor([1, 0]))
