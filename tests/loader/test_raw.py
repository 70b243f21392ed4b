"""The raw path: the same plan over the metadata table, decoded per step, equals the cache loader batch for batch."""

from __future__ import annotations

import os

import numpy as np
import pytest
from dutycycle.engine.cache.materialize import materialize
from dutycycle.engine.roots import RootCheck
from dutycycle.engine.transform import DecodeError, TransformSpec
from dutycycle.loader import AugmentConfig, CacheLoader, LoaderConfig, RawLoader, TorchDataset
from torch.utils.data import DataLoader

from ..support.memory import mapping_of
from ..support.tablemaker import add_file, jpeg_bytes, make_shapes_table, shape_image, write_table
from .test_loader import as_arrays, assert_same

SPEC = TransformSpec(size=16)
AUG = AugmentConfig(crop_padding=2, flip=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("raw"))
    table, rows = make_shapes_table(root, n=40, n_errors=2, size=(20, 40))
    result = materialize(table, root + "/cache", SPEC, runner="native", rows_per_shard=16)
    return table, result.uri, rows


def cfg(**kw):
    kw.setdefault("global_batch_size", 8)
    kw.setdefault("augment", AUG)
    kw.setdefault("raw_threads", 2)
    return LoaderConfig(**kw)


def test_raw_equals_cache_batch_for_batch(data):
    table, cache, _ = data
    cached = CacheLoader(cache, "train", config=cfg(mode="sync"))
    # the raw path has no statistics of its own: given the cache's (what the cache loader resolved), it
    # normalizes alike
    a = cached.config.augment
    assert cached.normalize_from.startswith("the dataset's statistics") and len(a.mean) == 3
    raw = RawLoader(table, SPEC, "train", config=cfg(mode="sync", augment=AugmentConfig(
        crop_padding=2, flip=True, mean=a.mean, std=a.std)))
    assert raw.normalize_from == "config" and raw.config.augment == a
    assert raw.fingerprint == cached.fingerprint and len(raw) == len(cached) > 1
    assert (raw.shape, raw.layout, raw.classes) == (cached.shape, cached.layout, cached.classes)
    raw.set_epoch(1)
    cached.set_epoch(1)
    assert_same(as_arrays(cached), as_arrays(raw))


def test_raw_thread_mode_at_two_ranks_matches_single_rank(data):
    table, _, _ = data
    single = as_arrays(RawLoader(table, SPEC, "train", config=cfg(mode="sync")))
    halves = [as_arrays(RawLoader(table, SPEC, "train", r, 2, cfg(mode="thread"))) for r in range(2)]
    for s, (img, lab, ids) in enumerate(single):
        assert np.array_equal(img, np.concatenate([halves[0][s][0], halves[1][s][0]]))
        assert ids == halves[0][s][2] + halves[1][s][2]
        assert np.array_equal(lab, np.concatenate([halves[0][s][1], halves[1][s][1]]))


def test_raw_loader_in_dataloader_workers_decodes_the_same_batches(data):
    """A TorchDataset over the raw path: each DataLoader worker takes its own copy of the row plan (no thread
    pool from the parent) and decodes its steps; the batches are the raw loader's own."""
    table, _, _ = data
    expected = as_arrays(RawLoader(table, SPEC, "train", config=cfg(mode="sync")))
    view = TorchDataset(RawLoader(table, SPEC, "train", config=cfg(mode="thread")))
    assert_same(as_arrays([view.loader.peek()]), expected[:1])  # the parent's source now holds a thread pool
    assert view.loader.source._pool is not None
    assert_same(as_arrays(DataLoader(view, batch_size=None, num_workers=2)), expected)


@pytest.mark.ray
def test_raw_ray_mode_matches_sync(ray_cluster, data):
    table, _, _ = data
    expected = as_arrays(RawLoader(table, SPEC, "val", config=cfg(mode="sync", drop_last=False)))
    got = as_arrays(RawLoader(table, SPEC, "val", config=cfg(mode="ray", drop_last=False)))
    assert_same(expected, got)
    # uint8 batches: the decode tasks leave them in this process's shared-memory folder (``loader.shm``), copied
    # once after decoding, and the loader hands out tensors over those pages (never a copy out of the object store)
    plain = AugmentConfig(crop_padding=0, flip=False, normalize=False)
    loader = RawLoader(table, SPEC, "val", config=cfg(mode="ray", drop_last=False, augment=plain))
    for b in loader:
        assert f"{loader.source._batches.path}/batch-" in mapping_of(b["image"].data_ptr())
    assert os.listdir(loader.source._batches.path) == []  # each file unlinked as it was mapped


def test_raw_undecodable_file_names_it(tmp_path, data):
    _, _, rows = data
    bad = add_file(str(tmp_path / "images"), "bad.jpg", b"\xff\xd8\xff" + b"\x00" * 64, "circle", error="x")
    bad.update(split="train", error=None)  # a row the table thought readable, whose bytes are not an image
    table = write_table(str(tmp_path / "table"), [r for r in rows if r["error"] is None] + [bad])
    loader = RawLoader(table, SPEC, "train", config=cfg(mode="thread", drop_last=False))
    with pytest.raises(DecodeError, match=r"bad\.jpg"):
        for _ in loader:
            pass


