"""Writing a table version: data files made durable under the writer's own folder, then the manifest created if
absent (the commit point, see ``format.py``). Every writer of tables goes through here: ingest (which keeps the
previous version's untouched files) through the pieces, a curated view's save and generated test or benchmark
tables through ``write_version``.

An ingest that loses the race for a version discards its own folder (nobody else references it) and plans again
against the newer version; ``write_version`` (whole versions: a save) commits the files it already wrote as the
version after. Either tries at most ``MAX_COMMIT_ATTEMPTS`` times. A saved view is written by Daft's Parquet
writer where its query runs (``write_dataframe``): its rows never pass through the driver.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import uuid
from typing import Any

from .. import io
from ..errors import DestinationError, DutycycleError
from . import format as tf

ROWS_PER_FILE = 200_000
MAX_COMMIT_ATTEMPTS = 8  # commits lost to concurrent writers before an ingest (or a save) gives up
# how Daft's Rust writer words ENOSPC (os error 28) and EDQUOT (122) in the exception it raises
_DAFT_NO_SPACE = re.compile(r"os error (28|122)\b|No space left on device|Disk quota exceeded", re.IGNORECASE)
WRITE_PROBE_PREFIX = ".write-probe-"  # the file check_destination writes and removes (vacuum removes leftovers)


def check_destination(table: str) -> None:
    """Refuse a table location that is an existing file, cannot be written, or whose store does not enforce the
    create-if-absent write the commit relies on, before any work is done."""
    fs, path = io.filesystem(table)
    if fs.exists(path) and not fs.isdir(path) and io.protocol(table) == "file":
        raise DestinationError(f"table {table!r} is an existing file; choose a folder path for the table")
    probe = io.join(table, f"{WRITE_PROBE_PREFIX}{uuid.uuid4().hex}")
    io.write_bytes_atomic(probe, b"")  # raises DestinationError naming the table location
    try:
        fs.rm(io.filesystem(probe)[1])
    except (FileNotFoundError, OSError):
        pass
    io.require_exclusive_create(table)  # once per process and table; the commit would probe it anyway


def write_rows(table_uri: str, folder: str, tables) -> list[str]:
    """Write Arrow tables of rows as Parquet files under ``folder`` (relative to the table), each made durable
    (fsync) before this returns; returns their paths relative to the table."""
    import pyarrow.parquet as pq

    files = []
    try:
        for rows in tables:
            for start in range(0, max(rows.num_rows, 1), ROWS_PER_FILE):
                rel = f"{folder}/part-{len(files):05d}.parquet"
                part = rows.slice(start, ROWS_PER_FILE).cast(tf.SCHEMA)
                io.write_fsynced(io.join(table_uri, rel), lambda f, t=part: pq.write_table(t, f, compression="zstd"))
                files.append(rel)
    except BaseException as e:
        # the folder is this writer's own and nothing references it yet: a failed write (a full disk: a
        # NoSpaceError from write_fsynced) leaves none of its files behind
        _discard(table_uri, folder)
        if isinstance(e, OSError):
            raise DestinationError(f"cannot write table {table_uri!r}: {e}; choose a writable location") from e
        raise
    return files


def _discard(table_uri: str, folder: str) -> None:
    """Remove this writer's own uncommitted folder after it lost a commit race (nobody else references it)."""
    fs, path = io.filesystem(io.join(table_uri, folder))
    try:
        fs.rm(path, recursive=True)
    except (FileNotFoundError, OSError):
        pass  # vacuum removes it later


def try_commit(table_uri: str, folder: str, manifest: tf.TableManifest) -> bool:
    """Commit ``manifest``, whose new data files this writer wrote under ``folder`` (``tf.data_dir`` of its
    version). False when another writer took that version first, or when the files under ``folder`` were removed
    before the commit (a vacuum took this write for a killed one: it went longer than
    ``vacuum.MIN_GRACE_SECONDS`` without writing there): the folder is discarded and the caller writes again
    against the newest version, so no version is ever committed naming a file that is gone."""
    try:
        tf.commit(table_uri, manifest)  # the commit point: the data files are invisible until it succeeds
    except tf.CommitConflict:
        _discard(table_uri, folder)
        return False
    except BaseException:
        # a commit that failed (a full disk under the manifest) leaves no data files behind, unless the manifest
        # did land and only a later step failed: then they are the committed version's
        if not _committed_by(table_uri, manifest):
            _discard(table_uri, folder)
        raise
    return True


