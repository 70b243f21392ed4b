"""The plan of a materialization, as Daft queries: which rows, in which order and shard, and the fingerprint.

Nothing here holds a Python object per row in the driver; the queries run wherever Daft's runner runs them
(in-process partitions on the native runner, Ray tasks on the Ray runner), and only per-shard or per-block
results come back:

- ``table_frame``: the table's committed Parquet files (only the columns the cache needs), filtered by ``where``.
- ``counts``: rows, error rows and rows on ``memory://`` (one aggregate row).
- ``selected_frame``: the good rows, one per sample id (the row with the smallest URI when the same content
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

from ..errors import ConfigError
from ..table import format as tf
from ..transform import TransformSpec
from . import format as cf

FINGERPRINT_BLOCK = 65_536
COLUMNS = ("sample_id", "uri", "label", "split", "error")


def first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[0][:200] if lines else type(e).__name__


def table_frame(table_uri: str, manifest: tf.TableManifest, where: str | None):
    """A lazy Daft DataFrame of the table's rows (``COLUMNS`` only), filtered by ``where``."""
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
    return df.select(*COLUMNS)


def counts(df, table_uri: str, where: str | None) -> dict[str, int]:
    """``{"rows", "errors", "memory"}`` over the filtered table, in one aggregate query."""
    import daft
    from daft import col

    as_int = daft.DataType.int64()
    q = df.agg(
        col("sample_id").count("all").alias("rows"),
        col("error").not_null().cast(as_int).sum().alias("errors"),
        col("uri").startswith("memory://").cast(as_int).sum().alias("memory"),
    )
    try:
        out = q.to_pydict()
    except Exception as e:
        if where and not isinstance(e, OSError):
            raise ConfigError(
                f"--where {where!r} failed on table {table_uri!r} ({first_line(e)}); check column names"
            ) from e
        raise
    return {k: int(v[0] or 0) for k, v in out.items()}


def selected_frame(df):
    """Good rows, one per sample id, with ``row``: the position in sample-id order (0-based, int64)."""
    import daft
    from daft import col
    from daft.functions import row_number

    good = df.where(col("error").is_null()).exclude("error")
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


def fingerprint(digests: Iterable[str], classes: list[str], spec: TransformSpec) -> str:
    """What the cache holds: format version, spec, classes, and the selected rows through their block digests."""
    h = hashlib.sha256()
    head = {"format_version": cf.FORMAT_VERSION, "spec": spec.to_dict(), "classes": classes,
            "rows": f"sha256 per {FINGERPRINT_BLOCK} rows"}
    h.update(json.dumps(head, sort_keys=True).encode())
    for d in digests:
        h.update(f"\n{d}".encode())
    return h.hexdigest()[:20]
