"""The plan of a materialization, as Daft queries: which rows, in which order and shard, and the fingerprint.

Nothing here holds a Python object per row in the driver; the queries run wherever Daft's runner runs them
(in-process partitions on the native runner, Ray tasks on the Ray runner), and only per-shard or per-block
results come back:

- ``table_frame``: the table's committed Parquet files (only the columns the cache needs), filtered by ``where``,
  with ``outside``: whether a row's URI lies outside the table's source roots (``engine.roots``), so that a
  crafted table cannot make materialize or the raw loader read ``/etc/passwd`` or another user's files.
- ``counts``: rows, error rows, good rows outside the roots and rows on ``memory://`` (one aggregate row).
- ``selected_frame``: the good rows inside the roots, one per sample id (the row with the smallest URI when the same content
  appears twice), numbered ``row`` = 0, 1, ... in sample-id order. Shard ``i`` holds rows
  ``[i * rows_per_shard, (i + 1) * rows_per_shard)``; fingerprint block ``b`` rows ``[b * B, (b + 1) * B)``.
- ``block_digests``: one sha256 per block of ``FINGERPRINT_BLOCK`` rows over its ``(sample id, label index,
  split)`` lines, combined in block order by ``fingerprint``. The block size is fixed, so the fingerprint
  depends on the selected rows, classes, spec and format version only, not on the shard size or the runner.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from ..errors import ConfigError
from ..roots import RootCheck, table_roots
from ..table import format as tf
from ..transform import TransformSpec
from . import format as cf

FINGERPRINT_BLOCK = 65_536
COLUMNS = ("sample_id", "uri", "label", "split", "error")


def first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[0][:200] if lines else type(e).__name__


def _outside_udf(roots: list[str]):
    import daft

    check = RootCheck(roots)

    @daft.func.batch(return_dtype=daft.DataType.bool())
    def outside(uris):
        import pyarrow as pa

        return pa.array(check.outside_mask(uris.to_pylist()), pa.bool_())

    return outside


def table_frame(table_uri: str, manifest: tf.TableManifest, where: str | None, roots: list[str] | None = None):
    """A lazy Daft DataFrame of the table's rows (``COLUMNS`` plus ``outside``), filtered by ``where``. ``roots``:
    where rows may point (default: the roots the table records, ``roots.table_roots``)."""
    import daft

    from ..table.table import read_dataframe

    # Every column, so that ``where`` may name any of them; the select below keeps what the cache needs.
    df = read_dataframe(table_uri, manifest)
    if where:
        try:
            df = df.where(daft.sql_expr(where))
        except Exception as e:
            raise ConfigError(
                f"--where {where!r} is not a valid filter ({first_line(e)}); use SQL like \"split = 'train'\""
            ) from e
    from daft import col

    roots = table_roots(manifest) if roots is None else roots
    return df.select(*COLUMNS).with_column("outside", _outside_udf(roots)(col("uri")))


def counts(df, table_uri: str, where: str | None) -> dict[str, Any]:
    """``{"rows", "errors", "outside", "memory"}`` over the filtered table (``outside``: good rows outside the
    roots), and ``outside_example`` (one of their URIs, for the message that names them, or None), in one
    aggregate query."""
    import daft
    from daft import col, lit
    from daft.functions import when

    as_int = daft.DataType.int64()
    outside = col("error").is_null() & col("outside")
    q = df.agg(
        col("sample_id").count("all").alias("rows"),
        col("error").not_null().cast(as_int).sum().alias("errors"),
        outside.cast(as_int).sum().alias("outside"),
        col("uri").startswith("memory://").cast(as_int).sum().alias("memory"),
        when(outside, col("uri")).otherwise(lit(None).cast(daft.DataType.string()))
        .any_value(ignore_nulls=True).alias("outside_example"),
    )
    try:
        out = q.to_pydict()
    except Exception as e:
        if where and not isinstance(e, OSError):
            raise ConfigError(
                f"--where {where!r} failed on table {table_uri!r} ({first_line(e)}); check column names"
            ) from e
        raise
    example = out.pop("outside_example")[0]
    return {**{k: int(v[0] or 0) for k, v in out.items()}, "outside_example": example}


def selected_frame(df):
    """Good rows inside the roots, one per sample id, with ``row``: the position in sample-id order (0-based,
    int64)."""
    import daft
    from daft import col
    from daft.functions import row_number

    good = df.where(col("error").is_null() & ~col("outside")).exclude("error", "outside")
    # The copy with the smallest URI stands for its content. A semi join against per-id minimums, not a window
    # per sample id: at 1M rows the window took 25 s and 4.5 GB here, the join 2 s and 0.4 GB (measured once
    # while writing this, not a benchmark row).
    first = good.groupby("sample_id").agg(col("uri").min().alias("uri"))
    good = good.join(first, on=["sample_id", "uri"], how="semi")
    order = row_number().over(daft.Window().order_by("sample_id"))
    return good.with_column("row", (order - 1).cast(daft.DataType.int64()))


def grouped(sel, size: int, key: str, fields: Iterable[str]):
    """One row per group of ``size`` consecutive rows: ``key`` (the group index) and ``rows``, a list of
    structs of ``fields`` (in no particular order: consumers sort by sample id)."""
    import daft
    from daft import col
    from daft.functions import to_struct

    df = sel.with_column(key, (col("row") // size).cast(daft.DataType.int64()))
    items = to_struct(**{f: col(f) for f in fields}).list_agg().alias("rows")
    return df.groupby(key).agg(items)


def label_index(classes: list[str]) -> dict[str | None, int]:
    return {c: k for k, c in enumerate(classes)}


def rows_digest(rows: Iterable[tuple[str, int, str]]) -> str:
    """sha256 over ``(sample id, label index, split)`` lines in the given (sample-id) order."""
    h = hashlib.sha256()
    for sid, lab, spl in rows:
        h.update(f"\n{sid}\t{int(lab)}\t{spl}".encode())
    return h.hexdigest()


def _block_udf():
    import daft

    @daft.func(return_dtype=daft.DataType.struct({"n": daft.DataType.int64(), "digest": daft.DataType.string()}))
    def block_digest(rows: list[dict], classes_json: str) -> dict:
        index = label_index(json.loads(classes_json))
        rows = sorted(rows, key=lambda r: r["sample_id"])
        lines = ((r["sample_id"], index.get(r["label"], -1), r["split"] or "") for r in rows)
        return {"n": len(rows), "digest": rows_digest(lines)}

    return block_digest


def block_digests(sel, classes: list[str]) -> list[tuple[int, int, str]]:
    """``(block, rows, digest)`` per fingerprint block, in block order."""
    from daft import col

    g = grouped(sel, FINGERPRINT_BLOCK, "block", ("sample_id", "label", "split"))
    out = g.select(col("block"), _block_udf()(col("rows"), json.dumps(classes)).alias("d")).to_pydict()
    blocks = sorted(zip(out["block"], out["d"], strict=True))
    return [(int(b), int(d["n"]), d["digest"]) for b, d in blocks]


# What materialize checks of every fetched file before decoding it (``udf.check_content``): a file that fails
# is skipped, so the check decides which rows land in a cache, and is named in its fingerprint.
CONTENT_CHECK = "sha256 prefix of the fetched bytes equals the row's sample_id"


def decode_settings(max_pixels: int | None = None, max_file_bytes: int | None = None) -> dict:
    """Every setting besides the rows, classes and spec that decides which rows land in a cache or what their
    pixels are: the byte and pixel caps, the decode budget per mode, the decoders allowed, the decoder library
    and its version (a new Pillow may decode or resample differently), and the content check (a file whose bytes
    no longer match its row's content id is skipped). Defaults: the limits' defaults."""
    import PIL

    from .. import limits

    return {
        "max_pixels": limits.DEFAULT_MAX_PIXELS if max_pixels is None else max_pixels,
        "max_file_bytes": limits.DEFAULT_MAX_FILE_BYTES if max_file_bytes is None else max_file_bytes,
        "decode_bytes_per_pixel": limits.decode_accounting(),
        "formats": list(limits.ALLOWED_FORMATS),
        "decoder": f"Pillow {PIL.__version__}",
        "content_check": CONTENT_CHECK,
    }


def fingerprint(
    digests: Iterable[str], classes: list[str], spec: TransformSpec, settings: dict
) -> str:
    """What the cache holds: format version, spec, classes, decode settings (``decode_settings``), and the
    selected rows through their block digests."""
    h = hashlib.sha256()
    head = {"format_version": cf.FORMAT_VERSION, "spec": spec.to_dict(), "classes": classes,
            "decode": settings,
            "rows": f"sha256 per {FINGERPRINT_BLOCK} rows"}
    h.update(json.dumps(head, sort_keys=True).encode())
    for d in digests:
        h.update(f"\n{d}".encode())
    return h.hexdigest()[:20]
