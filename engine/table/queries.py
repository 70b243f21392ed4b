"""Curation as Daft queries: stats, sample and resplit run where Daft's runner runs them (in-process
partitions, or Ray tasks), and only per-group results come back to the driver: counts per stratum.

Each query gives the same rows as its definition in ``choose.py`` (plain functions over Python lists, kept as the
specification and tested against these):

- ``dedupe``: in ``dedupe.py``.
- ``sample``: per stratum, the rows with the smallest ``sha256(seed:uri)``, as many as ``allocate`` gives it.
- ``resplit``: per stratum, rows ranked by ``(sha256(seed:sample_id), uri)`` and cut at the fractions; every copy
  of a content takes the split of its first copy.

Neither orders a whole stratum or table: rows are ranked only inside key buckets (see the sample/resplit
section), so the work is spread over partitions and the driver gets one count per (stratum, bucket).

Daft joins never match null keys, and a stratum may be null (unlabeled rows): strata are joined on a surrogate
pair (the value as a string, and whether it is null).
"""

from __future__ import annotations

from typing import Any

from .choose import _key, allocate
from .split import SPLIT_NAMES, parse_split


def _sha_udf(seed: int):
    import daft

    @daft.func.batch(return_dtype=daft.DataType.string())
    def sha(values):
        import pyarrow as pa

        return pa.array([_key(seed, v) for v in values.to_pylist()], pa.string())

    return sha


def _surrogate(df, column: str | None, prefix: str = "_s"):
    """``{prefix}k`` and ``{prefix}n``: a join key for ``column`` that matches null to null (None: one group)."""
    import daft
    from daft import col, lit

    if column is None:
        return df.with_columns({f"{prefix}k": lit(""), f"{prefix}n": lit(False)})
    return df.with_columns({f"{prefix}k": col(column).cast(daft.DataType.string()).fill_null(""),
                            f"{prefix}n": col(column).is_null()})


def _counts(df, stratum: str | None) -> dict[Any, int]:
    from daft import col

    if stratum is None:
        return {None: df.count_rows()}
    out = df.groupby(stratum).agg(col("uri").count("all").alias("_n")).to_pydict()
    return dict(zip(out[stratum], out["_n"], strict=True))


# ----------------------------------------------------------------------------------------- sample, resplit
#
# Both rank rows by a key (a sha256 hex string) within a stratum, with no window over a whole stratum or table:
# the key's first few hex digits name a bucket (keys are uniform, so buckets are even), the driver gets the
# count of rows per (stratum, bucket) and works out, per bucket, how many rows come before it in the stratum.
# Most buckets are then decided whole (all kept, all dropped, all one split); only the buckets a cut falls in
# (at most one per stratum for a sample, two for a split) are ranked, by a window partitioned by (stratum,
# bucket), a few thousand rows each.

BUCKET_ROWS = 2_048  # rows in a bucket of the largest stratum to aim for: what one ranking window holds
MAX_BUCKETS = 65_536  # (stratum, bucket) counts the driver receives at most (unless strata alone are more)
_MAX_DIGITS = 8


def bucket_digits(counts: dict[Any, int]) -> int:
    """The hex digits of the key that name a bucket: enough that the largest stratum's buckets hold about
    ``BUCKET_ROWS`` rows, few enough that the driver gets at most ``MAX_BUCKETS`` counts (1 at least)."""
    largest, strata = max(counts.values(), default=0), max(len(counts), 1)
    d = 1
    while d < _MAX_DIGITS and largest > BUCKET_ROWS * 16**d and strata * 16 ** (d + 1) <= MAX_BUCKETS:
        d += 1
    return d


def _keyed(df, value: str, seed: int, digits: int):
    """``df`` with ``_key`` (``sha256(seed:value)`` in hex) and ``_b`` (its first ``digits`` hex digits)."""
    from daft import col
    from daft.functions import left

    return df.with_column("_key", _sha_udf(seed)(col(value))).with_column("_b", left(col("_key"), digits))


def _bucket_counts(keyed, stratum: str | None) -> dict[Any, list[tuple[str, int]]]:
    """stratum -> [(bucket, rows)] in key order: what comes back to the driver (see ``bucket_digits``)."""
    from daft import col

    by = ["_b"] if stratum is None else [stratum, "_b"]
    out = keyed.groupby(*by).agg(col("_key").count("all").alias("_n")).to_pydict()
    strata = out[stratum] if stratum is not None else [None] * len(out["_b"])
    per: dict[Any, list[tuple[str, int]]] = {}
    for s, b, n in zip(strata, out["_b"], out["_n"], strict=True):
        per.setdefault(s, []).append((b, n))
    return {s: sorted(v) for s, v in per.items()}


