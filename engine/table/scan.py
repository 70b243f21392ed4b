"""What changed in a source folder since the table's last version: list files with a change stamp, diff them.

A file is unchanged when its URI, size and change stamp (``modified``: mtime in ns locally, the ETag on object
stores, the creation time on ``memory://``) all match the table's row. Anything else in the listing is probed
again (new or modified: a modified file gets a new content id and metadata), and rows whose file is gone or
modified drop out of the next version. Plain functions over Arrow tables; the driver holds the listing and
three columns of the previous version, never Python objects per row of the table.

Local sources are listed with ``lstat`` semantics, and nothing is opened while listing: a regular file is listed;
a symlink is followed only when its target is a regular file inside the source root (its row then carries the
target's size and stamp); anything else (a FIFO, socket or device, a symlink out of the root, to a folder or to
nothing) is listed with an ``error`` saying why, and becomes an error row that is never read. Opening a FIFO
would block the ingest and reading a device would never end.
"""

from __future__ import annotations

import os
import posixpath
import stat
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from .. import io
from ..errors import SourceError
from ..roots import under
from . import format as tf

LISTING_SCHEMA = pa.schema(
    [("uri", pa.string()), ("rel", pa.string()), ("size_bytes", pa.int64()), ("modified", pa.string()),
     ("error", pa.string())]  # null, or why the entry is not read (becomes the row's error)
)
STATE_SCHEMA = pa.schema(
    [("uri", pa.string()), ("size_bytes", pa.int64()), ("modified", pa.string()), ("_file", pa.int32())]
)
# The reasons of listing errors (the prefix of the row's ``error``, counted in summaries).
NOT_REGULAR = "not a regular file"
SYMLINK_OUT = "symlink out of the source root"
BROKEN_LINK = "broken symlink"


def check_source(source: str):
    """``(fs, root)`` of an existing source folder, or a ``SourceError`` naming the problem."""
    try:
        fs, root = io.filesystem(source)
    except (ValueError, ImportError) as e:
        raise SourceError(
            f"source {source!r} is not a location fsspec can open ({e}); pass a folder path or URI"
        ) from e
    if not fs.exists(root):
        raise SourceError(
            f"source {source!r} does not exist; pass a folder of images (e.g. one made by `dutycycle synth`)"
        )
    if not fs.isdir(root):
        raise SourceError(f"source {source!r} is a file, not a folder; pass the folder that holds the images")
    return fs, root.rstrip("/")


def _stamp(info: dict) -> str:
    """A change stamp from an fsspec ``info`` dict: the ETag when the store has one, else a modification time."""
    for key in ("ETag", "etag", "mtime", "LastModified", "last_modified", "created"):
        value = info.get(key)
        if value is not None:
            return str(value.isoformat() if hasattr(value, "isoformat") else value)
    return ""


