"""Ingest: scan a folder of images (any fsspec URI) with Daft and commit one metadata row per file, no pixels.

The plan, top to bottom:
1. check the arguments (source exists and has files, destination writable, split fractions valid);
2. list the source with a change stamp per file and diff it against the newest committed version
   (``scan.py``): new and modified files are probed, rows of modified and deleted files are dropped;
3. per file, in a Daft UDF (``probe.py``): read the bytes (refusing files over the byte cap unread), hash them, parse the
   header with the allowed decoders only (no pixel decode), check integrity, optionally compute a perceptual
   hash from a reduced decode; assign the split from the content hash, or, for a source laid out in split
   folders (``train/<class>/...``, ``val/``, ``test/``: ``split.folder_layout``), from the top folder, the label
   then coming from the folder below it; the manifest's ``options.split_assignment`` records which;
4. write the new rows, and copies of the old data files that lost rows (copy-on-write), as Parquet into a
   folder of this writer's own, fsync them, then create the manifest of version N+1 if absent (the commit
   point, see ``format.py``). If another writer committed N+1 first, start again from step 2 against its
   version (files already probed are not probed again) and commit N+2; nothing of the other writer's is
   touched. A killed ingest leaves the previous version intact; ``vacuum`` removes its files later.
"""

from __future__ import annotations

import csv
import io as _io
import json
import os
import posixpath
import sys
import time
import unicodedata
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from .. import io
from .. import runner as runner_mod
from ..errors import ConfigError, DestinationError, SourceError
from ..imageinfo import DEFAULT_MAX_PIXELS, error_reason
from ..limits import DEFAULT_MAX_FILE_BYTES
from ..roots import canonical as canonical_root
from . import format as tf
from . import probe, scan
from .commit import MAX_COMMIT_ATTEMPTS, ROWS_PER_FILE, check_destination
from .split import (  # noqa: F401 - the split is ingest's too
    DEFAULT_SPLIT,
    SPLIT_NAMES,
    FolderLayout,
    assign_split,
    describe_assignment,
    describe_folders,
    folder_layout,
    parse_split,
)


@dataclass
class IngestConfig:
    source: str
    table: str
    labels: str | None = None  # CSV/JSON mapping file: file name or relative path -> label
    split: tuple[float, ...] = DEFAULT_SPLIT  # train,val,test fractions of the hash split (unused with split folders)
    # recognise a source laid out in split folders (train/<class>/..., val/ or validation/, test/): the split
    # from the top folder, the label from the one below it. False: hash split, label from the first folder level
    split_folders: bool = True
    phash: bool = True
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES  # larger files get an error row and are never read
    progress_every: int = 1000  # print a progress line to stderr every this many files (0: quiet)
    # files listed, probed and written per batch: what the driver holds of the listing and the new rows at once
    batch_files: int = scan.LIST_BATCH
    partitions: int | None = None  # Daft partitions for the per-file work (None: by size, for Ray)
    use_process: bool | None = None  # UDF in worker processes (None: Daft decides, threads for small jobs)


# ---------------------------------------------------------------------------------------------------------
# plain functions: labels


def load_labels(uri: str) -> dict[str, str]:
    """Read a label mapping: JSON ``{"name or rel/path": "label"}`` or CSV rows ``name,label`` (header optional)."""
    fix = "pass a CSV (name,label) or JSON mapping file"
    try:
        # bounded, and only a regular file is opened (a FIFO would block the open, a device never end)
        data = io.read_capped(uri, io.MAX_MANIFEST_BYTES)
    except (FileNotFoundError, IsADirectoryError):
        raise SourceError(f"--labels {uri!r} does not exist; {fix}") from None
    except io.NotRegularFileError as e:
        raise SourceError(f"--labels {uri!r} is a {e.kind}, not a file; {fix}") from None
    except io.FileTooLargeError:
        raise ConfigError(
            f"--labels {uri!r} is larger than {io.MAX_MANIFEST_BYTES} bytes, far more than a label mapping holds; {fix}"
        ) from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--labels {uri!r} is not UTF-8 text ({e}); {fix}") from None
    if uri.lower().endswith(".json"):
        try:
            mapping = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"--labels {uri!r} is not valid JSON ({e}); write an object {{name: label}}"
            ) from None
        if not isinstance(mapping, dict):
            raise ConfigError(f"--labels {uri!r} must hold a JSON object {{name: label}}")
        return _with_nfc_keys({str(k): str(v) for k, v in mapping.items()})
    mapping = {}
    for row in csv.reader(_io.StringIO(text)):
        if not row or not row[0].strip():
            continue
        if len(row) < 2:
            raise ConfigError(f"--labels {uri!r}: row {row!r} needs two columns; write name,label per line")
        key, label = row[0].strip(), row[1].strip()
        if (
            not mapping
            and key.lower() in ("path", "file", "filename", "name", "uri")
            and label.lower() == "label"
        ):
            continue  # header
        mapping[key] = label
    return _with_nfc_keys(mapping)


