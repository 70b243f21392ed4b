"""The on-disk format of the transformed-sample cache, shared by its writer (engine) and its readers (loader).

A cache is a folder (any fsspec URI)::

    CACHE/
      shards/shard-00000.arrow    Arrow IPC file, uncompressed, one record batch per write
      shards/shard-00000.json     completion record of that shard (written after it; lets a rerun resume)
      shards/shard-00001.arrow
      manifest.json               written last: the commit point

``dutycycle materialize`` writes caches under a *cache root*, one folder per fingerprint, so a changed table
or transform never overwrites an older cache::

    ROOT/
      <fingerprint>/manifest.json, shards/...
      latest                      names the fingerprint the latest materialize returned (written after commit)
      _index/<key>.json           (table manifest, filter, spec) -> fingerprint, for instant reuse

``resolve`` (and so ``CacheReader``) accepts either a committed cache folder or a root.

Each shard has plain Arrow columns that any Arrow reader understands without dutycycle:

    sample_id: string, label: int64, split: string, image: fixed_size_binary[prod(shape)]

``image`` holds uint8 pixels in the manifest's ``layout`` (HWC or CHW) and ``shape``. A cache without
``manifest.json`` is uncommitted and never read; a shard whose sha256 differs from the manifest is refused
with an error naming it.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from .. import io
from ..errors import CorruptArtifactError, SourceError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_DIR = "shards"
LATEST = "latest"
INDEX_DIR = "_index"


def shard_name(index: int) -> str:
    return f"{SHARD_DIR}/shard-{index:05d}.arrow"


def cache_schema(sample_bytes: int) -> pa.Schema:
    return pa.schema(
        [
            ("sample_id", pa.string()),
            ("label", pa.int64()),
            ("split", pa.string()),
            ("image", pa.binary(sample_bytes)),
        ]
    )


@dataclass(frozen=True)
class ShardInfo:
    path: str  # relative to the cache root
    rows: int
    bytes: int
    sha256: str


@dataclass
class CacheManifest:
    fingerprint: str
    shape: list[int]  # per-sample array shape in `layout`, e.g. [64, 64, 3]
    layout: str  # "HWC" or "CHW"
    dtype: str  # "uint8"
    num_samples: int
    shards: list[ShardInfo]
    classes: list[str]  # label index -> class name
    split_counts: dict[str, int]
    spec: dict[str, Any]  # the transform spec that produced the pixels
    source: str = ""  # the metadata table the cache was made from
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count of rows not cached
    format_version: int = FORMAT_VERSION
    options: dict[str, Any] = field(default_factory=dict)  # how it was made: filter, table version, timings

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["shards"] = [asdict(s) for s in self.shards]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CacheManifest:
        d = dict(d)
        if d.get("format_version") != FORMAT_VERSION:
            raise CorruptArtifactError(
                f"cache format version {d.get('format_version')!r} is not supported (this dutycycle reads "
                f"{FORMAT_VERSION}); materialize the cache again"
            )
        d["shards"] = [ShardInfo(**s) for s in d["shards"]]
        return cls(**d)

    @property
    def sample_bytes(self) -> int:
        return int(np.prod(self.shape))


def encode_shard(sample_ids: list[str], labels, splits: list[str], images: np.ndarray) -> bytes:
    """Serialize one shard to Arrow IPC file bytes. ``images`` is uint8 of shape [N, *sample_shape]."""
    images = np.ascontiguousarray(images, dtype=np.uint8)
    n = images.shape[0]
    per = int(np.prod(images.shape[1:])) if images.ndim > 1 else 0
    image_col = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(per), n, [None, pa.py_buffer(images.reshape(-1))]
    )
    table = pa.table(
        {
            "sample_id": pa.array(sample_ids, pa.string()),
            "label": pa.array(np.asarray(labels, dtype=np.int64)),
            "split": pa.array(splits, pa.string()),
            "image": image_col,
        },
        schema=cache_schema(per),
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def write_shard(cache_uri: str, index: int, sample_ids, labels, splits, images: np.ndarray) -> ShardInfo:
    """Write shard ``index`` atomically and return its manifest entry. Rewriting a shard is idempotent."""
    data = encode_shard(list(sample_ids), labels, list(splits), images)
    rel = shard_name(index)
    io.write_bytes_atomic(io.join(cache_uri, rel), data)
    return ShardInfo(
        path=rel, rows=int(images.shape[0]), bytes=len(data), sha256=hashlib.sha256(data).hexdigest()
    )


def commit(cache_uri: str, manifest: CacheManifest) -> None:
    """Write the manifest last: from this moment the cache exists for readers."""
    assert manifest.num_samples == sum(s.rows for s in manifest.shards)
    io.write_json_atomic(io.join(cache_uri, MANIFEST), manifest.to_json())


def is_committed(cache_uri: str) -> bool:
    return io.exists(io.join(cache_uri, MANIFEST))


def write_latest(root_uri: str, fingerprint: str) -> None:
    """Point ``ROOT/latest`` at a committed fingerprint folder (atomic; call after its manifest is written)."""
    io.write_bytes_atomic(io.join(root_uri, LATEST), (fingerprint + "\n").encode())


def committed_fingerprints(root_uri: str) -> list[str]:
    """Fingerprint folders under a cache root that have a manifest (sorted by name)."""
    fs, path = io.filesystem(root_uri)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    names = sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")
    return [n for n in names if n not in (SHARD_DIR, INDEX_DIR) and is_committed(io.join(root_uri, n))]


def resolve(uri: str) -> str:
    """The committed cache folder that ``uri`` names: the folder itself, or in a cache root, the one that
    ``latest`` points at, or the only committed fingerprint folder."""
    if is_committed(uri):
        return uri
    latest = io.join(uri, LATEST)
    if io.exists(latest):
        fs, path = io.filesystem(latest)
        with fs.open(path, "rb") as f:
            fp = f.read().decode().strip()
        if fp and is_committed(io.resolve_inside(uri, fp, "cache root")):
            return io.join(uri, fp)
    found = committed_fingerprints(uri)
    if len(found) == 1:
        return io.join(uri, found[0])
    if len(found) > 1:
        raise SourceError(
            f"cache root {uri!r} holds {len(found)} committed caches ({', '.join(found[:4])}) and no `latest` "
            "pointer; pass one of those folders"
        )
    raise SourceError(
        f"no committed cache at {uri!r} ({MANIFEST} is missing): run `dutycycle materialize` "
        "to create or finish it"
    )


def read_manifest(cache_uri: str) -> CacheManifest:
    uri = io.join(cache_uri, MANIFEST)
    if not io.exists(uri):
        raise SourceError(
            f"no committed cache at {cache_uri!r} ({MANIFEST} is missing): run `dutycycle materialize` "
            "to create or finish it"
        )
    manifest = CacheManifest.from_json(io.read_json(uri))
    for shard in manifest.shards:  # a path in a manifest must stay inside the cache, or the cache is refused
        io.resolve_inside(cache_uri, shard.path, "cache")
    return manifest


class CacheReader:
    """Read-only access to a committed cache: shards memory-mapped when local, checksums verified once."""

    def __init__(self, uri: str, verify: bool = True):
        self.uri = resolve(uri)  # a committed cache folder, or a cache root holding one
        self.manifest = read_manifest(self.uri)
        self.verify = verify
        self._tables: dict[int, pa.Table] = {}
        self._lock = threading.Lock()
        self.offsets = np.concatenate([[0], np.cumsum([s.rows for s in self.manifest.shards])]).astype(
            np.int64
        )

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    @property
    def num_samples(self) -> int:
        return self.manifest.num_samples

    @property
    def num_shards(self) -> int:
        return len(self.manifest.shards)

    def shard(self, i: int) -> pa.Table:
        """Shard ``i`` as an Arrow table (zero-copy over a memory map for local caches)."""
        with self._lock:
            if i not in self._tables:
                self._tables[i] = self._open_shard(i)
            return self._tables[i]

    def _open_shard(self, i: int) -> pa.Table:
        info = self.manifest.shards[i]
        uri = io.resolve_inside(self.uri, info.path, "cache")
        fs, path = io.filesystem(uri)
        try:
            if io.protocol_of(fs) == "file":
                buf = pa.memory_map(path, "r").read_buffer()
            else:
                with fs.open(path, "rb") as f:
                    buf = pa.py_buffer(f.read())
        except FileNotFoundError as e:
            raise CorruptArtifactError(
                f"cache shard {uri!r} listed in the manifest is missing; materialize the cache again"
            ) from e
        if buf.size != info.bytes or (self.verify and hashlib.sha256(buf).hexdigest() != info.sha256):
            raise CorruptArtifactError(
                f"cache shard {uri!r} fails its checksum (expected sha256 {info.sha256[:12]}..., {info.bytes} "
                "bytes); delete the cache folder and materialize it again"
            )
        table = pa.ipc.open_file(buf).read_all()
        if table.num_rows != info.rows:
            raise CorruptArtifactError(
                f"cache shard {uri!r} has {table.num_rows} rows, manifest says {info.rows}"
            )
        return table

    def images(self, i: int) -> np.ndarray:
        """Shard ``i``'s pixels as a read-only uint8 array [rows, *shape], zero-copy from Arrow."""
        col = self.shard(i).column("image")
        # combine_chunks copies even a single chunk (a whole shard per call); a shard file holds one chunk.
        col = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
        data = np.frombuffer(col.buffers()[1], dtype=np.uint8)
        start = col.offset * self.manifest.sample_bytes
        n = len(col)
        return data[start : start + n * self.manifest.sample_bytes].reshape(n, *self.manifest.shape)

    def column(self, i: int, name: str) -> np.ndarray:
        return self.shard(i).column(name).to_numpy(zero_copy_only=False)

    def locate(self, global_index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Map global row indices to (shard, row-in-shard)."""
        shard = np.searchsorted(self.offsets, global_index, side="right") - 1
        return shard, global_index - self.offsets[shard]
