"""Where batch rows come from: a committed cache read in place (memory-mapped shards) or a split held in RAM.

Both return a ``RawBatch`` of numpy arrays in plan order; turning it into torch tensors and augmenting it is the
loader's job, so every execution mode (sync, thread, Ray, memory, auto) shares one collate path and yields
identical batches.

Gathers use ``np.take(..., out=..., mode="clip")``: with the default ``mode="raise"`` NumPy gathers through a
temporary buffer (about 3x slower for a batch of 256 rows); the row indices are checked once per batch instead.
Sample ids are kept as object arrays of Python strings, so a batch's id list is a gather plus ``tolist()``
(no per-sample string construction).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from dutycycle.engine.cache.format import CacheReader
from dutycycle.engine.errors import ConfigError, CorruptArtifactError


@dataclass
class RawBatch:
    images: np.ndarray  # uint8 [B, *sample shape]
    labels: np.ndarray  # int64 [B]
    sample_ids: np.ndarray  # str [B] (object array of Python str from the cache sources)


def as_id_array(ids) -> np.ndarray:
    """Sample ids as an object array of Python ``str`` (gathers and ``tolist()`` then create no new strings)."""
    ids = np.asarray(ids)
    if ids.dtype == object:
        return ids
    out = np.empty(len(ids), dtype=object)
    out[:] = ids.astype(str).tolist()
    return out


@dataclass
class _Shard:
    images: np.ndarray  # uint8 [rows, *shape], read-only view of the memory-mapped shard
    labels: np.ndarray  # int64 [rows]
    ids: np.ndarray  # object [rows]


class ShardGatherer:
    """Gathers arbitrary rows of a cache into one preallocated array per batch.

    Each shard's pixel view, labels and ids are built once and cached here. A batch whose rows all lie in one
    shard, or whose shards come in ascending order (a whole split), is gathered straight into the batch array,
    shard run by shard run. A batch mixing shards in plan order (the usual case: the plan's windows span several
    shards) is gathered shard by shard into a shard-ordered buffer, then put in plan order with one more gather
    from that cache-resident buffer; both are contiguous ``np.take`` calls, far faster than fancy-index
    assignment (``out[pos] = ...``).
    """

    def __init__(self, reader: CacheReader):
        self.reader = reader
        self.shape = tuple(reader.manifest.shape)
        self.num_samples = reader.num_samples
        self._shards: dict[int, _Shard] = {}

    def _shard(self, s: int) -> _Shard:
        got = self._shards.get(s)
        if got is None:  # a race between two threads only builds the same views twice
            r = self.reader
            got = _Shard(r.images(s), r.column(s, "label").astype(np.int64, copy=False), as_id_array(r.column(s, "sample_id")))
            self._shards[s] = got
        return got

    def labels(self, shard: int) -> np.ndarray:
        return self._shard(shard).labels

    def ids(self, shard: int) -> np.ndarray:
        return self._shard(shard).ids

    def read(self, rows: np.ndarray) -> RawBatch:
        """Rows (global cache row indices) in the given order."""
        rows = np.asarray(rows, dtype=np.int64)
        n = len(rows)
        images = np.empty((n, *self.shape), dtype=np.uint8)
        if n == 0:
            return RawBatch(images, np.empty(0, np.int64), np.empty(0, object))
        if rows.min() < 0 or rows.max() >= self.num_samples:  # "clip" below would not catch it
            raise IndexError(f"cache rows outside [0, {self.num_samples}) requested from {self.reader.uri!r}")
        shard, local = self.reader.locate(rows)
        first = int(shard[0])
        if shard[-1] == first and (shard == first).all():  # one shard: no reordering at all
            sh = self._shard(first)
            np.take(sh.images, local, axis=0, out=images, mode="clip")
            return RawBatch(images, sh.labels.take(local), sh.ids.take(local))
        ascending = bool((shard[1:] >= shard[:-1]).all())
        order = None if ascending else np.argsort(shard, kind="stable")
        if order is not None:  # shard-ordered copies of the positions
            shard, local = shard[order], local[order]
        labels = np.empty(n, dtype=np.int64)
        ids = np.empty(n, dtype=object)
        buf = images if order is None else np.empty_like(images)
        cuts = [0, *(np.flatnonzero(shard[1:] != shard[:-1]) + 1).tolist(), n]
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            sh = self._shard(int(shard[a]))
            idx = local[a:b]
            np.take(sh.images, idx, axis=0, out=buf[a:b], mode="clip")
            np.take(sh.labels, idx, out=labels[a:b])
            ids[a:b] = sh.ids.take(idx)
        if order is None:
            return RawBatch(images, labels, ids)
        inverse = np.empty(n, dtype=np.int64)
        inverse[order] = np.arange(n)
        np.take(buf, inverse, axis=0, out=images, mode="clip")
        return RawBatch(images, labels.take(inverse), ids.take(inverse))


def split_rows(reader: CacheReader, split: str) -> np.ndarray:
    """Global row indices of ``split`` in cache order (the order materialize wrote: sorted by sample id)."""
    counts = reader.manifest.split_counts
    if split not in counts or counts[split] == 0:
        raise ConfigError(
            f"split {split!r} has no samples in cache {reader.uri!r}; splits there: "
            f"{', '.join(f'{k}={v}' for k, v in sorted(counts.items())) or 'none'}"
        )
    if counts[split] == reader.num_samples:
        return np.arange(reader.num_samples, dtype=np.int64)
    parts = [np.flatnonzero(reader.column(i, "split") == split) + reader.offsets[i] for i in range(reader.num_shards)]
    rows = np.concatenate(parts).astype(np.int64)
    if len(rows) != counts[split]:  # the shards disagree with their manifest: never train on a torn cache
        raise CorruptArtifactError(
            f"cache {reader.uri!r} has {len(rows)} {split!r} rows in its shards but its manifest says "
            f"{counts[split]}; materialize the cache again"
        )
    return rows


class MemorySplit:
    """A whole split in three arrays; ``read`` gathers split indices. Built once per (cache, split)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, sample_ids: np.ndarray):
        # ids may arrive as a str array (e.g. from the object store, which holds plain arrays)
        self.images, self.labels, self.sample_ids = images, labels, as_id_array(sample_ids)

    @property
    def nbytes(self) -> int:
        return self.images.nbytes

    @classmethod
    def load(cls, cache_uri: str, split: str) -> MemorySplit:
        reader = CacheReader(cache_uri)
        raw = ShardGatherer(reader).read(split_rows(reader, split))
        return cls(raw.images, raw.labels, raw.sample_ids)

    def read(self, indices: np.ndarray) -> RawBatch:
        """``indices`` are split indices from the plan (always in range, so the gather skips bounds checks)."""
        images = np.empty((len(indices), *self.images.shape[1:]), dtype=np.uint8)
        self.images.take(indices, axis=0, out=images, mode="clip")
        return RawBatch(images, self.labels.take(indices), self.sample_ids.take(indices))
