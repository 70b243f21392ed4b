"""The on-disk format of a metadata table (one row per image file, no pixels), shared by writer and readers.

A table is a folder (any fsspec URI)::

    TABLE/
      v00001-3f9a0c1d/part-00000.parquet   data files (immutable once written), in a folder unique to the writer
      v00002-8b7e61aa/part-00000.parquet   a later version: new and changed rows, and rewrites of old files
                                           that lost rows (copy-on-write); untouched old files are kept
      _manifests/v00001.json               one manifest per version, created only if absent: the commit points
      _manifests/v00002.json
      _manifest.json                       a copy of the newest manifest for plain readers (written after it)
      _manifest.json.lock                  (local tables) the lock that keeps that copy moving forward

A version's manifest names every data file of that version. It is created with create-if-absent semantics
(``io.create_exclusive``: a hard link locally, a conditional PUT on object stores; a store that does not enforce
it is found by a probe and refused), so two writers that both prepared version N+1 cannot both commit it: the
loser sees the conflict (an "exists" answer, or an S3 409/412), rebases and commits N+2, and neither deletes the
other's files. A reader takes the highest committed version, and lists only the files its manifest names, so a
killed writer leaves the previous table intact and readers never see half a write. ``_manifest.json`` only
moves forward: it is replaced only by a newer version's manifest (a locked or conditional read-compare-write).

Each manifest records when files left the table, as Delta Lake's remove actions do: ``removed`` lists
``{path, version, at}`` for every data file an earlier version named and this one does not (``version`` the
version that dropped it, ``at`` that version's commit time, its ``created_at``), carried forward from version to
version until ``vacuum`` has deleted the file. ``vacuum`` counts its grace period for such a file from ``at``,
so a reader that opened an older version keeps its files for the whole grace; files no version ever named (a
killed or losing writer's) count from their modification time. Every path in a manifest must resolve inside the
table root, or the table is refused. Each manifest carries ``manifest_sha256``, the sha256 of its other fields'
canonical JSON, so a manifest changed after its commit (a flipped byte in a writer id, a class name, a root) is
refused rather than read as another table. Each manifest carries ``"format": 1`` (``engine.formats``); a manifest
of another format, or missing any field, is refused.
Columns (plain Arrow types, readable by any Parquet reader):

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
    uri_bytes binary      the path's exact bytes when they are not UTF-8 text (a local file name may be any
                          bytes but ``/`` and NUL); ``uri`` then holds a readable form, each undecodable byte
                          written ``\\xNN``. Null for every path that is text. Files written before this column
                          existed lack it: readers add it as nulls (``conform``)
"""

from __future__ import annotations

import json
import posixpath
import re
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import pyarrow as pa

from .. import formats, io, sealed
from ..errors import CorruptArtifactError, DestinationError, SourceError

LATEST_READ_ATTEMPTS = 3  # the newest manifest can be expired between listing and reading it: list again
MANIFEST = "_manifest.json"
MANIFEST_DIR = "_manifests"
_VERSION_FILE = re.compile(r"^v(\d{5,})\.json$")  # as ``version_dir`` names them (checked again: no "v01.json")
_DATA_FOLDER = re.compile(r"^v(\d{5,})(-[0-9a-f]+)?$")  # a version's data folder, as ``data_dir`` names them
DIGEST = sealed.MANIFEST_DIGEST  # a manifest's checksum of its own content (every other field)
# the fields every readable manifest has, with their JSON types (a bool is no number here)
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "version": (int,), "num_rows": (int,), "classes": (list,), "lineage": (dict,), "options": (dict,),
    "created_at": (int, float), "writer": (str,),
}

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
        ("uri_bytes", pa.binary()),
    ]
)


