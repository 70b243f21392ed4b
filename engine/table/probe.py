"""The per-file work of ingest, as Daft UDFs: bytes -> content id, header facts, integrity, perceptual hash.

``run_probe`` runs it over the files an ingest has to look at (new or modified). Every file is read through
``io.read_capped`` (``fetch_udf``, a thread pool per batch): never more than the byte cap plus one byte, whatever
the listing said about its size, and locally only a regular file, so a file that grew since it was listed is a
``too large`` row and a FIFO or device that took a file's place is refused unopened. Entries the listing already
refused (``scan.list_source``: FIFOs, devices, symlinks out of the source root) and files over the cap by their
listed size are not read at all. ``imageinfo.probe`` then parses headers with the allowed decoders only. A file
never fails the ingest: it becomes a row with an ``error``.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import pyarrow as pa
import pyarrow.compute as pc

from .. import imageinfo, io
from ..roots import RootCheck
from . import format as tf
from . import scan
from .split import assign_split

PROCESS_THRESHOLD = 2000  # files below which the UDF runs in threads (worker processes cost seconds to start)
FETCH_BATCH = 32  # files read per batch: bounds the bytes held (at most this many times the cap) ...
FETCH_THREADS = 16  # ... and reads in flight (object stores are latency-bound)


def _unread_row(uri: str, error: str, fractions: tuple[float, ...], exact: bytes | None = None) -> dict:
    """The row of a file whose bytes were not read: an id from its path's bytes, so it still has a stable
    split."""
    sid = "unreadable-" + hashlib.sha256(exact if exact is not None else uri.encode()).hexdigest()[:20]
    return {"sample_id": sid, "split": assign_split(sid, fractions), "error": error}


def too_large_message(max_bytes: int) -> str:
    return f"{imageinfo.TOO_LARGE}: over the per-file limit of {max_bytes} bytes; raise --max-file-bytes"


def fetch_one(uri: str, size: int, listed_error: str | None, max_bytes: int, inside=None,
              exact: bytes | None = None):
    """``(bytes, None)`` or ``(None, error)`` for one listed file: a listing error or an oversized listing is not
    read; otherwise a capped, regular-file-only read. ``inside`` (a ``roots.RootCheck`` over a local source)
    checks again that the file resolves inside the source root, in case a symlink was re-pointed since the
    listing. ``exact``: the path's bytes when its name is not text (``uri`` is then only its readable form)."""
    uri = io.open_path(uri, exact)
    if listed_error is not None:
        return None, listed_error
    if size > max_bytes:
        return None, f"{too_large_message(max_bytes)} ({size} bytes)"
    if inside is not None and inside.outside(uri):
        return None, f"{scan.SYMLINK_OUT}: it resolves to {os.path.realpath(uri)!r} when read"
    try:
        return io.read_capped(uri, max_bytes), None
    except io.FileTooLargeError:
        return None, f"{too_large_message(max_bytes)} (listed at {size} bytes, it grew past the limit before it was read)"
    except io.NotRegularFileError as e:
        return None, f"{scan.NOT_REGULAR}: {e.kind}"
    except Exception as e:  # noqa: BLE001 - a file never fails the ingest
        return None, f"{imageinfo.UNREADABLE}: {type(e).__name__}: {e}"


def fetch_udf(max_bytes: int, source: str):
    """A Daft batch UDF: (uri, listed size, listing error) -> struct{data: the bytes or null, error: why not}."""
    import daft
    from daft import DataType as DT

    inside = RootCheck([source]) if io.protocol(source) == "file" else None

    @daft.func.batch(return_dtype=DT.struct({"data": DT.binary(), "error": DT.string()}), batch_size=FETCH_BATCH,
                     use_process=False)
    def fetch(uris, sizes, errors, exact):
        args = list(zip(uris.to_pylist(), sizes.to_pylist(), errors.to_pylist(), exact.to_pylist(), strict=True))

        def one(a):
            return fetch_one(a[0], int(a[1] or 0), a[2], max_bytes, inside, a[3])

        if len(args) > 1 and io.protocol(source) != "memory":
            with ThreadPoolExecutor(min(FETCH_THREADS, len(args)), thread_name_prefix="dutycycle-fetch") as pool:
                got = list(pool.map(one, args))
        else:
            got = [one(a) for a in args]
        return pa.StructArray.from_arrays(
            [pa.array([g[0] for g in got], pa.binary()), pa.array([g[1] for g in got], pa.string())],
            names=["data", "error"],
        )

    return fetch


