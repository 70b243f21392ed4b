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
with an error naming it. ``manifest.json`` carries ``manifest_sha256``, the sha256 of its other fields' canonical
JSON, so a manifest changed after its commit (a digit of the fingerprint, a count) is refused rather than read as
another cache; manifests written before the field have none, and are read after their counts are checked. How
shards are read (memory-mapped, by range, node-local copies, checked once per
node) is ``shards.py``, ``remote.py`` and ``node.py``.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa

from .. import io, sealed
from ..errors import CorruptArtifactError, SourceError
from . import node
from .remote import EDGE_BYTES, ChunkCache, DiskCache, RangeFile, open_ranged
from .shards import ReadConfig, ReadStats, ShardView, open_mapped, view_of_table

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_DIR = "shards"
LATEST = "latest"
INDEX_DIR = "_index"
DIGEST = sealed.MANIFEST_DIGEST  # the manifest's checksum of its own content (every other field)
_FIX = "delete the cache folder and materialize it again"


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


CHECK_CHUNK_BYTES = 1 << 20  # pixel bytes per recorded checksum (rounded down to whole rows)


@dataclass(frozen=True)
class ShardInfo:
    """A shard's record in the manifest. The fields after ``sha256`` let a reader that reads by range verify
    every piece it fetches and find a split's rows without reading any column (caches written before them have
    none: readers then hash whole shards, and scan the split column)."""

    path: str  # relative to the cache root
    rows: int
    bytes: int
    sha256: str
    split_counts: dict[str, int] = field(default_factory=dict)  # rows of each split in this shard
    image_offset: int = 0  # where the pixel buffer starts in the file (it ends at image_offset + rows * sample bytes)
    meta_sha256: str = ""  # sha256 of the file's bytes before and after the pixel buffer (columns, footer)
    chunk_rows: int = 0  # rows per pixel checksum: CHECK_CHUNK_BYTES of pixels, rounded down to whole rows
    chunk_sha256: list[str] = field(default_factory=list)  # sha256 of pixel rows [k * chunk_rows, (k + 1) * ...)
    # rows of each split in each checksum chunk: where a split's rows fall in the chunks, so a plan can cut its
    # shuffle blocks at chunk boundaries (a ranged reader then fetches each chunk for one block)
    chunk_split_counts: dict[str, list[int]] = field(default_factory=dict)


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
        """Plain JSON, sealed with ``manifest_sha256`` (``engine.sealed``)."""
        d = asdict(self)
        d["shards"] = [asdict(s) for s in self.shards]
        return sealed.seal(d)

    @classmethod
    def from_json(cls, d: Any, where: str = "cache manifest") -> CacheManifest:
        """The manifest in ``d`` (parsed JSON) read from ``where`` (its URI, named in every error)."""
        d = sealed.unseal(d, where, _FIX)
        if d.get("format_version") != FORMAT_VERSION:
            raise CorruptArtifactError(
                f"{where}: cache format version {d.get('format_version')!r} is not supported (this dutycycle reads "
                f"{FORMAT_VERSION}); materialize the cache again"
            )
        problem = _manifest_problem(d)
        if problem:
            raise CorruptArtifactError(f"{where} is malformed: {problem}; {_FIX}")
        try:
            d["shards"] = [ShardInfo(**s) for s in d["shards"]]
            return cls(**d)
        except TypeError as e:  # a field missing, or one this format does not have (a damaged key)
            raise CorruptArtifactError(f"{where} is malformed ({e}); {_FIX}") from None

    @property
    def sample_bytes(self) -> int:
        return int(np.prod(self.shape))


def _manifest_problem(d: dict[str, Any]) -> str | None:
    """What is wrong with a manifest's fields (the types readers rely on, and ``num_samples`` against the shards'
    rows), or None."""
    shards = d.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
        return "`shards` must be a list of {path, rows, bytes, sha256}"
    for s in shards:
        if not (isinstance(s.get("path"), str) and sealed.is_count(s.get("rows")) and sealed.is_count(s.get("bytes"))
                and isinstance(s.get("sha256"), str)):
            return f"shard entry {s!r:.200} must hold a path, rows, bytes and a sha256"
    for s in shards:
        problem = shard_checks_problem(s)
        if problem:
            return f"shard entry {s.get('path')!r:.100}: {problem}"
    if not sealed.is_count(d.get("num_samples")):
        return f"`num_samples` is {d.get('num_samples')!r}, not a count"
    if d["num_samples"] != sum(s["rows"] for s in shards):
        return f"`num_samples` is {d['num_samples']}, but its shards hold {sum(s['rows'] for s in shards)} rows"
    shape = d.get("shape")
    if not isinstance(shape, list) or not all(sealed.is_count(n) for n in shape):
        return f"`shape` is {shape!r:.100}, not a list of sizes"
    for name, types in (("fingerprint", str), ("layout", str), ("dtype", str), ("classes", list),
                        ("split_counts", dict), ("spec", dict), ("skipped", dict), ("options", dict)):
        if name in d and not isinstance(d[name], types):
            return f"`{name}` is {type(d[name]).__name__}, not {types.__name__}"
    if not all(isinstance(c, str) for c in d.get("classes", [])):
        return "`classes` must be a list of names"
    return None


