"""What changed in a source folder since the table's last version: list files with a change stamp, diff them,
streaming.

A file is unchanged when its path, size and change stamp (``modified``: mtime in ns locally, the ETag on object
stores, the creation time on ``memory://``) all match the table's row. Anything else in the listing is probed
again (new or modified: a modified file gets a new content id and metadata), and rows whose file is gone or
modified drop out of the next version.

Streaming: ``iter_listing`` walks the source depth-first with each folder's entries sorted so that the files come
out in the byte order of their full paths, and yields them in batches; the committed rows are read back in the same
order (``SortedRows``, one Parquet batch per data file at a time), so ``diff_batch`` compares one listing batch with
the committed rows of the same key range. The driver holds a batch, the names of the folders on the current path
(one folder's entries at a time) and the changes, never the whole listing or the whole table.

Names are bytes on a local file system and need not be text: a name that is not valid UTF-8 is listed with a
readable ``uri`` (the undecodable bytes written ``\\xNN``) and its exact bytes in ``uri_bytes`` (null for every
name that is text); the key that orders and matches files is the exact bytes. Control characters are kept as they
are (the ``uri`` is the exact name); messages quote names with ``repr``.

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
from collections.abc import Iterator
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from .. import io
from ..errors import CorruptArtifactError, SourceError
from ..roots import under
from . import format as tf

LISTING_SCHEMA = pa.schema(
    [("uri", pa.string()), ("rel", pa.string()), ("size_bytes", pa.int64()), ("modified", pa.string()),
     ("error", pa.string()),  # null, or why the entry is not read (becomes the row's error)
     ("uri_bytes", pa.binary())]  # the path's exact bytes when they are not UTF-8 text (else null)
)
STATE_COLUMNS = ["uri", "size_bytes", "modified", "uri_bytes"]
# The reasons of listing errors (the prefix of the row's ``error``, counted in summaries).
NOT_REGULAR = "not a regular file"
SYMLINK_OUT = "symlink out of the source root"
BROKEN_LINK = "broken symlink"
UNREADABLE_FOLDER = "unreadable folder"  # a folder the listing could not open (its files are not listed)
LIST_BATCH = 10_000  # files per listing batch: what the driver holds of the listing at once


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


def readable(raw: bytes) -> tuple[str, bytes | None]:
    """``(text, exact)`` of a path's bytes: the text itself and None when they are UTF-8, else a readable form
    (each undecodable byte written ``\\xNN``) and the bytes."""
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError:
        return raw.decode("utf-8", "backslashreplace"), raw


def path_key(t: pa.Table) -> pa.Array:
    """The exact bytes of each row's path (``uri_bytes``, else the ``uri``'s UTF-8): what orders and matches
    files. A table written before ``uri_bytes`` existed has only text names."""
    text = pc.cast(t.column("uri"), pa.binary())
    if "uri_bytes" not in t.column_names:
        return text.combine_chunks() if isinstance(text, pa.ChunkedArray) else text
    got = pc.coalesce(pc.cast(t.column("uri_bytes"), pa.binary()), text)
    return got.combine_chunks() if isinstance(got, pa.ChunkedArray) else got


def state_key(t: pa.Table) -> pa.Array:
    """One value per row naming a file's state: its path's bytes, size and stamp."""
    size = pc.cast(pc.cast(t.column("size_bytes"), pa.string()), pa.binary())
    stamp = pc.cast(pc.fill_null(t.column("modified"), ""), pa.binary())
    got = pc.binary_join_element_wise(path_key(t), size, stamp, pa.scalar(b"\x00", pa.binary()))
    return got.combine_chunks() if isinstance(got, pa.ChunkedArray) else got


def _stamp(info: dict) -> str:
    """A change stamp from an fsspec ``info`` dict: the ETag when the store has one, else a modification time."""
    for key in ("ETag", "etag", "mtime", "LastModified", "last_modified", "created"):
        value = info.get(key)
        if value is not None:
            return str(value.isoformat() if hasattr(value, "isoformat") else value)
    return ""


def local_entry(path: str | bytes, real_root: str | bytes) -> tuple[int, str, str | None] | None:
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
        target = os.fsdecode(os.readlink(path))
    except OSError:
        target = "?"
    if not under(os.fsdecode(os.path.realpath(path)), os.fsdecode(real_root)):
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


def _local_names(base: bytes, skip: bytes | None) -> Iterator[tuple[bytes, str | None]]:
    """``(path, error)`` of every non-folder entry under ``base`` (paths as bytes, relative to ``base``), in the
    byte order of the full paths: each folder's entries sorted by name, a folder's name counting with its
    trailing ``/`` (so its files sort where their full paths do). Symlinked folders are entries, not descended
    into; ``skip`` (an absolute path) is not descended into either. A folder that cannot be read is an entry
    with the reason as its ``error`` (its files would otherwise go missing without a word)."""
    top, error = _sorted_folder(base)
    if error is not None:  # (listing nothing would read as every file deleted)
        raise SourceError(f"source {os.fsdecode(base)!r} cannot be listed ({error}); make it readable")
    stack: list[tuple[bytes, Iterator[tuple[bytes, bool]]]] = [(b"", iter(top))]
    while stack:
        rel, entries = stack[-1]
        step = next(entries, None)
        if step is None:
            stack.pop()
            continue
        name, is_dir = step
        child = rel + name
        if not is_dir:
            yield child, None
        elif skip is None or os.path.join(base, child) != skip:
            got, error = _sorted_folder(os.path.join(base, child))
            if error is not None:
                yield child, error
            stack.append((child + b"/", iter(got)))


def _sorted_folder(path: bytes) -> tuple[list[tuple[bytes, bool]], str | None]:
    """One folder's ``(name, is a real folder)`` entries sorted by name (a folder's with ``/``), and why it could
    not be read (None when it could; a folder that vanished meanwhile is empty)."""
    try:
        with os.scandir(path) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    except FileNotFoundError:
        return [], None
    except OSError as e:
        return [], f"{UNREADABLE_FOLDER}: {os.strerror(e.errno) if e.errno else type(e).__name__}"
    entries.sort(key=lambda e: e[0] + b"/" if e[1] else e[0])
    return entries, None


def _remote_names(fs, root: str, skip: str | None) -> Iterator[tuple[str, int, str]]:
    """``(path, size, stamp)`` of every file under ``root`` on an fsspec file system, in the byte order of the
    paths (folder by folder, as ``_local_names``). One folder's entries are held at a time, as compact tuples: the
    store's listing cache is dropped for each folder once read (s3fs would otherwise keep every listing, the whole
    bucket's info dicts, for the life of the file system object)."""
    def folder(path: str) -> list[tuple[str, bool, int, str]]:
        fs.invalidate_cache(path)  # a re-listing must see files changed since
        try:
            listed = fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        finally:
            fs.invalidate_cache(path)
        out = []
        for info in listed:
            name = info["name"].rstrip("/")
            if name == path.rstrip("/"):
                continue  # some stores list a folder's own marker
            kind = info.get("type")
            if kind in ("directory", "file"):
                out.append((name, kind == "directory", int(info.get("size") or 0), _stamp(info)))
        del listed
        out.sort(key=lambda e: (posixpath.basename(e[0]) + ("/" if e[1] else "")).encode())
        return out

    stack = [iter(folder(root))]
    while stack:
        step = next(stack[-1], None)
        if step is None:
            stack.pop()
            continue
        path, is_dir, size, stamp = step
        if not is_dir:
            yield path, size, stamp
        elif path != skip:
            stack.append(iter(folder(path)))


