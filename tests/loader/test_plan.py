"""The sample plan as pure functions: permutation, determinism, world-size invariance, block/window structure."""

from __future__ import annotations

import numpy as np
import pytest
from dutycycle.engine.errors import ConfigError
from dutycycle.loader.plan import epoch_order, num_steps, plan_epoch, rank_bounds, rank_slice

FP = "0123456789abcdef"


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000, 5003])
def test_epoch_order_is_a_permutation(n):
    order = epoch_order(n, seed=3, epoch=1, fingerprint=FP, block_size=64, window=256)
    assert order.dtype == np.int64
    assert np.array_equal(np.sort(order), np.arange(n))


def test_plan_is_deterministic_and_changes_with_epoch_seed_and_fingerprint():
    base = np.concatenate(plan_epoch(3000, 0, 0, FP, 100, drop_last=True))
    assert np.array_equal(base, np.concatenate(plan_epoch(3000, 0, 0, FP, 100, drop_last=True)))
    for other in (
        plan_epoch(3000, 0, 1, FP, 100, drop_last=True),  # next epoch
        plan_epoch(3000, 1, 0, FP, 100, drop_last=True),  # other seed
        plan_epoch(3000, 0, 0, FP[::-1], 100, drop_last=True),  # other cache
    ):
        other = np.concatenate(other)
        assert np.array_equal(np.sort(other), np.sort(base))
        # unrelated orders agree in only a handful of positions
        assert (other == base).mean() < 0.05


def test_drop_last_and_exactly_once():
    kept = plan_epoch(1050, 0, 0, FP, 100, drop_last=False)
    assert [len(b) for b in kept] == [100] * 10 + [50]
    assert np.array_equal(np.sort(np.concatenate(kept)), np.arange(1050))
    dropped = plan_epoch(1050, 0, 0, FP, 100, drop_last=True)
    assert [len(b) for b in dropped] == [100] * 10
    assert len(np.unique(np.concatenate(dropped))) == 1000
    assert num_steps(1050, 100, True) == 10 and num_steps(1050, 100, False) == 11
    assert plan_epoch(50, 0, 0, FP, 100, drop_last=True) == []


def test_no_shuffle_is_cache_order():
    batches = plan_epoch(25, 7, 3, FP, 10, drop_last=False, shuffle=False)
    assert np.array_equal(np.concatenate(batches), np.arange(25))


def test_block_and_window_structure():
    """Each window of the order is made of whole blocks of consecutive indices, shuffled within the window."""
    n, block, window = 4096, 32, 256
    order = epoch_order(n, 5, 0, FP, block_size=block, window=window)
    for w in range(n // window):
        part = order[w * window : (w + 1) * window]
        blocks = np.unique(part // block)
        assert len(blocks) == window // block  # whole blocks only
        assert np.array_equal(np.sort(part), np.sort((blocks[:, None] * block + np.arange(block)).ravel()))
        assert not np.array_equal(part, np.sort(part))  # shuffled inside the window
    # the blocks themselves are not in cache order
    first_blocks = [int(order[w * window] // block) for w in range(n // window)]
    assert first_blocks != sorted(first_blocks)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_rank_slices_concatenate_to_the_global_batch(world_size):
    for batch in plan_epoch(1030, 1, 2, FP, 64, drop_last=False):
        parts = [rank_slice(batch, r, world_size) for r in range(world_size)]
        assert np.array_equal(np.concatenate(parts), batch)
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1  # a short last batch is split as evenly as possible


def test_rank_bounds_of_a_short_batch():
    assert [rank_bounds(5, r, 4) for r in range(4)] == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert [rank_bounds(2, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    with pytest.raises(ConfigError, match="rank=4"):
        rank_bounds(8, 4, 4)


def test_bad_arguments_raise_config_errors():
    with pytest.raises(ConfigError, match="global_batch_size=0"):
        plan_epoch(10, 0, 0, FP, 0, drop_last=True)
    with pytest.raises(ConfigError, match="block_size=0"):
        epoch_order(10, 0, 0, FP, block_size=0)