def _with_nfc_keys(mapping: dict[str, str]) -> dict[str, str]:
    """``mapping`` plus each key's NFC spelling (where no key has it already), so a file name the file system
    wrote in another normal form (macOS writes NFD) still finds its label."""
    out = dict(mapping)
    for key, label in mapping.items():
        out.setdefault(unicodedata.normalize("NFC", key), label)
    return out


def label_for(rel: str, mapping: dict[str, str] | None, split_folders: bool = False) -> str | None:
    """Label of a file from its path relative to the source: the mapping (by rel path, then name, each as written
    and then in NFC), else its first folder level, or with ``split_folders`` the level below its split folder
    (``train/cat/a.png`` -> ``cat``). Not yet normalised: see ``normalise_label``."""
    if mapping is not None:
        for key in (rel, posixpath.basename(rel)):
            for spelling in (key, unicodedata.normalize("NFC", key)):
                if spelling in mapping:
                    return mapping[spelling]
        return None
    if split_folders:
        rel = rel.partition("/")[2]
    folder = posixpath.dirname(rel)
    return folder.split("/")[0] if folder else None


# ---------------------------------------------------------------------------------------------------------
# listing


def _table_prefix(table: str) -> str:
    import os

    return os.path.abspath(table).rstrip("/") if io.protocol(table) == "file" else table.rstrip("/")


# ---------------------------------------------------------------------------------------------------------
# ingest


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _rewrite(file_uri: str, drop):
    """The rows of one committed data file minus those whose path bytes are in ``drop`` (copy-on-write)."""
    import pyarrow.parquet as pq

    fs, path = io.filesystem(file_uri)
    with fs.open(path, "rb") as f:
        t = tf.conform(pq.read_table(f))
    return t.filter(pc.invert(pc.is_in(scan.path_key(t), value_set=drop)))


def table_summary(parts) -> dict[str, Any]:
    """Counts over Arrow tables of metadata rows (``parts``: one table or an iterable of them, e.g. a version's
    files read batch by batch): classes, splits, error reasons. Counted per distinct value, so a part's cost is
    its own size."""
    if isinstance(parts, pa.Table):
        parts = [parts]
    classes: dict[str, int] = {}
    reasons: dict[str, int] = {}
    split_counts: dict[str, int] = {}
    rows = unlabelled = 0

    def add(into: dict, values) -> None:
        for entry in pc.value_counts(values).to_pylist():
            if entry["values"] is not None:
                into[entry["values"]] = into.get(entry["values"], 0) + entry["counts"]

    for t in parts:
        rows += t.num_rows
        unlabelled += t.column("label").null_count
        ok = pc.is_null(t.column("error"))
        add(classes, t.column("label").filter(ok))
        add(split_counts, t.column("split").filter(ok))
        errors: dict[str, int] = {}
        add(errors, t.column("error"))
        for message, count in errors.items():
            r = error_reason(message)
            reasons[r] = reasons.get(r, 0) + count
    return {
        "rows": rows,
        "classes": dict(sorted(classes.items())),
        "splits": split_counts,
        "errors": dict(sorted(reasons.items())),
        "unlabelled": unlabelled,
    }


def _version_parts(table: str, manifest: tf.TableManifest, columns: list[str]):
    """A version's rows, ``columns`` only, one Parquet batch at a time (the summary of a large table)."""
    import pyarrow.parquet as pq

    for uri in tf.file_uris(table, manifest):
        fs, path = io.filesystem(uri)
        with fs.open(path, "rb") as f:
            for batch in pq.ParquetFile(f).iter_batches(scan.LIST_BATCH, columns=columns):
                yield pa.Table.from_batches([batch])