def conform(t: pa.Table, schema: pa.Schema | None = None) -> pa.Table:
    """``t`` (rows read from a data file) in ``schema`` (default ``SCHEMA``): columns a file written before they
    existed lacks (``uri_bytes``) are added as nulls."""
    schema = schema or SCHEMA
    for f in schema:
        if f.name not in t.column_names:
            t = t.append_column(f, pa.nulls(t.num_rows, f.type))
    return t.select(schema.names).cast(schema)


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
    format: int = formats.FORMAT
    writer: str = field(default_factory=lambda: uuid.uuid4().hex)  # who committed it (tells a retry its own)
    # data files earlier versions named and this one does not: {"path", "version" (that dropped it), "at"}
    removed: list[dict[str, Any]] = field(default_factory=list)
    # the previous version's ``manifest_sha256`` when this one was committed (None for version 1): the chain
    previous_sha256: str | None = None

    @classmethod
    def from_json(cls, d: Any, where: str = "table manifest") -> TableManifest:
        """The manifest in ``d`` (parsed JSON) read from ``where`` (its URI, named in every error)."""
        fix = "ingest the source again"
        formats.check(d, where)
        body = sealed.unseal(d, where, fix)
        # a manifest committed before versions chained has no ``previous_sha256``: read as unchained (its version
        # is still checked against its file name), so tables written then stay readable and the next commit chains
        # to it; every manifest committed since records the field
        unchained = "previous_sha256" not in body and isinstance(body.get("version"), int) and body["version"] > 1
        if unchained:
            body = {**body, "previous_sha256": None}
        missing = [f.name for f in fields(cls) if f.name not in body]
        if missing:
            raise CorruptArtifactError(f"{where} is missing {', '.join(f'`{m}`' for m in missing)}; {fix}")
        for name, types in _FIELD_TYPES.items():
            value = body[name]
            if not isinstance(value, types) or isinstance(value, bool):
                raise CorruptArtifactError(f"{where}: `{name}` is {type(value).__name__}, not "
                                           f"{' or '.join(t.__name__ for t in types)}; {fix}")
        if not isinstance(body["files"], list) or not all(isinstance(f, str) for f in body["files"]):
            raise CorruptArtifactError(f"{where}: `files` must be a list of paths; {fix}")
        if not all(isinstance(c, str) for c in body["classes"]):
            raise CorruptArtifactError(f"{where}: `classes` must be a list of names; {fix}")
        removed = body["removed"]
        if not isinstance(removed, list) or not all(_is_removal(e) for e in removed):
            raise CorruptArtifactError(f"{where}: `removed` must be a list of {{path, version, at}}; {fix}")
        if body["version"] < 1:
            raise CorruptArtifactError(f"{where}: `version` is {body['version']}; versions count from 1; {fix}")
        previous = body["previous_sha256"]
        chained_right = (previous is None) == (body["version"] == 1) or unchained
        if not chained_right or not (previous is None or _is_sha256(previous)):
            raise CorruptArtifactError(
                f"{where}: `previous_sha256` is {previous!r} at version {body['version']}: version 1 has none and "
                f"every later version the sha256 of the version before it; {fix}"
            )
        try:
            return cls(**body)
        except TypeError as e:  # a field this format does not have (a damaged key)
            raise CorruptArtifactError(f"{where} is malformed ({e}); {fix}") from None


def encode(d: dict[str, Any]) -> bytes:
    """A manifest's file bytes, as ``commit`` writes them: ``d`` sealed, indented, keys sorted."""
    return json.dumps(sealed.seal(d), indent=1, sort_keys=True).encode()


