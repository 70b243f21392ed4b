"""Ingest: scan a folder of images (any fsspec URI) with Daft and commit one metadata row per file, no pixels.

The plan, top to bottom:
1. check the arguments (source exists and has files, destination writable, split fractions valid);
2. list the source (Daft's glob for local and s3 paths, fsspec for other schemes);
3. drop files already in the table (incremental re-ingest reads only new files);
4. per file, in a Daft UDF: read the bytes, hash them, parse the header (no pixel decode), check integrity,
   optionally compute a perceptual hash from a reduced decode; assign the split from the content hash;
5. write the new rows as Parquet files into a fresh version folder, then commit a manifest that names the old
   and the new files. The manifest write is the commit point (see table/format.py), so a killed ingest leaves
   the previous table intact.
"""

from __future__ import annotations

import csv
import hashlib
import io as _io
import json
import posixpath
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from .. import io
from ..errors import ConfigError, DestinationError, SourceError
from ..imageinfo import DEFAULT_MAX_PIXELS, error_reason
from . import format as tf

DEFAULT_SPLIT = (0.8, 0.1, 0.1)
SPLIT_NAMES = ("train", "val", "test")
DAFT_SCHEMES = ("file", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "http", "https")
ROWS_PER_FILE = 200_000
PROCESS_THRESHOLD = 2000


@dataclass
class IngestConfig:
    source: str
    table: str
    labels: str | None = None  # CSV/JSON mapping file: file name or relative path -> label
    split: tuple[float, ...] = DEFAULT_SPLIT
    phash: bool = True
    max_pixels: int = DEFAULT_MAX_PIXELS
    progress_every: int = 1000  # print a progress line to stderr every this many files (0: quiet)
    partitions: int | None = None  # Daft partitions for the per-file work (None: by size, for Ray)
    use_process: bool | None = None  # UDF in worker processes (None: Daft decides, threads for small jobs)


# ---------------------------------------------------------------------------------------------------------
# plain functions: argument parsing, labels, splits


def parse_split(text: str | tuple | list) -> tuple[float, float, float]:
    """``"0.8,0.1,0.1"`` -> ``(0.8, 0.1, 0.1)``; fractions for train, val, test that sum to 1."""
    parts = text.split(",") if isinstance(text, str) else list(text)
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ConfigError(
            f"--split {text!r} is not three numbers; use train,val,test fractions like 0.8,0.1,0.1"
        ) from None
    if len(values) != 3 or any(v < 0 for v in values) or abs(sum(values) - 1.0) > 1e-6:
        raise ConfigError(
            f"--split {text!r} must be three non-negative fractions (train,val,test) that sum to 1, e.g. 0.8,0.1,0.1"
        )
    return values[0], values[1], values[2]


def assign_split(sample_id: str, fractions: tuple[float, ...]) -> str:
    """Deterministic split from the content hash: identical files always land in the same split."""
    u = int(hashlib.sha256(("split:" + sample_id).encode()).hexdigest()[:15], 16) / float(1 << 60)
    edge = 0.0
    for name, frac in zip(SPLIT_NAMES, fractions, strict=True):
        edge += frac
        if u < edge:
            return name
    return SPLIT_NAMES[-1]


def load_labels(uri: str) -> dict[str, str]:
    """Read a label mapping: JSON ``{"name or rel/path": "label"}`` or CSV rows ``name,label`` (header optional)."""
    try:
        fs, path = io.filesystem(uri)
        with fs.open(path, "rb") as f:
            text = f.read().decode("utf-8-sig")
    except (FileNotFoundError, IsADirectoryError):
        raise SourceError(
            f"--labels {uri!r} does not exist; pass a CSV (name,label) or JSON mapping file"
        ) from None
    if uri.lower().endswith(".json"):
        try:
            mapping = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"--labels {uri!r} is not valid JSON ({e}); write an object {{name: label}}"
            ) from None
        if not isinstance(mapping, dict):
            raise ConfigError(f"--labels {uri!r} must hold a JSON object {{name: label}}")
        return {str(k): str(v) for k, v in mapping.items()}
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
    return mapping


def label_for(rel: str, mapping: dict[str, str] | None) -> str | None:
    """Label of a file from its path relative to the source: the mapping (by rel path, then name), else its folder."""
    if mapping is not None:
        return mapping.get(rel, mapping.get(posixpath.basename(rel)))
    folder = posixpath.dirname(rel)
    return folder.split("/")[0] if folder else None


