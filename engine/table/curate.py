"""Curation on a metadata table: stats, exact and near-duplicate removal, stratified sampling and splitting,
and saving a subset with its lineage.

The plain functions of ``choose.py`` (``choose_unique``, ``choose_sample``, ``allocate``, ``split_rows``,
``size_bin``) define which rows a curation keeps, over Python lists; the DataFrame functions here run the same
choice as Daft queries (``queries.py``: windows, joins and group-bys), so a view stays lazy and only per-group
results reach the driver.
They take and return DataFrames (and ``save`` a committed manifest): ``table.Table`` wraps them as views.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, DestinationError
from . import dedupe as dd
from . import format as tf
from . import queries
from .choose import (  # noqa: F401 - the definitions, exported beside the queries that run them
    MAX_NEAR_DISTANCE,
    SIZE_BINS,
    allocate,
    choose_sample,
    choose_unique,
    size_bin,
    split_rows,
)
from .commit import check_destination, write_version
from .dedupe import DedupeConfig

# ---------------------------------------------------------------------------------------------------------
# stats


def _counts(df, key: str) -> dict[str, int]:
    from daft import col

    out = df.groupby(key).agg(col("uri").count("all").alias("n")).to_pydict()
    return dict(sorted((str(k), int(n)) for k, n in zip(out[key], out["n"], strict=True)))


def _size_label():
    """The ``size_bin`` of a row's longer side, as a Daft expression."""
    from daft import col, lit
    from daft.functions import when

    side = when(col("width") > col("height"), col("width")).otherwise(col("height"))
    label = None
    for lo, hi in zip(SIZE_BINS, SIZE_BINS[1:], strict=False):
        label = (when(side < hi, lit(f"{lo}-{hi - 1}")) if label is None else
                 label.when(side < hi, lit(f"{lo}-{hi - 1}")))
    return label.otherwise(lit(f">={SIZE_BINS[-1]}"))


def stats(df) -> dict[str, Any]:
    """Class balance and splits (readable rows), formats, a histogram of the longer side, errors per reason: Daft
    group-bys, so only the counts come back."""
    from daft import col
    from daft.functions import split_part

    readable = df.where(col("error").is_null())
    failed = df.where(col("error").not_null()).with_column("reason", split_part(col("error"), ":", 1))
    errors = _counts(failed, "reason")  # ``imageinfo.error_reason``: the text up to the first colon
    sized = readable.where(col("width").not_null() & col("height").not_null()).with_column("bin", _size_label())
    order = {size_bin(lo): i for i, lo in enumerate(SIZE_BINS)}
    rows = df.count_rows()
    return {
        "rows": rows,
        "readable": rows - sum(errors.values()),
        "classes": _counts(readable, "label"),
        "splits": _counts(readable, "split"),
        "formats": _counts(readable, "format"),
        "size_histogram": dict(sorted(_counts(sized, "bin").items(), key=lambda kv: order.get(kv[0], 99))),
        "errors": errors,
    }


def format_stats(s: dict[str, Any]) -> str:
    """A few human-readable lines for the terminal."""
    lines = [f"rows: {s['rows']} ({s['readable']} readable, {s['rows'] - s['readable']} with errors)"]
    for key in ("classes", "splits", "formats", "size_histogram", "errors"):
        items = ", ".join(f"{k}: {v}" for k, v in s[key].items()) or "none"
        lines.append(f"{key.replace('_', ' ')}: {items}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# dedupe


def dedupe(df, exact: bool = True, near: bool = True, max_distance: int = 4, **options):
    """``df`` without exact duplicates (same content hash) and near duplicates (perceptual-hash distance): the rows
    ``choose_unique`` keeps (while the near search is exact: ``dedupe.NearSearch.exact``), chosen by Daft queries
    (``dedupe.py``). ``options``: the other fields of ``DedupeConfig`` (method, recall, bucket_cap, lsh_seed)."""
    kept, _ = dd.dedupe(df, DedupeConfig(exact=exact, near=near, max_distance=max_distance, **options))
    return kept


# ---------------------------------------------------------------------------------------------------------
# sampling and splitting


def sample(
    df,
    n: int | None = None,
    fraction: float | None = None,
    stratify_by: str | None = "label",
    seed: int = 0,
):
    """A deterministic sample of ``df``: ``n`` rows or a ``fraction``, kept in proportion per ``stratify_by``."""
    if (n is None) == (fraction is None):
        raise ConfigError(f"sample needs exactly one of n or fraction (got n={n!r}, fraction={fraction!r})")
    if n is not None and n < 0:
        raise ConfigError(f"sample n={n} must be non-negative")
    if fraction is not None and not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"sample fraction={fraction} must be between 0 and 1")
    if stratify_by and stratify_by not in df.column_names:
        raise ConfigError(f"stratify_by={stratify_by!r} is not a column; use one of {df.column_names}")
    return queries.sample(df, n, fraction, stratify_by, seed)


def resplit(df, fractions="0.8,0.1,0.1", seed: int = 0, stratify_by: str | None = "label"):
    """``df`` with train/val/test reassigned so each stratum is split in the given fractions."""
    if stratify_by and stratify_by not in df.column_names:
        raise ConfigError(f"stratify_by={stratify_by!r} is not a column; use one of {df.column_names}")
    return queries.resplit(df, fractions, seed, stratify_by, list(tf.SCHEMA.names))


# ---------------------------------------------------------------------------------------------------------
# save


def save(view, uri: str, overwrite: bool = False) -> tf.TableManifest:
    """Commit ``view`` (a ``Table``: its DataFrame ``df``, ``uri``, ``manifest`` and ``operations``) as a new
    table at ``uri`` with lineage; returns the committed manifest.

    The view's query runs once, and Daft's Parquet writer writes its rows where the query runs (in-process
    partitions, or Ray workers: ``commit.write_dataframe``); the driver gets back the files' names and reads
    their row counts from the footers, then commits the manifest, last. Rows come in the query's order (one
    file per partition), not sorted: a table's readers do not depend on its order (the cache sorts by content)."""
    if tf.committed_versions(uri) and not overwrite:
        raise DestinationError(
            f"a table already exists at {uri!r}; choose a new location or pass overwrite=True"
        )
    check_destination(uri)
    filters = [op[len("where ") :] for op in view.operations if op.startswith("where ")]
    options = dict(view.manifest.options)
    resplits = [op for op in view.operations if op.startswith("resplit(")]
    if resplits:  # the splits are no longer the parent's (hash or split folders): say how they were made
        before = options.get("split_assignment") or {"by": "hash", "fractions": options.get("split")}
        options["split_assignment"] = {"by": "resplit", "operation": resplits[-1], "before": before}
    return write_version(
        uri,
        view.df,
        # the parent's classes, so a label keeps its index in the subset
        classes=list(view.manifest.classes),
        source=view.uri,
        lineage={
            "parent": view.uri,
            "parent_version": view.manifest.version,
            "filter": " AND ".join(f"({f})" for f in filters),
            "operations": list(view.operations),
        },
        options=options,
    )
