"""Curation as Daft queries (``engine.table.queries``) keeps exactly the rows its definitions keep (the plain
functions of ``engine.table.curate`` over Python lists), on a table built to hit every edge: repeated content,
error rows without an id or hash, unlabeled rows (a null stratum), clusters of near-duplicate hashes of both signs,
and strata of unequal sizes."""

from __future__ import annotations

import random

import daft
import pytest
from dutycycle.engine.table import curate, queries
from dutycycle.engine.table.choose import choose_sample, choose_unique, split_rows
from dutycycle.engine.table.curate import stats


def _rows(n: int = 400, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows, centers = [], [rng.getrandbits(64) - (1 << 63) for _ in range(n // 8)]
    for i in range(n):
        c = centers[i % len(centers)]
        flips = rng.choice([0, 1, 2, 3, 6, 20])  # within and beyond the distances tested
        h = c + (1 << 63)
        for _ in range(flips):
            h ^= 1 << rng.randrange(64)
        error = "corrupt: cut short" if i % 37 == 3 else None
        rows.append({
            "uri": f"/data/{rng.choice('abc')}/{rng.getrandbits(32):08x}-{i}.jpg",
            "sample_id": None if error else f"{rng.randrange(n * 3 // 4):06x}",  # about 1 in 4 repeats
            "phash": None if error or i % 11 == 0 else h - (1 << 63),
            "error": error,
            "label": rng.choice(["circle", "square", "star", None]) if i % 5 else "circle",
            "split": rng.choice(["train", "val", "test"]),
            "width": rng.choice([32, 100, 300, 5000]), "height": rng.choice([40, 200, 700]),
            "format": rng.choice(["JPEG", "PNG"]),
        })
    return rows


@pytest.fixture(scope="module")
def table():
    rows = _rows()
    return rows, daft.from_pylist(rows)


@pytest.mark.parametrize(("exact", "near", "distance"), [(True, False, 4), (True, True, 4), (False, True, 2),
                                                         (True, True, 0), (True, True, 9)])
def test_dedupe_keeps_the_rows_choose_unique_keeps(table, exact, near, distance):
    rows, df = table
    got = sorted(curate.dedupe(df, exact=exact, near=near, max_distance=distance).to_pydict()["uri"])
    want = sorted(r["uri"] for r in choose_unique(rows, exact=exact, near=near, max_distance=distance))
    assert got == want
    assert len(want) < len(rows)  # the case removes something: a query that kept everything would fail


@pytest.mark.parametrize(("n", "fraction", "by", "seed"), [(50, None, "label", 0), (None, 0.3, "label", 7),
                                                           (33, None, None, 1), (None, 0.5, "split", 2)])
def test_sample_keeps_the_rows_choose_sample_keeps(table, n, fraction, by, seed):
    rows, df = table
    got = sorted(queries.sample(df, n, fraction, by, seed).to_pydict()["uri"])
    assert got == sorted(choose_sample(rows, n, fraction, by, seed))


@pytest.mark.parametrize(("fractions", "by", "seed"), [("0.8,0.1,0.1", "label", 0), ("0.5,0.25,0.25", None, 3),
                                                       ("0.34,0.33,0.33", "format", 5)])
def test_resplit_assigns_the_splits_split_rows_assigns(table, fractions, by, seed):
    rows, df = table
    columns = list(rows[0])
    out = queries.resplit(df, fractions, seed, by, columns).to_pydict()
    assert sorted(out["uri"]) == sorted(r["uri"] for r in rows)  # every row, once
    assert dict(zip(out["uri"], out["split"], strict=True)) == split_rows(rows, fractions, seed, by)


def test_stats_counts_as_the_row_loop_would(table):
    from collections import Counter

    from dutycycle.engine.imageinfo import error_reason
    from dutycycle.engine.table.choose import size_bin

    rows, df = table
    s = stats(df)
    readable = [r for r in rows if r["error"] is None]
    assert s["rows"] == len(rows) and s["readable"] == len(readable)
    assert s["errors"] == dict(Counter(error_reason(r["error"]) for r in rows if r["error"]))
    assert s["classes"] == dict(sorted(Counter(str(r["label"]) for r in readable).items()))
    assert s["size_histogram"] == dict(Counter(size_bin(max(r["width"], r["height"])) for r in readable)) | {}
    assert sum(s["size_histogram"].values()) == len(readable)


@pytest.mark.parametrize("bucket_rows", [1, 10_000])
def test_sample_and_resplit_rank_only_inside_buckets(table, monkeypatch, bucket_rows):
    """The bucketed ranking keeps the definitions' rows with one-row buckets (every cut between two buckets:
    ``BUCKET_ROWS=1`` gives 256 buckets for about 100 rows per stratum) and with 16 crowded buckets (a cut inside
    a bucket of many rows), at the edges of a sample (none, all, more than there are), and no query plan holds a
    window over a whole table (Daft's ``WindowOrderByOnly``) or a partition-less window."""
    import contextlib
    import io

    rows, df = table
    monkeypatch.setattr(queries, "BUCKET_ROWS", bucket_rows)
    assert queries.bucket_digits({"a": 100, "b": 90}) == (2 if bucket_rows == 1 else 1)
    for n, fraction, by, seed in [(0, None, "label", 0), (len(rows), None, None, 4), (10**6, None, "label", 1),
                                  (None, 1.0, "split", 2), (None, 0.37, None, 9), (61, None, "label", 3)]:
        got = queries.sample(df, n, fraction, by, seed)
        assert sorted(got.to_pydict()["uri"]) == sorted(choose_sample(rows, n, fraction, by, seed)), (n, by)
    for fractions, by, seed in [("0.8,0.1,0.1", "label", 0), ("0.5,0.25,0.25", None, 3), ("0.2,0.2,0.6", "label", 8)]:
        out = queries.resplit(df, fractions, seed, by, list(rows[0])).to_pydict()
        assert sorted(out["uri"]) == sorted(r["uri"] for r in rows)
        assert dict(zip(out["uri"], out["split"], strict=True)) == split_rows(rows, fractions, seed, by)
    for query in (queries.sample(df, 50, None, None, 0), queries.resplit(df, "0.8,0.1,0.1", 0, None, list(rows[0]))):
        plan = io.StringIO()
        with contextlib.redirect_stdout(plan):
            query.explain(show_all=True)
        assert "Window" in plan.getvalue()  # the bucket ranking is there ...
        assert "WindowOrderByOnly" not in plan.getvalue() and "partition_by=[]" not in plan.getvalue()  # ... never global


def test_bucket_digits_bound_what_reaches_the_driver():
    """Buckets of about ``BUCKET_ROWS`` rows, and never more than ``MAX_BUCKETS`` (stratum, bucket) counts."""
    assert queries.bucket_digits({}) == 1 and queries.bucket_digits({None: 1_000}) == 1
    assert queries.bucket_digits({None: 1_000_000}) == 3  # 244 rows a bucket
    assert queries.bucket_digits({None: 10**9}) == 4  # 16**5 buckets would pass MAX_BUCKETS
    many = {f"s{i}": 10**8 for i in range(1_000)}
    assert 1_000 * 16 ** queries.bucket_digits(many) <= max(queries.MAX_BUCKETS, 16_000)