def _per_bucket(df, stratum: str | None, entries: list[tuple[Any, str, dict[str, int]]]):
    """``df`` joined with one small row per (stratum, bucket) in ``entries`` holding its values (column -> int):
    rows of buckets not listed drop out. Keeps the stratum's join key (``_sk``, ``_sn``) for the ranking window."""
    import daft

    names = sorted(entries[0][2])
    table = {stratum or "_stratum": [e[0] for e in entries], "_b": [e[1] for e in entries],
             **{n: [e[2][n] for e in entries] for n in names}}
    small = daft.from_pydict(table)
    if stratum is not None:
        small = small.with_column(stratum, small[stratum].cast(df.schema()[stratum].dtype))
    small = _surrogate(small, stratum).select("_sk", "_sn", "_b", *names)
    return _surrogate(df, stratum).join(small, on=["_sk", "_sn", "_b"])


def _within_bucket(rank_fn):
    """``rank_fn()`` over the rows of one (stratum, bucket), in key order: never a whole stratum or table."""
    import daft

    return rank_fn().over(daft.Window().partition_by("_sk", "_sn", "_b").order_by("_key"))


def sample(df, n: int | None, fraction: float | None, stratify_by: str | None, seed: int):
    """Per stratum, the ``allocate``d number of rows with the smallest ``sha256(seed:uri)``."""
    from daft import col, lit
    from daft.functions import row_number

    counts = _counts(df, stratify_by)
    want = allocate(counts, n if n is not None else round(fraction * sum(counts.values())))
    keyed = _keyed(df, "uri", seed, bucket_digits(counts))
    entries = []  # the buckets that keep rows: "_take" rows of the bucket (its first in key order), -1 all
    for s, buckets in _bucket_counts(keyed, stratify_by).items():
        left = want.get(s, 0)
        for b, rows in buckets:
            if left <= 0:
                break
            entries.append((s, b, {"_take": left if left < rows else -1}))
            left -= rows
    if not entries:
        return df.where(lit(False))
    kept = _per_bucket(keyed, stratify_by, entries)
    whole = kept.where(col("_take") < 0)
    edge = kept.where(col("_take") >= 0).with_column("_rank", _within_bucket(row_number))
    edge = edge.where(col("_rank") <= col("_take"))
    return whole.select(*df.column_names).concat(edge.select(*df.column_names))


def _split_code(first: int, train: int, val: int) -> int:
    """The split (index into ``SPLIT_NAMES``) of a content whose first copy has this 1-based rank."""
    return 0 if first <= train else 1 if first <= train + val else 2


def resplit(df, fractions, seed: int, stratify_by: str | None, columns: list[str]):
    """``df`` with ``split`` reassigned per stratum; ``columns``: the output columns (the table schema).

    A content's first copy ranks 1 + (rows of its stratum with a smaller key): every copy shares the key, so
    that is the bucket's offset plus the content's ``rank()`` (ties share the smallest) within its bucket."""
    from daft import col, lit
    from daft.functions import rank, when

    fr = parse_split(fractions)
    counts = _counts(df, stratify_by)
    if not sum(counts.values()):
        return df.select(*columns)
    cuts = {k: (round(fr[0] * c), round(fr[1] * c)) for k, c in counts.items()}
    keyed = _keyed(df, "sample_id", seed, bucket_digits(counts))
    entries = []  # per bucket: its split when every first rank in it gives the same one (else -1), its offset
    for s, buckets in _bucket_counts(keyed, stratify_by).items():
        train, val = cuts[s]
        before = 0
        for b, rows in buckets:
            lo, hi = _split_code(before + 1, train, val), _split_code(before + rows, train, val)
            entries.append((s, b, {"_fixed": lo if lo == hi else -1, "_off": before, "_train": train, "_val": val}))
            before += rows
    joined = _per_bucket(keyed, stratify_by, entries)
    first = col("_off") + col("_r")
    ranked = joined.where(col("_fixed") < 0).with_column("_r", _within_bucket(rank))
    ranked = ranked.with_column("_code", when(first <= col("_train"), lit(0)).when(
        first <= col("_train") + col("_val"), lit(1)).otherwise(lit(2)))
    whole = joined.where(col("_fixed") >= 0).with_column("_code", col("_fixed"))
    split = when(col("_code") == 0, lit(SPLIT_NAMES[0])).when(col("_code") == 1, lit(SPLIT_NAMES[1])).otherwise(
        lit(SPLIT_NAMES[2]))
    out = [split.alias("split") if c == "split" else col(c) for c in columns]
    return whole.select(*out).concat(ranked.select(*out))
