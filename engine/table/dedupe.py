"""Exact and near-duplicate removal as Daft queries, streaming: what reaches the driver is the near-duplicate pairs
(the keep-the-first choice must walk them in order) and a few counts, never a row per table row.

The rows kept are ``choose.choose_unique``'s: rows are ordered readable first, then by URI, and

- **exact**: the first row of each content hash (``sample_id``): a group-by on the id taking the smallest order
  key, then a semi-join of the rows on it (no window: a window per id holds every row of the table at once).
- **near**: a row goes when an earlier kept row's perceptual hash lies within ``max_distance`` bits. Rows sharing
  one hash value have the same neighbours, so the search runs over the distinct hashes (a group-by keeps each
  value's first row; the later rows with that value are near duplicates at distance 0 of a kept row, whatever
  happens to the first). The distinct hashes are materialized once (8 bytes and an order key each) and searched
  table by table (``bands.py``: exact pigeonhole bands while their cost is small, LSH tables sized for a stated
  recall beyond that): a self-join on each table's bucket key, the Hamming distance checked with Daft's
  ``hamming_distance`` on the joined pairs. A bucket larger than ``bucket_cap`` (a cluster of near-identical
  hashes, a skewed hash distribution) is not compared in full: its first ``bucket_cap`` members in keep order are
  compared with each other and every other member is compared with those only, so the work stays linear; how many
  buckets hit the cap is reported (``NearSearch``) and ``near_recall`` measures what it costs.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from ..errors import ConfigError
from .bands import DEFAULT_BUCKET_CAP, DEFAULT_RECALL, BandPlan, plan_bands, signed
from .choose import MAX_NEAR_DISTANCE

METHODS = ("auto", "pigeonhole", "lsh")
KEYED_PER_QUERY = 1 << 21  # bucket-keyed rows per search query (24 bytes each before the join)
_LOW63 = (1 << 63) - 1


@dataclass(frozen=True)
class DedupeConfig:
    exact: bool = True  # drop rows whose content hash (sample_id) an earlier row has
    near: bool = True  # drop rows whose perceptual hash lies within max_distance bits of an earlier kept row's
    max_distance: int = 4  # Hamming distance of the 64-bit perceptual hash, 0..MAX_NEAR_DISTANCE
    method: str = "auto"  # "pigeonhole" (every pair within the distance compared), "lsh", or "auto" (bands.py)
    recall: float = DEFAULT_RECALL  # lsh: the probability that a pair at max_distance is compared
    bucket_cap: int = DEFAULT_BUCKET_CAP  # members of one bucket compared with each other in full
    lsh_seed: int = 0  # lsh: the draw of the tables' bit positions

    def check(self) -> DedupeConfig:
        if not 0 <= self.max_distance <= MAX_NEAR_DISTANCE:
            raise ConfigError(f"max_distance {self.max_distance} must be between 0 and {MAX_NEAR_DISTANCE}, e.g. 4")
        if self.method not in METHODS:
            raise ConfigError(f"dedupe method {self.method!r} is not one of {', '.join(METHODS)}; e.g. 'auto'")
        if not 0.0 < self.recall < 1.0:
            raise ConfigError(f"dedupe recall {self.recall} must be between 0 and 1 (exclusive), e.g. 0.99; "
                              "for every pair use method='pigeonhole'")
        if self.bucket_cap < 2:
            raise ConfigError(f"dedupe bucket_cap {self.bucket_cap} must be at least 2, e.g. {DEFAULT_BUCKET_CAP}")
        return self


@dataclass
class NearSearch:
    """How the near-duplicate pairs were found: the plan, and where the bucket cap cut comparisons."""

    method: str  # "pigeonhole" or "lsh"
    max_distance: int
    tables: int
    bits: int  # bits per bucket key (the narrowest table's)
    recall: float  # the planned probability that a pair at max_distance is compared (1.0: pigeonhole)
    bucket_cap: int
    distinct_hashes: int = 0
    compared_pairs: int = 0  # candidate pairs whose distance was checked, over all tables
    capped_buckets: int = 0  # buckets larger than bucket_cap
    capped_rows: int = 0  # members of those buckets beyond the cap (compared only with the bucket's first ones)
    largest_bucket: int = 0
    pairs: int = 0  # distinct pairs of hashes found within max_distance

    @property
    def exact(self) -> bool:
        """Whether every pair within the distance was compared."""
        return self.method == "pigeonhole" and self.capped_buckets == 0

    def to_dict(self) -> dict:
        return {**asdict(self), "exact": self.exact}

    def describe(self) -> str:
        what = ("exact: pigeonhole bands, every pair within the distance compared" if self.method == "pigeonhole"
                else f"LSH: {self.tables} tables of {self.bits} bits, planned recall {self.recall:.3f} at distance "
                f"{self.max_distance}")
        line = (f"near search over {self.distinct_hashes} distinct hashes ({what}); {self.compared_pairs} pairs "
                f"compared, {self.pairs} within distance {self.max_distance}")
        if self.capped_buckets:
            line += (f"; {self.capped_buckets} buckets over the cap of {self.bucket_cap} (largest "
                     f"{self.largest_bucket}): {self.capped_rows} of their members compared only with the bucket's "
                     f"first {self.bucket_cap}")
        return line


@dataclass
class NearResult:
    """The near step's outcome over the distinct hashes (driver side: only hashes that have a pair)."""

    reps: object  # materialized Daft DataFrame: phash, _first (order key of its first row), _n (rows with it)
    search: NearSearch
    pairs: dict[tuple[int, int], int] = field(default_factory=dict)  # (a, b) with a < b -> distance
    first: dict[int, str] = field(default_factory=dict)  # hash -> order key of its first row (hashes in pairs)
    count: dict[int, int] = field(default_factory=dict)  # hash -> rows with it (hashes in pairs)
    dropped: dict[int, tuple[int, int]] = field(default_factory=dict)  # hash -> (the kept hash it matched, d)


