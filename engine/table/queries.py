"""Curation as Daft queries: stats, dedupe, sample and resplit run where Daft's runner runs them (in-process
partitions, or Ray tasks), and only per-group results come back to the driver: counts per stratum, and the pairs
of near-duplicate rows that the greedy choice must order.

Each query gives the same rows as its definition in ``choose.py`` (plain functions over Python lists, kept as the
specification and tested against these):

- ``dedupe``: the first row of each sample id in (readable first, then URI) order, by a window per sample id;
  near duplicates from a self-join of the rows on perceptual-hash bands (two hashes within the distance agree on
  at least one band), the Hamming distance checked on the joined pairs, then the greedy keep-the-first over the
  pairs alone (typically few): a row goes when an earlier kept row lies within the distance.
- ``sample``: per stratum, the rows with the smallest ``sha256(seed:uri)``, as many as ``allocate`` gives it.
- ``resplit``: per stratum, rows ranked by ``(sha256(seed:sample_id), uri)`` and cut at the fractions; every copy
  of a content takes the split of its first copy.

Daft joins never match null keys, and a stratum may be null (unlabeled rows): strata are joined on a surrogate
pair (the value as a string, and whether it is null).
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .choose import _bands, _key, allocate
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


# ------------------------------------------------------------------------------------------------- dedupe


def _hamming_udf():
    import daft

    @daft.func.batch(return_dtype=daft.DataType.int64())
    def hamming(a, b):
        import numpy as np
        import pyarrow as pa

        x = np.asarray(a.to_arrow(), np.int64).view(np.uint64) ^ np.asarray(b.to_arrow(), np.int64).view(np.uint64)
        return pa.array(np.bitwise_count(x).astype(np.int64))

    return hamming


def _near_pairs(rows, bands: list[tuple[int, int]], max_distance: int) -> list[tuple[int, str, int, str]]:
    """Pairs of rows (earlier, later in (unreadable, uri) order) whose hashes lie within ``max_distance``: each as
    (earlier's flag, earlier's uri, later's flag, later's uri)."""
    import daft
    from daft import col, lit

    hashed = rows.where(col("phash").not_null()).select("uri", "_unreadable", "phash")

    def band(lo: int, hi: int):
        # bits lo..hi-1 of the hash's 64-bit pattern: an arithmetic shift keeps them, the mask drops the sign
        if hi - lo >= 64:
            return col("phash")
        return (col("phash") >> lit(lo)) & lit((1 << (hi - lo)) - 1)

    parts = [hashed.select("uri", "_unreadable", "phash", lit(b).alias("_band"), band(lo, hi).alias("_key"))
             for b, (lo, hi) in enumerate(bands)]
    keyed = parts[0]
    for p in parts[1:]:
        keyed = keyed.concat(p)
    right = keyed.select(col("_band"), col("_key"), col("uri").alias("_uri2"), col("_unreadable").alias("_u2"),
                         col("phash").alias("_h2"))
    pairs = keyed.join(right, on=["_band", "_key"])
    earlier = (col("_unreadable").cast(daft.DataType.int8()) < col("_u2").cast(daft.DataType.int8())) | (
        (col("_unreadable") == col("_u2")) & (col("uri") < col("_uri2")))
    pairs = pairs.where(earlier).where(_hamming_udf()(col("phash"), col("_h2")) <= max_distance)
    out = pairs.select("_unreadable", "uri", "_u2", "_uri2").distinct().to_pydict()
    return list(zip(out["_unreadable"], out["uri"], out["_u2"], out["_uri2"], strict=True))


def _greedy_drop(pairs: list[tuple[int, str, int, str]]) -> list[str]:
    """The rows the greedy choice drops: in order, a row goes when an earlier row within the distance is kept."""
    earlier: dict[tuple, list[tuple]] = {}
    for ua, a, ub, b in pairs:
        earlier.setdefault((ub, b), []).append((ua, a))
        earlier.setdefault((ua, a), [])
    dropped: set[tuple] = set()
    for row in sorted(earlier):
        if any(e not in dropped for e in earlier[row]):
            dropped.add(row)
    return [uri for _, uri in dropped]


def dedupe(df, exact: bool = True, near: bool = True, max_distance: int = 4, max_near: int = 16):
    """``df`` without exact duplicates (same content hash) and near duplicates (perceptual-hash distance)."""
    import daft
    from daft import col
    from daft.functions import row_number

    if not 0 <= max_distance <= max_near:
        raise ConfigError(f"max_distance {max_distance} must be between 0 and {max_near}, e.g. 4")
    names = df.column_names
    rows = df.with_column("_unreadable", col("error").not_null())
    if exact:
        first = daft.Window().partition_by("sample_id").order_by(["_unreadable", "uri"])
        rows = rows.with_column("_rank", row_number().over(first)).where(col("_rank") == 1).exclude("_rank")
    if near:
        dropped = _greedy_drop(_near_pairs(rows, _bands(max_distance), max_distance))
        if dropped:
            rows = rows.join(daft.from_pydict({"uri": dropped}), on="uri", how="anti")
    return rows.select(*names)


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
