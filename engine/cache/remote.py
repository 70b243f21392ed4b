"""Remote shards: read by byte range through Arrow's random-access file reader, or copied once per node to disk.

**By range.** Arrow's IPC file reader asks a random-access file for exactly the pieces it needs: the footer,
the record batch's metadata, then one buffer per column it was told to include. ``RangeFile`` answers those
asks from the ranges fetched on open: everything but the pixel buffer, whose place the manifest records. Pixels
are then fetched in whole-row chunks as batches need them (``RangedPixels``), all chunks of a batch in one
concurrent ``cat_ranges`` call, into a bounded chunk cache shared by the reader's shards.

**On disk.** ``DiskCache`` keeps whole shards under ``<node dir>/shards/<sha256>.arrow`` (content-addressed, so
two caches with the same shard share it). The first process on the node that needs a shard takes its lock,
downloads it to a temporary file while hashing it, checks the sha256, and renames it into place; the others
wait on the lock and then map the file. Beyond ``limit_bytes`` the least recently used files are deleted
(a process that still maps one keeps reading it: unlinking a mapped file is safe on Linux). A copy is used only
while ``node.trusted`` (this user's, mode 0600, as it was written); any other file at its name is fetched
again over it.
"""

from __future__ import annotations

import hashlib
import io as _io
import os
import shutil
import threading
import time
import uuid
from collections import OrderedDict

import numpy as np
import pyarrow as pa

from ..errors import ConfigError, CorruptArtifactError
from . import node
from .shards import ReadStats, ShardView, single_chunk


class RangeFile(_io.RawIOBase):
    """A remote object of known size as a seekable, read-only file; reads become ranged requests.

    Ranges fetched once are kept (``pieces``) and serve later reads inside them.
    """

    def __init__(self, fs, path: str, size: int, stats: ReadStats):
        self.fs, self.path, self.size, self.stats = fs, path, size, stats
        self.pos = 0
        self.pieces: list[tuple[int, bytes]] = []

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def fetch(self, ranges: list[tuple[int, int]]) -> None:
        """Fetch ``[(start, stop), ...]`` concurrently and keep them."""
        merged: list[tuple[int, int]] = []
        for a, b in sorted((max(0, a), min(self.size, b)) for a, b in ranges):
            if b <= a:
                continue
            if merged and a <= merged[-1][1]:  # overlapping or touching: one request
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        ranges = merged
        if not ranges:
            return
        got = self.fs.cat_ranges([self.path] * len(ranges), [a for a, _ in ranges], [b for _, b in ranges])
        for (a, b), data in zip(ranges, got, strict=True):
            if isinstance(data, Exception):
                raise data
            if len(data) != b - a:
                raise CorruptArtifactError(f"cache shard {self.path!r} is shorter than its manifest says; "
                                           "materialize the cache again")
            self.pieces.append((a, bytes(data)))
            self.stats.add_fetch(len(data))  # one request per range, as in RangedPixels.take

    def _kept(self, start: int, n: int) -> bytes | None:
        for a, data in self.pieces:
            if a <= start and start + n <= a + len(data):
                return data[start - a : start - a + n]
        return None

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n is None or n < 0 else min(n, self.size - self.pos)
        if n <= 0:
            return b""
        data = self._kept(self.pos, n)
        if data is None:
            self.fetch([(self.pos, self.pos + n)])
            data = self._kept(self.pos, n)
        self.pos += n
        return data

    def readinto(self, buf) -> int:
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)


