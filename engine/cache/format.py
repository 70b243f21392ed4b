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

``resolve`` (and so ``CacheReader``) accepts either a committed cache folder or a root. A folder inside a cache
root (a folder holding ``latest`` or ``_index``) must be named by the fingerprint its manifest records: a
fingerprint folder swapped for, copied over by or renamed from another valid cache is refused (``read_manifest``),
since whoever asks for that fingerprint (the reuse index, ``latest``, a user, a resumed run) would otherwise get
another table's or another transform's samples. A cache written elsewhere (``write_cache``, a copy) may have
any name.

Each shard has plain Arrow columns that any Arrow reader understands without dutycycle:

    sample_id: string, label: int64, split: string, image: fixed_size_binary[prod(shape)]

``image`` holds uint8 pixels in the manifest's ``layout`` (HWC or CHW) and ``shape``. A cache without
``manifest.json`` is uncommitted and never read; a shard whose sha256 differs from the manifest is refused
with an error naming it. ``channel_stats`` holds the per-channel mean and standard deviation of the training
split's pixels (``stats``); a manifest written before the field existed has no such key and reads as None.
``manifest.json`` carries ``manifest_sha256``, the sha256 of its other fields' canonical
JSON, so a manifest changed after its commit (a digit of the fingerprint, a count) is refused rather than read as
another cache, and ``"format": 1`` (``engine.formats``): a manifest of another format, or missing a field, is
refused. How shards are read (memory-mapped, by range, node-local copies, checked once per
node) is ``shards.py``, ``remote.py`` and ``node.py``.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import pyarrow as pa

from .. import formats, io, sealed
from ..errors import CorruptArtifactError, SourceError
from .stats import stats_problem

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
    every piece it fetches and find a split's rows without reading any column."""

    path: str  # relative to the cache root
    rows: int
    bytes: int
    sha256: str
    split_counts: dict[str, int]  # rows of each split in this shard
    image_offset: int  # where the pixel buffer starts in the file (it ends at image_offset + rows * sample bytes)
    meta_sha256: str  # sha256 of the file's bytes before and after the pixel buffer (columns, footer)
    chunk_rows: int  # rows per pixel checksum: CHECK_CHUNK_BYTES of pixels, rounded down to whole rows
    chunk_sha256: list[str]  # sha256 of pixel rows [k * chunk_rows, (k + 1) * chunk_rows)
    # rows of each split in each checksum chunk: where a split's rows fall in the chunks, so a plan can cut its
    # shuffle blocks at chunk boundaries (a ranged reader then fetches each chunk for one block)
    chunk_split_counts: dict[str, list[int]]


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
    format: int = formats.FORMAT
    options: dict[str, Any] = field(default_factory=dict)  # how it was made: filter, table version, timings
    # The dataset's per-channel statistics on a 0..1 scale, exact over the training split (``stats``):
    # {"mean": [...], "std": [...], "samples": n, "split": "train" (or "all" without a train split)}. None in a
    # cache written before dutycycle recorded them (its manifest has no such key, and still reads).
    channel_stats: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain JSON, sealed with ``manifest_sha256`` (``engine.sealed``). A manifest without statistics has no
        ``channel_stats`` key, as before the field existed, so such a manifest reads and writes as it was sealed."""
        d = asdict(self)
        d["shards"] = [asdict(s) for s in self.shards]
        if d["channel_stats"] is None:
            del d["channel_stats"]
        return sealed.seal(d)

    @classmethod
    def from_json(cls, d: Any, where: str = "cache manifest") -> CacheManifest:
        """The manifest in ``d`` (parsed JSON) read from ``where`` (its URI, named in every error)."""
        formats.check(d, where)
        d = sealed.unseal(d, where, _FIX)
        problem = _manifest_problem(d)
        if problem:
            raise CorruptArtifactError(f"{where} is malformed: {problem}; {_FIX}")
        try:
            d["shards"] = [ShardInfo(**s) for s in d["shards"]]
            return cls(**d)
        except TypeError as e:  # a field this format does not have (a damaged key)
            raise CorruptArtifactError(f"{where} is malformed ({e}); {_FIX}") from None

    @property
    def sample_bytes(self) -> int:
        return int(np.prod(self.shape))

    @property
    def channels(self) -> int:
        """Channels per sample: 3 (RGB) or 1 (L), the last axis of an HWC shape, the first of a CHW one."""
        return channels_of(self.shape, self.layout)


def channels_of(shape, layout: str) -> int:
    return int(shape[-1] if layout == "HWC" else shape[0])


OPTIONAL_FIELDS = frozenset({"channel_stats"})  # fields a manifest may lack (written before they existed)


def _manifest_problem(d: dict[str, Any]) -> str | None:
    """What is wrong with a manifest's fields (every field present, the types readers rely on, and
    ``num_samples`` against the shards' rows), or None."""
    missing = [f.name for f in fields(CacheManifest) if f.name not in d and f.name not in OPTIONAL_FIELDS]
    if missing:
        return f"{', '.join(f'`{m}`' for m in missing)} missing"
    shards = d.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
        return "`shards` must be a list of {path, rows, bytes, sha256}"
    for s in shards:
        absent = [f.name for f in fields(ShardInfo) if f.name not in s]
        if absent:
            return f"shard entry {s.get('path')!r:.100} lacks {', '.join(f'`{m}`' for m in absent)}"
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
        if not isinstance(d[name], types):
            return f"`{name}` is {type(d[name]).__name__}, not {types.__name__}"
    if not all(isinstance(c, str) for c in d["classes"]):
        return "`classes` must be a list of names"
    if d.get("channel_stats") is not None:
        return stats_problem(d["channel_stats"], channels_of(shape, d["layout"]) if len(shape) == 3 else None)
    return None


