"""Near dedupe at scale: the search plan (exact pigeonhole bands while cheap, LSH tables sized for a recall beyond),
the bucket cap and its report, and the recall measured against exhaustive comparison, on Daft queries over
generated hashes (the rows kept while the search is exact are checked against ``choose_unique`` in
test_curate_queries.py)."""

from __future__ import annotations

import random

import daft
import pytest
from dutycycle.engine.errors import ConfigError
from dutycycle.engine.table import bands
from dutycycle.engine.table.choose import choose_unique
from dutycycle.engine.table.dedupe import DedupeConfig, dedupe, near_recall


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def _ham(a: int, b: int) -> int:
    return ((a ^ b) & ((1 << 64) - 1)).bit_count()


def _rows(n_random: int, clusters: list[tuple[int, int]], seed: int) -> list[dict]:
    """``n_random`` uniform hashes, plus per (size, radius) in ``clusters`` a centre with ``size`` distinct
    variants each at most ``radius`` bits from it; URIs shuffled so keep order and generation order differ."""
    rng = random.Random(seed)
    hashes = [rng.getrandbits(64) for _ in range(n_random)]
    for size, radius in clusters:
        centre = rng.getrandbits(64)
        seen = {centre}
        hashes.append(centre)
        while len(seen) < size:
            h = centre
            for p in rng.sample(range(64), rng.randint(1, radius)):
                h ^= 1 << p
            if h not in seen:
                seen.add(h)
                hashes.append(h)
    for i in range(n_random // 10):  # near copies of random hashes at 1..4 bits
        h = hashes[i]
        for p in rng.sample(range(64), 1 + i % 4):
            h ^= 1 << p
        hashes.append(h)
    names = rng.sample(range(10 * len(hashes)), len(hashes))
    return [{"uri": f"/d/{names[i]:08d}.png", "sample_id": f"id{i}", "phash": _signed(h), "error": None}
            for i, h in enumerate(hashes)]


def _uris(df) -> set[str]:
    return set(df.to_pydict()["uri"])


def test_plans_exact_while_cheap_lsh_linear_beyond_and_refuse_the_hopeless():
    masks = bands.pigeonhole_masks(4)
    assert len(masks) == 5 and sum(masks) == (1 << 64) - 1 and all(a & b == 0 for a in masks for b in masks if a != b)
    small, large = bands.plan_bands(20_000, 4), bands.plan_bands(200_000, 4)
    assert (small.method, small.recall) == ("pigeonhole", 1.0) and large.method == "lsh" and large.recall >= 0.99
    # LSH work per distinct hash stays flat as the table grows (pigeonhole's would grow as m: 3m/8192 pairs)
    per_hash = [bands.plan_bands(m, 4).work / m for m in (10**5, 10**6, 10**7)]
    assert max(per_hash) < 40 and bands._expected_pairs(10**7, masks) / 10**7 > 3000
    with pytest.raises(ConfigError, match="use method 'auto'"):  # exact at 10M hashes: 3.7e10 pairs, refused
        bands.plan_bands(10**7, 4, method="pigeonhole")
    # the recall a plan states is the collision probability of a random bit subset: checked by drawing subsets
    p = bands.collision_probability(4, 18)
    draws = bands.lsh_masks(18, 4000, seed=1)
    hit = sum(1 for m in draws if m & 0b1111 == 0) / len(draws)  # avoids 4 given differing bits
    assert abs(hit - p) < 4 * (p * (1 - p) / len(draws)) ** 0.5  # 4 sigma of a binomial proportion
    with pytest.raises(ConfigError, match="max_distance 16 over 1000000 distinct hashes"):
        bands.plan_bands(1_000_000, 16)
    with pytest.raises(ConfigError, match="recall"):
        DedupeConfig(recall=1.0).check()


def test_lsh_dedupe_is_sound_and_its_recall_is_measured_against_exhaustive_comparison():
    rows = _rows(1500, [(6, 2)], seed=3)
    df = daft.from_pylist(rows)
    cfg = DedupeConfig(exact=False, method="lsh", recall=0.8, lsh_seed=5)
    kept_df, run = dedupe(df, cfg)
    kept = _uris(kept_df)
    search = run.near.search
    assert search.method == "lsh" and search.tables >= 2 and 0.8 <= search.recall < 1 and not search.exact
    # sound: a row goes only when an earlier kept row lies within the distance
    order = sorted(rows, key=lambda r: r["uri"])
    kept_hashes = []
    for r in order:
        if r["uri"] in kept:
            kept_hashes.append(r["phash"])
        else:
            assert any(_ham(r["phash"], k) <= 4 for k in kept_hashes), r
    # each row exhaustive search removes has a kept neighbour the plan compares with probability >= 0.8: it
    # removes at least 0.8 of them, less 4 standard deviations of a binomial count (seeded: no flakes)
    n = len(rows) - len({r["uri"] for r in choose_unique(rows, exact=False, near=True, max_distance=4)})
    assert n > 150 and len(rows) - len(kept) >= 0.8 * n - 4 * (n * 0.8 * 0.2) ** 0.5

    # recall over every distinct hash (sample larger than the table): the exhaustive pairs by brute force
    r = near_recall(df, 4, sample=10_000, method="lsh", recall=0.8, lsh_seed=5)
    hashes = sorted({x["phash"] for x in rows})
    truth = [(a, b) for i, a in enumerate(hashes) for b in hashes[i + 1:] if _ham(a, b) <= 4]
    assert r["sample"] == len(hashes) and r["pairs"] == len(truth) == sum(v["pairs"] for v in r["by_distance"].values())
    assert r["found"] == search.pairs and 0.8 <= r["recall"] < 1  # a pair at distance 4 is the hardest: >= 0.8
    assert r["by_distance"][1]["found"] / r["by_distance"][1]["pairs"] > r["by_distance"][4]["found"] / r[
        "by_distance"][4]["pairs"]
    # pigeonhole bands compare every pair: recall 1 on a seeded sample of 500 hashes
    r = near_recall(df, 4, sample=500, seed=1, method="pigeonhole")
    assert r["sample"] == 500 and r["pairs"] > 20 and r["recall"] == 1.0 and r["search"]["exact"]


def test_bucket_cap_bounds_comparisons_and_is_reported():
    # a cluster of 60 distinct hashes within 2 bits of a centre (pairwise <= 4): every bucket holding it is
    # over a cap of 8, yet each member is still compared with the cluster's first rows, so the result is exact
    rows = _rows(400, [(60, 2)], seed=4)
    df = daft.from_pylist(rows)
    want = {r["uri"] for r in choose_unique(rows, exact=True, near=True, max_distance=4)}
    full = dedupe(df, DedupeConfig(method="pigeonhole"))[1].near.search
    with pytest.warns(UserWarning, match="over the cap of 8"):
        kept_df, run = dedupe(df, DedupeConfig(method="pigeonhole", bucket_cap=8))
    capped = run.near.search
    assert full.capped_buckets == 0 and full.exact and full.largest_bucket >= 30
    assert capped.capped_buckets >= 1 and capped.largest_bucket == full.largest_bucket and not capped.exact
    assert capped.capped_rows >= full.largest_bucket - 8 and capped.compared_pairs < full.compared_pairs
    assert "over the cap of 8" in capped.describe()
    assert _uris(kept_df) == want
    r = near_recall(df, 4, sample=10_000, method="pigeonhole", bucket_cap=8)
    assert r["recall"] < 1 and r["search"]["capped_buckets"] == capped.capped_buckets  # pairs past the cap missed
    none = near_recall(df.where(daft.col("phash") > 0).where(daft.col("phash") < 0), 4, sample=5)  # no hashes
    assert (none["sample"], none["pairs"], none["recall"]) == (0, 0, None)
