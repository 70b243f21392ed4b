"""A loader keeps torch's habits: each ``for`` is one pass (an epoch from its start, or once the rest of a
restored position), a pass run to the end moves to the next epoch, a ``break`` leaves the position for a
checkpoint while the next ``for`` starts over, ``set_epoch`` works as ``DistributedSampler``'s, ``peek()``
consumes nothing; and the trainer's batch source (``LoaderSource`` and ``take``) reads the positions right."""

from __future__ import annotations

import json

import pytest
from dutycycle.engine.errors import ConfigError
from dutycycle.loader import AugmentConfig, CacheLoader, LoaderConfig
from dutycycle.trainer.step.data import LoaderSource, take

from .test_loader import as_arrays, assert_same

# the shared ``cache`` fixture is tests/loader/conftest.py's (162 training samples: 10 batches of 16)

AUG = AugmentConfig(crop_padding=2, flip=True, normalize=True)


def cfg(**kw) -> LoaderConfig:
    return LoaderConfig(**{"global_batch_size": 16, "seed": 4, "mode": "sync", "augment": AUG, **kw})


def ids(batches) -> list[list[str]]:
    return [list(b["sample_id"]) for b in batches]


def reference(cache, epoch: int, **kw) -> list[list[str]]:
    """Epoch ``epoch`` read by a fresh loader moved there with set_epoch."""
    fresh = CacheLoader(cache, "train", config=cfg(**kw))
    fresh.set_epoch(epoch)
    return ids(fresh)


@pytest.mark.parametrize("mode", ["sync", "thread"])
def test_each_for_is_one_epoch_and_a_whole_pass_moves_to_the_next(cache, mode):
    loader = CacheLoader(cache, "train", config=cfg(mode=mode))
    assert len(loader) == 10 == loader.num_samples // 16
    epochs = []
    for e in range(3):  # no set_epoch: each pass that runs to the end moves on by itself
        assert (loader.epoch, loader.state_dict()["step"]) == (e, 0)
        epochs.append(ids(loader))
        assert len(epochs[-1]) == len(loader)
    assert loader.epoch == 3
    assert epochs == [reference(cache, e) for e in range(3)]
    assert epochs[0] != epochs[1] != epochs[2]
    # the position moves to the next epoch with the last batch handed out, before the consumer asks for more: a
    # consumer that stops at len(loader) batches (Lightning, zip, islice) has finished the epoch too
    it = iter(loader)
    for _ in range(len(loader)):
        next(it)
    assert (loader.epoch, loader.step) == (4, 0)
    assert ids(loader) == reference(cache, 4)


def test_a_break_keeps_the_position_for_a_checkpoint_and_the_next_for_starts_over(cache):
    loader = CacheLoader(cache, "train", config=cfg(mode="thread", prefetch=4))
    loader.set_epoch(2)
    first = []
    for batch in loader:
        first.append(batch)
        if len(first) == 3:
            break
    state = json.loads(json.dumps(loader.state_dict()))
    assert (state["epoch"], state["step"]) == (2, 3)  # after the last batch handed out, not those prefetched
    # a checkpoint taken now resumes right after it, in a new loader
    resumed = CacheLoader(cache, "train", config=cfg(mode="thread"))
    resumed.load_state_dict(state)
    rest = as_arrays(resumed)
    whole = CacheLoader(cache, "train", config=cfg())
    whole.set_epoch(2)
    expected = as_arrays(whole)
    assert_same(as_arrays(first) + rest, expected)
    assert (resumed.epoch, resumed.step) == (3, 0)
    # the same loader's next for starts epoch 2 over (torchdata's StatefulDataLoader does the same)
    again = iter(loader)
    assert loader.state_dict()["step"] == 0  # the new pass began at iter()
    assert_same(as_arrays(again), expected)
    assert loader.epoch == 3


def test_a_restored_position_is_used_once(cache):
    saver = CacheLoader(cache, "train", config=cfg())
    saver.set_epoch(5)
    for i, _ in enumerate(saver):
        if i == 6:
            break
    state = saver.state_dict()
    assert (state["epoch"], state["step"]) == (5, 7)
    loader = CacheLoader(cache, "train", config=cfg())
    loader.load_state_dict(state)
    assert (loader.epoch, loader.step) == (5, 7)
    assert ids(loader) == reference(cache, 5)[7:]  # the rest of epoch 5, once
    assert ids(loader) == reference(cache, 6)  # then whole epochs again
    # a state saved after an epoch's last batch is the next epoch's start...
    saver.set_epoch(5)
    it = iter(saver)
    for _ in range(len(saver)):
        next(it)
    end = saver.state_dict()
    assert (end["epoch"], end["step"]) == (6, 0)
    # ...and one written by an older dutycycle as (epoch, len) loads as the next epoch's start
    old = CacheLoader(cache, "train", config=cfg())
    old.load_state_dict(dict(end, epoch=5, step=len(old)))
    assert (old.epoch, old.step) == (6, 0) and ids(old) == reference(cache, 6)