def _committed_by(table_uri: str, manifest: tf.TableManifest) -> bool:
    """Whether ``manifest``'s version is committed by this writer (its writer id)."""
    try:
        return tf.read_manifest(table_uri, manifest.version).writer == manifest.writer
    except (DutycycleError, OSError):
        return False


def write_dataframe(table_uri: str, folder: str, df) -> tuple[list[str], int]:
    """Write a Daft DataFrame of the table's columns as Parquet files under ``folder`` (relative to the table)
    with Daft's writer, where Daft's runner runs the query (in-process partitions, or Ray workers): no row
    passes through this process. Returns the files' paths relative to the table and their rows, read from the
    files' footers; the files are durable before this returns.

    A location Daft cannot write (``memory://``) gets the query's results streamed here in batches instead,
    written as ``write_rows`` writes them: one batch of at most ``ROWS_PER_FILE`` rows in memory at a time."""
    import daft
    from daft import col

    typed = df.select(*[col(f.name).cast(daft.DataType.from_arrow_type(f.type)) for f in tf.SCHEMA])
    if io.protocol(table_uri) not in io.DAFT_SCHEMES:
        files = write_rows(table_uri, folder, _rebatch(typed.to_arrow_iter(), ROWS_PER_FILE))
        return files, sum(_footer_rows(table_uri, rel) for rel in files)
    root = io.join(table_uri, folder)
    try:
        written = typed.write_parquet(root, compression="zstd", io_config=io.daft_io_config()).to_pydict()["path"]
        # Daft names each file (a uuid) inside ``root``; the manifest names them relative to the table
        files = sorted(f"{folder}/{posixpath.basename(p)}" for p in written)
        _make_durable(table_uri, folder, files)
        return files, sum(_footer_rows(table_uri, rel) for rel in files)
    except BaseException as e:
        _discard(table_uri, folder)  # nobody references this writer's folder: leave nothing half-written
        named = _write_error(table_uri, root, e) if isinstance(e, Exception) else None
        if named is None:
            raise  # the view's own query failed (a user's function, a bad value): its error, unchanged
        raise named from e


def _write_error(table_uri: str, root: str, e: Exception) -> DestinationError | None:
    """The error a failed Daft write raises when the destination failed it: a full disk named (Daft reports
    the OS error in its message, not as an ``OSError``), another OS error with the table named; else None."""
    if isinstance(e, DestinationError):
        return None
    if not isinstance(e, OSError) and _DAFT_NO_SPACE.search(str(e)):
        e = OSError(errno.EDQUOT if "quota" in str(e).lower() else errno.ENOSPC, str(e))
    if not isinstance(e, OSError):
        return None
    return io.no_space(e, root) or DestinationError(
        f"cannot write table {table_uri!r}: {e}; choose a writable location")


def _rebatch(tables, rows: int):
    """Arrow tables (or record batches) regrouped into tables of ``rows`` rows (the last one shorter; one empty
    table for none)."""
    import pyarrow as pa

    pending, held = [], 0
    for t in tables:
        t = pa.Table.from_batches([t]) if isinstance(t, pa.RecordBatch) else t
        pending.append(t)
        held += t.num_rows
        while held >= rows:
            whole = pa.concat_tables(pending)
            yield whole.slice(0, rows)
            pending, held = [whole.slice(rows)], held - rows
    if held or not pending:
        yield pa.concat_tables(pending) if pending else tf.SCHEMA.empty_table()


