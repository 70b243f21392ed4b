"""The on-disk format of a metadata table (one row per image file, no pixels), shared by writer and readers.

A table is a folder (any fsspec URI)::

    TABLE/
      v00001/part-00000.parquet   data files of version 1 (immutable once written)
      v00002/part-00000.parquet   a later version (an incremental re-ingest adds files, keeps old ones)
      _manifest.json              written last: names the current version's files; the commit point

A reader lists only the files named in ``_manifest.json``, so a killed writer leaves the previous table
intact and readers never see half a write. Columns (plain Arrow types, readable by any Parquet reader):

    sample_id string      content hash (sha256 of the file bytes, 32 hex chars): stable across renames
    uri string            full URI of the file
    size_bytes int64
    format string         decoder's format name (JPEG, PNG, WEBP, ...); null when unreadable
    width int32           as displayed, i.e. after EXIF orientation; null when unreadable
    height int32
    mode string           PIL mode (RGB, L, P, RGBA, CMYK, I;16, ...)
    channels int32
    orientation int32     EXIF orientation tag 1..8 (1 when absent)
    label string          class name
    split string          train / val / test, a pure function of sample_id and the fractions
    phash int64           64-bit perceptual hash as signed int64; null when disabled or unreadable
    error string          null for a readable image, else the reason
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

from .. import io
from ..errors import CorruptArtifactError, SourceError

FORMAT_VERSION = 1
MANIFEST = "_manifest.json"

SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("uri", pa.string()),
        ("size_bytes", pa.int64()),
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

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TableManifest:
        if d.get("format_version") != FORMAT_VERSION:
            raise CorruptArtifactError(
                f"table format version {d.get('format_version')!r} is not supported; ingest the source again"
            )
        return cls(**d)


def version_dir(version: int) -> str:
    return f"v{version:05d}"


def commit(table_uri: str, manifest: TableManifest) -> None:
    io.write_json_atomic(io.join(table_uri, MANIFEST), asdict(manifest))


def read_manifest(table_uri: str) -> TableManifest:
    uri = io.join(table_uri, MANIFEST)
    if not io.exists(uri):
        raise SourceError(
            f"no committed metadata table at {table_uri!r} ({MANIFEST} is missing); create one with "
            "`dutycycle ingest SOURCE TABLE`"
        )
    return TableManifest.from_json(io.read_json(uri))


def file_uris(table_uri: str, manifest: TableManifest | None = None) -> list[str]:
    m = manifest or read_manifest(table_uri)
    return [io.join(table_uri, f) for f in m.files]
