"""The rows a materialization selects, computed once and kept on disk: counts, one row per sample id numbered in
sample-id order, the fingerprint's block digests and each shard's id digest, without a total-order pass and
without running the table query twice.

Two passes, each holding one batch or one bucket in memory:

1. **Bucket** (one streaming Daft query over the table, ``where`` included, and the roots check): every row goes to
   the bucket of its sample id's first byte, or first two bytes past a million rows (``bucket_width``). A bucket's ids all sort before the next bucket's, so buckets in
   key order are the sample-id order, and numbering needs only per-bucket counts and their prefix sums. On the
   native runner the rows stream into this process and are appended to one Arrow file per bucket in a local
   temporary folder; on the Ray runner the workers write them as Parquet partitioned by bucket under the cache
   root (shared by the workers, which write the shards there too), and nothing passes through the driver.
2. **Number** (this process, one bucket at a time, in key order): count rows, errors and rows outside the roots;
   keep the good rows inside the roots, one per sample id (the smallest URI when content repeats); number them
   from a running offset; write them as the selection's Parquet files; feed the block and shard digests.

Sample ids are content hashes (hex), so the 16 or 256 buckets hold about equal shares: 10M rows make buckets of
~40k. A table of other ids is planned correctly, only with unequal buckets.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import io
from ..errors import ConfigError, CorruptArtifactError
from ..roots import RootCheck
from . import plan as mp

SELECTED = ("sample_id", "uri", "label", "split", "uri_bytes", "row")
MAX_OPEN = 512  # bucket files open at once while bucketing (ids of any alphabet can make up to 65,536 buckets)


def bucket_of(ids, width: int = 2) -> np.ndarray:
    """The bucket of each id: its first ``width`` (1 or 2) UTF-8 bytes as a big-endian number (a missing byte
    counts as 0), so bucket order is byte order, the order Arrow sorts strings in. A null id (an error row) goes
    to bucket 0."""
    import pyarrow as pa

    a = ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids
    a = a.cast(pa.large_binary())
    n = len(a)
    offsets = np.frombuffer(a.buffers()[1], np.int64)[a.offset:a.offset + n + 1]
    data = a.buffers()[2]
    data = np.frombuffer(data, np.uint8) if data is not None and data.size else np.zeros(1, np.uint8)
    starts, lengths = np.minimum(offsets[:-1], len(data) - 1), np.diff(offsets)
    key = np.where(lengths >= 1, data[starts], 0).astype(np.int32)
    if width == 2:
        key = key * 256 + np.where(lengths >= 2, data[np.minimum(starts + 1, len(data) - 1)], 0).astype(np.int32)
    if a.null_count:
        key[~np.asarray(a.is_valid())] = 0
    return key


def bucket_width(rows: int) -> int:
    """Bytes of the id that pick a bucket: one (16 buckets of hex ids) up to a million rows, two (256) above, so
    a bucket holds at most about 60k rows of a small table and a small table is not cut into 256 files."""
    return 1 if rows <= 1_000_000 else 2


class _Digests:
    """sha256 over consecutive runs of ``size`` rows, fed a bucket at a time: the fingerprint's block digests
    (``plan.rows_digest`` lines) and the shards' id digests (``udf.ids_digest``: ids joined by newlines)."""

    def __init__(self, size: int, lines: bool):
        self.size, self.lines = size, lines
        self.done: list[tuple[int, int, str]] = []
        self._h, self._n = hashlib.sha256(), 0

    def feed(self, text) -> None:
        """``text``: a string array of "\\n"-led lines, one per row, in row order."""
        lo = 0
        while lo < len(text):
            take = min(self.size - self._n, len(text) - lo)
            piece = text.slice(lo, take)
            offsets = np.frombuffer(piece.buffers()[1], np.int64)[piece.offset:piece.offset + take + 1]
            body = memoryview(piece.buffers()[2])[offsets[0]:offsets[-1]]
            if not self.lines and self._n == 0:
                body = body[1:]  # ids_digest joins with newlines: no newline before a shard's first id
            self._h.update(body)
            self._n += take
            lo += take
            if self._n == self.size:
                self._close()

    def _close(self) -> None:
        digest = self._h.hexdigest()
        self.done.append((len(self.done), self._n, digest if self.lines else digest[:20]))
        self._h, self._n = hashlib.sha256(), 0

    def finish(self) -> list[tuple[int, int, str]]:
        if self._n:
            self._close()
        return self.done