def shard_checks_problem(s: dict[str, Any]) -> str | None:
    """What is wrong with a shard entry's optional fields (absent in caches written before them), or None."""
    counts = s.get("split_counts", {})
    if not isinstance(counts, dict) or not all(isinstance(k, str) and sealed.is_count(v) for k, v in counts.items()):
        return "`split_counts` must map split names to counts"
    if counts and sum(counts.values()) != s["rows"]:
        return f"`split_counts` add up to {sum(counts.values())}, not its {s['rows']} rows"
    for name in ("image_offset", "chunk_rows"):
        if not sealed.is_count(s.get(name, 0)):
            return f"`{name}` must be a count"
    hashes = s.get("chunk_sha256", [])
    if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes) \
            or not isinstance(s.get("meta_sha256", ""), str):
        return "`chunk_sha256` must be a list of sha256 strings and `meta_sha256` a string"
    if s.get("chunk_rows", 0) and len(hashes) != -(-s["rows"] // s["chunk_rows"]):
        return f"`chunk_sha256` has {len(hashes)} entries for {s['rows']} rows in chunks of {s['chunk_rows']}"
    per_chunk = s.get("chunk_split_counts", {})
    if per_chunk:
        if not isinstance(per_chunk, dict) or set(per_chunk) != set(counts) or not all(
                isinstance(v, list) and len(v) == len(hashes) and all(sealed.is_count(c) for c in v)
                for v in per_chunk.values()):
            return "`chunk_split_counts` must hold, for each split, one count per checksum chunk"
        if any(sum(v) != counts[k] for k, v in per_chunk.items()):
            return "`chunk_split_counts` disagree with `split_counts`"
    return None


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
    splits = list(splits)
    data = encode_shard(list(sample_ids), labels, splits, images)
    rel = shard_name(index)
    io.write_bytes_atomic(io.join(cache_uri, rel), data)
    return describe_shard(rel, data, splits)


def describe_shard(rel: str, data: bytes, splits: list[str]) -> ShardInfo:
    """The manifest entry of the shard file ``data``: size and sha256, the rows of each split, and checksums of
    its pixel chunks and of the rest, so a ranged read can be verified piece by piece."""
    buf = pa.py_buffer(data)
    batch = pa.ipc.open_file(pa.BufferReader(buf)).get_batch(0)  # zero-copy: its buffers point into ``data``
    image = batch.column(batch.schema.names.index("image"))
    per = image.type.byte_width
    start = image.buffers()[1].address - buf.address + image.offset * per
    stop = start + len(image) * per
    assert 0 <= start <= stop <= len(data)
    chunk_rows = max(1, CHECK_CHUNK_BYTES // max(1, per))
    step = chunk_rows * per
    view = memoryview(data)
    meta = hashlib.sha256(view[:start])
    meta.update(view[stop:])
    counts: dict[str, int] = {}
    per_chunk: dict[str, list[int]] = {}
    chunks = -(-len(image) // chunk_rows)
    for row, name in enumerate(splits):
        counts[name] = counts.get(name, 0) + 1
        per_chunk.setdefault(name, [0] * chunks)[row // chunk_rows] += 1
    return ShardInfo(
        path=rel, rows=len(image), bytes=len(data), sha256=hashlib.sha256(data).hexdigest(),
        split_counts=counts, image_offset=start, meta_sha256=meta.hexdigest(), chunk_rows=chunk_rows,
        chunk_sha256=[hashlib.sha256(view[a:min(a + step, stop)]).hexdigest() for a in range(start, stop, step)],
        chunk_split_counts=per_chunk,
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


def read_latest(root_uri: str) -> str | None:
    """The fingerprint that ``ROOT/latest`` names (stripped; may be empty), or None when there is no pointer."""
    latest = io.join(root_uri, LATEST)
    try:
        data = io.read_small(latest)  # bounded: a pointer holds one fingerprint
    except FileNotFoundError:
        return None
    try:
        return data.decode().strip()
    except UnicodeDecodeError:
        raise CorruptArtifactError(f"cache root pointer {latest!r} is not UTF-8 text; delete it and run "
                                   "`dutycycle materialize` again") from None


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
    fp = read_latest(uri)
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
    d = io.read_json(uri, _FIX)
    manifest = CacheManifest.from_json(d, f"cache manifest {uri!r}")
    for shard in manifest.shards:  # a path in a manifest must stay inside the cache, or the cache is refused
        io.resolve_inside(cache_uri, shard.path, "cache")
    return manifest


class CacheReader:
    """Read-only access to a committed cache, one ``ShardView`` per open shard (see ``shards``): local shards are
    memory-mapped in place, remote ones read by range or from a node-local copy; a shard's sha256 is checked
    once per node, not on every open (``read.verify``). At most ``read.max_open_shards`` views stay open."""

    def __init__(self, uri: str, verify: bool = True, read: ReadConfig | None = None, stats: ReadStats | None = None):
        self.uri = resolve(uri)  # a committed cache folder, or a cache root holding one
        self.manifest = read_manifest(self.uri)
        read = read or ReadConfig()
        if not verify:
            read = replace(read, verify="never")
        self.read_config, self.verify = read, read.verify != "never"
        self.stats = stats if stats is not None else ReadStats()  # a loader passes its own, to count in one place
        self._views: OrderedDict[int, ShardView] = OrderedDict()
        self.opened: set[int] = set()  # shards this reader has opened at least once (``reads``: locality figures)
        self._lock = threading.RLock()
        self.offsets = np.concatenate([[0], np.cumsum([s.rows for s in self.manifest.shards])]).astype(
            np.int64
        )
        self._fs, _ = io.filesystem(self.uri)
        self.is_local = io.protocol_of(self._fs) == "file"
        self.remote = None if self.is_local else read.remote
        self._disk = self._chunks = None
        self._node_root: str | None = None  # the node folder, checked once, when first needed
        if self.remote in ("auto", "disk"):
            self._disk = DiskCache(self.node_root(), read.disk_cache_bytes, self.stats)
            total = sum(s.bytes for s in self.manifest.shards)
            self.remote = "disk" if self.remote == "disk" or total <= self._disk.limit else "range"
        if self.remote == "range":
            self._chunks = ChunkCache(read.range_cache_bytes, read.range_chunk_bytes, self.stats)

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    @property
    def num_samples(self) -> int:
        return self.manifest.num_samples

    @property
    def num_shards(self) -> int:
        return len(self.manifest.shards)

    @property
    def mapped(self) -> bool:
        """Whether shard pixels are memory-mapped files (local, or node-local copies) rather than ranged reads."""
        return self.remote != "range"

    def shard_uri(self, i: int) -> str:
        # a path read from a manifest is data: it must stay inside the cache (read_manifest checked it too)
        return io.resolve_inside(self.uri, self.manifest.shards[i].path, "cache")

    def view(self, i: int) -> ShardView:
        """Shard ``i``'s open view (opened, and verified where that applies, on first use)."""
        with self._lock:
            got = self._views.get(i)
            if got is not None:
                self._views.move_to_end(i)
                return got
            got = self._open_view(i)
            self._views[i] = got
            while len(self._views) > self.read_config.max_open_shards:
                self._views.popitem(last=False)  # a caller still holding the view keeps its memory map alive
            return got

    def _open_view(self, i: int) -> ShardView:
        self.opened.add(i)  # every open counts, this reader's views and a gatherer's alike
        info, uri = self.manifest.shards[i], self.shard_uri(i)
        shape = tuple(self.manifest.shape)
        try:
            if self.mapped:
                try:
                    table = open_mapped(self.local_path(i))
                except FileNotFoundError:
                    if self.is_local:
                        raise
                    table = open_mapped(self.local_path(i))  # another process evicted the node copy: land it again
                if table.num_rows != info.rows:
                    raise CorruptArtifactError(
                        f"cache shard {uri!r} has {table.num_rows} rows, manifest says {info.rows}"
                    )
                return view_of_table(i, table, shape, uri)
            return open_ranged(self._fs, io.filesystem(uri)[1], i, info, shape, self.stats, self._chunks)
        except FileNotFoundError as e:
            raise CorruptArtifactError(
                f"cache shard {uri!r} listed in the manifest is missing; materialize the cache again"
            ) from e
        except (pa.ArrowInvalid, OSError) as e:
            raise CorruptArtifactError(f"cache shard {uri!r} cannot be read as Arrow IPC ({e}); "
                                       "delete the cache folder and materialize it again") from e

    def reads(self) -> dict:
        """Which shards this reader opened (as runs of consecutive indices) and what it fetched: how local a
        rank's reads were."""
        runs: list[list[int]] = []
        for i in sorted(self.opened):
            if runs and runs[-1][1] == i - 1:
                runs[-1][1] = i
            else:
                runs.append([i, i])
        return {"shards": len(self.opened), "shard_runs": runs, "of_shards": self.num_shards,
                "bytes_fetched": self.stats.bytes_fetched, "requests": self.stats.requests}

    def node_root(self) -> str:
        """This node's folder for verified-shard records and shard copies (``engine.cache.node``)."""
        if self._node_root is None:
            self._node_root = node.node_dir(self.read_config.node_dir)
        return self._node_root

    def local_path(self, i: int) -> str:
        """A local file with shard ``i``'s bytes (the shard itself, or its node-local copy), checked per ``verify``."""
        info, uri = self.manifest.shards[i], self.shard_uri(i)
        if self.is_local:
            path = io.filesystem(uri)[1]
        else:
            path = self._disk.fetch(self._fs, io.filesystem(uri)[1], info.sha256, info.bytes)
        if self.read_config.verify == "always":
            ok, hashed = os.path.getsize(path) == info.bytes and node.sha256_file(path) == info.sha256, True
        elif self.read_config.verify == "once":
            ok, hashed = node.verify_once(path, info.sha256, info.bytes, self.node_root())
        else:
            ok, hashed = os.path.getsize(path) == info.bytes, False
        self.stats.shards_hashed += hashed
        if not ok:
            raise CorruptArtifactError(
                f"cache shard {uri!r} fails its checksum (expected sha256 {info.sha256[:12]}..., {info.bytes} "
                "bytes); delete the cache folder and materialize it again"
            )
        return path

    def split_column(self, i: int) -> pa.Array:
        """Shard ``i``'s ``split`` column alone, read without the pixels (by range on a remote cache) and without
        verifying the shard (the reads that use its pixels do). For building a split's row index."""
        uri = self.shard_uri(i)
        fs, path = io.filesystem(uri)
        try:
            if self.is_local:
                source = pa.memory_map(path, "r")
            else:
                f = RangeFile(fs, path, self.manifest.shards[i].bytes, self.stats)
                f.fetch([(0, EDGE_BYTES), (f.size - EDGE_BYTES, f.size)])  # footer and metadata in one round trip
                source = pa.PythonFile(f, mode="r")
            names = pa.ipc.open_file(source).schema.names
            opts = pa.ipc.IpcReadOptions(included_fields=[names.index("split")])
            batches = pa.ipc.open_file(source, options=opts)
            return pa.concat_arrays([batches.get_batch(b).column(0) for b in range(batches.num_record_batches)])
        except FileNotFoundError as e:
            raise CorruptArtifactError(
                f"cache shard {uri!r} listed in the manifest is missing; materialize the cache again"
            ) from e
        except (pa.ArrowInvalid, ValueError, OSError) as e:
            raise CorruptArtifactError(f"cache shard {uri!r} has no readable split column ({e}); "
                                       "delete the cache folder and materialize it again") from e

    def shard(self, i: int) -> pa.Table:
        """Shard ``i`` as a whole Arrow table (zero-copy over a memory map when mapped; a ranged cache downloads
        it for this call only)."""
        if self.mapped:
            return open_mapped(self.local_path(i))
        fs, path = io.filesystem(self.shard_uri(i))
        data = fs.cat_file(path)
        self.stats.add_fetch(len(data))
        return pa.ipc.open_file(pa.py_buffer(data)).read_all()

    def images(self, i: int) -> np.ndarray:
        """Shard ``i``'s pixels as a read-only uint8 array [rows, *shape] (zero-copy when mapped)."""
        v = self.view(i)
        return v.pixels if v.pixels is not None else v.ranged.take(np.arange(v.rows))

    def column(self, i: int, name: str) -> np.ndarray:
        v = self.view(i)
        if name == "label":
            return v.labels
        if name in ("sample_id", "split"):
            return (v.ids if name == "sample_id" else v.split).to_numpy(zero_copy_only=False)
        return self.shard(i).column(name).to_numpy(zero_copy_only=False)

    def locate(self, global_index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Map global row indices to (shard, row-in-shard)."""
        shard = np.searchsorted(self.offsets, global_index, side="right") - 1
        return shard, global_index - self.offsets[shard]