def iter_rels(source: str, skip: str | None = None) -> Iterator[str]:
    """The readable path, relative to ``source``, of every file under it, in listing order, without a ``stat``
    per file (the split-folder layout needs only names)."""
    fs, root = check_source(source)
    if io.protocol(source) == "file":
        base = os.fsencode(os.path.abspath(root))
        for rel, _error in _local_names(base, os.fsencode(skip) if skip else None):
            yield readable(rel)[0]
    else:
        prefix = root.rstrip("/") + "/"
        for path, _size, _when in _remote_names(fs, root, _remote_skip(fs, skip)):
            yield path[len(prefix):] if path.startswith(prefix) else posixpath.basename(path)


def _remote_skip(fs, skip: str | None) -> str | None:
    return io.filesystem(skip)[1].rstrip("/") if skip else None


def iter_listing(source: str, skip: str | None = None, batch: int = LIST_BATCH) -> Iterator[pa.Table]:
    """Every file under ``source`` as tables ``(uri, rel, size_bytes, modified, error, uri_bytes)`` of at most
    ``batch`` rows, in the byte order of the paths (see the module docstring); ``error`` is set for entries that
    are not read. ``skip``: a folder under the source not to list (a table kept inside its own source)."""
    fs, root = check_source(source)
    cols: dict[str, list] = {name: [] for name in LISTING_SCHEMA.names}

    def add(uri, rel, size, stamp, error, exact):
        for name, value in zip(LISTING_SCHEMA.names, (uri, rel, size, stamp, error, exact), strict=True):
            cols[name].append(value)

    def flush() -> pa.Table:
        t = pa.table([cols[n] for n in LISTING_SCHEMA.names], schema=LISTING_SCHEMA)
        for values in cols.values():
            values.clear()
        return t

    if io.protocol(source) == "file":
        base = os.fsencode(os.path.abspath(root))
        real_base = os.path.realpath(base)
        for rel, error in _local_names(base, os.fsencode(skip) if skip else None):
            path = os.path.join(base, rel)
            entry = (0, "", error) if error is not None else local_entry(path, real_base)
            if entry is None:  # vanished since the folder was read
                continue
            uri, exact = readable(path)
            add(uri, readable(rel)[0], entry[0], entry[1], entry[2], exact)
            if len(cols["uri"]) >= batch:
                yield flush()
    else:
        prefix = io.to_uri(fs, root) + "/"
        for path, size, stamp in _remote_names(fs, root, _remote_skip(fs, skip)):
            uri = io.to_uri(fs, path)
            rel = uri[len(prefix):] if uri.startswith(prefix) else posixpath.basename(uri)
            add(uri, rel, size, stamp, None, None)
            if len(cols["uri"]) >= batch:
                yield flush()
    if cols["uri"]:
        yield flush()


