"""Ingest's streaming pass: the source listed in path order a batch at a time, each batch diffed against the
committed rows of its key range, its new and modified files probed, and their rows appended to this writer's data
files; then the old data files that lost rows copied without them (copy-on-write).

What the driver holds: one listing batch and its rows, the names of the folders on the current path, one Parquet
batch per committed data file, the open data file's writer, and the changes (the paths of rows that leave the
table). Nothing per unchanged or new file outlives its batch.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from .. import io
from ..errors import DestinationError
from . import format as tf
from . import probe, scan
from .commit import ROWS_PER_FILE
from .labels import label_for, normalise_label
from .split import FolderLayout


@dataclass
class StreamRun:
    """What one streaming pass wrote: its data files, the counts, the classes, the label spellings seen."""

    changes: scan.Changes
    files: list[str] = field(default_factory=list)
    new_rows: int = 0
    classes: set[str] = field(default_factory=set)
    spellings: dict[str, set[str]] = field(default_factory=dict)  # NFC label -> spellings found
    before: frozenset[str] = frozenset()  # the previous version's classes

    def merged(self) -> dict[str, list[str]]:
        """NFC label -> the folder spellings merged into it: those not in NFC, where another spelling was
        seen too or the class already existed."""
        out = {}
        for label, seen in sorted(self.spellings.items()):
            other = seen - {label}
            if other and (len(seen) > 1 or label in self.before):
                out[label] = sorted(seen | ({label} if label in self.before else set()))
        return out


def stream_source(cfg: Any, previous: tf.TableManifest | None, layout: FolderLayout, mapping: dict | None,
                  runner_name: str, folder: str, reuse: str | None, total: int, skip: str,
                  progress: Callable[[str], None]) -> StreamRun:
    """With the options of ``cfg`` (an ``IngestConfig``), list the source batch by batch, diff each batch against the committed rows of its key range, probe the
    new and modified files (or take their rows from ``reuse``, a lost attempt's folder) and write them under
    ``folder``; then copy the old data files that lost rows without those rows."""
    state = scan.state_rows(cfg.table, previous)
    reused = scan.SortedRows(_folder_files(cfg.table, reuse), missing_ok=True) if reuse else None
    run = StreamRun(scan.Changes(), before=frozenset(previous.classes if previous else ()))
    parts = PartWriter(cfg.table, folder)
    every, next_report = cfg.progress_every, cfg.progress_every

    def report(handled: int) -> None:
        nonlocal next_report
        if every and handled >= next_report:
            progress(f"ingest: {handled}/{total} files")
            next_report = (handled // every + 1) * every

    for listed in scan.iter_listing(cfg.source, skip, cfg.batch_files):
        last = scan.path_key(listed)[-1].as_py()
        todo = scan.diff_batch(listed, state.upto(last), run.changes)
        if todo.num_rows:
            base = run.changes.listed - todo.num_rows
            rows = _probe_batch(cfg, todo, reused.upto(last) if reused else None, mapping, runner_name, layout,
                                run, lambda done, base=base: report(base + done))
            parts.write(rows)
            run.new_rows += rows.num_rows
            good = rows.filter(pc.and_(pc.is_null(rows.column("error")), pc.is_valid(rows.column("label"))))
            run.classes.update(good.column("label").unique().to_pylist())
        report(run.changes.listed)
    scan.deleted_rest(state.upto(None), run.changes)
    run.files = parts.close()
    if run.changes.affected_files:  # copy-on-write: each old file that lost rows, less those rows
        uris = tf.file_uris(cfg.table, previous)
        for k in run.changes.affected_files:
            for kept in _rewrite(uris[k], pa.concat_arrays(run.changes.drop[k])):
                parts.write(kept)
            run.files += parts.close()  # one file each: the rows of new files stay in path order
    return run


def _folder_files(table: str, folder: str) -> list[str]:
    fs, path = io.filesystem(io.join(table, folder))
    try:
        names = sorted(fs.ls(path, detail=False))
    except FileNotFoundError:
        return []
    return [io.to_uri(fs, n) for n in names if n.endswith(".parquet")]


def _probe_batch(cfg: Any, todo, reused, mapping, runner_name: str, layout: FolderLayout, run: StreamRun,
                 progress):
    """The table rows of the listing rows ``todo``: taken from ``reused`` (rows a lost attempt probed, same path,
    size and stamp) where there, else probed; in path order."""
    got = None
    if reused is not None and reused.num_rows:
        hit = pc.is_in(scan.state_key(reused), value_set=scan.state_key(todo))
        got = tf.conform(reused.filter(hit))
        todo = todo.filter(pc.invert(pc.is_in(scan.state_key(todo), value_set=scan.state_key(got))))
    if todo.num_rows:
        rels = todo.column("rel").to_pylist()
        folders = layout.recognised
        labels = []
        for rel in rels:
            raw = label_for(rel, mapping, folders)
            label = normalise_label(raw)
            if raw is not None:
                run.spellings.setdefault(label, set()).add(raw)
            labels.append(label)
        splits = [layout.split_of(rel) for rel in rels] if folders else None
        fresh = probe.run_probe(cfg, todo, labels, runner_name, progress, splits)
        got = fresh if got is None else pa.concat_tables([got, fresh])
    return got.take(pc.sort_indices(scan.path_key(got)))


class PartWriter:
    """Data files written as rows arrive: one Parquet file open at a time, a row group per batch, a new file
    every ``ROWS_PER_FILE`` rows, each made durable (fsync) when closed."""

    def __init__(self, table: str, folder: str):
        self.table, self.folder = table, folder
        self.files: list[str] = []
        self._count = 0
        self._open = None  # (rel, file object, ParquetWriter, rows written)

    def write(self, rows) -> None:
        import pyarrow.parquet as pq

        if not rows.num_rows:
            return
        try:
            if self._open is None:
                rel = f"{self.folder}/part-{self._count:05d}.parquet"
                self._count += 1
                fs, path = io.filesystem(io.join(self.table, rel))
                fs.makedirs(posixpath.dirname(path), exist_ok=True)
                f = fs.open(path, "wb")
                self._open = [rel, f, pq.ParquetWriter(f, tf.SCHEMA, compression="zstd"), 0]
            self._open[2].write_table(tf.conform(rows))
            self._open[3] += rows.num_rows
        except OSError as e:
            raise self._failed(e) from e
        if self._open[3] >= ROWS_PER_FILE:
            self._close_open()  # kept in ``files`` until the caller's next ``close`` hands them over

    def close(self) -> list[str]:
        """Close the open file (durable once this returns); the files closed since the last call, those that
        ``write`` closed on reaching ``ROWS_PER_FILE`` included."""
        self._close_open()
        done, self.files = self.files, []
        return done

    def _close_open(self) -> None:
        if self._open is not None:
            rel, f, writer, _ = self._open
            self._open = None
            try:
                writer.close()
                if io.protocol(self.table) == "file":
                    f.flush()
                    os.fsync(f.fileno())
                f.close()
                if io.protocol(self.table) == "file":
                    io.fsync_dir(io.filesystem(io.join(self.table, self.folder))[1])
            except OSError as e:
                raise self._failed(e) from e
            self.files.append(rel)

    def _failed(self, e: OSError) -> Exception:
        return io.no_space(e, io.join(self.table, self.folder)) or DestinationError(
            f"cannot write table {self.table!r}: {e}; choose a writable location")


def discard(table: str, folder: str) -> None:
    """Remove this writer's own uncommitted folder (nobody else references it); vacuum removes what is left."""
    fs, path = io.filesystem(io.join(table, folder))
    try:
        fs.rm(path, recursive=True)
    except (FileNotFoundError, OSError):
        pass


def _rewrite(file_uri: str, drop) -> Iterator[pa.Table]:
    """The rows of one committed data file minus those whose path bytes are in ``drop`` (copy-on-write), a
    batch at a time (never the whole file in memory)."""
    import pyarrow.parquet as pq

    fs, path = io.filesystem(file_uri)
    with fs.open(path, "rb") as f:
        for batch in pq.ParquetFile(f).iter_batches(scan.LIST_BATCH):
            t = tf.conform(pa.Table.from_batches([batch]))
            yield t.filter(pc.invert(pc.is_in(scan.path_key(t), value_set=drop)))