def ingest(
    source: str,
    table: str,
    *,
    labels: str | None = None,
    split: str | tuple | None = None,
    split_folders: bool = True,
    phash: bool = True,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    progress_every: int = 1000,
    runner: str | None = None,
    ray_address: str | None = None,
    partitions: int | None = None,
    use_process: bool | None = None,
    batch_files: int = scan.LIST_BATCH,
) -> dict[str, Any]:
    """Scan ``source`` and commit the next version of the metadata table at ``table``; returns a summary dict.

    New and modified files are probed, rows of deleted files dropped; nothing changed -> no new version.
    Safe to run concurrently with other ingests into the same table (each commits its own version). The listing
    streams: files are listed, probed and written ``batch_files`` at a time, so the driver's memory does not
    grow with the number of files. A table holds one source: ingesting another folder into it is refused.

    Splits: a source laid out in split folders (``train/<class>/...``, ``val/`` or ``validation/``, ``test/``;
    see ``split.folder_layout``) takes each row's split from its top folder and its label from the folder below,
    unless ``split_folders=False``; otherwise ``split`` (train,val,test fractions; default 0.8,0.1,0.1, or the
    table's own on a re-ingest) splits by content hash. ``split`` together with split folders is refused. A
    re-ingest assigns splits the way the table's first version did, or is refused naming the difference.

    Labels are normalised to Unicode NFC, so class folders whose names differ only in normal form (``café``
    typed on Linux and on macOS) are one class; the summary's ``merged_labels`` lists the spellings merged.
    """
    t0 = time.time()
    cfg = IngestConfig(
        source=source,
        table=table,
        labels=labels,
        split=parse_split(split) if split is not None else DEFAULT_SPLIT,
        split_folders=split_folders,
        phash=phash,
        max_pixels=max_pixels,
        max_file_bytes=max_file_bytes,
        progress_every=progress_every,
        partitions=partitions,
        use_process=use_process,
        batch_files=batch_files,
    )
    runner_name = runner_mod.resolve(runner)
    if cfg.max_pixels < 1:
        raise ConfigError(f"--max-pixels {cfg.max_pixels} must be positive, e.g. {DEFAULT_MAX_PIXELS}")
    if cfg.max_file_bytes < 1:
        raise ConfigError(f"--max-file-bytes {cfg.max_file_bytes} must be positive, e.g. {DEFAULT_MAX_FILE_BYTES}")
    if cfg.batch_files < 1:
        raise ConfigError(f"batch_files {cfg.batch_files} must be positive, e.g. {scan.LIST_BATCH}")
    mapping = load_labels(cfg.labels) if cfg.labels else None
    scan.check_source(cfg.source)
    check_destination(cfg.table)
    runner_mod.configure(runner_name, ray_address)

    given_split = split is not None
    skip = _table_prefix(cfg.table)  # a table kept inside its own source folder must not ingest its own files
    reuse: str | None = None  # the folder of an attempt that lost its commit: its rows are not probed again
    try:
        for attempt in range(MAX_COMMIT_ATTEMPTS):
            versions = tf.committed_versions(cfg.table)  # listed once: read_manifest() alone would list them again
            previous = tf.read_manifest(cfg.table, versions[-1]) if versions else None
            check_one_source(cfg, previous)
            total = _Counter(scan.iter_rels(cfg.source, skip))
            layout = folder_layout(total) if cfg.split_folders else FolderLayout()
            if cfg.split_folders is False:
                for _ in total:  # (the layout pass counts the files; without it, count them here)
                    pass
            if not total.n and previous is None:
                raise SourceError(f"source {cfg.source!r} contains no files; add images or point at another folder")
            cfg = _splits_for(cfg, layout, previous, given_split)
            if cfg.progress_every and attempt == 0:
                _progress(f"ingest: {total.n} files under {cfg.source}")
                if layout.recognised:
                    _progress(f"ingest: split folders {describe_folders(layout.splits)}: the split from the top "
                              "folder, the label from the folder below (--no-split-folders: labels from the "
                              "first level)")
                elif layout.found:  # some split folders, beside others: say why they are not used
                    _progress(f"ingest: not split folders: top-level folder(s) {', '.join(layout.others)} beside "
                              f"{describe_folders(layout.found)} are no split names; labels from the first "
                              "folder level, splits by content hash")
            version = (previous.version if previous else 0) + 1
            folder = tf.data_dir(version)
            try:
                run = _stream(cfg, previous, layout, mapping, runner_name, folder, reuse, total.n, skip)
            except BaseException:
                _discard(cfg.table, folder)  # nothing half-written stays behind a failed ingest
                raise
            changes = run.changes
            if cfg.progress_every:
                _progress(f"ingest: {changes.listed} files: {changes.todo} new or modified, {changes.deleted} "
                          "deleted" + (f" (attempt {attempt + 1})" if attempt else ""))
            counts = {"unchanged": changes.unchanged, "modified": changes.modified, "deleted": changes.deleted,
                      "conflicts": attempt, "merged_labels": run.merged()}
            if not changes.any:
                _discard(cfg.table, folder)
                return _finish(cfg, previous, {"version": previous.version, "committed": False, "new_rows": 0,
                                               **counts}, t0, runner_name)
            affected = set(changes.affected_files)
            kept = [f for k, f in enumerate(previous.files if previous else []) if k not in affected]
            num_rows = (previous.num_rows if previous else 0) - changes.modified - changes.deleted + run.new_rows
            manifest = _manifest(cfg, previous, version, kept + run.files, num_rows, run.classes, layout)
            try:
                tf.commit(cfg.table, manifest)  # the commit point: the data files are invisible until it succeeds
            except tf.CommitConflict:
                # keep this attempt's rows (written in path order) for the next: they are not probed again
                if reuse is not None:
                    _discard(cfg.table, reuse)
                reuse = folder
                continue
            summary = {"version": version, "committed": True, "new_rows": run.new_rows, **counts}
            return _finish(cfg, manifest, summary, t0, runner_name)
    finally:
        if reuse is not None:
            _discard(cfg.table, reuse)
    raise DestinationError(
        f"table {cfg.table!r} kept changing under this ingest: {MAX_COMMIT_ATTEMPTS} commits were taken by other "
        "writers first; run the ingest again"
    )


