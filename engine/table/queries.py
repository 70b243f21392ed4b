"""Curation as Daft queries: stats, sample and resplit run where Daft's runner runs them (in-process
partitions, or Ray tasks), and only per-group results come back to the driver: counts per stratum.

Each query gives the same rows as its definition in ``choose.py`` (plain functions over Python lists, kept as the
specification and tested against these):

- ``dedupe``: in ``dedupe.py``.
- ``sample``: per stratum, the rows with the smallest ``sha256(seed:uri)``, as many as ``allocate`` gives it.
- ``resplit``: per stratum, rows ranked by ``(sha256(seed:sample_id), uri)`` and cut at the fractions; every copy
  of a content takes the split of its first copy.

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


def _per_stratum(df, stratum: str | None, values: dict[Any, dict[str, int]]):
    """``df`` joined with one small row per stratum holding ``values[stratum]`` (column -> int)."""
    import daft

    names = sorted(next(iter(values.values()))) if values else []
    table = {stratum or "_stratum": list(values), **{n: [v[n] for v in values.values()] for n in names}}
    small = daft.from_pydict(table)
    if stratum is not None:
        small = small.with_column(stratum, small[stratum].cast(df.schema()[stratum].dtype))
    small = _surrogate(small, stratum).select("_sk", "_sn", *names)
    return _surrogate(df, stratum).join(small, on=["_sk", "_sn"]).exclude("_sk", "_sn")


def _counts(df, stratum: str | None) -> dict[Any, int]:
    from daft import col

    if stratum is None:
        return {None: df.count_rows()}
    out = df.groupby(stratum).agg(col("uri").count("all").alias("_n")).to_pydict()
    return dict(zip(out[stratum], out["_n"], strict=True))


# ----------------------------------------------------------------------------------------- sample, resplit


def sample(df, n: int | None, fraction: float | None, stratify_by: str | None, seed: int):
    from daft import col
    from daft.functions import row_number

    counts = _counts(df, stratify_by)
    want = allocate(counts, n if n is not None else round(fraction * sum(counts.values())))
    import daft

    window = daft.Window().order_by("_key") if stratify_by is None else \
        daft.Window().partition_by(stratify_by).order_by("_key")
    ranked = df.with_column("_key", _sha_udf(seed)(col("uri"))).with_column("_rank", row_number().over(window))
    ranked = _per_stratum(ranked, stratify_by, {k: {"_want": v} for k, v in want.items()})
    return ranked.where(col("_rank") <= col("_want")).select(*df.column_names)


def resplit(df, fractions, seed: int, stratify_by: str | None, columns: list[str]):
    """``df`` with ``split`` reassigned per stratum; ``columns``: the output columns (the table schema)."""
    import daft
    from daft import col, lit
    from daft.functions import row_number, when

    fr = parse_split(fractions)
    counts = _counts(df, stratify_by)
    cuts = {k: {"_train": round(fr[0] * c), "_val": round(fr[1] * c)} for k, c in counts.items()}
    parts = [] if stratify_by is None else [stratify_by]
    window = daft.Window().order_by(["_key", "uri"]) if not parts else \
        daft.Window().partition_by(*parts).order_by(["_key", "uri"])
    ranked = df.with_column("_key", _sha_udf(seed)(col("sample_id"))).with_column("_rank", row_number().over(window))
    # every copy of a content takes its first copy's place (the smallest rank of its id in its stratum)
    by = ["_sk", "_sn", "_ik", "_in"]
    ranked = _surrogate(_surrogate(ranked, stratify_by), "sample_id", "_i")
    first = ranked.groupby(*by).agg(col("_rank").min().alias("_first"))
    ranked = ranked.join(first, on=by).exclude(*by)
    ranked = _per_stratum(ranked, stratify_by, cuts)
    split = when(col("_first") <= col("_train"), lit(SPLIT_NAMES[0])).when(
        col("_first") <= col("_train") + col("_val"), lit(SPLIT_NAMES[1])).otherwise(lit(SPLIT_NAMES[2]))
    return ranked.select(*[split.alias("split") if c == "split" else col(c) for c in columns])