def open_ranged(fs, path: str, index: int, info, shape: tuple[int, ...], stats: ReadStats,
                chunks: ChunkCache) -> ShardView:
    """Open a remote shard for range reads: its small columns now, pixels on demand. ``info`` is the shard's
    manifest entry (``format.ShardInfo``), which gives the pixel buffer's place and checksums: everything but the
    pixels comes in one request of two ranges, checked against ``meta_sha256`` before Arrow parses a byte of it,
    and each pixel chunk is checked as it arrives."""
    per = int(np.prod(shape))
    start, stop = info.image_offset, info.image_offset + info.rows * per
    if not 0 < start <= stop <= info.bytes:
        raise CorruptArtifactError(f"cache shard {path!r}: its manifest entry places the pixels at [{start}, {stop}) "
                                   f"in {info.bytes} bytes; materialize the cache again")
    f = RangeFile(fs, path, info.bytes, stats)
    f.fetch([(0, start), (stop, info.bytes)])
    head, tail = f._kept(0, start), f._kept(stop, info.bytes - stop) if stop < info.bytes else b""
    h = hashlib.sha256(head)
    h.update(tail)
    if h.hexdigest() != info.meta_sha256:
        raise CorruptArtifactError(f"cache shard {path!r} fails its checksum outside the pixels (columns and footer: "
                                   f"expected sha256 {info.meta_sha256[:12]}...); materialize the cache again")
    names = pa.ipc.open_file(pa.PythonFile(f, mode="r")).schema.names
    small = [names.index(c) for c in ("sample_id", "label", "split") if c in names]
    opts = pa.ipc.IpcReadOptions(included_fields=small)
    batch = pa.ipc.open_file(pa.PythonFile(f, mode="r"), options=opts).get_batch(0)
    if batch.num_rows != info.rows:
        raise CorruptArtifactError(f"cache shard {path!r} has {batch.num_rows} rows, manifest says {info.rows}")
    # Arrow reads a record batch from a file it cannot map into one buffer the size of the whole body, pixels
    # included (left unfilled: only the included columns are read into it), and the columns point into it. Kept,
    # that buffer held every open ranged shard's full size: 12 MB a shard of the loader benchmark's cache, where
    # the s3 range row's private memory grew by 120 MiB over 20 shards. The small columns are copied out (a few
    # bytes a row) so the body goes now.
    label = single_chunk(batch.column("label")).to_numpy(zero_copy_only=False).astype(np.int64, copy=True)
    return ShardView(
        index=index, rows=info.rows, labels=label,
        ids=_own(batch.column("sample_id")), split=_own(batch.column("split")),
        ranged=RangedPixels(fs, path, index, start, info.rows, shape, chunks,
                            checks=(info.chunk_rows, info.chunk_sha256)),
    )


def _own(column) -> pa.Array:
    """A copy of ``column`` in buffers of its own (not slices of a larger one)."""
    col = single_chunk(column)
    return col.take(pa.array(np.arange(len(col), dtype=np.int64)))


class ChunkCache:
    """Fetched pixel chunks, least recently used dropped beyond ``capacity`` bytes (shared by a reader's shards)."""

    def __init__(self, capacity: int, chunk_bytes: int, stats: ReadStats):
        self.capacity, self.chunk_bytes, self.stats = capacity, chunk_bytes, stats
        self._chunks: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get_many(self, keys: list[tuple[int, int]]) -> dict[tuple[int, int], np.ndarray]:
        with self._lock:
            out = {}
            for k in keys:
                if k in self._chunks:
                    self._chunks.move_to_end(k)
                    out[k] = self._chunks[k]
            return out

    def put_many(self, items: dict[tuple[int, int], np.ndarray], keep: set) -> None:
        with self._lock:
            for k, arr in items.items():
                self._chunks[k] = arr
                self._bytes += arr.nbytes
            while self._bytes > self.capacity and self._chunks:
                k = next(iter(self._chunks))
                if k in keep and len(keep) >= len(self._chunks):
                    break  # everything left is needed by the batch being gathered
                self._bytes -= self._chunks.pop(k).nbytes