def _is_sha256(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def _is_removal(e: Any) -> bool:
    return (
        isinstance(e, dict)
        and isinstance(e.get("path"), str)
        and isinstance(e.get("version"), int)
        and isinstance(e.get("at"), (int, float))
        and not isinstance(e.get("at"), bool)
    )


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
    found = (int(m.group(1)) for m in map(_VERSION_FILE.match, names) if m)
    # only the names ``manifest_path`` gives: "v000003.json" beside "v00003.json" is not a second version 3
    return sorted({v for v in found if f"{version_dir(v)}.json" in names})


def folder_version(rel: str) -> int | None:
    """The version whose data folder holds ``rel`` (a path relative to the table), or None outside any."""
    m = _DATA_FOLDER.match(rel.split("/", 1)[0])
    return int(m.group(1)) if m else None


def commit(table_uri: str, manifest: TableManifest) -> None:
    """Create version ``manifest.version``'s manifest if no writer has: the commit point. Data files must be
    durable before this call. Raises ``CommitConflict`` when another writer committed that version first, or
    when this writer's own new files are gone (a vacuum that took it for a killed writer): the caller writes
    them again against the newest version.

    Fills in what only the commit knows: ``created_at`` (the commit time), ``previous_sha256`` (the chain) and
    ``removed`` (the files the previous version named that this one drops, stamped with that time, plus the
    earlier records whose files vacuum has not deleted yet)."""
    _check_paths(table_uri, manifest)
    previous, previous_sha256 = _previous(table_uri, manifest.version)
    new = _check_new_files(table_uri, manifest, previous)
    manifest.format = formats.FORMAT
    manifest.created_at = time.time()  # vacuum's grace for the files this version drops counts from here
    manifest.previous_sha256 = previous_sha256
    manifest.removed = _removals(table_uri, manifest, previous)
    data = encode(asdict(manifest))
    gone = missing(table_uri, new)  # listed last before the commit: a vacuum may have judged this writer dead
    if gone:
        raise CommitConflict(
            f"table {table_uri!r}: {len(gone)} of the data files of version {manifest.version} were removed before "
            f"its commit (e.g. {gone[0]!r}: a vacuum took this write for a killed one); they are written again"
        )
    if not io.create_exclusive(io.join(table_uri, manifest_path(manifest.version)), data, store=table_uri):
        try:  # a retried request may have committed our own manifest already (e.g. a PUT retried by the client)
            if read_manifest(table_uri, manifest.version).writer == manifest.writer:
                return
        except (SourceError, CorruptArtifactError):
            pass
        raise CommitConflict(
            f"table {table_uri!r}: version {manifest.version} was committed by another writer first"
        )
    # The copy for plain readers trails the commit; dutycycle itself reads the newest versioned manifest.
    publish_pointer(table_uri, manifest.version, data)
    newest = max(committed_versions(table_uri), default=0)
    if newest > manifest.version:
        # A later writer publishes its own; this only helps when it died first, or when a store without a
        # conditional replace let our older copy land over its newer one.
        try:  # bounded: a manifest is small, and one that is not (or not a file) is left for readers to refuse
            publish_pointer(table_uri, newest, io.read_small(io.join(table_uri, manifest_path(newest))))
        except (FileNotFoundError, SourceError, CorruptArtifactError):
            pass


def _pointer_version(data: bytes | None) -> int:
    """The version a ``_manifest.json`` copy holds; 0 when absent or unreadable (any manifest replaces it)."""
    if data is None:
        return 0
    try:
        version = json.loads(data).get("version")
    except (ValueError, AttributeError):
        return 0
    return version if isinstance(version, int) and not isinstance(version, bool) else 0


def publish_pointer(table_uri: str, version: int, data: bytes) -> bool:
    """Make ``data`` (version ``version``'s manifest) the ``_manifest.json`` copy unless that copy already holds
    this or a newer version: the copy only moves forward, even when two commits publish at once (the read and
    the write are one locked or conditional step, ``io.replace_if``). Returns whether it wrote."""
    return io.replace_if(io.join(table_uri, MANIFEST), data, lambda current: _pointer_version(current) < version)


def _previous(table_uri: str, version: int) -> tuple[TableManifest | None, str | None]:
    """The manifest ``version`` is committed on (None for version 1) and its ``manifest_sha256``, checked against
    the version before it too: a commit never chains onto a manifest copied over another."""
    if version <= 1:
        return None, None
    try:
        previous, digest = _load(table_uri, version - 1)
    except SourceError as e:
        # Only vacuum removes manifests, and never the newest one: the version this one was prepared on is no
        # longer the newest, so another writer has committed this version.
        raise CommitConflict(
            f"table {table_uri!r}: version {version - 1} is gone, so version {version} was "
            "committed by another writer first"
        ) from e
    if version > 2:
        check_chain(table_uri, previous, _previous_sha256(table_uri, version - 2))
    return previous, digest


def _check_new_files(table_uri: str, manifest: TableManifest, previous: TableManifest | None) -> list[str]:
    """The files ``manifest`` names that its previous version does not, after checking that each lies in a
    data folder of ``manifest``'s version: the rule that lets vacuum tell a write in progress (a folder above
    the newest version) from files no version can commit any more."""
    kept = set(previous.files) if previous else set()
    new = [f for f in manifest.files if f not in kept]
    for rel in new:
        if folder_version(rel) != manifest.version:
            raise DestinationError(
                f"table {table_uri!r}: version {manifest.version} would name the data file {rel!r}, which its "
                f"previous version does not name and which is not in a folder of version {manifest.version}; a "
                f"writer writes a version's new files under format.data_dir({manifest.version})"
            )
    return new


def _removals(table_uri: str, manifest: TableManifest, previous: TableManifest | None) -> list[dict[str, Any]]:
    """``manifest``'s ``removed`` records: the previous version's, less those whose files are gone (vacuum
    deleted them) or that this version names again, plus one per file the previous version named and this one
    does not."""
    if previous is None:
        return []
    names = set(manifest.files)
    carried = [e for e in previous.removed if e["path"] not in names]
    if carried:
        present = _present(table_uri, [e["path"] for e in carried])
        if present is not None:
            carried = [e for e in carried if e["path"] in present]
    dropped = [
        {"path": f, "version": manifest.version, "at": manifest.created_at}
        for f in dict.fromkeys(previous.files)
        if f not in names
    ]
    return carried + dropped


def missing(table_uri: str, paths: list[str]) -> list[str]:
    """Which of ``paths`` (relative to the table) do not exist, by listing their folders; none when the store
    cannot list them."""
    present = _present(table_uri, paths) if paths else None
    return [] if present is None else [p for p in paths if p not in present]


def _present(table_uri: str, paths: list[str]) -> set[str] | None:
    """Which of ``paths`` (relative to the table) still exist, listing only the folders that hold them (one
    listing per version folder, not the whole table); None when the store cannot list them."""
    fs, root = io.filesystem(table_uri)
    root = root.rstrip("/")
    found: set[str] = set()
    for folder in sorted({posixpath.dirname(p) for p in paths}):
        where = f"{root}/{folder}" if folder else root
        fs.invalidate_cache(where)
        try:
            listed = fs.ls(where, detail=False)
        except FileNotFoundError:
            continue  # the whole folder is gone: none of its files is present
        except OSError:
            return None
        found.update(p[len(root) + 1:] for p in listed if p.startswith(root + "/"))
    return found


def read_manifest(table_uri: str, version: int | None = None) -> TableManifest:
    """The newest committed manifest (or ``version``'s), checked: every file path inside the table, its version
    the one its file name says, and its chain to the version before it (while that manifest exists)."""
    if version is not None:
        return _read_checked(table_uri, version)
    for attempt in range(LATEST_READ_ATTEMPTS):
        versions = committed_versions(table_uri)
        try:
            return _read_checked(table_uri, versions[-1]) if versions else _load(table_uri, None)[0]
        except SourceError:
            # vacuum expires a manifest only once a newer one exists: list again to find it
            if not versions or attempt == LATEST_READ_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def read_pointer(table_uri: str) -> TableManifest | None:
    """The ``_manifest.json`` copy for plain readers; None when absent or damaged (dutycycle reads the versioned
    manifests; vacuum keeps the copy's files too, since plain readers read them)."""
    try:
        return _load(table_uri, None)[0]
    except (SourceError, CorruptArtifactError):
        return None


def _read_checked(table_uri: str, version: int) -> TableManifest:
    """Version ``version``'s manifest, refused unless it chains to the manifest of the version before it."""
    manifest, _ = _load(table_uri, version)
    if version > 1:
        check_chain(table_uri, manifest, _previous_sha256(table_uri, version - 1))
    return manifest


def _previous_sha256(table_uri: str, version: int) -> str | None:
    """``version``'s ``manifest_sha256`` as its file holds it; None when vacuum has expired that manifest."""
    try:
        return _load(table_uri, version)[1]
    except SourceError:
        return None
    except CorruptArtifactError as e:
        raise CorruptArtifactError(
            f"table {table_uri!r}: version {version + 1} cannot be checked against the version before it, whose "
            f"manifest is damaged ({e}); restore {manifest_path(version)}, or delete it to expire version {version} "
            f"(version {version + 1}'s own files are unaffected)"
        ) from None


def check_chain(table_uri: str, manifest: TableManifest, previous_sha256: str | None) -> None:
    """Refuse ``manifest`` unless it records ``previous_sha256``, the digest of the version before it as it
    is on disk now (None: that manifest was expired, nothing to check against)."""
    if previous_sha256 is None or manifest.previous_sha256 == previous_sha256:
        return
    if manifest.previous_sha256 is None and manifest.version > 1:  # committed before versions chained
        return
    v = manifest.version
    raise CorruptArtifactError(
        f"table {table_uri!r}: {manifest_path(v)} does not chain to {manifest_path(v - 1)} (it was committed on "
        f"a version {v - 1} whose manifest_sha256 was {manifest.previous_sha256}, the file there now has "
        f"{previous_sha256}): one of them was replaced after its commit, e.g. by an older copy or by another "
        "table's; restore the original manifests, or ingest the source again into a new table"
    )


def _load(table_uri: str, version: int | None) -> tuple[TableManifest, str]:
    """Version ``version``'s manifest (None: the ``_manifest.json`` copy) and its ``manifest_sha256``, checked
    on its own: format, checksum, fields, paths, and the version its file name says."""
    uri = io.join(table_uri, manifest_path(version)) if version is not None else io.join(table_uri, MANIFEST)
    if not io.exists(uri):
        raise SourceError(
            f"no committed metadata table at {table_uri!r} ({MANIFEST} is missing); create one with "
            "`dutycycle ingest SOURCE TABLE`"
        )
    d = io.read_json(uri, "ingest the source again")  # expired meanwhile: SourceError, read_manifest lists again
    manifest = TableManifest.from_json(d, f"table manifest {uri!r}")
    if version is not None and manifest.version != version:
        raise CorruptArtifactError(
            f"table manifest {uri!r} holds version {manifest.version}, not the version {version} its name says: a "
            f"manifest was copied over another (an older version restored?); restore the original "
            f"{manifest_path(version)}, or ingest the source again into a new table"
        )
    _check_paths(table_uri, manifest)
    return manifest, d[DIGEST]


def _check_paths(table_uri: str, manifest: TableManifest) -> None:
    for rel in manifest.files:
        io.resolve_inside(table_uri, rel, "table")
    for record in manifest.removed:
        io.resolve_inside(table_uri, record["path"], "table")


def file_uris(table_uri: str, manifest: TableManifest | None = None) -> list[str]:
    m = manifest or read_manifest(table_uri)
    return [io.resolve_inside(table_uri, f, "table") for f in m.files]