def test_set_epoch_works_as_distributed_samplers(cache):
    loader = CacheLoader(cache, "train", config=cfg())
    loader.set_epoch(7)
    assert (loader.epoch, loader.step) == (7, 0)
    assert ids(loader) == reference(cache, 7)
    # a training loop calling set_epoch at every epoch's start: the calls agree with the passes
    seen = []
    for e in range(8, 10):
        loader.set_epoch(e)
        seen.append(ids(loader))
    assert seen == [reference(cache, 8), reference(cache, 9)]
    # after a resume, set_epoch of the restored epoch keeps the position; another epoch replaces it
    state = dict(loader.state_dict(), epoch=3, step=4)
    loader.load_state_dict(state)
    loader.set_epoch(3)
    assert (loader.epoch, loader.step) == (3, 4) and ids(loader) == reference(cache, 3)[4:]
    loader.load_state_dict(state)
    loader.set_epoch(1)
    assert (loader.epoch, loader.step) == (1, 0) and ids(loader) == reference(cache, 1)
    # set_epoch of the epoch it is in changes nothing: a pass begun before it (Lightning begins its pass, then
    # runs its epoch-start hooks) keeps counting, and a break's position stays for a checkpoint
    it = iter(loader)
    loader.set_epoch(2)
    next(it)
    loader.set_epoch(2)
    assert (loader.epoch, loader.step) == (2, 1)
    # another epoch: a pass under way keeps yielding its own but no longer moves the position
    loader.set_epoch(8)
    rest = ids(it)
    assert rest == reference(cache, 2)[1:] and (loader.epoch, loader.step) == (8, 0)
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ConfigError, match=r"set_epoch\(.*\) is invalid; pass an integer >= 0"):
            loader.set_epoch(bad)


@pytest.mark.parametrize("mode", ["sync", "thread"])
def test_peek_consumes_nothing(cache, mode):
    loader = CacheLoader(cache, "train", config=cfg(mode=mode))
    loader.set_epoch(1)

    def check(expected_step):
        state, count = loader.state_dict(), loader.stats.count
        peeked = as_arrays([loader.peek()])
        assert loader.state_dict() == state and loader.stats.count == count  # nothing handed out
        assert state["step"] == expected_step
        return peeked

    peeked = check(0)
    batches = iter(loader)
    assert_same(peeked, as_arrays([next(batches)]))  # bit-identical to what the next for yields first
    next(batches)
    batches.close()
    # after a break the next for starts the epoch over: so does peek
    assert_same(check(2), peeked)
    # after load_state_dict, the restored batch
    loader.load_state_dict(dict(loader.state_dict(), step=6))
    restored = check(6)
    assert_same(restored, as_arrays([next(iter(loader))]))
    assert ids([loader.peek()]) == reference(cache, 1)[:1]  # that pass used the restored position up


def test_the_trainers_source_reads_each_batch_position_before_it(cache):
    """``take`` names each batch by ``source.position()`` read before ``next``: right at a pass's first batch
    after a break, after a resume, and across the epoch's end, and batches in ``skip`` are left out."""
    source = LoaderSource(CacheLoader(cache, "train", config=cfg(augment=AugmentConfig(normalize=False))))
    it = iter(source)
    got = [take(it, source, set())[1] for _ in range(3)]
    assert got == [0, 1, 2] and source.position() == (0, 3)
    it = iter(source)  # after that break, a new pass: position is its first batch before any next
    assert source.position() == (0, 0)
    batch, index = take(it, source, {(0, 0), (0, 2)})
    assert index == 1 and list(batch["sample_id"]) == reference(cache, 0)[1]
    assert batch["image"].is_floating_point()  # the source's float conversion
    source.load_state_dict(dict(source.state_dict(), step=8))
    it = iter(source)
    assert [take(it, source, set())[1] for _ in range(2)] == [8, 9]
    assert source.position() == (1, 0) and take(it, source, set()) == (None, -1)