def list_source(source: str, skip: str | None = None) -> pa.Table:
    """All files under ``source`` as one table (``iter_listing``'s batches together), in path order."""
    parts = list(iter_listing(source, skip))
    return pa.concat_tables(parts) if parts else LISTING_SCHEMA.empty_table()


class SortedRows:
    """The rows of a version's data files, read back in path order a key range at a time (``upto``): a k-way
    walk over the files, each of which ingest wrote in path order (a file that is not, e.g. one a curated save
    wrote, is read whole and sorted: at most ``commit.ROWS_PER_FILE`` rows). Adds ``_key`` (the path's bytes)
    and ``_file`` (the file's index in ``uris``)."""

    def __init__(self, uris: list[str], columns: list[str] | None = None, missing_ok: bool = False):
        self.uris, self.columns = uris, columns
        self._cursors = [_FileCursor(uri, k, columns, missing_ok) for k, uri in enumerate(uris)]

    def upto(self, last: bytes | None) -> pa.Table | None:
        """The rows not returned yet whose path bytes are ``<= last`` (every remaining row for None); None when
        there are none."""
        parts = [t for c in self._cursors if (t := c.upto(last)) is not None and t.num_rows]
        return pa.concat_tables(parts, promote_options="permissive") if parts else None


@dataclass
class _FileCursor:
    """One data file's rows in path order, a row group at a time; the file is opened per read, never held open
    (a table with thousands of data files would otherwise hold as many descriptors)."""

    uri: str
    index: int
    columns: list[str] | None
    missing_ok: bool = False  # a file that is gone has no rows (else a CorruptArtifactError)
    _pending: pa.Table | None = None
    _groups: list | None = None  # row-group indices still to read, or [a table] for a file read whole
    _present: list[str] | None = None

    def _open(self):
        """The file's plan: its row groups in order when its rows are in path order, else all of it sorted."""
        import pyarrow.parquet as pq

        fs, path = io.filesystem(self.uri)
        try:
            f = fs.open(path, "rb")
        except FileNotFoundError:
            if not self.missing_ok:
                raise CorruptArtifactError(
                    f"the table's data file {self.uri!r} does not exist; ingest into a new table, or restore it"
                ) from None
            self._groups = []  # (rows a lost attempt kept: probed again instead)
            return
        with f:
            pf = pq.ParquetFile(f)
            names = pf.schema_arrow.names
            self._present = None if self.columns is None else [c for c in self.columns if c in names]
            if _sorted(pf):
                self._groups = list(range(pf.num_row_groups))
            else:  # (at most commit.ROWS_PER_FILE rows)
                t = _with_keys(pf.read(columns=self._present), self.index)
                self._groups = [t.take(pc.sort_indices(t.column("_key")))]

    def _next(self) -> pa.Table | None:
        import pyarrow.parquet as pq

        if self._groups is None:
            self._open()
        if not self._groups:
            return None
        group = self._groups.pop(0)
        if isinstance(group, pa.Table):
            return group
        fs, path = io.filesystem(self.uri)
        with fs.open(path, "rb") as f:
            t = pq.ParquetFile(f).read_row_group(group, columns=self._present)
        return _with_keys(t, self.index)

    def upto(self, last: bytes | None) -> pa.Table | None:
        parts = []
        while True:
            if self._pending is None or not self._pending.num_rows:
                self._pending = self._next()
                if self._pending is None:
                    break
            keys = self._pending.column("_key")
            n = self._pending.num_rows if last is None else pc.sum(
                pc.less_equal(keys, pa.scalar(last, pa.binary()))).as_py() or 0
            parts.append(self._pending.slice(0, n))
            self._pending = self._pending.slice(n)
            if self._pending.num_rows:  # the rest lies beyond ``last``
                break
        return pa.concat_tables(parts) if parts else None


