"""How cache shards are read: checksums once per node, remote caches by range with bounded memory, node-local
copies downloaded once, split indexes without pixels. Real files, real processes, a real S3-compatible server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from dutycycle.engine.cache import format as cf
from dutycycle.engine.cache.reader import CacheReader
from dutycycle.engine.cache.shards import ReadConfig
from dutycycle.engine.errors import ConfigError, CorruptArtifactError
from dutycycle.loader import AugmentConfig, CacheLoader, LoaderConfig

from ..support.cachemaker import make_cache

PLAIN = AugmentConfig(crop_padding=0, flip=False, normalize=False)

# A child process opens the cache, reads every shard's pixels and prints its read statistics.
READ_ALL = """
import json, sys
from dutycycle.engine.cache.reader import CacheReader
from dutycycle.engine.cache.shards import ReadConfig
r = CacheReader(sys.argv[1], read=ReadConfig(**json.loads(sys.argv[2])))
total = sum(int(r.images(i).sum()) for i in range(r.num_shards))
print(json.dumps({"sum": total, **r.stats.__dict__}))
"""


def read_all_in_processes(uri: str, n: int, read: dict, node_dir: str) -> list[dict]:
    env = {**os.environ, "DUTYCYCLE_NODE_DIR": node_dir}
    procs = [subprocess.Popen([sys.executable, "-c", READ_ALL, uri, json.dumps(read)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(n)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-2000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def loader_batches(uri, read: ReadConfig, split="train", steps=None, **config):
    config.setdefault("global_batch_size", 32)
    loader = CacheLoader(uri, split, 0, 1, LoaderConfig(mode="sync", augment=PLAIN, read=read, **config))
    got = []
    for b in loader:
        got.append((b["image"].numpy().copy(), b["label"].numpy().copy(), list(b["sample_id"])))
        if steps is not None and len(got) == steps:
            break
    return loader, got


def assert_same(a, b):
    assert len(a) == len(b) > 0
    for (ia, la, sa), (ib, lb, sb) in zip(a, b, strict=True):
        assert sa == sb and np.array_equal(la, lb) and np.array_equal(ia, ib)


def test_local_checksum_is_verified_once_per_node(tmp_path):
    uri, node_dir = str(tmp_path / "cache"), str(tmp_path / "node")
    make_cache(uri, 400, shape=(16, 16, 3), shards=4)
    # Four processes open the cache at once: each shard is hashed by exactly one of them.
    stats = read_all_in_processes(uri, 4, {}, node_dir)
    assert len({s["sum"] for s in stats}) == 1
    assert sum(s["shards_hashed"] for s in stats) == 4
    assert read_all_in_processes(uri, 1, {}, node_dir)[0]["shards_hashed"] == 0  # a later process: none
    assert read_all_in_processes(uri, 1, {"verify": "always"}, node_dir)[0]["shards_hashed"] == 4
    # A shard changed after it was verified is a new version of the file: hashed again, and refused.
    shard = tmp_path / "cache" / "shards" / "shard-00002.arrow"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    reader = CacheReader(uri, read=ReadConfig(node_dir=node_dir))
    reader.images(1)
    with pytest.raises(CorruptArtifactError, match=r"shard-00002\.arrow.*fails its checksum"):
        reader.images(2)
    assert reader.stats.shards_hashed == 1


def test_s3_cache_read_by_range_with_bounded_memory(s3, tmp_path, monkeypatch):
    """A 6.3 MB cache on S3 read by range: three batches fetch a small part of it, a whole epoch holds little
    more than the chunk cache, and the batches are bit-identical to a local copy's."""
    uri, local = f"{s3}/cache", str(tmp_path / "local")
    # A verified read fetches whole checksum chunks: this cache records one per 32 KB of pixels, so that reads
    # by 32 KB chunks stay small next to its size
    monkeypatch.setattr(cf, "CHECK_CHUNK_BYTES", 32 * 1024)
    make_cache(uri, 2000, shape=(32, 32, 3), shards=4)  # 3 KB per sample, 4 shards of 500 rows (1.5 MB each)
    make_cache(local, 2000, shape=(32, 32, 3), shards=4)  # the same cache, on local disk
    total = sum(s.bytes for s in cf.read_manifest(uri).shards)
    read = ReadConfig(remote="range", range_chunk_bytes=32 * 1024, range_cache_bytes=1 << 20)
    plan = {"global_batch_size": 64, "window": 256, "block_size": 32}  # 8 windows of 8 blocks
    loader, got = loader_batches(uri, read, steps=3, **plan)
    assert loader.reader.remote == "range" and "ranged reads" in loader.execution
    _, expected = loader_batches(local, ReadConfig(), steps=3, **plan)
    assert_same(got, expected)
    # The first window's 8 blocks of 32 rows, fetched in chunks of 10 rows (~1 MB), each shard's ids, labels
    # and splits (~24 KB) and 16 KB of edges per shard. Measured: 1.18 MB in 47 requests, 0.19 of the cache.
    fetched = loader.reader.stats.bytes_fetched
    assert fetched < 0.25 * total, (fetched, total)
    # A whole epoch: every Python-visible allocation (numpy buffers, fetched bytes) together peaks near the
    # 1 MB chunk cache plus a batch and the shards' small columns, whatever the cache's size. Measured peak:
    # 2.3 MB, 0.37 of this cache.
    tracemalloc.start()
    try:
        loader.set_epoch(1)
        n = sum(len(b["label"]) for b in loader)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == 2000 - 2000 % 64
    assert peak < 0.45 * total, (peak, total)
    assert loader.reader._chunks._bytes <= (1 << 20) + 64 * 32 * 1024  # the cache bound (+ one batch's chunks)
    # Arrow's allocations, which tracemalloc does not see: an open ranged shard holds its small columns only. On
    # main each open view kept a buffer the size of its whole shard (Arrow reads a record batch from a file it
    # cannot map into one body-sized buffer): 6.3 MB here, 3.5 GB for the loader benchmark's 300 shards.
    import pyarrow as pa

    reader = CacheReader(uri, read=read)
    before = pa.total_allocated_bytes()
    views = [reader.view(i) for i in range(reader.num_shards)]
    held = pa.total_allocated_bytes() - before
    assert held < 0.05 * total and len(views) == 4, (held, total)  # measured: 91 KB (ids, splits, labels)


