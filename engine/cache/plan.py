"""The plan of a materialization: which rows (the table as a Daft query), how they are digested, and the
fingerprint. Selecting, numbering and digesting the rows is ``selection.py``'s, in one pass.

- ``table_frame``: the table's committed Parquet files (only the columns the cache needs), filtered by ``where``.
  The selection adds ``outside``: whether the path a row opens (``io.open_path``: its URI, or the exact bytes
  of a name that is not text) lies outside the table's source roots (``engine.roots``), so
  that a crafted table cannot make materialize or the raw loader read ``/etc/passwd`` or another user's files.
- The selection: the good rows inside the roots, one per sample id (the row with the smallest URI when the same
  content appears twice), numbered ``row`` = 0, 1, ... in sample-id order. Shard ``i`` holds rows
  ``[i * rows_per_shard, (i + 1) * rows_per_shard)``; fingerprint block ``b`` rows ``[b * B, (b + 1) * B)``.
- Block digests: one sha256 per block of ``FINGERPRINT_BLOCK`` rows over its ``(sample id, label index,
  split)`` lines (``rows_digest``), combined in block order by ``fingerprint``. The block size is fixed, so the
  fingerprint depends on the selected rows, classes, spec and format version only, not on the shard size or the
  runner.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

from .. import formats, io, limits
from ..errors import ConfigError
from ..roots import RootCheck
from ..table import format as tf
from ..table.table import read_dataframe
from ..transform import TransformSpec

FINGERPRINT_BLOCK = 65_536
COLUMNS = ("sample_id", "uri", "label", "split", "error", "uri_bytes")  # uri_bytes: what io.open_path opens


def first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[0][:200] if lines else type(e).__name__


def outside_udf(roots: list[str]):
    import daft

    check = RootCheck(roots)

    @daft.func.batch(return_dtype=daft.DataType.bool())
    def outside(uris, uri_bytes):
        import pyarrow as pa

        # the path a read would open, not the readable form: a crafted uri_bytes must not leave the roots
        paths = [io.open_path(u, b) for u, b in zip(uris.to_pylist(), uri_bytes.to_pylist(), strict=True)]
        return pa.array(check.outside_mask(paths), pa.bool_())

    return outside


def table_frame(table_uri: str, manifest: tf.TableManifest, where: str | None):
    """A lazy Daft DataFrame of the table's rows (``COLUMNS``), filtered by ``where``."""
    import daft

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


# What materialize checks of every fetched file before decoding it (``udf.check_content``): a file that fails
# is skipped, so the check decides which rows land in a cache, and is named in its fingerprint.
CONTENT_CHECK = "sha256 prefix of the fetched bytes equals the row's sample_id"


def decode_settings(max_pixels: int | None = None, max_file_bytes: int | None = None) -> dict:
    """Every setting besides the rows, classes and spec that decides which rows land in a cache or what their
    pixels are: the byte and pixel caps, the decode budget per mode, the decoders allowed, the decoder library
    and its version (a new Pillow may decode or resample differently), and the content check (a file whose bytes
    no longer match its row's content id is skipped). Defaults: the limits' defaults."""
    import PIL

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
    head = {"format_version": formats.FORMAT, "spec": spec.to_dict(), "classes": classes,
            "decode": settings,
            "rows": f"sha256 per {FINGERPRINT_BLOCK} rows"}
    h.update(json.dumps(head, sort_keys=True).encode())
    for d in digests:
        h.update(f"\n{d}".encode())
    return h.hexdigest()[:20]