@dataclass
class Selection:
    """A planned selection: its files (Parquet, ``SELECTED`` columns, in row order), counts and digests."""

    files: list[str]
    counts: dict[str, Any]
    blocks: list[tuple[int, int, str]]  # (block, rows, digest) per fingerprint block
    shard_digests: dict[int, str]  # shard -> ids_digest of its sample ids
    rows_per_shard: int
    staging: str = ""
    _cleanup: list = field(default_factory=list, repr=False)

    @property
    def selected(self) -> int:
        return sum(b[1] for b in self.blocks)

    def frame(self):
        """The selection as a lazy Daft DataFrame (row order within and across its files)."""
        import daft

        if not self.files:
            return daft.from_arrow(self.table())
        return daft.read_parquet(self.files, io_config=io.daft_io_config())

    def tables(self) -> Iterator:
        """The selection's Arrow tables, one file at a time, in row order."""
        import pyarrow.parquet as pq

        for f in self.files:
            fs, path = io.filesystem(f)
            with fs.open(path, "rb") as fh:
                yield pq.read_table(fh)

    def table(self):
        """The whole selection as one Arrow table (for callers that need every row anyway)."""
        import pyarrow as pa

        tables = list(self.tables())
        if tables:
            return pa.concat_tables(tables)
        return pa.table({c: pa.array([], t) for c, t in _selected_types().items()})

    def close(self) -> None:
        for fn in self._cleanup:
            fn()
        self._cleanup.clear()


def _selected_types():
    import pyarrow as pa

    return {"sample_id": pa.string(), "uri": pa.string(), "label": pa.string(), "split": pa.string(),
            "uri_bytes": pa.binary(), "row": pa.int64()}


# ------------------------------------------------------------------------------------------------ 1 bucket


def _bucket_udf(width: int):
    import daft
    import pyarrow as pa

    @daft.func.batch(return_dtype=daft.DataType.int32())
    def bucket(ids):
        return pa.array(bucket_of(ids.to_arrow(), width), pa.int32())

    return bucket


def _bucket_native(df, roots: list[str], folder: str, width: int) -> dict[int, list[str]]:
    """Stream the rows into this process; add ``outside``; append each to its bucket's Arrow file under
    ``folder``.

    ``outside`` is computed here, not by a Daft UDF in the query: with a Python UDF in a native streaming query,
    Daft 0.7.26 sometimes ends the stream without rows and without the read's error when a Parquet file is torn
    (1 run in 3 here; never without the UDF in 200), and the plan would have selected nothing from a broken table.
    """
    import pyarrow as pa

    check = RootCheck(roots)
    writers: dict[int, Any] = {}  # bucket -> open writer (at most MAX_OPEN; a reopened bucket gets a new part)
    parts: dict[int, list[str]] = {}
    try:
        for batch in df.to_arrow_iter():
            t = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
            if not len(t):
                continue
            t = t.append_column("outside", pa.array(check.outside_mask(io.open_paths(t)), pa.bool_()))
            key = bucket_of(t.column("sample_id"), width)
            order = np.argsort(key, kind="stable")
            key = key[order]
            t = t.take(pa.array(order))
            cuts = np.flatnonzero(np.diff(key)) + 1
            for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(key)], strict=True):
                k = int(key[lo])
                w = writers.get(k)
                if w is None:
                    if len(writers) >= MAX_OPEN:
                        writers.pop(next(iter(writers))).close()
                    path = os.path.join(folder, f"{k:05d}-{len(parts.get(k, [])):04d}.arrow")
                    parts.setdefault(k, []).append(path)
                    w = writers[k] = pa.ipc.new_stream(path, t.schema)
                w.write_table(t.slice(lo, hi - lo))
    finally:
        for w in writers.values():
            w.close()
    return parts


