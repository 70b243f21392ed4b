"""What a shard's manifest entry records so that a node can start reading at scale: each split's row count (the
split index comes from the manifest, no column scan) and checksums of the bytes around the pixels and of every
pixel chunk, so that every ranged read is verified before its bytes are used. Real shard files; remote reads
against a real S3-compatible server."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pyarrow.compute as pc
import pytest
from dutycycle.engine.cache import format as cf
from dutycycle.engine.cache.reader import CacheReader
from dutycycle.engine.cache.shards import ReadConfig
from dutycycle.engine.errors import CorruptArtifactError
from dutycycle.loader import AugmentConfig, CacheLoader, LoaderConfig
from dutycycle.loader.source import SplitIndex

from ..support.cachemaker import make_cache, sample_pixels

PLAIN = AugmentConfig(normalize=False)
SHAPE = (32, 32, 3)  # 3,072 bytes a sample: 341 rows per 1 MiB checksum chunk


def full_scan(reader: CacheReader, split: str) -> np.ndarray:
    return np.concatenate([np.flatnonzero(pc.equal(reader.shard(i).column("split"), split).to_numpy(
        zero_copy_only=False)) + reader.offsets[i] for i in range(reader.num_shards)])


def test_shard_entries_record_split_counts_and_piecewise_checksums(tmp_path):
    uri = str(tmp_path / "cache")
    make_cache(uri, 1500, shape=SHAPE, shards=2, splits={"train": 0.8, "val": 0.2})
    manifest = cf.read_manifest(uri)
    per = int(np.prod(SHAPE))
    for info in manifest.shards:
        data = (tmp_path / "cache" / info.path).read_bytes()
        start, stop = info.image_offset, info.image_offset + info.rows * per
        assert sum(info.split_counts.values()) == info.rows and set(info.split_counts) == {"train", "val"}
        assert info.chunk_rows == (1 << 20) // per == 341
        assert len(info.chunk_sha256) == -(-info.rows // info.chunk_rows) == 3
        for k, h in enumerate(info.chunk_sha256):
            a = start + k * info.chunk_rows * per
            assert hashlib.sha256(data[a:min(stop, a + info.chunk_rows * per)]).hexdigest() == h
        assert hashlib.sha256(data[:start] + data[stop:]).hexdigest() == info.meta_sha256
        # the recorded place is the pixels: the first row's bytes are sample 0's of this shard
    first = (tmp_path / "cache" / manifest.shards[0].path).read_bytes()[manifest.shards[0].image_offset:][:per]
    assert first == sample_pixels(0, SHAPE).tobytes()
    assert sum(s.split_counts["val"] for s in manifest.shards) == manifest.split_counts["val"]


def flip(fs, path: str, offset: int) -> None:
    data = bytearray(fs.cat_file(path))
    data[offset] ^= 0xFF
    fs.pipe_file(path, bytes(data))


@pytest.fixture
def s3fs_client():
    import s3fs

    return s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]})


def test_a_damaged_pixel_chunk_is_refused_naming_shard_and_chunk(s3, s3fs_client, tmp_path):
    uri = f"{s3}/cache"
    make_cache(uri, 1200, shape=SHAPE, shards=2)
    info = cf.read_manifest(uri).shards[1]
    per = int(np.prod(SHAPE))
    path = f"{uri[len('s3://'):]}/{info.path}"
    flip(s3fs_client, path, info.image_offset + 1 * info.chunk_rows * per + 7)  # chunk 1 of shard 1
    reader = CacheReader(uri, read=ReadConfig(remote="range"))
    view = reader.view(1)
    assert np.array_equal(view.ranged.take(np.array([0, 5])),
                          np.stack([sample_pixels(600 + i, SHAPE) for i in (0, 5)]))  # chunk 0: intact, served
    with pytest.raises(CorruptArtifactError, match=r"shard-00001\.arrow.*pixel chunk 1 \(rows 341-599\) fails"):
        view.ranged.take(np.array([400]))
    # a larger read chunk is a whole number of checksum chunks: the damage is found however it is fetched
    wide = CacheReader(uri, read=ReadConfig(remote="range", range_chunk_bytes=4 << 20))
    with pytest.raises(CorruptArtifactError, match="pixel chunk 1"):
        wide.view(1).ranged.take(np.array([0]))


def test_damage_outside_the_pixels_is_refused_before_it_is_parsed(s3, s3fs_client):
    uri = f"{s3}/cache"
    make_cache(uri, 400, shape=SHAPE, shards=2, splits={"train": 0.5, "val": 0.5})
    info = cf.read_manifest(uri).shards[0]
    flip(s3fs_client, f"{uri[len('s3://'):]}/{info.path}", info.image_offset // 2)  # in the columns
    reader = CacheReader(uri, read=ReadConfig(remote="range"))
    with pytest.raises(CorruptArtifactError, match=r"shard-00000\.arrow' fails its checksum outside the pixels"):
        reader.view(0)
    reader.view(1)  # the other shard opens


def test_the_split_index_comes_from_the_manifest_and_reads_only_needed_shards(s3, tmp_path):
    uri = f"{s3}/cache"
    make_cache(uri, 2000, shape=(8, 8, 3), shards=8, splits={"train": 0.75, "val": 0.25})
    read = ReadConfig(remote="range", node_dir=str(tmp_path / "node"))
    loader = CacheLoader(uri, "train", 0, 4, LoaderConfig(global_batch_size=16, partitions=4, mode="sync",
                                                            augment=PLAIN, read=read))
    assert isinstance(loader.rows, SplitIndex)
    assert loader.reader.stats.bytes_fetched == 0  # nothing read to build it
    next(iter(loader))
    assert 0 < loader.rows.shards_resolved <= 3  # rank 0 of 4 reads partition 0: the first quarter of the rows
    assert np.array_equal(np.asarray(loader.rows), full_scan(loader.reader, "train"))
    n = len(loader.rows)
    assert np.array_equal(loader.rows[np.array([5, 0, n - 1])], full_scan(loader.reader, "train")[[5, 0, n - 1]])
    with pytest.raises(IndexError, match=rf"outside \[-{n}, {n}\)"):
        loader.rows[np.array([n])]


def test_a_manifest_whose_split_counts_disagree_is_refused(tmp_path):
    from dataclasses import replace

    uri = str(tmp_path / "cache")
    make_cache(uri, 300, shape=(8, 8, 3), shards=3, splits={"train": 0.5, "val": 0.5})
    m = cf.read_manifest(uri)
    s0, s1 = m.shards[:2]  # one 'val' row moved from shard 1's count to shard 0's: the totals still agree
    c0 = {"train": s0.split_counts["train"] - 1, "val": s0.split_counts["val"] + 1}
    c1 = {"train": s1.split_counts["train"] + 1, "val": s1.split_counts["val"] - 1}
    assert len(s0.chunk_sha256) == len(s1.chunk_sha256) == 1  # one checksum chunk a shard: counts move with it
    m.shards = [replace(s0, split_counts=c0, chunk_split_counts={k: [v] for k, v in c0.items()}),
                replace(s1, split_counts=c1, chunk_split_counts={k: [v] for k, v in c1.items()}), *m.shards[2:]]
    cf.commit(uri, m)
    loader = CacheLoader(uri, "val", config=LoaderConfig(global_batch_size=10, mode="sync", shuffle=False))
    with pytest.raises(CorruptArtifactError, match=r"shard-00000\.arrow.*'val' rows but its manifest entry says"):
        np.asarray(loader.rows)


def test_blocks_cut_at_chunks_fetch_each_chunk_once_by_range(s3, tmp_path):
    """A ranged reader with a chunk cache of six chunks, over an epoch: with blocks cut at the cache's chunks
    (``block_size = 0``) a window of 1,024 samples draws from at most five chunks, and each chunk is fetched about
    once; with the default blocks of 64 rows a window draws from 16 chunks, more than the cache holds, and chunks
    are fetched again and again."""
    uri = f"{s3}/cache"
    make_cache(uri, 4096, shape=SHAPE, shards=2)  # 2 shards of 2048 rows: 7 checksum chunks each (6 of 341 rows)
    info = cf.read_manifest(uri).shards[0]
    assert info.chunk_split_counts == {"train": [341] * 6 + [2]}
    pixels = 4096 * int(np.prod(SHAPE))
    fetched = {}
    for block in (0, 64):
        read = ReadConfig(remote="range", range_cache_bytes=6 << 20, node_dir=str(tmp_path / f"node{block}"))
        cfg = LoaderConfig(global_batch_size=64, window=1024, block_size=block, mode="sync", augment=PLAIN, read=read)
        loader = CacheLoader(uri, "train", config=cfg)
        assert sum(len(b["label"]) for b in loader) == 4096
        fetched[block] = loader.reader.stats.bytes_fetched
    assert fetched[0] < 1.1 * pixels, fetched  # each chunk once, plus the columns and footers
    assert fetched[64] > 2 * pixels, fetched


def test_chunk_split_counts_follow_the_rows(tmp_path):
    uri = str(tmp_path / "cache")
    make_cache(uri, 1500, shape=SHAPE, shards=2, splits={"train": 0.8, "val": 0.2})
    reader = CacheReader(uri)
    for i, info in enumerate(reader.manifest.shards):
        split = reader.view(i).split.to_numpy(zero_copy_only=False)
        for name, per_chunk in info.chunk_split_counts.items():
            want = [int((split[k * info.chunk_rows:(k + 1) * info.chunk_rows] == name).sum())
                    for k in range(len(info.chunk_sha256))]
            assert per_chunk == want
    loader = CacheLoader(uri, "val", config=LoaderConfig(global_batch_size=10, block_size=0, mode="sync"))
    starts = loader.source.block_starts()
    assert starts[0] == 0 and np.all(np.diff(starts) > 0) and len(starts) == 6  # 3 chunks in each shard


def test_the_split_index_reads_masks_and_negative_indices_as_an_array_does(tmp_path):
    uri = str(tmp_path / "cache")
    make_cache(uri, 300, shape=(8, 8, 3), shards=3, splits={"train": 0.5, "val": 0.5})
    reader = CacheReader(uri)
    index = SplitIndex(reader, "val")
    whole = full_scan(reader, "val")
    mask = np.zeros(len(index), bool)
    mask[[0, 5, 8]] = True
    assert np.array_equal(index[mask], whole[mask])
    assert np.array_equal(index[np.array([-1, -len(index)])], whole[[-1, 0]])
    assert index[3] == whole[3] and np.array_equal(index[2:9:3], whole[2:9:3])
    with pytest.raises(IndexError):
        index[np.array([[0, 1]])]
    with pytest.raises(IndexError):
        index[np.array([len(index)])]


def test_reads_count_every_shard_a_loader_opens(tmp_path):
    """A one-split cache (its split index needs no shard): the shards a batch reads are counted all the same."""
    uri = str(tmp_path / "cache")
    make_cache(uri, 400, shape=(8, 8, 3), shards=4)
    loader = CacheLoader(uri, "train", 0, 2, LoaderConfig(global_batch_size=8, partitions=2, mode="sync",
                                                           augment=PLAIN))
    next(iter(loader))
    reads = loader.reader.reads()
    assert reads["shards"] >= 1 and reads["shard_runs"][0][0] == 0 and reads["of_shards"] == 4
    for _ in loader:
        pass
    assert loader.reader.reads()["shard_runs"] == [[0, 1]]  # rank 0 of 2, partition 0 of 2: the first half
