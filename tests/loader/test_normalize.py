"""Loaders over one-channel (grey) samples and the normalization a loader resolves when it is built: the cache's
statistics by default, 0.5 for sources without them, the config's values when given; ``loader.config.augment``
holds the values applied."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from dutycycle.engine.cache.materialize import materialize
from dutycycle.engine.errors import ConfigError
from dutycycle.engine.transform import TransformSpec
from dutycycle.loader import ArrayLoader, AugmentConfig, CacheLoader, LoaderConfig, RawLoader
from dutycycle.loader.augment import augment_params

from ..support.cachemaker import make_cache, sample_pixels
from ..support.tablemaker import make_shapes_table
from .test_loader import as_arrays, assert_same, reference_augment

AUG = AugmentConfig(crop_padding=2, flip=True)  # mean and std: the dataset's


def cfg(**kw):
    kw.setdefault("global_batch_size", 8)
    kw.setdefault("mode", "sync")
    kw.setdefault("augment", AUG)
    return LoaderConfig(**kw)


@pytest.fixture(scope="module")
def grey(tmp_path_factory):
    """Grey caches of the same 60 samples in both layouts (shape [8, 8, 1] and [1, 8, 8])."""
    root = tmp_path_factory.mktemp("grey")
    hwc = str(root / "hwc")
    make_cache(hwc, 60, shape=(8, 8, 1), shards=3, splits={"train": 0.75, "val": 0.25}, fingerprint="grey60")
    chw = str(root / "chw")  # the same fingerprint: the same plan (one channel: CHW holds the very same bytes)
    make_cache(chw, 60, shape=(1, 8, 8), shards=3, splits={"train": 0.75, "val": 0.25}, layout="CHW",
               fingerprint="grey60")
    return hwc, chw


def test_grey_batches_are_augmented_and_normalized_with_the_caches_statistics(grey):
    hwc, chw = grey
    loader = CacheLoader(hwc, "train", config=cfg(seed=3))
    stats = loader.reader.manifest.channel_stats
    a = loader.config.augment
    assert stats["split"] == "train" and stats["samples"] == loader.num_samples == 45
    assert a.mean == tuple(stats["mean"]) and a.std == tuple(stats["std"]) and len(a.mean) == 1
    assert loader.normalize_from == "the dataset's statistics (train split, 45 samples)"
    assert a.crop_padding == 2 and a.flip  # only mean and std were filled in
    batch = next(iter(loader))
    assert batch["image"].shape == (8, 1, 8, 8) and batch["image"].dtype == torch.float32
    rows = loader.rows[loader.rank_indices(0, 0)]
    dy, dx, flip = augment_params(a, 3, 0, batch["sample_id"])
    assert flip.any() and not flip.all() and len(set(dy.tolist())) > 1  # crops and flips of one channel
    for i, row in enumerate(rows):
        ref = reference_augment(sample_pixels(int(row), (8, 8, 1)), dy[i], dx[i], flip[i], a)
        np.testing.assert_allclose(batch["image"][i].numpy(), ref, rtol=0, atol=1e-6)
    # CHW holds the same pixels per sample: the same batches
    assert_same(as_arrays(CacheLoader(chw, "train", config=cfg(seed=3))), as_arrays(CacheLoader(hwc, "train",
                                                                                                  config=cfg(seed=3))))
    # validation resolves the same values from the same cache (the training split's statistics, not its own)
    val = CacheLoader(hwc, "val", config=LoaderConfig.for_eval(global_batch_size=8, mode="sync"))
    assert val.config.augment.mean == a.mean and val.config.augment.std == a.std and not val.config.augment.random
    # in-RAM and threaded modes give the same grey batches
    for mode in ("thread", "memory"):
        assert_same(as_arrays(CacheLoader(hwc, "train", 1, 2, cfg(mode=mode))),
                    as_arrays(CacheLoader(hwc, "train", 1, 2, cfg())))
    # normalization off: uint8 [B, 1, H, W], the cached pixels
    raw = next(iter(CacheLoader(hwc, "train", config=cfg(augment=AugmentConfig(normalize=False)))))
    assert raw["image"].dtype == torch.uint8 and raw["image"].shape == (8, 1, 8, 8)


def test_config_values_override_the_dataset_and_must_fit_the_channels(grey, cache):
    hwc, _ = grey
    loader = CacheLoader(hwc, "train", config=cfg(augment=AugmentConfig(mean=(0.25,), std=(0.125,))))
    assert loader.config.augment.mean == (0.25,) and loader.normalize_from == "config"
    x = next(iter(CacheLoader(hwc, "train", config=cfg(augment=AugmentConfig(mean=(0.25,), std=(0.125,),
                                                                             flip=False)))))["image"]
    plain = next(iter(CacheLoader(hwc, "train", config=cfg(augment=AugmentConfig(normalize=False)))))["image"]
    np.testing.assert_allclose(x.numpy(), (plain.numpy() / 255.0 - 0.25) / 0.125, rtol=0, atol=1e-5)
    with pytest.raises(ConfigError, match=r"AugmentConfig.mean has 3 values for 1 channels"):
        CacheLoader(hwc, "train", config=cfg(augment=AugmentConfig(mean=(0.4, 0.5, 0.6), std=(0.2, 0.2, 0.2))))
    with pytest.raises(ConfigError, match="must be of equal length"):
        AugmentConfig(mean=(0.5,))
    # RGB: one value is expanded to every channel; the default takes the three channels' own statistics
    rgb = CacheLoader(cache, "train", config=cfg(augment=AugmentConfig(mean=(0.5,), std=(0.25,))))
    assert rgb.config.augment.mean == (0.5, 0.5, 0.5) and rgb.config.augment.std == (0.25, 0.25, 0.25)
    own = CacheLoader(cache, "train", config=cfg()).config.augment
    assert own.mean == tuple(rgb.reader.manifest.channel_stats["mean"]) and len(set(own.mean)) == 3
    with pytest.raises(ConfigError, match="is empty .* which a Loader resolves"):
        from dutycycle.loader.augment import to_tensor

        to_tensor(np.zeros((1, 8, 8, 1), np.uint8), AugmentConfig())


def test_sources_without_statistics_use_half_and_say_so(tmp_path):
    images = np.stack([sample_pixels(i, (8, 8, 1)) for i in range(16)])
    arrays = ArrayLoader(images, np.arange(16) % 2, config=cfg())
    assert arrays.config.augment.mean == (0.5,) and arrays.config.augment.std == (0.5,)
    assert arrays.normalize_from.startswith("0.5 (no dataset statistics: arrays in memory carry none")
    x = next(iter(arrays))["image"]
    assert x.shape == (8, 1, 8, 8) and float(x.min()) >= -1.0 and float(x.max()) <= 1.0

    # the raw path with a grey spec: the cache's pixels, decoded per step, normalized with 0.5 unless told
    table, _ = make_shapes_table(str(tmp_path), n=16, size=(20, 32))
    spec = TransformSpec(size=8, mode="L")
    cache = materialize(table, str(tmp_path / "cache"), spec, rows_per_shard=8)
    raw = RawLoader(table, spec, "train", config=cfg(drop_last=False))
    assert raw.shape == (8, 8, 1) and raw.config.augment.mean == (0.5,)
    assert "the raw path decodes per step" in raw.normalize_from
    cached = CacheLoader(cache.uri, "train", config=cfg(drop_last=False))
    assert cached.config.augment.mean == tuple(cache.manifest.channel_stats["mean"])
    given = dataclasses.replace(AUG, mean=cached.config.augment.mean, std=cached.config.augment.std)
    assert_same(as_arrays(cached), as_arrays(RawLoader(table, spec, "train", config=cfg(drop_last=False,
                                                                                        augment=given))))


@pytest.mark.ray
def test_ray_mode_reads_grey_batches_as_sync_does(ray_cluster, grey):
    hwc, _ = grey
    for rank in range(2):
        expected = as_arrays(CacheLoader(hwc, "train", rank, 2, cfg()))
        assert_same(expected, as_arrays(CacheLoader(hwc, "train", rank, 2, cfg(mode="ray"))))