def local_entry(path: str, real_root: str) -> tuple[int, str, str | None] | None:
    """``(size, stamp, error)`` of one local directory entry, from ``lstat`` and (for a symlink) its resolved
    target; nothing is opened. None when the entry vanished."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return st.st_size, str(st.st_mtime_ns), None
    if not stat.S_ISLNK(mode):
        return st.st_size, str(st.st_mtime_ns), f"{NOT_REGULAR}: {io.file_kind(mode)}"
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    if not under(os.path.realpath(path), real_root):
        return st.st_size, str(st.st_mtime_ns), f"{SYMLINK_OUT}: it points to {target!r}"
    try:
        tst = os.stat(path)
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else type(e).__name__
        return st.st_size, str(st.st_mtime_ns), f"{BROKEN_LINK}: it points to {target!r} ({why})"
    if not stat.S_ISREG(tst.st_mode):
        return st.st_size, str(st.st_mtime_ns), f"{NOT_REGULAR}: symlink to a {io.file_kind(tst.st_mode)}"
    # the link's own time counts too: pointing it at another file of the same size and age is a change
    return tst.st_size, str(max(tst.st_mtime_ns, st.st_mtime_ns)), None


def list_source(source: str) -> pa.Table:
    """All files under ``source`` as a table ``(uri, rel, size_bytes, modified, error)`` sorted by URI; ``error``
    is set for entries that are not read (see the module docstring)."""
    fs, root = check_source(source)
    uris, rels, sizes, stamps, errors = [], [], [], [], []
    if io.protocol(source) == "file":
        base = os.path.abspath(root)
        real_base = os.path.realpath(base)
        for folder, dirs, names in os.walk(base):  # does not descend into symlinked folders
            links = [d for d in dirs if os.path.islink(os.path.join(folder, d))]
            for name in [*names, *links]:
                path = os.path.join(folder, name)
                entry = local_entry(path, real_base)
                if entry is None:  # vanished since the folder was read
                    continue
                uris.append(path)
                rels.append(os.path.relpath(path, base).replace(os.sep, "/"))
                sizes.append(entry[0])
                stamps.append(entry[1])
                errors.append(entry[2])
    else:
        prefix = io.to_uri(fs, root) + "/"
        fs.invalidate_cache(root)  # s3fs caches listings: a re-listing must see files changed since
        for path, info in fs.find(root, detail=True).items():
            if info.get("type") != "file":
                continue
            uri = io.to_uri(fs, path)
            uris.append(uri)
            rels.append(uri[len(prefix) :] if uri.startswith(prefix) else posixpath.basename(uri))
            sizes.append(int(info.get("size") or 0))
            stamps.append(_stamp(info))
            errors.append(None)
    t = pa.table([uris, rels, sizes, stamps, errors], schema=LISTING_SCHEMA)
    return t.sort_by("uri")


def read_state(table_uri: str, manifest: tf.TableManifest | None) -> pa.Table:
    """The committed rows' ``(uri, size_bytes, modified)`` plus ``_file``, the index of the file holding each."""
    import pyarrow.parquet as pq

    schema = STATE_SCHEMA
    if manifest is None:
        return schema.empty_table()
    parts = []
    for k, uri in enumerate(tf.file_uris(table_uri, manifest)):
        fs, path = io.filesystem(uri)
        with fs.open(path, "rb") as f:
            t = pq.read_table(f, columns=["uri", "size_bytes", "modified"])
        parts.append(t.append_column("_file", pa.array([k] * t.num_rows, pa.int32())))
    return pa.concat_tables(parts).cast(schema) if parts else schema.empty_table()


@dataclass
class Changes:
    todo: pa.Table  # listing rows to probe: new or modified files
    unchanged: int  # listed files the table already describes
    modified: int  # listed files whose row is replaced
    deleted: int  # rows whose file is gone
    drop: pa.Array  # URIs whose rows leave the table (modified or deleted)
    affected_files: list[int]  # indices (in the manifest) of data files holding a dropped row

    @property
    def any(self) -> bool:
        return self.todo.num_rows > 0 or len(self.drop) > 0


def _key(t: pa.Table) -> pa.Array:
    """One string per row naming a file's state: URI, size and stamp."""
    size = pc.cast(t.column("size_bytes"), pa.string())
    stamp = pc.fill_null(t.column("modified"), "")
    return pc.binary_join_element_wise(t.column("uri"), size, stamp, "\x00")


def diff(listing: pa.Table, state: pa.Table) -> Changes:
    """Which listed files to probe and which committed rows to drop (see the module docstring)."""
    list_key, state_key = _key(listing), _key(state)
    same = pc.is_in(state_key, value_set=list_key)  # committed rows still true to their file
    todo = listing.filter(pc.invert(pc.is_in(list_key, value_set=state_key)))
    drop_mask = pc.invert(same)
    dropped = state.filter(drop_mask)
    still_listed = pc.is_in(dropped.column("uri"), value_set=listing.column("uri"))
    n_modified = pc.sum(pc.cast(still_listed, pa.int64())).as_py() or 0
    return Changes(
        todo=todo,
        unchanged=listing.num_rows - todo.num_rows,
        modified=n_modified,
        deleted=dropped.num_rows - n_modified,
        drop=dropped.column("uri").combine_chunks() if dropped.num_rows else pa.array([], pa.string()),
        affected_files=sorted(set(dropped.column("_file").to_pylist())),
    )