def test_s3_node_copies_are_downloaded_and_verified_once_per_node(s3, tmp_path):
    uri, node_dir = f"{s3}/cache", str(tmp_path / "node")
    make_cache(uri, 400, shape=(16, 16, 3), shards=4)
    sizes = [s.bytes for s in cf.read_manifest(uri).shards]
    first = read_all_in_processes(uri, 2, {"remote": "disk"}, node_dir)
    assert sum(s["shards_downloaded"] for s in first) == 4 and sum(s["shards_hashed"] for s in first) == 4
    assert sum(s["bytes_fetched"] for s in first) == sum(sizes)  # each shard crossed the network once
    again = read_all_in_processes(uri, 1, {"remote": "disk"}, node_dir)[0]
    assert again["shards_downloaded"] == again["shards_hashed"] == again["bytes_fetched"] == 0
    assert again["sum"] == first[0]["sum"]
    # A small disk cache keeps the most recently used shards only.
    small = ReadConfig(remote="disk", node_dir=str(tmp_path / "small"), disk_cache_bytes=int(2.5 * max(sizes)))
    reader = CacheReader(uri, read=small)
    for i in range(4):
        reader.images(i)
    kept = os.listdir(tmp_path / "small" / "shards")
    assert sorted(kept) == sorted(f"{cf.read_manifest(uri).shards[i].sha256}.arrow" for i in (2, 3))
    with pytest.raises(ConfigError, match="disk_cache_bytes"):
        CacheReader(uri, read=ReadConfig(remote="disk", node_dir=str(tmp_path / "tiny"), disk_cache_bytes=10)
                       ).images(0)


def test_a_node_copy_is_recorded_as_verified_before_it_appears(s3, tmp_path, monkeypatch):
    """Another process may find the copy at its name (outside the download's lock) the moment it is renamed
    there: its verification record must already exist, or that process hashes the shard a second time (seen
    once in CI: 5 shards hashed for 4). At each rename, a second reader's check of the copy hashes nothing."""
    from dutycycle.engine.cache import node, remote

    uri, node_dir = f"{s3}/cache", str(tmp_path / "node")
    make_cache(uri, 200, shape=(8, 8, 3), shards=2)
    shas = {s.sha256: s.bytes for s in cf.read_manifest(uri).shards}
    real_replace, seen = os.replace, []

    def replace_then_check(src, dst):
        real_replace(src, dst)
        sha = os.path.basename(dst).removesuffix(".arrow")
        if sha in shas:  # a shard landing (not a record written through write_file_atomic)
            seen.append(node.verify_once(dst, sha, shas[sha], node_dir))

    monkeypatch.setattr(remote.os, "replace", replace_then_check)
    reader = CacheReader(uri, read=ReadConfig(remote="disk", node_dir=node_dir))
    for i in range(reader.num_shards):
        reader.images(i)
    assert seen == [(True, False)] * 2 and reader.stats.shards_hashed == 2


