"""Where batch rows come from: a committed cache read in place (memory-mapped shards, or ranged reads of a remote
cache), or, opted into, a split held in RAM.

Both return a ``RawBatch`` of numpy arrays in plan order; turning it into torch tensors and augmenting it is the
loader's job, so every execution mode (sync, thread, Ray, memory, auto) shares one collate path and yields
identical batches.

**One gather per batch over many shards.** A batch's rows come from several shards (the plan's window spans up
to ``window / block_size`` blocks, each in its own place in the cache), and each shard is a separate memory
map. Gathering shard by shard and then putting rows in plan order copies every byte twice (about half the rate
of a gather from one array). Instead, ``_RowSpan`` addresses the rows of all open shards as rows of one strided
byte view whose base is the lowest mapped address: row ``r`` of a shard mapped at address ``a`` is element
``a - base + r * row_bytes`` of the view (its elements overlap, stride 1 byte, and it is only ever indexed at
those row starts). One fancy-index gather then copies each sample once, straight into plan order. The view
holds no memory of its own; the shard views it addresses are kept open (``_open``) as long as it exists.
Labels and fixed-width ASCII sample ids are gathered the same way, so a batch costs a handful of numpy calls
whatever the number of shards. Remote shards read by range (and ids of varying width) take a per-shard path.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from dutycycle.engine.cache.reader import CacheReader
from dutycycle.engine.cache.shards import ShardView
from dutycycle.engine.errors import ConfigError, CorruptArtifactError
from numpy.lib.stride_tricks import as_strided


@dataclass
class RawBatch:
    images: np.ndarray  # uint8 [B, *sample shape]
    labels: np.ndarray  # int64 [B]
    sample_ids: list[str]  # [B]: a list, the form the batch dict hands out (every producer converts once)


class _RowSpan:
    """The rows of several contiguous arrays (one per shard, ``row_bytes`` each) as rows of one strided view.

    Shards are added and removed one at a time (O(1) each, plus one vectorized shift when a shard maps below the
    current origin), so opening a shard never costs a pass over the others. The array at the origin stays
    referenced, and so mapped, while the span exists, even after its shard is removed.
    """

    def __init__(self, num_shards: int, row_bytes: int):
        self.row_bytes = row_bytes
        # Byte offset of each registered shard's row 0 from the origin, -1 if not registered; one more entry,
        # always -1, for the shard index a row outside the cache maps to (-1 or num_shards): one check, both.
        self.starts = np.full(num_shards + 1, -1, dtype=np.int64)
        self.view: np.ndarray | None = None
        self._origin: np.ndarray | None = None  # the lowest-addressed array added so far
        self._lo = self._hi = 0

    def add(self, shard: int, array: np.ndarray) -> None:
        """Address ``array`` (C-contiguous, ``row_bytes`` per row) as shard ``shard``'s rows."""
        if not array.nbytes:
            return  # no row lives there, so nothing ever looks it up
        assert array.flags.c_contiguous and array.nbytes % self.row_bytes == 0
        addr = array.__array_interface__["data"][0]
        if self._origin is None or addr < self._lo:
            if self._origin is not None:
                self.starts[self.starts >= 0] += self._lo - addr  # offsets from the new, lower origin
            else:
                self._hi = addr
            self._origin, self._lo = array, addr
        self._hi = max(self._hi, addr + array.nbytes)
        self.starts[shard] = addr - self._lo
        # One opaque ``V{row_bytes}`` element per byte offset: numpy copies each gathered element with one
        # memcpy (faster here than a [rows, row_bytes] uint8 view, and no slower than np.take from one array).
        first = self._origin.reshape(-1).view(np.uint8)[: self.row_bytes].view(f"V{self.row_bytes}")
        rows = self._hi - self._lo - self.row_bytes + 1  # the last element that starts inside the span
        self.view = as_strided(first, shape=(rows,), strides=(1,), writeable=False)

    def remove(self, shard: int) -> None:
        self.starts[shard] = -1

    def gather(self, shard: np.ndarray, local: np.ndarray, starts: np.ndarray | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
        """uint8 [n, row_bytes]: row ``local[i]`` of shard ``shard[i]`` (all registered; rows in range).
        ``starts`` may pass ``self.starts[shard]`` when the caller has it already; ``out`` (C-contiguous uint8,
        ``n * row_bytes``): gather straight into it (a shared-memory batch) instead of a fresh array."""
        starts = self.starts[shard] if starts is None else starts
        at = starts + local * self.row_bytes
        if out is None:
            return self.view[at].view(np.uint8).reshape(len(shard), -1)
        # numpy's gathers write only into a fresh array (``np.take(out=)`` first copies a strided source whole),
        # so the rows are copied one slice each: about 1.6x the vectorized gather's time for 12 KiB rows, in a
        # read task whose alternative was the gather plus two more copies (torch's ``index_select`` would do it
        # in one call, but importing torch costs each Ray worker 128 MiB and 1.7 s here)
        span = as_strided(self._origin.reshape(-1).view(np.uint8), shape=(self._hi - self._lo,), strides=(1,),
                          writeable=False)
        flat = out.reshape(len(shard), self.row_bytes)
        width = self.row_bytes
        for i, a in enumerate(at.tolist()):
            flat[i] = span[a:a + width]
        return flat


class ShardGatherer:
    """Gathers arbitrary rows of a cache, in the order asked, into fresh arrays (one per batch)."""

    def __init__(self, reader: CacheReader):
        self.reader = reader
        self.shape = tuple(reader.manifest.shape)
        self.num_samples = reader.num_samples
        self.max_open = reader.read_config.open_limit(reader.mapped)
        self._open: OrderedDict[int, ShardView] = OrderedDict()
        n, per = reader.num_shards, reader.manifest.sample_bytes
        self._pixels, self._labels, self._ids = _RowSpan(n, per), _RowSpan(n, 8), None
        self._ranged = 0  # open shards read by range (not memory-mapped): then no span serves a batch
        self._odd_ids = 0  # open shards whose ids are not ASCII of the spans' one width
        self.opens = 0  # shard views opened, reopens included: past the open limit this counts the churn
        self._lock = threading.Lock()  # the spans change while shards open and close

    @property
    def _fast(self) -> bool:
        return self._ranged == 0

    @property
    def _id_width(self) -> int | None:
        return self._ids.row_bytes if self._ids is not None and self._odd_ids == 0 else None

    def _add(self, s: int, view: ShardView) -> None:
        self._open[s] = view
        self.opens += 1
        if view.pixels is None:
            self._ranged += 1
            return
        self._pixels.add(s, view.pixels)
        self._labels.add(s, view.labels.view(np.uint8))
        ids = view.id_bytes
        if ids is not None and self._ids is None:
            self._ids = _RowSpan(self.reader.num_shards, ids.shape[1])
        if ids is None or ids.shape[1] != self._ids.row_bytes:
            self._odd_ids += 1
        else:
            self._ids.add(s, ids)

    def _remove(self, s: int) -> None:
        view = self._open.pop(s)
        if view.pixels is None:
            self._ranged -= 1
            return
        self._pixels.remove(s)
        self._labels.remove(s)
        ids = view.id_bytes
        if ids is None or ids.shape[1] != self._ids.row_bytes:
            self._odd_ids -= 1
        else:
            self._ids.remove(s)

    def _ensure_open(self, shards: list[int]) -> None:
        """Open the batch's shards that are not open, closing the least recently opened ones beyond the limit
        (batches that find all their shards open skip this: the order is one of opening, not of use)."""
        for s in shards:
            if s in self._open:
                self._open.move_to_end(s)
            else:
                # ``_open_view``, not ``view``: ``_open`` is the one cache of these views (capped at max_open
                # like the reader's); going through the reader's too would keep a second LRU of the same views.
                self._add(s, self.reader._open_view(s))
        while len(self._open) > max(self.max_open, len(shards)):
            self._remove(next(iter(self._open)))  # the batch's own shards were just moved last

    def read(self, rows: np.ndarray, pixels: bool = True, out: np.ndarray | None = None) -> RawBatch:
        """Rows (global cache row indices) in the given order. ``pixels=False``: labels and ids only. ``out``:
        a uint8 array of the batch's shape the pixels are gathered into (one copy from the shards), else a fresh
        one."""
        rows = np.asarray(rows, dtype=np.int64)
        n = len(rows)
        assert out is None or (out.shape == (n, *self.shape) and out.dtype == np.uint8 and out.flags.c_contiguous)
        if n == 0:
            return RawBatch(np.empty((0, *self.shape), np.uint8) if out is None else out, np.empty(0, np.int64), [])
        shard, local = self.reader.locate(rows)  # a row outside the cache gets shard -1 or num_shards
        with self._lock:
            starts = self._pixels.starts[shard]
            if not self._fast or starts.min() < 0:  # a shard not open yet (or ranged), or a row out of range
                if rows.min() < 0 or rows.max() >= self.num_samples:  # the gathers below trust every index
                    raise IndexError(f"cache rows outside [0, {self.num_samples}) requested from {self.reader.uri!r}")
                self._ensure_open(np.unique(shard).tolist())
                starts = self._pixels.starts[shard]
            if self._fast:
                images = self._pixels.gather(shard, local, starts, out).reshape(n, *self.shape) if pixels else None
                labels = self._labels.gather(shard, local).view(np.int64).reshape(n)
                if self._id_width:  # ASCII bytes of one width: decoding each is cheaper than astype("U")
                    raw = self._ids.gather(shard, local).view(f"S{self._id_width}").reshape(n)
                    return RawBatch(images, labels, list(map(bytes.decode, raw.tolist())))
                return RawBatch(images, labels, self._ids_by_shard(shard, local))
            return self._read_by_shard(shard, local, pixels, out)

    def _ids_by_shard(self, shard: np.ndarray, local: np.ndarray) -> list[str]:
        ids = np.empty(len(shard), dtype=object)
        for s in np.unique(shard).tolist():
            sel = np.flatnonzero(shard == s)
            ids[sel] = self._open[s].ids.take(pa.array(local[sel])).to_numpy(zero_copy_only=False)
        return ids.tolist()

    def _read_by_shard(self, shard: np.ndarray, local: np.ndarray, pixels: bool, out: np.ndarray | None = None
                       ) -> RawBatch:
        n = len(shard)
        images = (np.empty((n, *self.shape), np.uint8) if out is None else out) if pixels else None
        labels = np.empty(n, np.int64)
        for s in np.unique(shard).tolist():
            sel = np.flatnonzero(shard == s)
            v = self._open[s]
            labels[sel] = v.labels[local[sel]]
            if pixels:
                images[sel] = v.pixels[local[sel]] if v.pixels is not None else v.ranged.take(local[sel])
        return RawBatch(images, labels, self._ids_by_shard(shard, local))


def rows_in_split(split_column, split: str, offset: int) -> np.ndarray:
    """Global cache rows (``offset`` + position) of one shard's rows whose ``split`` column equals ``split``."""
    import pyarrow.compute as pc  # loaded when a split column is first read, not by every importer of the loader

    return np.flatnonzero(pc.equal(split_column, split).to_numpy(zero_copy_only=False)).astype(np.int64) + offset


class SplitIndex:
    """Split index -> global cache row, for a cache whose manifest records each shard's split counts: built from
    the manifest alone (no column read, nothing fetched), resolved shard by shard as rows are asked for.

    Split index ``i`` lies in the shard where the running count of the split's rows passes ``i``; which row of
    that shard it is comes from the shard's own ``split`` column, read (and verified, as every read of a shard
    is) the first time a batch needs that shard and kept for this index's life. A rank that reads a share of
    the cache therefore touches only the shards of its share, and a node's cold start costs no scan."""

    def __init__(self, reader: CacheReader, split: str):
        self.reader, self.split = reader, split
        counts = [s.split_counts.get(split, 0) for s in reader.manifest.shards]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._positions: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def shards_resolved(self) -> int:
        """How many shards' split columns this index has read so far."""
        with self._lock:
            return len(self._positions)

    def _rows_of(self, shard: int) -> np.ndarray:
        with self._lock:
            got = self._positions.get(shard)
        if got is not None:
            return got
        rows = rows_in_split(self.reader.view(shard).split, self.split, int(self.reader.offsets[shard]))
        want = int(self.starts[shard + 1] - self.starts[shard])
        if len(rows) != want:  # the shard disagrees with its manifest entry: never train on a torn cache
            raise CorruptArtifactError(
                f"cache shard {self.reader.shard_uri(shard)!r} has {len(rows)} {self.split!r} rows but its manifest "
                f"entry says {want}; materialize the cache again")
        with self._lock:
            self._positions[shard] = rows
        return rows

    def __getitem__(self, indices) -> np.ndarray:
        if isinstance(indices, slice):
            indices = np.arange(len(self))[indices]
        idx = np.asarray(indices)
        if idx.dtype == bool:  # a mask, as numpy reads one
            if idx.shape != (len(self),):
                raise IndexError(f"a boolean mask of shape {idx.shape} for split {self.split!r} of {len(self)} rows")
            idx = np.flatnonzero(idx)
        idx = idx.astype(np.int64, copy=False)
        if idx.ndim == 0:
            return self[idx.reshape(1)][0]
        if idx.ndim != 1:
            raise IndexError(f"split indices must be one-dimensional, got shape {idx.shape}")
        if len(idx) and (idx.min() < -len(self) or idx.max() >= len(self)):
            raise IndexError(f"split indices outside [-{len(self)}, {len(self)}) asked of split {self.split!r}")
        idx = np.where(idx < 0, idx + len(self), idx)  # from the end, as an array counts
        shard = np.searchsorted(self.starts, idx, side="right") - 1
        out = np.empty(len(idx), np.int64)
        for s in np.unique(shard).tolist():
            sel = shard == s
            out[sel] = self._rows_of(s)[idx[sel] - self.starts[s]]
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[np.arange(len(self))]
        return whole if dtype is None else whole.astype(dtype)


def chunk_block_starts(reader: CacheReader, split: str) -> np.ndarray:
    """Split indices where the split's rows enter a new checksum chunk (each shard's ``chunk_split_counts``): the
    plan's shuffle blocks for ``block_size = 0``, so each block is one chunk's rows of the split."""
    return manifest_block_starts(reader.manifest, split)


def manifest_block_starts(manifest, split: str) -> np.ndarray:
    """``chunk_block_starts`` from a cache's manifest alone (a ``format.Manifest``)."""
    shards = manifest.shards
    counts = np.concatenate([np.asarray(s.chunk_split_counts.get(split, [0] * len(s.chunk_sha256)), np.int64)
                             for s in shards])
    counts = counts[counts > 0]
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


def split_rows(reader: CacheReader, split: str) -> np.ndarray | SplitIndex:
    """Global row indices of ``split`` in cache order (the order materialize wrote: sorted by sample id).

    Every shard's manifest entry records its split counts, so this is a ``SplitIndex``: nothing is read until a
    batch needs a shard.
    """
    counts = reader.manifest.split_counts
    split_size(reader.manifest, reader.uri, split)
    if counts[split] == reader.num_samples:
        return np.arange(reader.num_samples, dtype=np.int64)
    index = SplitIndex(reader, split)
    if len(index) != counts[split]:
        raise CorruptArtifactError(
            f"cache {reader.uri!r}: its shards' entries count {len(index)} {split!r} rows but its manifest says "
            f"{counts[split]}; materialize the cache again")
    return index


def split_size(manifest, uri: str, split: str) -> int:
    """The samples of ``split`` by the cache's manifest (a ``format.Manifest``); a split it has none of is a
    ``ConfigError`` naming the splits there."""
    counts = manifest.split_counts
    if split not in counts or counts[split] == 0:
        raise ConfigError(
            f"split {split!r} has no samples in cache {uri!r}; splits there: "
            f"{', '.join(f'{k}={v}' for k, v in sorted(counts.items())) or 'none'}"
        )
    return int(counts[split])


class MemorySplit:
    """A whole split in three arrays; ``read`` gathers split indices. The opt-in ``memory`` mode."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, sample_ids: np.ndarray):
        self.images, self.labels, self.sample_ids = images, labels, np.asarray(sample_ids)

    @classmethod
    def gather(cls, reader: CacheReader, rows: np.ndarray) -> MemorySplit:
        """The cache rows ``rows`` (a split's, from ``split_rows``) copied into RAM. A gatherer of its own, dropped
        when this returns, so the shards it mapped to copy them are not kept mapped beside the copy."""
        raw = ShardGatherer(reader).read(rows)
        return cls(raw.images, raw.labels, raw.sample_ids)

    @classmethod
    def load(cls, cache_uri: str, split: str, read=None) -> MemorySplit:
        reader = CacheReader(cache_uri, read=read)
        return cls.gather(reader, split_rows(reader, split))

    def read(self, indices: np.ndarray) -> RawBatch:
        """``indices`` are split indices from the plan (always in range, so the gather skips bounds checks)."""
        images = np.empty((len(indices), *self.images.shape[1:]), dtype=np.uint8)
        self.images.take(indices, axis=0, out=images, mode="clip")
        return RawBatch(images, self.labels.take(indices), self.sample_ids.take(indices).tolist())
