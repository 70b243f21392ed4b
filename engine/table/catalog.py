"""Ingest: scan a folder of images (any fsspec URI) with Daft and commit one metadata row per file, no pixels.

The plan, top to bottom:
1. check the arguments (source exists and has files, destination writable, split fractions valid) and that the
   table holds no other source's rows (``check_one_source``);
2. a pass over the source's names (no ``stat``): how many files, and whether it is laid out in split folders;
3. list the source in path order, ``batch_files`` at a time, with a change stamp per file (``scan.py``), and diff
   each batch against the committed rows of the same key range: new and modified files are probed, rows of
   modified and deleted files are dropped;
4. per file, in a Daft UDF (``probe.py``): read the bytes (refusing files over the byte cap unread), hash them, parse the
   header with the allowed decoders only (no pixel decode), check integrity, optionally compute a perceptual
   hash from a reduced decode; assign the split from the content hash, or, for a source laid out in split
   folders (``train/<class>/...``, ``val/``, ``test/``: ``split.folder_layout``), from the top folder, the label
   then coming from the folder below it (in Unicode NFC); the manifest's ``options.split_assignment`` records which;
5. append each batch's rows to a Parquet file in a folder of this writer's own (a new file every
   ``ROWS_PER_FILE`` rows), then copy the old data files that lost rows (copy-on-write), fsync them, and create
   the manifest of version N+1 if absent (the commit point, see ``format.py``). If another writer committed N+1
   first, start again from step 2 against its version (files already probed are taken from this writer's
   first folder, not probed again) and commit N+2; nothing of the other writer's is touched. A failed or
   killed ingest leaves the previous version intact; a failed one removes its folder, ``vacuum`` a killed one's.

The driver holds one batch, the names of the folders on the current path and the changes: its memory does not
grow with the number of files (``benchmarks/ingest_scale.py``).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from .. import io
from .. import runner as runner_mod
from ..errors import ConfigError, DestinationError, DutycycleError, SourceError
from ..imageinfo import DEFAULT_MAX_PIXELS, error_reason
from ..limits import DEFAULT_MAX_FILE_BYTES
from ..roots import canonical as canonical_root
from . import commit as table_commit
from . import format as tf
from . import scan, stream
from .commit import MAX_COMMIT_ATTEMPTS, check_destination
from .labels import label_for, load_labels, normalise_label  # noqa: F401 - ingest's API
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
# listing


def _table_prefix(table: str) -> str:

    return os.path.abspath(table).rstrip("/") if io.protocol(table) == "file" else table.rstrip("/")


# ---------------------------------------------------------------------------------------------------------
# ingest


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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
                run = stream.stream_source(cfg, previous, layout, mapping, runner_name, folder, reuse, total.n, skip,
                                           _progress)
            except BaseException:
                stream.discard(cfg.table, folder)  # nothing half-written stays behind a failed ingest
                raise
            changes = run.changes
            if cfg.progress_every:
                _progress(f"ingest: {changes.listed} files: {changes.todo} new or modified, {changes.deleted} "
                          "deleted" + (f" (attempt {attempt + 1})" if attempt else ""))
            counts = {"unchanged": changes.unchanged, "modified": changes.modified, "deleted": changes.deleted,
                      "conflicts": attempt, "merged_labels": run.merged()}
            if not changes.any:
                stream.discard(cfg.table, folder)
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
                    stream.discard(cfg.table, reuse)
                reuse = folder
                continue
            except BaseException:
                # a commit that failed (a full disk under the manifest) leaves no data files behind, unless the
                # manifest did land and only a later step failed: then they are the committed version's
                if not _committed_by(cfg.table, manifest):
                    table_commit._discard(cfg.table, folder)
                raise
            summary = {"version": version, "committed": True, "new_rows": run.new_rows, **counts}
            return _finish(cfg, manifest, summary, t0, runner_name)
    finally:
        if reuse is not None:
            stream.discard(cfg.table, reuse)
    raise DestinationError(
        f"table {cfg.table!r} kept changing under this ingest: {MAX_COMMIT_ATTEMPTS} commits were taken by other "
        "writers first; run the ingest again"
    )


def _committed_by(table: str, manifest: tf.TableManifest) -> bool:
    """Whether ``manifest``'s version is committed by this writer (its writer id)."""
    try:
        return tf.read_manifest(table, manifest.version).writer == manifest.writer
    except (DutycycleError, OSError):
        return False


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
