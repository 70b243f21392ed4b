"""The per-file work of ingest, as a Daft UDF: bytes -> content id, header facts, integrity, perceptual hash.

``run_probe`` runs it over the files an ingest has to look at (new or modified): Daft downloads files from
object stores (files over the byte cap, by their listed size, are not downloaded at all), the UDF reads the rest
through fsspec with the cap, and ``imageinfo.probe`` parses headers with the allowed decoders only. A file
never fails the ingest: it becomes a row with an ``error``.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict

import pyarrow as pa

from .. import io
from . import format as tf
from .split import assign_split

PROCESS_THRESHOLD = 2000  # files below which the UDF runs in threads (worker processes cost seconds to start)


def _unread_row(uri: str, error: str, fractions: tuple[float, ...]) -> dict:
    """The row of a file whose bytes were not read: an id from its URI, so it still has a stable split."""
    sid = "unreadable-" + hashlib.sha256(uri.encode()).hexdigest()[:20]
    return {"sample_id": sid, "split": assign_split(sid, fractions), "error": error}


def probe_udf(
    with_phash: bool, max_pixels: int, max_bytes: int, fractions: tuple[float, ...], use_process: bool | None
):
    """A Daft row UDF: (uri, size, bytes or null) -> the metadata struct. Built per call so options travel."""
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
    def probe_file(uri: str, size: int, data: bytes | None) -> dict:
        from dutycycle.engine import imageinfo
        from dutycycle.engine import io as dio

        too_large = f"{imageinfo.TOO_LARGE}: over the per-file limit of {max_bytes} bytes; raise --max-file-bytes"
        if size > max_bytes or (data is not None and len(data) > max_bytes):
            return _unread_row(uri, f"{too_large} ({max(size, len(data or b''))} bytes)", fractions)
        if data is None:  # not fetched by Daft (fsspec-only scheme, or Daft could not): read it ourselves
            try:
                data = dio.read_capped(uri, max_bytes)
            except dio.FileTooLargeError:
                return _unread_row(uri, too_large, fractions)
            except Exception as e:
                return _unread_row(uri, f"{imageinfo.UNREADABLE}: {type(e).__name__}: {e}", fractions)
        sid = imageinfo.sample_id(data)
        facts = imageinfo.probe(data, max_pixels=max_pixels, with_phash=with_phash)
        row = asdict(facts)
        row["sample_id"] = sid
        row["split"] = assign_split(sid, fractions)
        return row

    return probe_file


def run_probe(cfg, todo, labels: list[str | None], runner: str, progress) -> pa.Table:
    """Probe the listing rows ``todo`` (an Arrow table: uri, rel, size_bytes, modified) labelled ``labels``, with
    the options of ``cfg`` (an ``IngestConfig``); returns their table rows sorted by URI."""
    import daft
    from daft import col, lit

    n = todo.num_rows
    df = daft.from_pydict(
        {
            "uri": todo.column("uri").to_pylist(),
            "size_bytes": todo.column("size_bytes").to_pylist(),
            "modified": todo.column("modified").to_pylist(),
            "label": labels,
        }
    )
    nparts = cfg.partitions or (max(1, min(64, n // 500)) if runner == "ray" else 1)
    if nparts > 1:
        df = df.into_partitions(nparts)
    if cfg.progress_every:
        # results stream back in batches of this size, so the progress line moves during long scans
        df = df.into_batches(max(1, min(cfg.progress_every, 1000)))
    if io.protocol(cfg.source) in io.DAFT_SCHEMES:
        # Files over the byte cap (by their listed size) are not downloaded at all: their URI becomes null.
        small = daft.functions.when(col("size_bytes") <= cfg.max_file_bytes, col("uri")).otherwise(None)
        data = daft.functions.download(small, on_error="null", io_config=io.daft_io_config())
    else:  # e.g. memory://: read inside the UDF through fsspec (same process on the native runner)
        data = lit(None).cast(daft.DataType.binary())
    # Worker processes sidestep the GIL for hashing and decoding but cost seconds to start: small jobs run
    # the UDF in threads.
    use_process = cfg.use_process
    if use_process is None and n < PROCESS_THRESHOLD:
        use_process = False
    probe_file = probe_udf(cfg.phash, cfg.max_pixels, cfg.max_file_bytes, cfg.split, use_process)
    df = df.with_column("data", data).select(
        col("uri"), col("size_bytes"), col("modified"), col("label"),
        probe_file(col("uri"), col("size_bytes"), col("data")),
    )
    batches, done = [], 0
    next_report = cfg.progress_every
    for batch in df.to_arrow_iter():
        batches.append(batch)
        done += batch.num_rows
        if cfg.progress_every and done >= next_report:
            progress(f"ingest: {done}/{n} files")
            next_report = (done // cfg.progress_every + 1) * cfg.progress_every
    table = pa.Table.from_batches(batches) if batches else tf.SCHEMA.empty_table()
    return table.select(tf.SCHEMA.names).cast(tf.SCHEMA).sort_by("uri")