def _with_keys(t: pa.Table, index: int) -> pa.Table:
    t = t.append_column("_key", path_key(t))
    return t.append_column("_file", pa.array([index] * t.num_rows, pa.int32()))


def _sorted(pf) -> bool:
    """Whether a data file's rows are in path order (a streaming pass over its path columns)."""
    last = None
    keep = [c for c in ("uri", "uri_bytes") if c in pf.schema_arrow.names]
    for b in pf.iter_batches(LIST_BATCH, columns=keep):
        keys = path_key(pa.Table.from_batches([b]))
        if not len(keys):
            continue
        if last is not None and keys[0].as_py() < last:
            return False
        if len(keys) > 1 and not pc.all(pc.less_equal(keys[:-1], keys[1:])).as_py():
            return False
        last = keys[-1].as_py()
    return True


@dataclass
class Changes:
    """What a listing changes in the table, summed over its batches."""

    unchanged: int = 0  # listed files the table already describes
    modified: int = 0  # listed files whose row is replaced
    deleted: int = 0  # rows whose file is gone
    listed: int = 0
    todo: int = 0  # listed files to probe (new or modified)
    drop: dict[int, list[pa.Array]] = field(default_factory=dict)  # data file -> path keys of rows leaving it

    @property
    def any(self) -> bool:
        return self.todo > 0 or bool(self.drop)

    @property
    def affected_files(self) -> list[int]:
        return sorted(self.drop)


def diff_batch(listing: pa.Table, state: pa.Table | None, changes: Changes) -> pa.Table:
    """The rows of ``listing`` to probe (new or modified files); ``state`` holds the committed rows of the same
    key range (or None). Counts and the rows to drop are added to ``changes``."""
    changes.listed += listing.num_rows
    if state is None or not state.num_rows:
        changes.todo += listing.num_rows
        return listing
    list_key, old_key = state_key(listing), state_key(state)
    same = pc.is_in(old_key, value_set=list_key)  # committed rows still true to their file
    todo = listing.filter(pc.invert(pc.is_in(list_key, value_set=old_key)))
    dropped = state.filter(pc.invert(same))
    still_listed = pc.is_in(dropped.column("_key"), value_set=path_key(listing))
    n_modified = pc.sum(pc.cast(still_listed, pa.int64())).as_py() or 0
    changes.unchanged += listing.num_rows - todo.num_rows
    changes.modified += n_modified
    changes.deleted += dropped.num_rows - n_modified
    changes.todo += todo.num_rows
    _add_drops(dropped, changes)
    return todo


def _add_drops(dropped: pa.Table, changes: Changes) -> None:
    files = dropped.column("_file").to_numpy()
    keys = dropped.column("_key").combine_chunks()
    for k in sorted(set(files.tolist())):
        changes.drop.setdefault(int(k), []).append(keys.filter(pa.array(files == k)))


def deleted_rest(state: pa.Table | None, changes: Changes) -> None:
    """Count the committed rows past the end of the listing: their files are gone."""
    if state is None or not state.num_rows:
        return
    changes.deleted += state.num_rows
    _add_drops(state, changes)


def state_rows(table_uri: str, manifest: tf.TableManifest | None) -> SortedRows:
    """The committed rows' ``(uri, size_bytes, modified, uri_bytes)`` in path order (``SortedRows``)."""
    return SortedRows(tf.file_uris(table_uri, manifest) if manifest is not None else [], STATE_COLUMNS)
