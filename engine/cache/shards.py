"""Opening one cache shard for reading: memory-mapped in place, from a node-local copy, or by byte range.

A ``ShardView`` is what readers use: the shard's labels, sample ids and split column as Arrow/numpy arrays, and
its pixels either as a read-only numpy view of a memory map (``pixels``) or, for a shard read by range, a
``RangedPixels`` that fetches only the rows asked for. Nothing is copied into the process for a local shard: the
pages belong to the page cache, which every process on the node shares.

Where a shard's bytes come from (``ReadConfig``):

- a local cache: the file itself, memory-mapped; its sha256 is checked once per node (``node.verify_once``);
- a remote cache (``s3://``, ``memory://``, ...), ``remote="disk"``: a node-local copy, downloaded once per node
  under a lock, its sha256 checked while it lands, evicted least recently used beyond ``disk_cache_bytes``;
- a remote cache, ``remote="range"``: Arrow IPC read through a random-access file, one ranged request per piece
  (footer, metadata, the small columns), and pixels fetched in chunks of ``range_chunk_bytes`` as batches need
  them, into a bounded per-reader chunk cache. A shard read this way is never whole in memory and its sha256
  cannot be checked without reading all of it: its size and Arrow footer are checked instead;
- ``remote="auto"`` (default): ``disk`` when the whole cache fits in ``disk_cache_bytes``, else ``range``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, CorruptArtifactError

if TYPE_CHECKING:  # numpy and pyarrow load with the first shard opened, so the configs that name ReadConfig
    import numpy as np  # (LoaderConfig, the trainer's) import light: `dutycycle --help` reads them
    import pyarrow as pa

VERIFY = ("once", "always", "never")
REMOTE = ("auto", "range", "disk")


@dataclass(frozen=True)
class ReadConfig:
    """How a ``CacheReader`` reaches shard bytes (see the module docstring)."""

    verify: str = "once"  # sha256 of local / landed shards: once per node per file version, on every open, never
    remote: str = "auto"
    node_dir: str | None = None  # node-local folder (default: $DUTYCYCLE_NODE_DIR or <tmp>/dutycycle-node-<uid>)
    disk_cache_bytes: int | None = None  # node-local copies of remote shards; None: half the folder's free space
    range_chunk_bytes: int = 1 << 20  # pixels fetched per ranged request (rounded to whole rows)
    range_cache_bytes: int = 64 << 20  # fetched pixel chunks kept per reader (a batch's chunks always fit)
    # Shard views kept open per reader; None: MAPPED_OPEN (8192) when shards are memory-mapped, RANGED_OPEN (256)
    # when read by range (a ranged view holds its ids and labels in the heap). A mapped view holds no file
    # descriptor (the map outlives it) and no heap, only one of the kernel's vm.max_map_count mappings (65,530 by
    # default per process); reopening one maps the shard afresh, and every row read from it page-faults again. At
    # 256 mapped views over a 300-shard cache that churn (0.2 faults a sample) held the loader to 226k samples/s
    # against 464k with every view kept open (benchmarks/loader.py's cache, uint8 batches of 256).
    max_open_shards: int | None = None

    def __post_init__(self):
        if self.verify not in VERIFY:
            raise ConfigError(f"ReadConfig.verify={self.verify!r} is invalid; use one of {', '.join(VERIFY)}")
        if self.remote not in REMOTE:
            raise ConfigError(f"ReadConfig.remote={self.remote!r} is invalid; use one of {', '.join(REMOTE)}")
        for name in ("range_chunk_bytes", "range_cache_bytes", "max_open_shards"):
            v = getattr(self, name)
            if v is None and name == "max_open_shards":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"ReadConfig.{name}={v!r} is invalid; use an integer >= 1")
        v = self.disk_cache_bytes
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"ReadConfig.disk_cache_bytes={v!r} is invalid; use an integer >= 1 or None")


    def open_limit(self, mapped: bool) -> int:
        """How many shard views a reader keeps open: ``max_open_shards``, or by default by how shards are read."""
        if self.max_open_shards is not None:
            return self.max_open_shards
        return MAPPED_OPEN if mapped else RANGED_OPEN


MAPPED_OPEN, RANGED_OPEN = 8192, 256  # ReadConfig.open_limit's defaults (see max_open_shards)


@dataclass
class ReadStats:
    """What a reader fetched from remote storage and how often it hashed shards (for tests and benchmarks)."""

    bytes_fetched: int = 0
    requests: int = 0
    shards_hashed: int = 0
    shards_downloaded: int = 0

    def add_fetch(self, nbytes: int, requests: int = 1) -> None:
        self.bytes_fetched += nbytes
        self.requests += requests


@dataclass
class ShardView:
    """One open shard. ``pixels`` is set for memory-mapped shards, ``ranged`` for shards read by range."""

    index: int
    rows: int
    labels: np.ndarray  # int64 [rows], read-only
    ids: pa.Array  # string [rows]
    split: pa.Array  # string [rows]
    pixels: np.ndarray | None = None  # uint8 [rows, *shape], read-only view of a memory map
    ranged: Any = None  # remote.RangedPixels
    _id_bytes: Any = field(default=False, repr=False)

    @property
    def id_bytes(self) -> np.ndarray | None:
        """The ids as uint8 [rows, L] (zero-copy) when every id is ASCII of the same byte length L, else None."""
        if self._id_bytes is False:
            ids = fixed_width_bytes(self.ids)
            self._id_bytes = ids if ids is not None and int(ids.max()) < 128 else None
        return self._id_bytes


def fixed_width_bytes(ids: pa.Array) -> np.ndarray | None:
    """A zero-copy uint8 [n, L] view of a string array whose values all have L > 0 bytes, else None."""
    import numpy as np

    n = len(ids)
    if n == 0 or ids.null_count:
        return None
    offsets = np.frombuffer(ids.buffers()[1], dtype=np.int32)[ids.offset : ids.offset + n + 1]
    width = int(offsets[1] - offsets[0])
    if width <= 0 or int(offsets[-1] - offsets[0]) != width * n or not (np.diff(offsets) == width).all():
        return None
    data = np.frombuffer(ids.buffers()[2], dtype=np.uint8)
    return data[offsets[0] : offsets[0] + n * width].reshape(n, width)


def single_chunk(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    """A column as one array: zero-copy when it has one chunk (every shard dutycycle writes), else a copy."""
    import pyarrow as pa

    if isinstance(col, pa.ChunkedArray):
        return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    return col


def pixel_view(image: pa.Array, shape: tuple[int, ...]) -> np.ndarray:
    """A fixed-size-binary image column as a read-only uint8 array [rows, *shape], zero-copy."""
    import numpy as np

    per = int(np.prod(shape))
    data = np.frombuffer(image.buffers()[1], dtype=np.uint8)
    start = image.offset * per
    return data[start : start + len(image) * per].reshape(len(image), *shape)


def view_of_table(index: int, table: pa.Table | pa.RecordBatch, shape: tuple[int, ...], shard_uri: str) -> ShardView:
    """A ``ShardView`` over a whole shard already in (mapped) memory."""
    import numpy as np
    import pyarrow as pa

    names = table.schema.names
    for name in ("sample_id", "label", "split", "image"):
        if name not in names:
            raise CorruptArtifactError(f"cache shard {shard_uri!r} has no {name!r} column; materialize the cache again")
    label = single_chunk(table.column("label"))
    return ShardView(
        index=index,
        rows=table.num_rows,
        labels=label.to_numpy(zero_copy_only=label.null_count == 0 and label.type == pa.int64()).astype(np.int64, copy=False),
        ids=single_chunk(table.column("sample_id")),
        split=single_chunk(table.column("split")),
        pixels=pixel_view(single_chunk(table.column("image")), shape),
    )


def open_mapped(path: str) -> pa.Table:
    """A local Arrow IPC file as a table over a read-only memory map (no copy)."""
    import pyarrow as pa

    return pa.ipc.open_file(pa.memory_map(path, "r")).read_all()