class _Counter:
    """An iterable over ``items`` that counts what went through it (``n``), so one pass both feeds a consumer
    and counts."""

    def __init__(self, items):
        self._items, self.n = iter(items), 0

    def __iter__(self):
        for item in self._items:
            self.n += 1
            yield item


def check_one_source(cfg: IngestConfig, previous: tf.TableManifest | None) -> None:
    """Refuse to ingest a source into a table that holds another's rows: the ingest would drop them all (its
    listing has none of their files). One table, one source."""
    if previous is None or canonical_root(previous.source) == canonical_root(cfg.source):
        return
    what = (f"the rows of source {previous.source!r}" if previous.lineage.get("parent") is None else
            f"a curated subset of {previous.source!r}")
    raise ConfigError(
        f"table {cfg.table!r} holds {what}; ingesting {cfg.source!r} into it would drop them (a table holds one "
        f"source). Ingest {cfg.source!r} into a new table, or put both folders under one and ingest that into a "
        "new table"
    )


@dataclass
class _Run:
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


def _stream(cfg: IngestConfig, previous, layout: FolderLayout, mapping, runner_name: str, folder: str,
            reuse: str | None, total: int, skip: str) -> _Run:
    """List the source batch by batch, diff each batch against the committed rows of its key range, probe the
    new and modified files (or take their rows from ``reuse``, a lost attempt's folder) and write them under
    ``folder``; then copy the old data files that lost rows without those rows."""
    state = scan.state_rows(cfg.table, previous)
    reused = scan.SortedRows(_folder_files(cfg.table, reuse)) if reuse else None
    run = _Run(scan.Changes(), before=frozenset(previous.classes if previous else ()))
    parts = _Parts(cfg.table, folder)
    every, next_report = cfg.progress_every, cfg.progress_every

    def report(handled: int) -> None:
        nonlocal next_report
        if every and handled >= next_report:
            _progress(f"ingest: {handled}/{total} files")
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
            kept = _rewrite(uris[k], pa.concat_arrays(run.changes.drop[k]))
            if kept.num_rows:
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


def normalise_label(label: str | None) -> str | None:
    """A class name in Unicode NFC: one class however the file system or the keyboard composed its letters."""
    return None if label is None else unicodedata.normalize("NFC", label)


