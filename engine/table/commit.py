"""Writing a table version: data files made durable under the writer's own folder, then the manifest created if
absent (the commit point, see ``format.py``). Every writer of tables goes through here: ingest (which keeps the
previous version's untouched files) through the pieces, a curated view's save and generated test or benchmark
tables through ``write_version``.

A writer that loses the race for a version discards its own folder (nobody else references it) and retries
against the newer version, at most ``MAX_COMMIT_ATTEMPTS`` times.
"""

from __future__ import annotations

import uuid
from typing import Any

from .. import io
from ..errors import DestinationError, DutycycleError
from . import format as tf

ROWS_PER_FILE = 200_000
MAX_COMMIT_ATTEMPTS = 8  # commits lost to concurrent writers before an ingest (or a save) gives up
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


def write_version(table_uri: str, rows, *, classes: list[str], source: str = "", lineage: dict[str, Any] | None = None,
                  options: dict[str, Any] | None = None) -> tf.TableManifest:
    """Commit ``rows`` (an Arrow table of the table's columns) as the whole of the next version of the table at
    ``table_uri``; returns the committed manifest. Another writer may commit meanwhile: this one then takes the
    version after, its files written again."""
    for _ in range(MAX_COMMIT_ATTEMPTS):
        versions = tf.committed_versions(table_uri)
        version = (versions[-1] if versions else 0) + 1
        folder = tf.data_dir(version)
        manifest = tf.TableManifest(version=version, files=write_rows(table_uri, folder, [rows]),
                                    num_rows=rows.num_rows, classes=list(classes), source=source,
                                    lineage=dict(lineage or {}), options=dict(options or {}))
        if try_commit(table_uri, folder, manifest):
            return manifest
    raise DestinationError(f"table {table_uri!r} kept changing while writing to it; write again")