# ---------------------------------------------------------------------------------------------------------
# checks and listing


def _norm(uri: str) -> str:
    """Strip Daft's ``file://`` so local rows hold plain absolute paths, as engine.io.to_uri does."""
    return uri[len("file://") :] if uri.startswith("file://") else uri


def _check_source(source: str):
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


def _check_destination(table: str) -> None:
    fs, path = io.filesystem(table)
    if fs.exists(path) and not fs.isdir(path) and protocol_is_local(table):
        raise DestinationError(f"table {table!r} is an existing file; choose a folder path for the table")
    probe = io.join(table, f".write-probe-{uuid.uuid4().hex}")
    io.write_bytes_atomic(probe, b"")  # raises DestinationError naming the table location
    try:
        fs.rm(io.filesystem(probe)[1])
    except (FileNotFoundError, OSError):
        pass


def _local_abs(path: str) -> str:
    import os

    return os.path.abspath(_norm(path)).rstrip("/")


def protocol_is_local(uri: str) -> bool:
    return io.protocol(uri) == "file"


def list_source(source: str) -> list[tuple[str, str, int]]:
    """All files under ``source`` as sorted ``(uri, relative_path, size_bytes)``."""
    fs, root = _check_source(source)
    scheme = io.protocol(source)
    if scheme in DAFT_SCHEMES:
        import daft

        base = _local_abs(root) if scheme == "file" else source.rstrip("/")
        try:
            listing = (
                daft.from_glob_path(f"{base}/**", io_config=io.daft_io_config())
                .select("path", "size")
                .to_pydict()
            )
        except Exception:
            if not fs.find(root):  # Daft's glob fails on a folder with no files at all
                return []
            raise
        uris = [_norm(p) for p in listing["path"]]
        sizes = listing["size"]
        prefix = base + "/"
    else:
        found = fs.find(root, detail=True)
        uris = [io.to_uri(fs, p) for p, info in found.items() if info.get("type") == "file"]
        sizes = [found[p].get("size") or 0 for p, info in found.items() if info.get("type") == "file"]
        prefix = io.to_uri(fs, root) + "/"
    out = []
    for uri, size in zip(uris, sizes, strict=True):
        rel = uri[len(prefix) :] if uri.startswith(prefix) else posixpath.basename(uri)
        out.append((uri, rel, int(size or 0)))
    out.sort()
    return out


# ---------------------------------------------------------------------------------------------------------
# the per-file UDF


def _probe_udf(with_phash: bool, max_pixels: int, fractions: tuple[float, ...], use_process: bool | None):
    """A Daft row UDF: (uri, bytes or null) -> the metadata struct. Built per call so options travel with it."""
    import daft
    from daft import DataType as DT

    fields = {
        "sample_id": DT.string(),
        "format": DT.string(),
        "width": DT.int32(),
        "height": DT.int32(),
        "mode": DT.string(),
        "channels": DT.int32(),
        "orientation": DT.int32(),
        "split": DT.string(),
        "phash": DT.int64(),
        "error": DT.string(),
    }

    @daft.func(return_dtype=DT.struct(fields), unnest=True, use_process=use_process)
    def probe_file(uri: str, data: bytes | None) -> dict:
        from dutycycle.engine import imageinfo
        from dutycycle.engine import io as dio

        if data is None:  # Daft could not fetch it (or the scheme is fsspec-only): read it ourselves
            try:
                fs, path = dio.filesystem(uri)
                with fs.open(path, "rb") as f:
                    data = f.read()
            except Exception as e:
                sid = "unreadable-" + hashlib.sha256(uri.encode()).hexdigest()[:20]
                return {
                    "sample_id": sid,
                    "split": assign_split(sid, fractions),
                    "error": f"{imageinfo.UNREADABLE}: {type(e).__name__}: {e}",
                }
        sid = imageinfo.sample_id(data)
        facts = imageinfo.probe(data, max_pixels=max_pixels, with_phash=with_phash)
        row = asdict(facts)
        row["sample_id"] = sid
        row["split"] = assign_split(sid, fractions)
        return row

    return probe_file