def order_key():
    """The keep order as one string: readable rows first ("0" + uri), then rows with an error ("1" + uri)."""
    from daft import col, lit
    from daft.functions import when

    return when(col("error").not_null(), lit("1")).otherwise(lit("0")) + col("uri")


def uri_of(key: str) -> str:
    return key[1:]


def hamming(a, b):
    """Bits that differ between two int64 hashes, as a Daft expression: ``hamming_distance`` takes unsigned
    values (a negative int64 gives null), so the sign bit is counted apart."""
    import daft
    from daft import lit
    from daft.functions import hamming_distance

    x = a ^ b
    return (hamming_distance(x & lit(_LOW63), lit(0)).cast(daft.DataType.int64())
            + (x < lit(0)).cast(daft.DataType.int64()))


def exact_firsts(rows):
    """Per content hash, the order key of its first row (a group-by)."""
    from daft import col

    return rows.groupby("sample_id").agg(col("_o").min().alias("_first"))


def exact_unique(rows):
    """``rows`` (with ``_o``) keeping the first row of each content hash: a group-by, then a semi-join."""
    from daft import col

    return rows.join(exact_firsts(rows).select(col("_first").alias("_o")), on="_o", how="semi")


def distinct_hashes(rows):
    """One row per perceptual hash value: its first row's order key and how many rows have it; materialized
    (8 bytes and a key per value) because the search reads it once per table."""
    from daft import col

    hashed = rows.where(col("phash").not_null())
    return hashed.groupby("phash").agg(col("_o").min().alias("_first"), col("_o").count().alias("_n")).collect()