class RangedPixels:
    """Pixels of a remote shard, fetched by whole-row chunks when rows are asked for.

    With ``checks = (rows per checksum, [sha256, ...])`` from the shard's record, a fetch is a whole number of
    checksum chunks (the configured chunk size rounded to a multiple of them) and every one is verified before
    its rows are used; a mismatch is refused naming the shard and the chunk."""

    def __init__(self, fs, path: str, shard: int, offset: int, rows: int, shape: tuple[int, ...], chunks: ChunkCache,
                 checks: tuple[int, list[str]] | None = None):
        self.fs, self.path, self.shard, self.offset, self.rows, self.shape = fs, path, shard, offset, rows, shape
        self.per = int(np.prod(shape))
        self.chunk_rows = max(1, chunks.chunk_bytes // self.per)
        self.checks = checks
        if checks:
            unit = checks[0]
            self.chunk_rows = unit * max(1, round(self.chunk_rows / unit))
        self.chunks = chunks

    def _verify(self, first_row: int, data: bytes) -> None:
        unit, hashes = self.checks
        step = unit * self.per
        view = memoryview(data)
        for k, a in enumerate(range(0, len(data), step), start=first_row // unit):
            if k >= len(hashes) or hashlib.sha256(view[a:a + step]).hexdigest() != hashes[k]:
                rows = f"rows {k * unit}-{min(self.rows, (k + 1) * unit) - 1}"
                raise CorruptArtifactError(f"cache shard {self.path!r}: pixel chunk {k} ({rows}) fails its checksum "
                                           "in the manifest; its bytes were not used. Materialize the cache again")

    def take(self, local: np.ndarray) -> np.ndarray:
        """uint8 [len(local), *shape]: the given rows of this shard, in the given order."""
        which = local // self.chunk_rows
        need = np.unique(which).tolist()
        keys = [(self.shard, c) for c in need]
        have = self.chunks.get_many(keys)
        todo = [c for c in need if (self.shard, c) not in have]
        if todo:
            spans = [(c * self.chunk_rows, min(self.rows, (c + 1) * self.chunk_rows)) for c in todo]
            got = self.fs.cat_ranges([self.path] * len(todo), [self.offset + a * self.per for a, _ in spans],
                                     [self.offset + b * self.per for _, b in spans])
            fresh = {}
            for c, (a, b), data in zip(todo, spans, got, strict=True):
                if isinstance(data, Exception):
                    raise data
                if len(data) != (b - a) * self.per:
                    raise CorruptArtifactError(f"cache shard {self.path!r} is shorter than its manifest says; "
                                               "materialize the cache again")
                if self.checks:
                    self._verify(a, data)
                fresh[(self.shard, c)] = np.frombuffer(data, np.uint8).reshape(b - a, *self.shape)
                self.chunks.stats.add_fetch(len(data))
            have.update(fresh)
            self.chunks.put_many(fresh, set(keys))
        out = np.empty((len(local), *self.shape), np.uint8)
        for c in need:  # remote reads are bound by the network, not by these per-chunk copies
            sel = np.flatnonzero(which == c)
            out[sel] = have[(self.shard, c)][local[sel] - c * self.chunk_rows]
        return out


class DiskCache:
    """Whole remote shards kept on node-local disk, downloaded and verified once per node (see module doc)."""

    def __init__(self, root: str, limit_bytes: int | None, stats: ReadStats):
        self.root = os.path.join(root, "shards")
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        self.node_root = root
        if limit_bytes is None:  # half of what is free now: room for the cache without filling the disk
            limit_bytes = shutil.disk_usage(self.root).free // 2
        self.limit, self.stats = limit_bytes, stats

    def path_for(self, sha256: str) -> str:
        return os.path.join(self.root, f"{sha256}.arrow")

    def fetch(self, fs, remote_path: str, sha256: str, nbytes: int) -> str:
        """The local path of the shard with content ``sha256`` (downloading and verifying it if needed). A copy
        that is not ``node.trusted`` (another owner, a loose mode, a link) is not used: it is fetched again."""
        local = self.path_for(sha256)
        if node.trusted(local):
            _touch(local)
            return local
        if nbytes > self.limit:
            raise ConfigError(
                f"cache shard {remote_path!r} ({nbytes} bytes) is larger than the node disk cache "
                f"(disk_cache_bytes={self.limit}); raise ReadConfig.disk_cache_bytes or use remote='range'"
            )
        with node.file_lock(node.lock_path(self.node_root, sha256)):
            if node.trusted(local):  # another process landed it while we waited
                _touch(local)
                return local
            self._make_room(nbytes)
            tmp = f"{local}.tmp-{uuid.uuid4().hex}"
            h = hashlib.sha256()
            try:
                # 0600, as node.trusted expects of a copy; it replaces an untrusted one at the same name
                dst = os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")
                # no read-ahead buffer (s3fs keeps 50 MiB blocks by default): each 8 MiB read is one request
                with dst, fs.open(remote_path, "rb", block_size=8 << 20, cache_type="none") as src:
                    while chunk := src.read(8 << 20):
                        h.update(chunk)
                        dst.write(chunk)
                size = os.path.getsize(tmp)
                self.stats.add_fetch(size)
                if size != nbytes or h.hexdigest() != sha256:
                    raise CorruptArtifactError(
                        f"cache shard {remote_path!r} fails its checksum (expected sha256 {sha256[:12]}..., "
                        f"{nbytes} bytes); delete the cache folder and materialize it again"
                    )
                # recorded as verified before it appears at its name: a process that finds it there (outside
                # this lock) must find the record too, or it hashes the shard a second time
                node.mark_verified(local, sha256, self.node_root, landing=tmp)
                os.replace(tmp, local)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            # its access time from the fine clock, like every later use: a new file's is the kernel's coarse
            # one (a 4 ms tick), and two shards landed in one tick would tie in the eviction order
            _touch(local)
            self.stats.shards_downloaded += 1
            self.stats.shards_hashed += 1  # hashed while it landed
        return local

    def _make_room(self, nbytes: int) -> None:
        with node.file_lock(os.path.join(self.node_root, "locks", "disk-cache-evict.lock")):
            files = []
            for entry in os.scandir(self.root):
                if entry.name.endswith(".arrow"):
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue
                    files.append((st.st_atime, st.st_size, entry.path))
            total = sum(size for _, size, _ in files)
            for _, size, path in sorted(files):  # oldest use first
                if total + nbytes <= self.limit:
                    break
                try:
                    os.unlink(path)
                    total -= size
                except FileNotFoundError:
                    pass


def _touch(path: str) -> None:
    """Mark a node-local shard as just used: eviction goes by access time. The modification time is kept, since
    it is part of the version ``node.verify_once`` recorded when the shard landed."""
    try:
        st = os.stat(path)
        os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))
    except OSError:  # evicted meanwhile, or a read-only node folder: the caller's open decides
        pass