# ---------------------------------------------------------------------------------------------------------
# ingest


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _existing(table: str) -> tuple[tf.TableManifest | None, set[str]]:
    """The committed manifest (or None) and the URIs it already holds."""
    if not io.exists(io.join(table, tf.MANIFEST)):
        return None, set()
    manifest = tf.read_manifest(table)
    import pyarrow.parquet as pq

    uris: set[str] = set()
    for uri in tf.file_uris(table, manifest):
        fs, path = io.filesystem(uri)
        with fs.open(path, "rb") as f:
            uris.update(pq.read_table(f, columns=["uri"]).column("uri").to_pylist())
    return manifest, uris


def _run_udf(cfg: IngestConfig, todo: list[tuple[str, str, int]], labels: dict | None, runner: str):
    import daft
    import pyarrow as pa
    from daft import col, lit

    scheme = io.protocol(cfg.source)
    df = daft.from_pydict(
        {
            "uri": [u for u, _, _ in todo],
            "size_bytes": [s for _, _, s in todo],
            "label": [label_for(rel, labels) for _, rel, _ in todo],
        }
    )
    nparts = cfg.partitions or (max(1, min(64, len(todo) // 500)) if runner == "ray" else 1)
    if nparts > 1:
        df = df.into_partitions(nparts)
    if cfg.progress_every:
        # results stream back in batches of this size, so the progress line moves during long scans
        df = df.into_batches(max(1, min(cfg.progress_every, 1000)))
    if scheme in DAFT_SCHEMES:
        data = daft.functions.download(col("uri"), on_error="null", io_config=io.daft_io_config())
    else:  # e.g. memory://: read inside the UDF through fsspec (same process on the native runner)
        data = lit(None).cast(daft.DataType.binary())
    # Worker processes sidestep the GIL for hashing and decoding but cost seconds to start: small jobs run
    # the UDF in threads.
    use_process = cfg.use_process
    if use_process is None and len(todo) < PROCESS_THRESHOLD:
        use_process = False
    probe_file = _probe_udf(cfg.phash, cfg.max_pixels, cfg.split, use_process)
    df = df.with_column("data", data).select(
        col("uri"), col("size_bytes"), col("label"), probe_file(col("uri"), col("data"))
    )
    batches, done = [], 0
    next_report = cfg.progress_every
    for batch in df.to_arrow_iter():
        batches.append(batch)
        done += batch.num_rows
        if cfg.progress_every and done >= next_report:
            _progress(f"ingest: {done}/{len(todo)} files")
            next_report = (done // cfg.progress_every + 1) * cfg.progress_every
    if batches:
        table = pa.Table.from_batches(batches)
    else:
        table = tf.SCHEMA.empty_table()
    table = table.select(tf.SCHEMA.names).cast(tf.SCHEMA)
    return table.sort_by("uri")


def _write_version(table_uri: str, version: int, rows) -> list[str]:
    """Write the new rows as Parquet under a fresh version folder; returns their paths relative to the table."""
    import pyarrow.parquet as pq

    vdir = tf.version_dir(version)
    fs, vpath = io.filesystem(io.join(table_uri, vdir))
    if fs.exists(vpath):  # leftovers of a killed ingest: never committed, so nobody reads them
        fs.rm(vpath, recursive=True)
    fs.makedirs(vpath, exist_ok=True)
    files = []
    for i, start in enumerate(range(0, max(rows.num_rows, 1), ROWS_PER_FILE)):
        rel = f"{vdir}/part-{i:05d}.parquet"
        _, path = io.filesystem(io.join(table_uri, rel))
        try:
            with fs.open(path, "wb") as f:
                pq.write_table(rows.slice(start, ROWS_PER_FILE), f, compression="zstd")
        except OSError as e:
            raise DestinationError(
                f"cannot write table {table_uri!r}: {e}; choose a writable location"
            ) from e
        files.append(rel)
    return files


def table_summary(rows) -> dict[str, Any]:
    """Counts over an Arrow table of metadata rows: classes, splits, error reasons."""
    labels = rows.column("label").to_pylist()
    errors = rows.column("error").to_pylist()
    splits = rows.column("split").to_pylist()
    classes: dict[str, int] = {}
    reasons: dict[str, int] = {}
    split_counts: dict[str, int] = {}
    for label, err, split in zip(labels, errors, splits, strict=True):
        if err is None and label is not None:
            classes[label] = classes.get(label, 0) + 1
        if err is not None:
            r = error_reason(err)
            reasons[r] = reasons.get(r, 0) + 1
        elif split is not None:
            split_counts[split] = split_counts.get(split, 0) + 1
    return {
        "rows": rows.num_rows,
        "classes": dict(sorted(classes.items())),
        "splits": split_counts,
        "errors": dict(sorted(reasons.items())),
        "unlabelled": sum(1 for lab in labels if lab is None),
    }


def ingest(
    source: str,
    table: str,
    *,
    labels: str | None = None,
    split: str | tuple = DEFAULT_SPLIT,
    phash: bool = True,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    progress_every: int = 1000,
    runner: str | None = None,
    ray_address: str | None = None,
    partitions: int | None = None,
    use_process: bool | None = None,
) -> dict[str, Any]:
    """Scan ``source`` and commit (or extend) the metadata table at ``table``; returns a summary dict."""
    from .. import runner as runner_mod

    t0 = time.time()
    cfg = IngestConfig(
        source=source,
        table=table,
        labels=labels,
        split=parse_split(split),
        phash=phash,
        max_pixels=max_pixels,
        progress_every=progress_every,
        partitions=partitions,
        use_process=use_process,
    )
    runner_name = runner_mod.resolve(runner)
    if cfg.max_pixels < 1:
        raise ConfigError(f"--max-pixels {cfg.max_pixels} must be positive, e.g. {DEFAULT_MAX_PIXELS}")
    mapping = load_labels(cfg.labels) if cfg.labels else None
    _check_source(cfg.source)
    _check_destination(cfg.table)
    previous, known = _existing(cfg.table)
    if (
        previous is not None
        and previous.options.get("split")
        and tuple(previous.options["split"]) != cfg.split
    ):
        raise ConfigError(
            f"--split {','.join(map(str, cfg.split))} differs from the table's "
            f"{','.join(map(str, previous.options['split']))}; pass the same fractions or ingest into a new table"
        )
    runner_mod.configure(runner_name, ray_address)

    listing = list_source(cfg.source)
    # A table kept inside its own source folder must not ingest its own Parquet files.
    table_prefix = _local_abs(cfg.table) if protocol_is_local(cfg.table) else cfg.table.rstrip("/")
    listing = [item for item in listing if not item[0].startswith(table_prefix + "/")]
    if not listing and previous is None:
        raise SourceError(f"source {cfg.source!r} contains no files; add images or point at another folder")
    todo = [item for item in listing if item[0] not in known]
    if cfg.progress_every:
        _progress(f"ingest: {len(listing)} files under {cfg.source}, {len(todo)} new")

    if not todo and previous is not None:
        summary = {"version": previous.version, "new_rows": 0, "skipped_existing": len(listing) - len(todo)}
        return _finish(cfg, previous, summary, t0, runner_name)

    rows = _run_udf(cfg, todo, mapping, runner_name)
    version = (previous.version if previous else 0) + 1
    files = _write_version(cfg.table, version, rows)
    all_labels = set(previous.classes if previous else [])
    all_labels.update(
        v
        for v, e in zip(rows.column("label").to_pylist(), rows.column("error").to_pylist(), strict=True)
        if v is not None and e is None
    )
    manifest = tf.TableManifest(
        version=version,
        files=(previous.files if previous else []) + files,
        num_rows=(previous.num_rows if previous else 0) + rows.num_rows,
        classes=sorted(all_labels),
        source=cfg.source,
        lineage=previous.lineage if previous else {},
        options={
            "split": list(cfg.split),
            "phash": cfg.phash,
            "labels": cfg.labels,
            "max_pixels": cfg.max_pixels,
        },
    )
    tf.commit(cfg.table, manifest)  # the commit point: everything above is invisible until this write
    summary = {"version": version, "new_rows": rows.num_rows, "skipped_existing": len(listing) - len(todo)}
    return _finish(cfg, manifest, summary, t0, runner_name)


def _finish(
    cfg: IngestConfig, manifest: tf.TableManifest, summary: dict, t0: float, runner_name: str
) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = []
    for uri in tf.file_uris(cfg.table, manifest):
        fs, path = io.filesystem(uri)
        with fs.open(path, "rb") as f:
            parts.append(pq.read_table(f, columns=["label", "error", "split"]))
    counts = table_summary(pa.concat_tables(parts)) if parts else table_summary(tf.SCHEMA.empty_table())
    return {
        "table": cfg.table,
        "source": cfg.source,
        "runner": runner_name,
        **summary,
        **counts,
        "seconds": round(time.time() - t0, 3),
    }