def _bucket_ray(df, roots: list[str], folder: str, width: int) -> dict[int, list[str]]:
    """The workers add ``outside`` and write the rows as Parquet partitioned by bucket under ``folder``
    (Hive-style ``bucket=K``)."""
    from daft import col

    df = df.with_column("outside", mp.outside_udf(roots)(col("uri"), col("uri_bytes")))
    written = df.with_column("bucket", _bucket_udf(width)(col("sample_id"))).write_parquet(
        folder, partition_cols=["bucket"], io_config=io.daft_io_config()).to_pydict()
    parts: dict[int, list[str]] = {}
    for path in written["path"]:
        k = int(path.rstrip("/").rsplit("/", 2)[-2].split("=", 1)[1])
        parts.setdefault(k, []).append(path)
    return parts


def _remove_tree(uri: str) -> None:
    fs, path = io.filesystem(uri)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(path, recursive=True)


def _read_bucket(paths: list[str]):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for p in sorted(paths):
        if p.endswith(".arrow"):
            with pa.OSFile(p, "rb") as fh:
                tables.append(pa.ipc.open_stream(fh).read_all())
        else:
            fs, path = io.filesystem(p)
            with fs.open(path, "rb") as fh:
                t = pq.read_table(fh)
            tables.append(t.drop_columns(["bucket"]) if "bucket" in t.column_names else t)
    return pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]


# ------------------------------------------------------------------------------------------------ 2 number


