"""The loader's default "auto" mode and the shard gather behind every local mode: what auto chooses, and that
every choice yields the sync mode's batches bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from dutycycle.engine.cache.format import CacheReader
from dutycycle.engine.errors import ConfigError
from dutycycle.loader import AugmentConfig, CacheLoader, LoaderConfig
from dutycycle.loader.source import ShardGatherer

from .cachemaker import make_cache, pixel_index, sample_pixels

TRAIN_AUG = AugmentConfig(crop_padding=2, flip=True, normalize=True)
PLAIN = AugmentConfig(crop_padding=0, flip=False, normalize=False)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("auto") / "cache")
    make_cache(uri, 150, shape=(8, 8, 3), shards=4, splits={"train": 0.8, "val": 0.2})
    return uri


def batches(uri, split="train", rank=0, world_size=1, config=None, **kw):
    kw.setdefault("global_batch_size", 16)
    loader = CacheLoader(uri, split, rank, world_size, config or LoaderConfig(**kw))
    got = [(b["image"].numpy().copy(), b["label"].numpy().copy(), list(b["sample_id"])) for b in loader]
    return loader, got


def assert_same(a, b):
    assert len(a) == len(b) > 0
    for (ia, la, sa), (ib, lb, sb) in zip(a, b, strict=True):
        assert sa == sb and np.array_equal(la, lb) and ia.dtype == ib.dtype and np.array_equal(ia, ib)


@pytest.mark.parametrize(
    "augment,fraction,in_memory,background",
    [
        (PLAIN, 0.25, True, False),  # a small split, nothing to compute per batch: RAM, caller's thread
        (TRAIN_AUG, 0.25, True, True),  # augmentation: RAM, plus a prefetch thread to overlap it
        (PLAIN, 0.0, False, True),  # no memory budget: memory-mapped shards, prefetch thread
    ],
)
def test_auto_chooses_and_matches_sync(cache, augment, fraction, in_memory, background):
    loader, got = batches(cache, "train", 1, 2, mode="auto", augment=augment, auto_memory_fraction=fraction)
    assert (loader.in_memory, loader.background) == (in_memory, background), loader.execution
    assert loader.execution.startswith("auto: ")
    _, expected = batches(cache, "train", 1, 2, mode="sync", augment=augment)
    assert_same(got, expected)


def test_auto_is_the_default_and_eval_matches_sync(cache):
    assert LoaderConfig().mode == "auto" and LoaderConfig.for_eval().mode == "auto"
    loader, got = batches(cache, "val", 1, 2, LoaderConfig.for_eval(8))
    _, expected = batches(cache, "val", 1, 2, LoaderConfig.for_eval(8, mode="sync"))
    assert loader.in_memory
    assert_same(got, expected)


@pytest.mark.parametrize("fraction", [-0.1, 1.5, "half", True])
def test_bad_memory_fraction_is_a_config_error(fraction):
    with pytest.raises(ConfigError, match="auto_memory_fraction"):
        LoaderConfig(auto_memory_fraction=fraction)


def test_gather_any_rows_in_any_order(cache):
    reader = CacheReader(cache)
    gatherer = ShardGatherer(reader)
    ids = np.concatenate([reader.column(i, "sample_id") for i in range(reader.num_shards)])
    labels = np.concatenate([reader.column(i, "label") for i in range(reader.num_shards)])
    rng = np.random.default_rng(0)
    n = reader.num_samples
    cases = [
        rng.permutation(n)[:40],  # shards interleaved: gathered per shard, then put back in order
        np.sort(rng.permutation(n)[:40]),  # shards ascending: straight into the batch
        np.arange(3, 9)[::-1],  # one shard
        np.array([5, 5, n - 1, 0, 5]),  # repeats
        np.array([], dtype=np.int64),
    ]
    for rows in cases:
        raw = gatherer.read(rows)
        assert raw.images.shape == (len(rows), 8, 8, 3)
        assert [pixel_index(img) for img in raw.images] == rows.tolist()
        for img, row in zip(raw.images, rows, strict=True):
            assert np.array_equal(img, sample_pixels(int(row), (8, 8, 3)))
        assert raw.labels.dtype == np.int64 and raw.labels.tolist() == labels[rows].tolist()
        assert raw.sample_ids.tolist() == ids[rows].tolist()
    for bad in ([0, n], [-1, 2]):
        with pytest.raises(IndexError, match="outside"):
            gatherer.read(np.array(bad))