def test_s3_damaged_or_missing_shards_are_refused(s3, tmp_path):
    import s3fs

    uri = f"{s3}/cache"
    make_cache(uri, 100, shape=(8, 8, 3), shards=2)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]})
    path = uri[len("s3://"):] + "/shards/shard-00001.arrow"
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    reader = CacheReader(uri, read=ReadConfig(remote="disk", node_dir=str(tmp_path / "node")))
    reader.images(0)
    with pytest.raises(CorruptArtifactError, match=r"shard-00001\.arrow.*fails its checksum"):
        reader.images(1)
    assert not [f for f in os.listdir(tmp_path / "node" / "shards") if "tmp" in f]  # nothing half-landed
    fs.rm(path)
    for remote in ("disk", "range"):
        reader = CacheReader(uri, read=ReadConfig(remote=remote, node_dir=str(tmp_path / f"n-{remote}")))
        with pytest.raises(CorruptArtifactError, match=r"shard-00001\.arrow.*is missing"):
            reader.images(1)


@pytest.mark.parametrize("kw,name", [({"verify": "sometimes"}, "verify"), ({"remote": "ftp"}, "remote"),
                                     ({"range_chunk_bytes": 0}, "range_chunk_bytes"),
                                     ({"disk_cache_bytes": -1}, "disk_cache_bytes"),
                                     ({"max_open_shards": True}, "max_open_shards")])
def test_bad_read_config_is_a_config_error(kw, name):
    with pytest.raises(ConfigError, match=f"ReadConfig.{name}"):
        ReadConfig(**kw)


def _flip(fs, path: str, at: int) -> None:
    data = bytearray(fs.cat_file(path))
    data[at] ^= 0xFF
    fs.pipe_file(path, bytes(data))


# Every way a shard's bytes reach a caller: each must refuse a damaged shard. (name, call on a reader, whether
# it returns pixels: a ranged read fetches only what it returns, so a flipped pixel stops only those.)
READ_PATHS = [
    ("images", lambda r: r.images(1), True),
    ("view", lambda r: r.view(1).labels, False),
    ("column label", lambda r: r.column(1, "label"), False),
    ("column split", lambda r: r.column(1, "split"), False),
    ("column image (whole shard)", lambda r: r.column(1, "image"), True),
    ("shard", lambda r: r.shard(1), True),
    ("gatherer", lambda r: _gatherer(r).read(np.arange(r.offsets[1], r.offsets[2])), True),
    ("split index", lambda r: _split_index(r)[np.arange(len(_split_index(r)))], False),
    ("memory split", lambda r: _memory_split(r), True),
]


def _gatherer(reader):
    from dutycycle.loader.source import ShardGatherer

    return ShardGatherer(reader)


def _split_index(reader):
    from dutycycle.loader.source import SplitIndex

    return SplitIndex(reader, "train")


def _memory_split(reader):
    from dutycycle.loader.source import MemorySplit

    return MemorySplit.gather(reader, np.arange(reader.num_samples))


@pytest.mark.parametrize("where", ["local", "s3"])
def test_every_read_path_checks_the_checksum(request, tmp_path, where):
    """A byte flipped in a shard's pixels, then one outside them, is refused by every read path, local or
    remote, memory-mapped, node-local copy or by range. On main ``CacheReader.shard()`` (and so
    ``column(i, "image")``) of a ranged cache downloaded the shard and parsed it unchecked."""
    import fsspec

    uri = f"{request.getfixturevalue('s3')}/cache" if where == "s3" else str(tmp_path / "cache")
    manifest = make_cache(uri, 60, shape=(8, 8, 3), shards=2, splits={"train": 0.5, "val": 0.5})
    fs, root = fsspec.core.url_to_fs(uri)
    info = manifest.shards[1]
    path = f"{root}/{info.path}"
    remotes = ["auto"] if where == "local" else ["disk", "range"]
    # a landed node copy is hashed as it lands and a ranged piece as it arrives, whatever ``verify`` says
    verifies = ("once", "always") if where == "local" else ("once",)
    runs = 0
    for flipped in ("pixels", "outside"):
        # the middle of the pixels; the last byte before them (the split column's end: still covered)
        _flip(fs, path, info.image_offset + 100 if flipped == "pixels" else info.image_offset - 1)
        for remote in remotes:
            for verify in verifies:
                for name, call, pixels in READ_PATHS:
                    node_dir = str(tmp_path / f"node-{runs}")
                    reader = CacheReader(uri, read=ReadConfig(remote=remote, verify=verify, node_dir=node_dir))
                    runs += 1
                    if remote == "range" and flipped == "pixels" and not pixels:
                        call(reader)  # reads no pixel, so nothing it returns is damaged
                        continue
                    try:
                        call(reader)
                    except CorruptArtifactError as e:
                        assert re.search(r"shard-00001\.arrow.*fails its checksum", str(e)), (name, str(e))
                    else:
                        pytest.fail(f"{name} ({remote}, verify={verify}) read a shard with flipped {flipped}")
                reader.images(0)  # the good shard still reads
        _flip(fs, path, info.image_offset + 100 if flipped == "pixels" else info.image_offset - 1)  # undo
    assert runs == len(READ_PATHS) * 2 * len(remotes) * len(verifies)
