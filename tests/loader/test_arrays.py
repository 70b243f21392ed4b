"""ArrayLoader (a split given as arrays) runs the cache loader's plan, augmentation and state; one stats object."""

from __future__ import annotations

import numpy as np
import pytest
from dutycycle.engine.errors import ConfigError
from dutycycle.loader import ArrayLoader, AugmentConfig, CacheLoader
from dutycycle.loader.source import MemorySplit

from .test_loader import as_arrays, assert_same, cfg, take

# the shared ``cache`` fixture is tests/loader/conftest.py's


def arrays_of(cache_loader: CacheLoader, rank: int = 0, world_size: int = 1, **kw) -> ArrayLoader:
    """An ArrayLoader over the same split, ids and fingerprint as ``cache_loader``."""
    split = MemorySplit.gather(cache_loader.reader, cache_loader.rows)
    return ArrayLoader(split.images, split.labels, rank, world_size, cfg(**kw), cache_loader.fingerprint,
                       sample_ids=split.sample_ids, layout=cache_loader.layout)


@pytest.mark.parametrize("epoch", [0, 3])
def test_arrays_yield_the_cache_loaders_batches(cache, epoch):
    cached = CacheLoader(cache, "train", config=cfg())
    arrays = arrays_of(cached)
    cached.set_epoch(epoch)
    arrays.set_epoch(epoch)
    assert len(arrays) == len(cached) > 2
    assert_same(as_arrays(cached), as_arrays(arrays))


def test_arrays_are_world_size_invariant_and_resume_by_state():
    images = np.stack([np.full((4, 4, 3), i, np.uint8) for i in range(30)])
    labels = np.arange(30) % 3
    config = cfg(global_batch_size=6, drop_last=False, augment=AugmentConfig(flip=True, normalize=False))
    single = as_arrays(ArrayLoader(images, labels, config=config))
    halves = [as_arrays(ArrayLoader(images, labels, r, 2, config)) for r in range(2)]
    for s, (img, lab, ids) in enumerate(single):
        assert np.array_equal(img, np.concatenate([halves[0][s][0], halves[1][s][0]]))
        assert np.array_equal(lab, np.concatenate([halves[0][s][1], halves[1][s][1]]))
        assert ids == halves[0][s][2] + halves[1][s][2]
    assert sorted(i for _, _, ids in single for i in ids) == list(range(30))  # row numbers as ids
    # stop after 2 batches, resume at world size 3 from the state: the same global batches follow
    first = ArrayLoader(images, labels, config=config)
    take(first, 2)
    resumed = [ArrayLoader(images, labels, r, 3, config) for r in range(3)]
    for loader in resumed:
        loader.load_state_dict(first.state_dict())
    rest = [as_arrays(loader) for loader in resumed]
    assert [sum((rest[r][s][2] for r in range(3)), []) for s in range(len(rest[0]))] == [b[2] for b in single[2:]]


def test_arrays_refuse_ray_mode_and_other_pixel_types():
    images, labels = np.zeros((8, 2, 2, 3), np.uint8), np.zeros(8)
    with pytest.raises(ConfigError, match="mode='ray'"):
        ArrayLoader(images, labels, config=cfg(mode="ray"))
    with pytest.raises(ConfigError, match="uint8 images"):
        ArrayLoader(images.astype(np.float32), labels, config=cfg())
    with pytest.raises(ConfigError, match="uint8 images"):
        ArrayLoader(images, labels[:4], config=cfg())


def test_a_cache_loader_and_its_reader_count_in_one_stats_object(cache):
    loader = CacheLoader(cache, "train", config=cfg(augment=AugmentConfig(normalize=False)))
    assert loader.stats is loader.reader.stats
    take(loader, 2)
    assert loader.stats.count == 2
    loader.stats.reset()
    assert (loader.stats.count, loader.stats.total_wait_s, loader.stats.bytes_fetched) == (0, 0.0, 0)
