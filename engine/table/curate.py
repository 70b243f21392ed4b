"""Curation on a metadata table: stats, exact and near-duplicate removal, stratified sampling and splitting,
and saving a subset with its lineage.

The plain functions here (``choose_unique``, ``allocate``, ``split_rows``, ``size_bin``) define which rows a
curation keeps, over Python lists; the DataFrame functions run the same choice as Daft queries
(``queries.py``: windows, joins and group-bys), so a view stays lazy and only per-group results reach the driver.
They take and return DataFrames (and ``save`` a committed manifest): ``table.Table`` wraps them as views.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ..errors import ConfigError, DestinationError
from . import format as tf
from .commit import check_destination, write_version
from .split import SPLIT_NAMES, parse_split

SIZE_BINS = (0, 64, 128, 256, 512, 1024, 4096)
MAX_NEAR_DISTANCE = 16


# ---------------------------------------------------------------------------------------------------------
# stats


def size_bin(side: int) -> str:
    for lo, hi in zip(SIZE_BINS, SIZE_BINS[1:], strict=False):
        if side < hi:
            return f"{lo}-{hi - 1}"
    return f">={SIZE_BINS[-1]}"


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


def _bands(max_distance: int) -> list[tuple[int, int]]:
    """Split 64 bits into max_distance+1 bands: two hashes within the distance agree on at least one band."""
    k = max_distance + 1
    edges = [round(i * 64 / k) for i in range(k + 1)]
    return [(edges[i], edges[i + 1]) for i in range(k)]


def choose_unique(
    rows: list[dict], exact: bool = True, near: bool = True, max_distance: int = 4
) -> list[dict]:
    """Keep the first row (readable first, then by URI) of each duplicate group. Pure function.

    ``rows`` are dicts with ``uri``, ``sample_id``, ``phash``, ``error``. Near duplicates are found greedily
    against the rows already kept, using band buckets so each row is compared only with likely matches.
    """
    if not 0 <= max_distance <= MAX_NEAR_DISTANCE:
        raise ConfigError(f"max_distance {max_distance} must be between 0 and {MAX_NEAR_DISTANCE}, e.g. 4")
    ordered = sorted(rows, key=lambda r: (r["error"] is not None, r["uri"]))
    seen_ids: set[str] = set()
    bands = _bands(max_distance)
    buckets: list[dict[int, list[int]]] = [{} for _ in bands]
    kept = []
    for r in ordered:
        if exact:
            if r["sample_id"] in seen_ids:
                continue
            seen_ids.add(r["sample_id"])
        h = r["phash"]
        if near and h is not None:
            u = h & ((1 << 64) - 1)
            keys = [(u >> lo) & ((1 << (hi - lo)) - 1) for lo, hi in bands]
            if any(
                ((u ^ other).bit_count()) <= max_distance
                for b, key in enumerate(keys)
                for other in buckets[b].get(key, ())
            ):
                continue
            for b, key in enumerate(keys):
                buckets[b].setdefault(key, []).append(u)
        kept.append(r)
    return kept


def dedupe(df, exact: bool = True, near: bool = True, max_distance: int = 4):
    """``df`` without exact duplicates (same content hash) and near duplicates (perceptual-hash distance): the rows
    ``choose_unique`` keeps, chosen by Daft queries (``queries.dedupe``)."""
    from . import queries

    return queries.dedupe(df, exact=exact, near=near, max_distance=max_distance, max_near=MAX_NEAR_DISTANCE)


# ---------------------------------------------------------------------------------------------------------
# sampling and splitting


def _key(seed: int, value: str) -> str:
    return hashlib.sha256(f"{seed}:{value}".encode()).hexdigest()


def _strata(rows: list[dict], stratify_by: str | None) -> dict[Any, list[dict]]:
    groups: dict[Any, list[dict]] = {}
    for r in rows:
        groups.setdefault(r.get(stratify_by) if stratify_by else None, []).append(r)
    return groups


def allocate(counts: dict[Any, int], n: int) -> dict[Any, int]:
    """Split ``n`` across strata in proportion to their sizes (largest remainder). Pure function."""
    total = sum(counts.values())
    n = min(n, total)
    if total == 0:
        return dict.fromkeys(counts, 0)
    exact = {k: n * c / total for k, c in counts.items()}
    out = {k: int(v) for k, v in exact.items()}
    rest = n - sum(out.values())
    for k in sorted(counts, key=lambda k: (-(exact[k] - out[k]), str(k)))[:rest]:
        out[k] += 1
    return out


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
    from . import queries

    return queries.sample(df, n, fraction, stratify_by, seed)


def choose_sample(rows: list[dict], n: int | None, fraction: float | None, stratify_by: str | None,
                  seed: int) -> list[str]:
    """The URIs ``sample`` keeps: per stratum, the rows with the smallest ``_key(seed, uri)``, as many as
    ``allocate`` gives the stratum. Pure function (the definition ``queries.sample`` is tested against)."""
    groups = _strata(rows, stratify_by)
    counts = {k: len(v) for k, v in groups.items()}
    want = allocate(counts, n if n is not None else round(fraction * sum(counts.values())))
    keep = []
    for k, members in groups.items():
        members.sort(key=lambda r: _key(seed, r["uri"]))
        keep.extend(r["uri"] for r in members[: want[k]])
    return keep


def split_rows(rows: list[dict], fractions, seed: int, stratify_by: str | None) -> dict[str, str]:
    """uri -> split, so each stratum is divided in the given fractions; duplicates (same id) stay together."""
    fr = parse_split(fractions)
    out = {}
    for members in _strata(rows, stratify_by).values():
        members.sort(key=lambda r: (_key(seed, r["sample_id"]), r["uri"]))
        n = len(members)
        n_train = round(fr[0] * n)
        n_val = round(fr[1] * n)
        for i, r in enumerate(members):
            out[r["uri"]] = (
                SPLIT_NAMES[0] if i < n_train else SPLIT_NAMES[1] if i < n_train + n_val else SPLIT_NAMES[2]
            )
        # duplicates follow their first copy so the same content never sits in two splits
        first: dict[str, str] = {}
        for r in members:
            out[r["uri"]] = first.setdefault(r["sample_id"], out[r["uri"]])
    return out


def resplit(df, fractions="0.8,0.1,0.1", seed: int = 0, stratify_by: str | None = "label"):
    """``df`` with train/val/test reassigned so each stratum is split in the given fractions."""
    from . import queries

    if stratify_by and stratify_by not in df.column_names:
        raise ConfigError(f"stratify_by={stratify_by!r} is not a column; use one of {df.column_names}")
    return queries.resplit(df, fractions, seed, stratify_by, list(tf.SCHEMA.names))


# ---------------------------------------------------------------------------------------------------------
# save


def save(view, uri: str, overwrite: bool = False) -> tf.TableManifest:
    """Commit ``view`` (a ``Table``: its rows, ``uri``, ``manifest`` and ``operations``) as a new table at ``uri``
    with lineage; returns the committed manifest."""
    if tf.committed_versions(uri) and not overwrite:
        raise DestinationError(
            f"a table already exists at {uri!r}; choose a new location or pass overwrite=True"
        )
    check_destination(uri)
    rows = view.to_arrow().sort_by("uri")
    filters = [op[len("where ") :] for op in view.operations if op.startswith("where ")]
    return write_version(
        uri,
        rows,
        # the parent's classes, so a label keeps its index in the subset
        classes=list(view.manifest.classes),
        source=view.uri,
        lineage={
            "parent": view.uri,
            "parent_version": view.manifest.version,
            "filter": " AND ".join(f"({f})" for f in filters),
            "operations": list(view.operations),
        },
        options=dict(view.manifest.options),
    )