def _group_pairs(reps, masks: list[int], max_distance: int, cap: int, search: NearSearch) -> list[tuple]:
    """The pairs (a, b, distance) of a group of tables: hashes sharing the bucket ``h & mask`` of a table and
    within the distance; a bucket over ``cap`` is compared through its first ``cap`` members (module note)."""
    import daft
    from daft import col, lit
    from daft.functions import row_number, when

    def keyed(*extra):
        parts = [reps.select(lit(t).alias("_t"), col("phash").alias("_h"),
                             (col("phash") & lit(signed(mask))).alias("_k"), *extra)
                 for t, mask in enumerate(masks)]
        out = parts[0]
        for p in parts[1:]:
            out = out.concat(p)
        return out

    bucket = ["_t", "_k"]
    rows = keyed()
    sizes = rows.groupby(*bucket).agg(col("_h").count().alias("_c"))
    c = col("_c").cast(daft.DataType.int64())
    over = c > lit(cap)
    compared = when(over, lit(cap * (cap - 1) // 2) + (c - lit(cap)) * lit(cap)).otherwise(c * (c - lit(1)) / lit(2))
    s = sizes.agg(compared.cast(daft.DataType.int64()).sum().alias("pairs"), c.max().alias("largest"),
                  over.cast(daft.DataType.int64()).sum().alias("capped"),
                  when(over, c - lit(cap)).otherwise(lit(0)).sum().alias("rest")).to_pydict()
    search.compared_pairs += int(s["pairs"][0] or 0)
    search.largest_bucket = max(search.largest_bucket, int(s["largest"][0] or 0))
    search.capped_buckets += int(s["capped"][0] or 0)
    search.capped_rows += int(s["rest"][0] or 0)

    def right(df):
        extra = [col("_r").alias("_r2")] if "_r" in df.column_names else []
        return df.select(*bucket, col("_h").alias("_h2"), *extra)

    def within(pairs):
        return pairs.with_column("_d", hamming(col("_h"), col("_h2"))).where(col("_d") <= lit(max_distance)).select(
            "_h", "_h2", "_d")

    if not s["capped"][0]:
        found = within(rows.join(right(rows), on=bucket).where(col("_h") < col("_h2")))
    else:
        big = sizes.where(over).select(*bucket)
        small = rows.join(big, on=bucket, how="anti")
        # a window partitioned by bucket only over the capped buckets: few partitions, each large
        ranked = keyed("_first").join(big, on=bucket, how="semi").with_column(
            "_r", row_number().over(daft.Window().partition_by(*bucket).order_by("_first")))
        heads = ranked.where(col("_r") <= lit(cap))
        found = within(small.join(right(small), on=bucket).where(col("_h") < col("_h2"))).concat(
            within(ranked.join(right(heads), on=bucket).where(col("_r2") < col("_r"))))
    out = found.to_pydict()
    return [(min(a, b), max(a, b), d) for a, b, d in zip(out["_h"], out["_h2"], out["_d"], strict=True)]


def near_pairs(reps, cfg: DedupeConfig, distinct: int | None = None) -> tuple[dict[tuple[int, int], int], NearSearch]:
    """Every pair of distinct hashes within ``cfg.max_distance`` that the planned search compares."""
    m = reps.count_rows() if distinct is None else distinct
    plan: BandPlan = plan_bands(m, cfg.max_distance, cfg.recall, cfg.lsh_seed, cfg.method)
    search = NearSearch(plan.method, cfg.max_distance, plan.tables, plan.bits, plan.recall, cfg.bucket_cap,
                        distinct_hashes=m)
    pairs: dict[tuple[int, int], int] = {}
    if m >= 2:
        # tables are searched in groups keying at most KEYED_PER_QUERY rows: one query for a small table, one
        # table per query (bounded memory) for a large one
        per = max(1, KEYED_PER_QUERY // m)
        for i in range(0, plan.tables, per):
            for a, b, d in _group_pairs(reps, list(plan.masks[i:i + per]), cfg.max_distance, cfg.bucket_cap,
                                        search):
                pairs[(a, b)] = d
    search.pairs = len(pairs)
    return pairs, search


def _facts(reps, hashes: list[int]) -> tuple[dict[int, str], dict[int, int]]:
    """Order key and row count of each of ``hashes`` (a join with the distinct hashes)."""
    import daft

    if not hashes:
        return {}, {}
    out = reps.join(daft.from_pydict({"phash": hashes}), on="phash").to_pydict()
    return (dict(zip(out["phash"], out["_first"], strict=True)),
            dict(zip(out["phash"], out["_n"], strict=True)))


def greedy(pairs: dict[tuple[int, int], int], first: dict[int, str]) -> dict[int, tuple[int, int]]:
    """The hashes the keep-the-first choice drops, walking them in keep order: a hash goes when an earlier hash
    within the distance is kept; it maps to the nearest such kept hash (the earlier on a tie) and the distance."""
    neighbours: dict[int, list[tuple[int, int]]] = {}
    for (a, b), d in pairs.items():
        neighbours.setdefault(a, []).append((b, d))
        neighbours.setdefault(b, []).append((a, d))
    dropped: dict[int, tuple[int, int]] = {}
    for h in sorted(neighbours, key=first.__getitem__):
        kept = [(d, first[o], o) for o, d in neighbours[h] if first[o] < first[h] and o not in dropped]
        if kept:
            d, _, o = min(kept)
            dropped[h] = (o, d)
    return dropped


def near_step(rows, cfg: DedupeConfig) -> NearResult:
    reps = distinct_hashes(rows)
    pairs, search = near_pairs(reps, cfg)
    if search.capped_buckets:  # the result is no longer exact: say so where a notebook user sees it
        warnings.warn(f"dedupe: {search.describe()}; raise bucket_cap to compare more", stacklevel=4)
    hashes = sorted({h for p in pairs for h in p})
    first, count = _facts(reps, hashes)
    return NearResult(reps, search, pairs, first, count, greedy(pairs, first))


def kept_rows(rows, near: NearResult):
    """``rows`` without near duplicates: rows without a hash, and the first row of each hash not dropped."""
    import daft
    from daft import col

    keep = near.reps
    if near.dropped:
        keep = keep.join(daft.from_pydict({"phash": list(near.dropped)}), on="phash", how="anti")
    first_rows = rows.join(keep.select(col("_first").alias("_o")), on="_o", how="semi")
    return rows.where(col("phash").is_null()).concat(first_rows)


class DedupeRun(NamedTuple):
    """One dedupe: its input and config, the rows after exact dedupe (with ``_o``), the near step (None without
    ``near``; ``near.search`` says how its pairs were found) and the rows kept. All lazy but the near step, which
    ran: ``dedupe_stats(..., run=)`` counts from it without searching again."""

    source: object
    config: DedupeConfig
    rows: object
    near: NearResult | None
    kept: object


def run(df, cfg: DedupeConfig) -> DedupeRun:
    cfg.check()
    rows = df.with_column("_o", order_key())
    if cfg.exact:
        rows = exact_unique(rows)
    near = near_step(rows, cfg) if cfg.near else None
    kept = kept_rows(rows, near) if near is not None else rows
    return DedupeRun(df, cfg, rows, near, kept)


def dedupe(df, cfg: DedupeConfig | None = None) -> tuple[object, DedupeRun]:
    """``df`` without exact and near duplicates (its columns), and the run that chose them."""
    result = run(df, cfg or DedupeConfig())
    return result.kept.select(*df.column_names), result


# --------------------------------------------------------------------------------------------------- recall


def _exhaustive(reps, sample: list[int], max_distance: int) -> dict[tuple[int, int], int]:
    """Every pair (a, b), a < b, of a hash in ``sample`` and any distinct hash within the distance: the sample
    compared with every hash, batch by batch on the workers (a Daft UDF), only the matches returned."""
    import daft
    from daft import col

    probe = sorted(sample)

    @daft.func.batch(return_dtype=daft.DataType.list(daft.DataType.int64()))
    def matches(hashes):
        import numpy as np
        import pyarrow as pa

        x = np.asarray(hashes.to_arrow(), np.int64).view(np.uint64)
        s = np.asarray(probe, np.int64).view(np.uint64)
        rows, cols = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        step = max(1, (1 << 22) // max(len(s), 1))  # at most 4M distances in memory at once
        for lo in range(0, len(x), step):
            d = np.bitwise_count(x[lo:lo + step, None] ^ s[None, :])
            r, c = np.nonzero((d <= max_distance) & (d > 0))
            rows.append(r + lo)
            cols.append(c)
        r, c = np.concatenate(rows), np.concatenate(cols)
        order = np.argsort(r, kind="stable")
        offsets = np.searchsorted(r[order], np.arange(len(x) + 1))
        values = np.asarray(s[c[order]].view(np.int64))
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, pa.int64()))

    out = (reps.select(col("phash").alias("_h"), matches(col("phash")).alias("_m")).explode("_m")
           .where(col("_m").not_null()).with_column("_d", hamming(col("_h"), col("_m"))).to_pydict())
    return {(min(a, b), max(a, b)): d for a, b, d in zip(out["_h"], out["_m"], out["_d"], strict=True)}


def near_recall(df, max_distance: int = 4, sample: int = 1000, seed: int = 0, **options) -> dict:
    """The share of near-duplicate pairs the planned search finds, against exhaustive comparison on a sample.

    ``sample`` distinct hashes (chosen by a seeded hash of their value) are compared with every distinct hash of
    ``df``; of the pairs within ``max_distance`` that gives, ``recall`` is the share the search (``options``: the
    other ``DedupeConfig`` fields, as ``dedupe`` gets them) also found. Pairs are of distinct hash values (distance
    1 and up): rows sharing a value are always found. Returns ``sample``, ``pairs``, ``found``, ``recall`` (None
    without pairs), ``by_distance`` ({d: {"pairs", "found"}}) and the ``search`` (``NearSearch.to_dict``)."""
    from daft import col

    if sample < 1:
        raise ConfigError(f"near_recall sample={sample} must be at least 1, e.g. 1000")
    cfg = DedupeConfig(exact=False, near=True, max_distance=max_distance, **options).check()
    reps = distinct_hashes(df.with_column("_o", order_key()))
    pairs, search = near_pairs(reps, cfg)
    chosen = (reps.select("phash", col("phash").hash(seed=seed).alias("_s")).sort("_s").limit(sample)
              .to_pydict()["phash"])
    truth = _exhaustive(reps, chosen, max_distance)
    by_distance = {d: {"pairs": 0, "found": 0} for d in range(1, max_distance + 1)}
    for p, d in truth.items():
        by_distance[d]["pairs"] += 1
        by_distance[d]["found"] += p in pairs
    found = sum(v["found"] for v in by_distance.values())
    return {"sample": len(chosen), "pairs": len(truth), "found": found,
            "recall": found / len(truth) if truth else None, "by_distance": by_distance,
            "search": search.to_dict()}
