"""One global batch and one sample's place, computed without the epoch (plan.global_batch, plan.sample_place,
plan.shuffled_slice: what ``dutycycle trace`` asks of the plan), against the whole epoch's plan."""

from __future__ import annotations

import numpy as np
import pytest
from dutycycle.engine.errors import ConfigError
from dutycycle.loader import plan as P


@pytest.mark.parametrize("n,block,window", [(1000, 64, 256), (1000, 7, 13), (37, 5, 3), (300, 64, 1000)])
def test_a_slice_of_the_shuffle_is_the_shuffle_sliced(n, block, window):
    for key in (1, 2**63 + 5):
        full = P.shuffled(n, key, block, window)
        for lo, hi in [(0, n), (0, 1), (n - 1, n), (13, 200), (250, 260), (5, 5)]:
            assert np.array_equal(P.shuffled_slice(n, key, lo, hi, block, window), full[lo:hi]), (lo, hi)
    starts = np.array([0, 3, 40, 41, 200, 777])
    starts = starts[starts < n]
    full = P.shuffled(n, 9, 0, window, starts)
    assert np.array_equal(P.shuffled_slice(n, 9, 20, 30, 0, window, starts), full[20:30])


@pytest.mark.parametrize("n,gbs,parts,drop", [(1000, 48, 1, True), (1000, 48, 5, False), (97, 12, 3, False),
                                             (500, 50, 7, True)])
def test_one_batch_and_one_sample_agree_with_the_epoch(n, gbs, parts, drop):
    kw = dict(block_size=4, window=10, partitions=parts)
    epoch = P.plan_epoch(n, 3, 2, "fp", gbs, drop, **kw)
    placed = {}
    for s, batch in enumerate(epoch):
        assert np.array_equal(P.global_batch(n, 3, 2, "fp", gbs, drop, s, **kw), batch)
        placed.update({int(i): (s, pos) for pos, i in enumerate(batch)})
    for i in range(0, n, 7):  # every 7th sample: its batch and place, or None where drop_last left it out
        assert P.sample_place(n, 3, 2, "fp", gbs, drop, i, **kw) == placed.get(i)
    with pytest.raises(ConfigError, match="outside this epoch"):
        P.global_batch(n, 3, 2, "fp", gbs, drop, len(epoch), **kw)