class _SelectedWriter:
    """The numbered rows, bucket after bucket, as Parquet files of up to ``FILE_ROWS`` rows in row groups of
    about ``GROUP_ROWS``: a bucket of a small table holds a dozen rows, and 256 files of a dozen rows made the
    build's scan cost more than the build (3,000 rows: 5.2 s against 3.0 s for the hand-written loop)."""

    GROUP_ROWS, FILE_ROWS = 65_536, 1 << 20

    def __init__(self, folder: str):
        self.folder, self.files = folder, []
        self.fs, self.base = io.filesystem(folder)
        self.fs.makedirs(self.base, exist_ok=True)
        self._held, self._held_rows, self._writer, self._fh, self._file_rows = [], 0, None, None, 0

    def add(self, table) -> None:
        self._held.append(table)
        self._held_rows += len(table)
        if self._held_rows >= self.GROUP_ROWS:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self._held:
            return
        group = pa.concat_tables(self._held).combine_chunks()
        self._held, self._held_rows = [], 0
        if self._writer is None:
            name = f"part-{len(self.files):05d}.parquet"
            self._fh = self.fs.open(f"{self.base}/{name}", "wb")
            self._writer = pq.ParquetWriter(self._fh, group.schema)
            self.files.append(io.join(self.folder, name))
        self._writer.write_table(group)
        self._file_rows += len(group)
        if self._file_rows >= self.FILE_ROWS:
            self._end_file()

    def _end_file(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._fh.close()
            self._writer, self._fh, self._file_rows = None, None, 0

    def close(self) -> list[str]:
        self._flush()
        self._end_file()
        return self.files


def _count(t) -> dict[str, Any]:
    import pyarrow.compute as pc

    ok = pc.is_null(t.column("error"))
    outside = pc.and_(ok, t.column("outside"))
    example = None
    if pc.any(outside).as_py():
        example = t.column("uri").filter(outside)[0].as_py()
    return {"rows": len(t), "errors": len(t) - pc.sum(ok).as_py() if len(t) else 0,
            "outside": int(pc.sum(outside).as_py() or 0),
            "memory": int(pc.sum(pc.starts_with(t.column("uri"), "memory://")).as_py() or 0),
            "outside_example": example}


def _dedupe(t):
    """Good rows inside the roots, one per sample id (the smallest URI), sorted by sample id."""
    import pyarrow as pa
    import pyarrow.compute as pc

    good = t.filter(pc.and_(pc.is_null(t.column("error")), pc.invert(t.column("outside"))))
    good = good.select(["sample_id", "uri", "label", "split", "uri_bytes"])
    good = good.sort_by([("sample_id", "ascending"), ("uri", "ascending")])
    ids = good.column("sample_id").combine_chunks()
    if len(ids) < 2:
        return good
    first = np.ones(len(ids), bool)
    first[1:] = ~np.asarray(pc.equal(ids.slice(1), ids.slice(0, len(ids) - 1)).fill_null(False))
    return good.filter(pa.array(first))


def _lines(t, classes: list[str]):
    """Each row's "\\n"-led digest line: ``plan.rows_digest``'s (sample id, label index, split) and
    ``udf.ids_digest``'s id, as string arrays."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def column(name):
        return t.column(name).combine_chunks()

    ids = column("sample_id").cast(pa.large_string())
    labels = pc.index_in(column("label"), value_set=pa.array(classes, pa.string())).fill_null(-1)
    labels = labels.cast(pa.large_string())
    splits = column("split").cast(pa.large_string()).fill_null("")
    tab, empty = pa.scalar("\t", pa.large_string()), pa.scalar("", pa.large_string())
    newlines = pa.array(["\n"] * len(t), pa.large_string())
    rows = pc.binary_join_element_wise(newlines, pc.binary_join_element_wise(ids, labels, splits, tab), empty)
    return rows, pc.binary_join_element_wise(newlines, ids, empty)


def select(df, *, roots: list[str], classes: list[str], rows_per_shard: int, runner: str, staging: str | None,
           table_uri: str, where: str | None, rows: int | None = None) -> Selection:
    """Plan the selection of ``df`` (``plan.table_frame``) within ``roots`` (``roots.table_roots``): bucket it,
    then number and digest it bucket by bucket. ``staging``: a shared folder for the Ray runner's files (ignored
    on the native runner, which uses a local temporary folder). ``rows``: the table's row count from its
    manifest, if known: it picks the bucket width, and without ``where`` the bucketing must have seen exactly
    that many rows (a read that ended early without an error is caught here). The caller closes the result (its
    files are deleted)."""
    import pyarrow as pa

    cleanup = []
    if runner == "ray":
        assert staging, "the Ray runner stages its buckets in a shared folder"
        root = io.join(staging, f"plan-{uuid.uuid4().hex[:12]}")
        cleanup.append(lambda: _remove_tree(root))
    else:
        root = tempfile.mkdtemp(prefix="dutycycle-plan-")
        cleanup.append(lambda: shutil.rmtree(root, ignore_errors=True))
    sel = Selection([], {}, [], {}, rows_per_shard, root, cleanup)
    width = bucket_width(rows) if rows is not None else 2
    try:
        try:
            if runner == "ray":
                parts = _bucket_ray(df, roots, io.join(root, "buckets"), width)
            else:
                os.makedirs(os.path.join(root, "buckets"))
                parts = _bucket_native(df, roots, os.path.join(root, "buckets"), width)
        except Exception as e:
            if where and not isinstance(e, OSError):
                raise ConfigError(f"--where {where!r} failed on table {table_uri!r} ({mp.first_line(e)}); "
                                  "check column names") from e
            raise
        counts = {"rows": 0, "errors": 0, "outside": 0, "memory": 0, "outside_example": None}
        blocks, shards = _Digests(mp.FINGERPRINT_BLOCK, True), _Digests(rows_per_shard, False)
        offset = 0
        out = _SelectedWriter(io.join(root, "selected"))
        for k in sorted(parts):
            t = _read_bucket(parts[k])
            c = _count(t)
            for name in ("rows", "errors", "outside", "memory"):
                counts[name] += c[name]
            counts["outside_example"] = counts["outside_example"] or c["outside_example"]
            good = _dedupe(t)
            del t
            if not len(good):
                continue
            good = good.append_column("row", pa.array(np.arange(offset, offset + len(good), dtype=np.int64)))
            offset += len(good)
            block_lines, id_lines = _lines(good, classes)
            blocks.feed(block_lines)
            shards.feed(id_lines)
            out.add(good)
        sel.files = out.close()
        if where is None and rows is not None and counts["rows"] != rows:
            raise CorruptArtifactError(
                f"table {table_uri!r}: its manifest records {rows} rows and reading its files gave "
                f"{counts['rows']}; a data file changed after the commit: ingest the source again")
        sel.counts = counts
        sel.blocks = blocks.finish()
        sel.shard_digests = {i: d for i, _, d in shards.finish()}
        return sel
    except BaseException:
        sel.close()
        raise


@contextlib.contextmanager
def selected(df, **kw) -> Iterator[Selection]:
    sel = select(df, **kw)
    try:
        yield sel
    finally:
        sel.close()