def probe_udf(
    with_phash: bool, max_pixels: int, max_bytes: int, fractions: tuple[float, ...], use_process: bool | None
):
    """A Daft row UDF: (uri, bytes or null, why not read) -> the metadata struct. Built per call so options
    travel."""
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
    def probe_file(uri: str, data: bytes | None, fetch_error: str | None, exact: bytes | None) -> dict:
        if data is None or len(data) > max_bytes:  # (never longer: the read is capped; checked all the same)
            why = fetch_error or f"{imageinfo.UNREADABLE}: the file was not read"
            return _unread_row(uri, why, fractions, exact)
        sid = imageinfo.sample_id(data)
        facts = imageinfo.probe(data, max_pixels=max_pixels, with_phash=with_phash)
        row = asdict(facts)
        row["sample_id"] = sid
        row["split"] = assign_split(sid, fractions)
        return row

    return probe_file


def run_probe(cfg, todo, labels: list[str | None], runner: str, progress,
              splits: list[str | None] | None = None) -> pa.Table:
    """Probe the listing rows ``todo`` (an Arrow table: uri, rel, size_bytes, modified[, error, uri_bytes])
    labelled ``labels``, with the options of ``cfg`` (an ``IngestConfig``); returns their table rows in path
    order. ``splits``: each row's split from its split folder (None for a file outside them), in place of the
    hash split. ``progress`` is called with the rows done so far as results arrive."""
    import daft
    from daft import col

    n = todo.num_rows
    missing = pa.nulls(n, pa.string())
    df = daft.from_arrow(pa.table({
        "uri": todo.column("uri"),
        "size_bytes": todo.column("size_bytes"),
        "modified": todo.column("modified"),
        "label": pa.array(labels, pa.string()),
        "listed_error": todo.column("error") if "error" in todo.column_names else missing,
        "uri_bytes": todo.column("uri_bytes") if "uri_bytes" in todo.column_names else pa.nulls(n, pa.binary()),
        "folder_split": pa.array(splits, pa.string()) if splits is not None else missing,
    }))
    nparts = cfg.partitions or (max(1, min(64, n // 500)) if runner == "ray" else 1)
    if nparts > 1:
        df = df.into_partitions(nparts)
    if cfg.progress_every:
        # results stream back in batches of this size, so the progress line moves during long scans
        df = df.into_batches(max(1, min(cfg.progress_every, 1000)))
    # Every read is capped and regular-file-only (see the module docstring); Daft's own download is not used, as
    # it reads a whole file (or a device without end) whatever its listed size.
    fetched = fetch_udf(cfg.max_file_bytes, cfg.source)(col("uri"), col("size_bytes"), col("listed_error"),
                                                         col("uri_bytes"))
    # Worker processes sidestep the GIL for hashing and decoding but cost seconds to start: small jobs run
    # the UDF in threads.
    use_process = cfg.use_process
    if use_process is None and n < PROCESS_THRESHOLD:
        use_process = False
    probe_file = probe_udf(cfg.phash, cfg.max_pixels, cfg.max_file_bytes, cfg.split, use_process)
    df = df.with_column("fetched", fetched).select(
        col("uri"), col("size_bytes"), col("modified"), col("label"), col("uri_bytes"), col("folder_split"),
        probe_file(col("uri"), col("fetched").get("data"), col("fetched").get("error"), col("uri_bytes")),
    )
    batches, done = [], 0
    for batch in df.to_arrow_iter():
        batches.append(batch)
        done += batch.num_rows
        progress(done)
    table = pa.Table.from_batches(batches) if batches else None
    if table is None or not table.num_rows:
        return tf.SCHEMA.empty_table()
    if splits is not None:  # the folders' splits in place of the hash split
        table = table.set_column(table.schema.get_field_index("split"), "split", table.column("folder_split"))
    table = table.select(tf.SCHEMA.names).cast(tf.SCHEMA)
    return table.take(pc.sort_indices(scan.path_key(table)))