def test_raw_rejects_memory_mode_and_unknown_split(data):
    table, _, _ = data
    from dutycycle.engine.errors import ConfigError

    with pytest.raises(ConfigError, match="mode='memory'"):
        RawLoader(table, SPEC, "train", config=cfg(mode="memory"))
    with pytest.raises(ConfigError, match="split 'test'"):
        RawLoader(table, SPEC, "test", config=cfg(mode="sync"))


def test_raw_reads_respect_the_per_file_byte_cap(tmp_path, monkeypatch):
    """The raw path reads untrusted files with the same cap as ingest and materialize: no whole read past it."""
    from dutycycle.engine.io import FileTooLargeError, read_capped
    from dutycycle.loader import decode

    path = tmp_path / "big.jpg"
    path.write_bytes(b"\xff\xd8\xff" + b"\x00" * 5000)
    assert len(read_capped(str(path), max_bytes=10_000)) == 5003
    with pytest.raises(FileTooLargeError, match="per-file limit of 1000 bytes"):
        read_capped(str(path), max_bytes=1000)
    # and the raw path's decode reads through that cap: a file over it is a "too large" DecodeError, unread
    monkeypatch.setattr(decode, "DEFAULT_MAX_FILE_BYTES", 1000)
    with pytest.raises(DecodeError, match="per-file limit of 1000 bytes") as err:
        decode.decode_one(str(path), SPEC, RootCheck([str(tmp_path)]))
    assert err.value.reason == "too large"


def test_raw_reads_only_rows_inside_the_tables_roots(tmp_path, data):
    """A crafted table's rows outside its source roots (``/etc/passwd``, another folder's image) are left out of
    the plan, counted and named, as materialize leaves them out of the cache; allowed roots bring them back; a
    symlink that points out of the roots when a step reads it is refused."""
    import os

    from dutycycle.engine.transform import decode_and_transform

    _, _, rows = data
    good = [dict(r, split="train") for r in rows if r["error"] is None]
    root = os.path.dirname(os.path.dirname(good[0]["uri"]))  # the images folder: class folders below it
    other = str(tmp_path / "other")
    img, kind = shape_image(1000, 24, 24)
    stranger = add_file(other, "stranger.jpg", jpeg_bytes(img), kind)
    stranger["split"] = "train"
    passwd = dict(good[1], uri="/etc/passwd", sample_id="1" * 32)
    table = write_table(str(tmp_path / "table"), [*good, stranger, passwd], roots=[root])
    with pytest.warns(UserWarning, match="2 rows outside the table's source roots are left out"):
        raw = RawLoader(table, SPEC, "train", config=cfg(mode="sync", drop_last=False))
    assert raw.outside == 2 and len(raw.uris) == len(good)
    assert "/etc/passwd" not in raw.uris and stranger["uri"] not in raw.uris
    with pytest.warns(UserWarning, match="'/etc/passwd'"):
        allowed = RawLoader(table, SPEC, "train", config=cfg(mode="sync", drop_last=False), allowed_roots=[other])
    assert allowed.outside == 1 and stranger["uri"] in allowed.uris and "/etc/passwd" not in allowed.uris
    # checked again when a step reads: a file swapped for a symlink out of the roots after the plan is refused
    victim = raw.uris[0]
    os.rename(victim, victim + ".moved")
    os.symlink(stranger["uri"], victim)
    try:
        with pytest.raises(DecodeError, match="outside the table's source roots") as err:
            for _ in raw:
                pass
        assert err.value.reason == "outside the table's source roots"
    finally:
        os.unlink(victim)
        os.rename(victim + ".moved", victim)
    assert decode_and_transform(open(victim, "rb").read(), SPEC).shape == (16, 16, 3)


@pytest.mark.ray
def test_raw_ray_tasks_check_the_roots_when_they_read(ray_cluster, tmp_path, data):
    """Ray decode tasks refuse what this process refuses: a file swapped for a symlink out of the table's roots
    after the plan is refused inside the task that reads it."""
    import os

    _, _, rows = data
    good = [dict(r, split="train") for r in rows if r["error"] is None]
    root = os.path.dirname(os.path.dirname(good[0]["uri"]))
    img, kind = shape_image(1001, 24, 24)
    stranger = add_file(str(tmp_path / "other"), "stranger.jpg", jpeg_bytes(img), kind)
    table = write_table(str(tmp_path / "table"), good, roots=[root])
    raw = RawLoader(table, SPEC, "train", config=cfg(mode="ray", drop_last=False))
    victim = raw.uris[0]
    os.rename(victim, victim + ".moved")
    os.symlink(stranger["uri"], victim)
    try:
        with pytest.raises(DecodeError, match="outside the table's source roots"):
            for _ in raw:
                pass
    finally:
        os.unlink(victim)
        os.rename(victim + ".moved", victim)