def _make_durable(table_uri: str, folder: str, files: list[str]) -> None:
    """fsync files another process wrote (Daft's writer), and their folder: the commit must not name a file a
    power cut could lose. An object store's upload is durable once it completed."""
    if io.protocol(table_uri) != "file":
        return
    for rel in files:
        path = io.filesystem(io.join(table_uri, rel))[1]
        fd = os.open(path, os.O_RDONLY)  # fsync flushes the file's dirty pages whichever descriptor asks
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    io.fsync_dir(io.filesystem(io.join(table_uri, folder))[1])


def _footer_rows(table_uri: str, rel: str) -> int:
    """The rows of a written data file, from its Parquet footer (a few KB read, not the data)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, path = io.filesystem(io.join(table_uri, rel))
    try:
        with fs.open(path, "rb") as f:
            return pq.ParquetFile(f).metadata.num_rows
    except (OSError, pa.ArrowInvalid) as e:
        raise DestinationError(f"table {table_uri!r}: the data file {rel!r} just written cannot be read back "
                               f"({e}); check the location and write again") from e


def write_version(table_uri: str, rows, *, classes: list[str], source: str = "", lineage: dict[str, Any] | None = None,
                  options: dict[str, Any] | None = None) -> tf.TableManifest:
    """Commit ``rows`` as the whole of the next version of the table at ``table_uri``; returns the committed
    manifest. ``rows``: an Arrow table of the table's columns, or a Daft DataFrame (written by Daft's writer where
    the query runs, ``write_dataframe``: a saved view never passes through this process).

    The data files are written once: when another writer commits that version first, this one moves its folder to
    a data folder of the version after (a rename locally, a server-side copy on object stores; a version's new
    files live under its own ``data_dir``) and commits that. Only when its files are gone (a vacuum that took it for
    a killed writer) does it write them again."""
    written: tuple[str, list[str], int] | None = None  # (folder, files, rows) this writer holds, uncommitted
    for _ in range(MAX_COMMIT_ATTEMPTS):
        versions = tf.committed_versions(table_uri)
        version = (versions[-1] if versions else 0) + 1
        folder = tf.data_dir(version)
        if written is not None:
            written = _move(table_uri, written, folder)
        if written is None:
            if hasattr(rows, "num_rows"):  # Arrow
                written = folder, write_rows(table_uri, folder, [rows]), rows.num_rows
            else:
                written = folder, *write_dataframe(table_uri, folder, rows)
        _, files, num_rows = written
        manifest = tf.TableManifest(version=version, files=list(files), num_rows=num_rows, classes=list(classes),
                                    source=source, lineage=dict(lineage or {}), options=dict(options or {}))
        try:
            tf.commit(table_uri, manifest)  # the commit point: the data files are invisible until it succeeds
            return manifest
        except tf.CommitConflict:
            continue
        except BaseException:
            if not _committed_by(table_uri, manifest):  # a failed commit leaves no data files behind
                _discard(table_uri, written[0])
            raise
    if written is not None:
        _discard(table_uri, written[0])
    raise DestinationError(f"table {table_uri!r} kept changing while writing to it; write again")


def _move(table_uri: str, written: tuple[str, list[str], int], folder: str) -> tuple[str, list[str], int] | None:
    """This writer's uncommitted files moved from their folder to ``folder``; None when they are gone."""
    old, files, num_rows = written
    fs, src = io.filesystem(io.join(table_uri, old))
    dst = io.filesystem(io.join(table_uri, folder))[1]
    moved = [f"{folder}/{f[len(old) + 1:]}" for f in files]
    try:
        fs.mv(src, dst, recursive=True)
        if io.protocol(table_uri) == "file":
            io.fsync_dir(posixpath.dirname(dst))  # the new name survives a power cut
        if _missing_files(table_uri, moved):
            raise FileNotFoundError(moved[0])
    except (FileNotFoundError, OSError):
        _discard(table_uri, old)
        _discard(table_uri, folder)
        return None
    return folder, moved, num_rows


def _missing_files(table_uri: str, files: list[str]) -> list[str]:
    """Which of ``files`` (relative to the table) do not exist."""
    return [f for f in files if not io.exists(io.join(table_uri, f))]