def _probe_batch(cfg: IngestConfig, todo, reused, mapping, runner_name: str, layout: FolderLayout, run: _Run,
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


class _Parts:
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
            self.close()

    def close(self) -> list[str]:
        """Close the open file (durable once this returns); the files closed since the last call."""
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
        done, self.files = self.files, []
        return done

    def _failed(self, e: OSError) -> Exception:
        return io.no_space(e, io.join(self.table, self.folder)) or DestinationError(
            f"cannot write table {self.table!r}: {e}; choose a writable location")


def _discard(table: str, folder: str) -> None:
    """Remove this writer's own uncommitted folder (nobody else references it); vacuum removes what is left."""
    fs, path = io.filesystem(io.join(table, folder))
    try:
        fs.rm(path, recursive=True)
    except (FileNotFoundError, OSError):
        pass


def _assignment(options: dict) -> dict:
    """How a table's splits were assigned (``options.split_assignment``); a table ingested before it was
    recorded was split by hash with its ``split`` fractions."""
    got = options.get("split_assignment")
    if isinstance(got, dict) and got.get("by"):
        return got
    return {"by": "hash", "fractions": options.get("split")}


def _splits_for(cfg: IngestConfig, layout: FolderLayout, previous: tf.TableManifest | None,
                given_split: bool) -> IngestConfig:
    """``cfg`` with the fractions this ingest splits by, after checking that the way splits are assigned (split
    folders or hash, and the fractions) agrees with what the user asked for and with the table's versions."""
    from dataclasses import replace

    before = _assignment(previous.options) if previous is not None else None
    if layout.recognised:
        if given_split:
            raise ConfigError(
                f"--split {','.join(map(str, cfg.split))} was given, but source {cfg.source!r} is laid out in split "
                f"folders ({describe_folders(layout.splits)}), which assign the splits; drop --split, or pass "
                "--no-split-folders (split_folders=False) to split by content hash with labels from the first "
                "folder level"
            )
        if before is not None and before["by"] != "folders":
            raise ConfigError(
                f"table {cfg.table!r} was split {describe_assignment(before)} with labels from the first folder "
                f"level, but source "
                f"{cfg.source!r} is now laid out in split folders ({describe_folders(layout.splits)}); pass "
                "--no-split-folders (split_folders=False) to keep ingesting it as before, or ingest into a new table"
            )
        return cfg
    if before is not None and before["by"] == "folders":
        why = ("split folders are turned off (--no-split-folders)" if not cfg.split_folders else
               f"top-level folder(s) {', '.join(layout.others)} are no split names" if layout.others else
               "the source has no split folders any more")
        raise ConfigError(
            f"table {cfg.table!r} takes its splits from split folders ({describe_folders(before['folders'])}), but "
            f"now {why}; restore the layout (move other folders out of {cfg.source!r}), or ingest into a new table"
        )
    if before is not None and before.get("fractions"):
        if not given_split:  # a re-ingest keeps the table's fractions unless told otherwise
            return replace(cfg, split=tuple(before["fractions"]))
        if tuple(before["fractions"]) != cfg.split:
            raise ConfigError(
                f"--split {','.join(map(str, cfg.split))} differs from the table's "
                f"{','.join(map(str, before['fractions']))}; pass the same fractions or ingest into a new table"
            )
    return cfg


def _manifest(
    cfg: IngestConfig, previous: tf.TableManifest | None, version: int, files: list[str], num_rows: int,
    new_classes: set[str], layout: FolderLayout,
):
    """Version ``version``'s manifest. Classes only grow, so a label keeps its index across versions; so do the
    split folders named in ``split_assignment``."""
    classes = set(previous.classes if previous else []) | new_classes
    if layout.recognised:
        before = _assignment(previous.options).get("folders", {}) if previous else {}
        assignment = {"by": "folders", "folders": dict(sorted({**before, **layout.splits}.items()))}
    else:
        assignment = {"by": "hash", "fractions": list(cfg.split)}
    return tf.TableManifest(
        version=version,
        files=files,
        num_rows=num_rows,
        classes=sorted(classes),
        source=cfg.source,
        lineage=previous.lineage if previous else {},
        options={
            # the hash split's fractions; null when split folders assign the splits
            "split": None if layout.recognised else list(cfg.split),
            # how each row's split was assigned: {"by": "hash", "fractions": [...]} or {"by": "folders",
            # "folders": {folder: split}} (a curated table's save may record {"by": "resplit", ...})
            "split_assignment": assignment,
            "phash": cfg.phash,
            "labels": cfg.labels,
            "max_pixels": cfg.max_pixels,
            "max_file_bytes": cfg.max_file_bytes,
            "roots": [canonical_root(cfg.source)],  # where rows may point (readers refuse other URIs)
        },
    )


def _finish(
    cfg: IngestConfig, manifest: tf.TableManifest, summary: dict, t0: float, runner_name: str
) -> dict:
    counts = table_summary(_version_parts(cfg.table, manifest, ["label", "error", "split"]))
    return {
        "table": cfg.table,
        "source": cfg.source,
        "runner": runner_name,
        "split_assignment": _assignment(manifest.options),
        **summary,
        **counts,
        "seconds": round(time.time() - t0, 3),
    }
