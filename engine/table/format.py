"""The on-disk format of a metadata table (one row per image file, no pixels), shared by writer and readers.

A table is a folder (any fsspec URI)::

    TABLE/
      v00001-3f9a0c1d/part-00000.parquet   data files (immutable once written), in a folder unique to the writer
      v00002-8b7e61aa/part-00000.parquet   a later version: new and changed rows, and rewrites of old files
                                           that lost rows (copy-on-write); untouched old files are kept
      _manifests/v00001.json               one manifest per version, created only if absent: the commit points
      _manifests/v00002.json
      _manifest.json                       a copy of the newest manifest for plain readers (written after it)

A version's manifest names every data file of that version. It is created with create-if-absent semantics
(``io.create_exclusive``: a hard link locally, a conditional PUT on object stores), so two writers that both
prepared version N+1 cannot both commit it: the loser sees the conflict, rebases and commits N+2, and neither
deletes the other's files. A reader takes the highest committed version, and lists only the files its manifest
names, so a killed writer leaves the previous table intact and readers never see half a write. Files no manifest
names (a killed or losing writer's) are removed by ``vacuum`` once older than a grace period. Every path in a
manifest must resolve inside the table root, or the table is refused. Columns (plain Arrow types, readable by
any Parquet reader):

    sample_id string      content hash (sha256 of the file bytes, 32 hex chars): stable across renames
    uri string            full URI of the file
    size_bytes int64
    modified string       the file's change stamp at ingest: mtime in ns (local), ETag (object stores)
    format string         decoder's format name (JPEG, PNG, WEBP, ...); null when unreadable
    width int32           as displayed, i.e. after EXIF orientation; null when unreadable
    height int32
    mode string           PIL mode (RGB, L, P, RGBA, CMYK, I;16, ...)
    channels int32
    orientation int32     EXIF orientation tag 1..8 (1 when absent)
    label string          class name
    split string          train / val / test, a pure function of sample_id and the fractions
    phash int64           64-bit perceptual hash as signed int64; null when disabled, unreadable or too large
    error string          null for a readable image, else the reason
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

from .. import io
from ..errors import CorruptArtifactError, DestinationError, SourceError

FORMAT_VERSION = 2  # 2: the `modified` column, versioned manifests created exclusively, a writer id
MANIFEST = "_manifest.json"
MANIFEST_DIR = "_manifests"
_VERSION_FILE = re.compile(r"^v(\d+)\.json$")

SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("uri", pa.string()),
        ("size_bytes", pa.int64()),
        ("modified", pa.string()),
        ("format", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("mode", pa.string()),
        ("channels", pa.int32()),
        ("orientation", pa.int32()),
        ("label", pa.string()),
        ("split", pa.string()),
        ("phash", pa.int64()),
        ("error", pa.string()),
    ]
)


@dataclass
class TableManifest:
    version: int
    files: list[str]  # relative to the table root
    num_rows: int
    classes: list[str]  # sorted class names; a label's index is its position here
    source: str = ""  # where the images came from (ingest) or the parent table (curation)
    lineage: dict[str, Any] = field(default_factory=dict)  # {"parent": uri, "filter": str, ...} for subsets
    options: dict[str, Any] = field(
        default_factory=dict
    )  # ingest options (split fractions, phash, labels file)
    created_at: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION
    writer: str = field(default_factory=lambda: uuid.uuid4().hex)  # who committed it (tells a retry its own)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TableManifest:
        if d.get("format_version") != FORMAT_VERSION:
            raise CorruptArtifactError(
                f"table format version {d.get('format_version')!r} is not supported; ingest the source again"
            )
        if not isinstance(d.get("files"), list) or not all(isinstance(f, str) for f in d["files"]):
            raise CorruptArtifactError("table manifest: `files` must be a list of paths; ingest the source again")
        return cls(**d)


class CommitConflict(DestinationError):
    """Another writer committed the version this one prepared; rebase onto it and try the next version."""


def version_dir(version: int) -> str:
    return f"v{version:05d}"


def data_dir(version: int) -> str:
    """A fresh folder for one writer's data files of ``version``: never shared, so never overwritten."""
    return f"{version_dir(version)}-{uuid.uuid4().hex[:8]}"


def manifest_path(version: int) -> str:
    return f"{MANIFEST_DIR}/{version_dir(version)}.json"


def committed_versions(table_uri: str) -> list[int]:
    """The versions with a committed manifest, ascending."""
    fs, path = io.filesystem(io.join(table_uri, MANIFEST_DIR))
    fs.invalidate_cache(path)  # s3fs caches listings; another writer may have committed since
    try:
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(path, detail=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for m in map(_VERSION_FILE.match, names) if m)


def commit(table_uri: str, manifest: TableManifest) -> None:
    """Create version ``manifest.version``'s manifest if no writer has: the commit point. Data files must be
    durable before this call. Raises ``CommitConflict`` when another writer committed that version first."""
    _check_paths(table_uri, manifest)
    data = json.dumps(asdict(manifest), indent=1, sort_keys=True).encode()
    if not io.create_exclusive(io.join(table_uri, manifest_path(manifest.version)), data):
        try:  # a retried request may have committed our own manifest already (e.g. a PUT retried by the client)
            if read_manifest(table_uri, manifest.version).writer == manifest.writer:
                return
        except (SourceError, CorruptArtifactError):
            pass
        raise CommitConflict(
            f"table {table_uri!r}: version {manifest.version} was committed by another writer first"
        )
    # The copy for plain readers trails the commit; dutycycle itself reads the newest versioned manifest.
    if max(committed_versions(table_uri), default=0) == manifest.version:
        io.write_bytes_atomic(io.join(table_uri, MANIFEST), data)


def read_manifest(table_uri: str, version: int | None = None) -> TableManifest:
    """The newest committed manifest (or ``version``'s), with every file path checked to lie inside the table."""
    if version is None:
        versions = committed_versions(table_uri)
        version = versions[-1] if versions else None
    uri = io.join(table_uri, manifest_path(version)) if version is not None else io.join(table_uri, MANIFEST)
    if not io.exists(uri):
        raise SourceError(
            f"no committed metadata table at {table_uri!r} ({MANIFEST} is missing); create one with "
            "`dutycycle ingest SOURCE TABLE`"
        )
    try:
        manifest = TableManifest.from_json(io.read_json(uri))
    except (TypeError, json.JSONDecodeError) as e:
        raise CorruptArtifactError(f"table manifest {uri!r} cannot be parsed ({e}); ingest the source again") from e
    _check_paths(table_uri, manifest)
    return manifest


def _check_paths(table_uri: str, manifest: TableManifest) -> None:
    for rel in manifest.files:
        io.resolve_inside(table_uri, rel, "table")


def file_uris(table_uri: str, manifest: TableManifest | None = None) -> list[str]:
    m = manifest or read_manifest(table_uri)
    return [io.resolve_inside(table_uri, f, "table") for f in m.files]