def shard_checks_problem(s: dict[str, Any]) -> str | None:
    """What is wrong with a shard entry's fields after ``sha256`` (its counts and piecewise checksums), or None."""
    counts = s.get("split_counts")
    if not isinstance(counts, dict) or not all(isinstance(k, str) and sealed.is_count(v) for k, v in counts.items()):
        return "`split_counts` must map split names to counts"
    if sum(counts.values()) != s["rows"]:
        return f"`split_counts` add up to {sum(counts.values())}, not its {s['rows']} rows"
    for name in ("image_offset", "chunk_rows"):
        if not sealed.is_count(s.get(name)):
            return f"`{name}` must be a count"
    hashes = s.get("chunk_sha256")
    if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes) \
            or not isinstance(s.get("meta_sha256"), str):
        return "`chunk_sha256` must be a list of sha256 strings and `meta_sha256` a string"
    if s["chunk_rows"] < 1 or len(hashes) != -(-s["rows"] // s["chunk_rows"]):
        return f"`chunk_sha256` has {len(hashes)} entries for {s['rows']} rows in chunks of {s['chunk_rows']}"
    per_chunk = s.get("chunk_split_counts")
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
    check_folder(cache_uri, manifest)
    for shard in manifest.shards:  # a path in a manifest must stay inside the cache, or the cache is refused
        io.resolve_inside(cache_uri, shard.path, "cache")
    return manifest



def is_cache_root(uri: str) -> bool:
    """Whether ``uri`` is a cache root: materialize left its ``latest`` pointer or its ``_index`` there."""
    return io.exists(io.join(uri, LATEST)) or io.exists(io.join(uri, INDEX_DIR))


def _parent_and_name(uri: str) -> tuple[str, str]:
    if "://" in uri:
        scheme, rest = uri.split("://", 1)
        parent, name = posixpath.split(rest.rstrip("/"))
        return f"{scheme}://{parent}", name
    return os.path.split(os.path.abspath(uri))


def check_folder(cache_uri: str, manifest: CacheManifest) -> None:
    """Refuse a fingerprint folder of a cache root whose manifest records another fingerprint (see the module
    doc). The name is compared first, so a cache in its own folder costs no extra request."""
    root, name = _parent_and_name(cache_uri)
    if name == manifest.fingerprint or not is_cache_root(root):
        return
    raise CorruptArtifactError(
        f"cache folder {cache_uri!r} holds the cache of fingerprint {manifest.fingerprint!r}, not {name!r}: in "
        f"the cache root {root!r} a folder is named by the fingerprint of its cache, so this one was swapped, "
        f"copied over or renamed, and whoever asks for {name!r} would get other samples; it is refused. Delete "
        f"{cache_uri!r} and run `dutycycle materialize` again (a copy meant to be kept belongs outside the root)"
    )
