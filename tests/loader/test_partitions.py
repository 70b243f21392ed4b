"""Canonical partitions (plan.py): each rank plans only the partitions it reads, the global batches are the same
at world sizes 1, 2, 4 and 8, a node's ranks read only their node's partitions, every sample is used once per
epoch, and a state saved at one world size resumes at another without replaying or skipping a sample."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from dutycycle.engine.errors import ConfigError
from dutycycle.loader import ArrayLoader, AugmentConfig, CacheLoader, LoaderConfig
from dutycycle.loader import plan as plan_mod
from dutycycle.loader.plan import epoch_order, partition_bounds, plan_epoch, rank_plan

from .test_loader import as_arrays, assert_same

FP = "f" * 64


def joined(num_samples, world_size, batch, partitions, drop_last, shuffle=True, epoch=0):
    """Every step's global batch, rebuilt from each rank's own plan."""
    plans = [rank_plan(num_samples, 5, epoch, FP, batch, drop_last, r, world_size, shuffle=shuffle, block_size=8,
                       window=64, partitions=partitions) for r in range(world_size)]
    assert len({len(p) for p in plans}) == 1
    return [np.concatenate([p.indices(s) for p in plans]) for s in range(len(plans[0]))]


@pytest.mark.parametrize("partitions", [1, 3, 4, 8])
@pytest.mark.parametrize("num_samples,drop_last", [(1000, True), (1037, True), (1037, False)])
def test_global_batches_are_the_same_at_world_sizes_1_2_4_8(partitions, num_samples, drop_last):
    reference = plan_epoch(num_samples, 5, 0, FP, 16, drop_last, block_size=8, window=64, partitions=partitions)
    for world_size in (1, 2, 4, 8):
        got = joined(num_samples, world_size, 16, partitions, drop_last)
        assert len(got) == len(reference)
        for a, b in zip(got, reference, strict=True):
            assert np.array_equal(a, b), (world_size, partitions)


@pytest.mark.parametrize("partitions", [1, 3, 4, 8, 16])
def test_every_sample_once_per_epoch_and_partitions_last_the_epoch(partitions):
    for n in (1000, 1037, 16 * 64 + 15):
        everything = np.concatenate(plan_epoch(n, 1, 2, FP, 16, drop_last=False, partitions=partitions))
        assert np.array_equal(np.sort(everything), np.arange(n))
        kept = np.concatenate(plan_epoch(n, 1, 2, FP, 16, drop_last=True, partitions=partitions))
        assert len(kept) == (n // 16) * 16 and len(np.unique(kept)) == len(kept)


def test_one_partition_is_the_unpartitioned_plan():
    order = epoch_order(1037, 5, 3, FP, block_size=8, window=64)
    batches = plan_epoch(1037, 5, 3, FP, 16, drop_last=False, block_size=8, window=64)
    assert np.array_equal(np.concatenate(batches), order)
    assert all(len(b) == 16 for b in batches[:-1]) and len(batches[-1]) == 1037 % 16


def test_a_node_reads_only_its_partitions():
    """8 ranks on 4 nodes of 2, 8 partitions: node n's samples all lie in partitions 2n and 2n+1, a contiguous run
    of cache rows; each global batch takes 2 samples from every partition."""
    n, batch, parts = 4000, 16, 8
    bounds = partition_bounds(n, batch, parts)
    for node in range(4):
        got = np.concatenate([rank_plan(n, 0, 1, FP, batch, True, r, 8, partitions=parts).full.ravel()
                              for r in (2 * node, 2 * node + 1)])
        assert got.min() >= bounds[2 * node] and got.max() < bounds[2 * node + 2]
        assert len(got) == len(np.unique(got)) == bounds[2 * node + 2] - bounds[2 * node]  # all of them, once
    for b in plan_epoch(n, 0, 1, FP, batch, True, partitions=parts):
        assert np.array_equal(np.bincount(np.searchsorted(bounds, b, side="right") - 1, minlength=parts),
                              np.full(parts, 2))


def test_a_rank_computes_only_the_partitions_it_reads(monkeypatch):
    """With as many partitions as ranks a rank shuffles one partition (O(N / world size)), not all of them."""
    computed = []
    real = plan_mod.partition_order
    monkeypatch.setattr(plan_mod, "partition_order", lambda *a, **k: computed.append(a[6]) or real(*a, **k))
    plan = rank_plan(64_000, 0, 0, FP, 64, True, rank=5, world_size=16, partitions=16)
    assert computed == [5]
    assert plan.full.shape == (1000, 4)
    computed.clear()
    rank_plan(64_000, 0, 0, FP, 64, True, rank=5, world_size=8, partitions=16)
    assert computed == [10, 11]  # two partitions per rank at half the ranks


def test_partitions_change_the_order_and_are_checked():
    one = np.concatenate(plan_epoch(1024, 0, 0, FP, 16, True))
    four = np.concatenate(plan_epoch(1024, 0, 0, FP, 16, True, partitions=4))
    assert not np.array_equal(one, four)
    assert np.array_equal(np.sort(one), np.sort(four))
    with pytest.raises(ConfigError, match="partitions=32 is more than global_batch_size=16"):
        plan_epoch(1000, 0, 0, FP, 16, True, partitions=32)
    with pytest.raises(ConfigError, match="partitions=32 is more than global_batch_size=16"):
        LoaderConfig(global_batch_size=16, partitions=32)
    with pytest.raises(ConfigError, match="partitions=-1"):
        LoaderConfig(global_batch_size=16, partitions=-1)
    # 0 is "sized for the world": a Loader resolves it; a plan made directly needs the number
    with pytest.raises(ConfigError, match="partitions=0 is invalid.*default_partitions"):
        plan_epoch(1000, 0, 0, FP, 16, True, partitions=0)


# ------------------------------------------------------------------------------------------------ the loader

N = 1000
IMAGES = (np.arange(N, dtype=np.int64)[:, None, None, None] % 251).astype(np.uint8) * np.ones((1, 2, 2, 1), np.uint8)
LABELS = np.arange(N) % 7


def loader(rank, world_size, **kw):
    kw.setdefault("block_size", 8)
    cfg = LoaderConfig(global_batch_size=16, seed=2, mode="sync", partitions=8, window=64,
                       augment=AugmentConfig(normalize=False), **kw)
    return ArrayLoader(IMAGES, LABELS, rank, world_size, cfg, fingerprint="partitions-v1")


def ids(batch) -> list:
    return list(batch["sample_id"])


@pytest.mark.parametrize("saved_at,resumed_at", [(2, 4), (4, 1), (8, 2), (1, 8)])
def test_a_state_resumes_at_another_world_size_sample_exactly(saved_at, resumed_at):
    """Steps 0-24 at one world size, the state saved, the rest of the epoch at another: the multiset of every id
    handed out is the epoch's, each once; the batches after the resume are the uninterrupted run's."""
    first = [loader(r, saved_at) for r in range(saved_at)]
    seen = Counter()
    iters = [iter(ld) for ld in first]
    for _ in range(25):
        for it in iters:
            seen.update(ids(next(it)))
    state = json.loads(json.dumps(first[0].state_dict()))
    assert state["partitions"] == 8
    rest = [loader(r, resumed_at) for r in range(resumed_at)]
    for ld in rest:
        ld.load_state_dict(state)
    after = [[ids(b) for b in ld] for ld in rest]
    for per_rank in after:
        for batch_ids in per_rank:
            seen.update(batch_ids)
    epoch = plan_epoch(N, 2, 0, "partitions-v1", 16, True, block_size=8, window=64, partitions=8)
    assert seen == Counter(int(i) for b in epoch for i in b)
    assert max(seen.values()) == 1 and sum(seen.values()) == (N // 16) * 16
    whole = loader(0, 1)
    uninterrupted = [ids(b) for b in whole][25:]
    assert [sum((after[r][s] for r in range(resumed_at)), []) for s in range(len(after[0]))] == uninterrupted


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_cache_loader_batches_match_one_process_with_partitions(cache, world_size):
    cfg = LoaderConfig(global_batch_size=16, mode="sync", partitions=4)
    single = as_arrays(CacheLoader(cache, "train", config=cfg))
    per_rank = [as_arrays(CacheLoader(cache, "train", r, world_size, cfg)) for r in range(world_size)]
    joined_batches = [
        (np.concatenate([per_rank[r][s][0] for r in range(world_size)]),
         np.concatenate([per_rank[r][s][1] for r in range(world_size)]),
         sum((per_rank[r][s][2] for r in range(world_size)), []))
        for s in range(len(single))
    ]
    assert_same(single, joined_batches)


# ------------------------------------------------------------------------------------- blocks at given starts


def test_blocks_at_given_starts_stay_whole_and_the_plan_stays_elastic():
    """Blocks cut where given (a cache's chunk boundaries): with a window of 1 the epoch is those blocks, each
    whole and in order, permuted; partitions cut them at their own ends; the global batches are the same at every
    world size."""
    n = 1000
    starts = np.array([0, 7, 300, 341, 682, 690, 999])
    order = epoch_order(n, 5, 0, FP, block_size=0, window=1, block_starts=starts)
    bounds = np.append(starts, n)
    runs = [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    pos, seen = 0, []
    while pos < n:
        run = next(r for r in runs if r[0] == order[pos])
        assert np.array_equal(order[pos:pos + len(run)], run)
        seen.append(run[0])
        pos += len(run)
    assert sorted(seen) == starts.tolist() and seen != starts.tolist()
    with pytest.raises(ConfigError, match="block_size=0 cuts shuffle blocks"):
        epoch_order(n, 5, 0, FP, block_size=0)
    reference = plan_epoch(n, 5, 0, FP, 16, True, block_size=0, window=64, partitions=4, block_starts=starts)
    for world_size in (1, 2, 4, 8):
        plans = [rank_plan(n, 5, 0, FP, 16, True, r, world_size, block_size=0, window=64, partitions=4,
                           block_starts=starts) for r in range(world_size)]
        for s, want in enumerate(reference):
            assert np.array_equal(np.concatenate([p.indices(s) for p in plans]), want)


def test_block_size_zero_needs_a_cache():
    with pytest.raises(ConfigError, match="block_size=-1 is invalid; use an integer >= 0"):
        LoaderConfig(block_size=-1)
    with pytest.raises(ConfigError, match="block_size=0 cuts shuffle blocks"):
        loader(0, 1, block_size=0)


def test_node_boundaries_line_up_when_partitions_do_not_divide_the_batch():
    """B = 6, P = 4, 2 nodes of 1 rank: partition p's share of a batch starts at floor(p * B / P), so node 1's
    positions [3, 6) are partitions 2 and 3 only."""
    n, batch, parts = 600, 6, 4
    bounds = partition_bounds(n, batch, parts)
    node1 = rank_plan(n, 0, 0, FP, batch, True, 1, 2, partitions=parts).full.ravel()
    assert node1.min() >= bounds[2] and node1.max() < bounds[4]
    node0 = rank_plan(n, 0, 0, FP, batch, True, 0, 2, partitions=parts).full.ravel()
    assert node0.max() < bounds[2]
