"""How near-duplicate search finds its candidate pairs: which bits of the 64-bit perceptual hash two hashes must
share to be compared. Plain functions (no Daft): the plan is chosen from the number of distinct hashes alone.

A table of the plan is a bit mask; two hashes are compared when ``a & mask == b & mask`` (they fall in the same
bucket of that table) in at least one table. Two plans:

- **pigeonhole** (exact): the 64 bits cut into ``max_distance + 1`` disjoint bands. Two hashes within the distance
  differ in at most ``max_distance`` bits, so at least one band holds none of them: every pair within the distance
  is compared. The bands are short (13 bits at distance 4), so with uniform hashes a band's buckets hold about
  ``m / 2**13`` hashes each and the candidate pairs grow as ``m**2``: exact is used while that count is small.
- **lsh** (locality-sensitive hashing, bit sampling): ``tables`` masks of ``bits`` positions each, drawn at random
  (seeded). A pair at Hamming distance ``k`` agrees on all of a random ``bits``-subset with probability
  ``C(64 - k, bits) / C(64, bits)``, so ``tables`` independent draws compare it with probability
  ``1 - (1 - p)**tables``: tables are added until that reaches the stated recall at ``k = max_distance`` (closer
  pairs are found more often). Bits grow as ``log2(m)``, so each bucket holds about one hash and the candidate
  pairs grow about linearly in ``m``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ..errors import ConfigError

HASH_BITS = 64
DEFAULT_RECALL = 0.99  # the probability that the LSH plan compares a pair at exactly max_distance
DEFAULT_BUCKET_CAP = 256  # hashes of one bucket compared with each other in full (the rest with those: dedupe.py)
# Exact search while its expected comparisons stay under this many per distinct hash (uniform hashes): at
# distance 4 that is up to about 87,000 distinct hashes; beyond it the pigeonhole cost grows as m**2. Below
# EXACT_FLOOR comparisons (a second or so) exact search is used whatever the distance.
EXACT_BUDGET_PER_HASH = 32
EXACT_FLOOR = 2_000_000
# A plan whose work (keyed rows plus comparisons) passes this many per distinct hash, and 10 million in all, is
# refused rather than run for hours: bit sampling needs thousands of tables near distance 16 at a million hashes.
MAX_WORK_PER_HASH = 1024
MIN_REFUSED_WORK = 10_000_000


@dataclass(frozen=True)
class BandPlan:
    """The tables (bit masks) of a near-duplicate search and what they promise."""

    method: str  # "pigeonhole" (every pair within max_distance compared) or "lsh"
    max_distance: int
    masks: tuple[int, ...]  # one per table; a mask's set bits are the positions a bucket key keeps
    recall: float  # the probability a pair at max_distance is compared (1.0 for pigeonhole)
    expected_candidates: float  # pairs compared if hashes were uniform (without a bucket cap)
    distinct: int  # the distinct hashes it was planned for

    @property
    def work(self) -> float:
        """Rows keyed (one per hash and table) plus pairs compared, with uniform hashes."""
        return self.tables * self.distinct + self.expected_candidates

    @property
    def tables(self) -> int:
        return len(self.masks)

    @property
    def bits(self) -> int:
        """Bits per key (the narrowest table's)."""
        return min(m.bit_count() for m in self.masks)


def signed(mask: int) -> int:
    """A 64-bit pattern as the signed int64 the table stores hashes in (so a mask can be a Daft literal)."""
    return mask - (1 << HASH_BITS) if mask >= 1 << (HASH_BITS - 1) else mask


def pigeonhole_masks(max_distance: int) -> tuple[int, ...]:
    """``max_distance + 1`` disjoint bands covering the 64 bits (their lengths differ by at most one)."""
    k = max_distance + 1
    edges = [round(i * HASH_BITS / k) for i in range(k + 1)]
    return tuple(((1 << (hi - lo)) - 1) << lo for lo, hi in zip(edges, edges[1:], strict=False))


def collision_probability(distance: int, bits: int) -> float:
    """The probability that two hashes ``distance`` bits apart agree on ``bits`` positions drawn at random."""
    if bits > HASH_BITS - distance:
        return 0.0
    return math.comb(HASH_BITS - distance, bits) / math.comb(HASH_BITS, bits)


def tables_for(recall: float, p: float) -> int:
    """Independent tables, each comparing a pair with probability ``p``, needed to compare it with ``recall``."""
    if p >= 1.0:
        return 1
    return max(1, math.ceil(math.log1p(-recall) / math.log1p(-p)))


def _expected_pairs(distinct: int, masks) -> float:
    """Pairs sharing a bucket in some table if the hashes were uniform (pairs counted once per table)."""
    return sum(distinct * (distinct - 1) / 2 / 2 ** m.bit_count() for m in masks)


def lsh_shape(distinct: int, max_distance: int, recall: float) -> tuple[int, int]:
    """(bits, tables) of the cheapest LSH plan reaching ``recall`` at ``max_distance``: the cost counted is the
    rows the search keys (tables x distinct) plus the pairs it compares (uniform hashes)."""
    best = None
    for bits in range(1, HASH_BITS - max_distance + 1):
        tables = tables_for(recall, collision_probability(max_distance, bits))
        cost = tables * distinct + tables * distinct * (distinct - 1) / 2 / 2**bits
        if best is None or cost < best[0]:
            best = (cost, bits, tables)
    assert best is not None
    return best[1], best[2]


def lsh_masks(bits: int, tables: int, seed: int) -> tuple[int, ...]:
    """``tables`` masks of ``bits`` positions each, drawn without replacement per table (seeded: reproducible)."""
    rng = random.Random(f"dutycycle-lsh:{seed}")
    return tuple(sum(1 << p for p in rng.sample(range(HASH_BITS), bits)) for _ in range(tables))


def plan_bands(distinct: int, max_distance: int, recall: float = DEFAULT_RECALL, seed: int = 0,
               method: str = "auto") -> BandPlan:
    """The search for ``distinct`` hashes: ``method`` "pigeonhole", "lsh", or "auto" (pigeonhole while its
    expected comparisons stay within ``EXACT_BUDGET_PER_HASH`` per hash or ``EXACT_FLOOR``, or where it costs
    no more than LSH).
    A plan whose work passes ``MAX_WORK_PER_HASH`` per hash (and ``MIN_REFUSED_WORK``) is refused."""
    exact = BandPlan("pigeonhole", max_distance, pigeonhole_masks(max_distance), 1.0,
                     _expected_pairs(distinct, pigeonhole_masks(max_distance)), distinct)
    plan = exact
    if method != "pigeonhole":
        bits, tables = lsh_shape(max(distinct, 2), max_distance, recall)
        masks = lsh_masks(bits, tables, seed)
        p = collision_probability(max_distance, bits)
        lsh = BandPlan("lsh", max_distance, masks, 1 - (1 - p) ** tables, _expected_pairs(distinct, masks), distinct)
        cheap = (exact.expected_candidates <= max(EXACT_BUDGET_PER_HASH * distinct, EXACT_FLOOR)
                 or exact.work <= lsh.work)
        plan = exact if method == "auto" and cheap else lsh
    if plan.work > max(MAX_WORK_PER_HASH * distinct, MIN_REFUSED_WORK):
        if plan.method == "pigeonhole":
            what, fix = "pigeonhole bands, every pair", "use method 'auto' (LSH tables beyond a small table)"
        else:
            what = f"LSH: {plan.tables} tables of {plan.bits} bits for recall {recall}"
            fix = f"lower max_distance (below {max_distance}) or the recall"
        raise ConfigError(
            f"near dedupe at max_distance {max_distance} over {distinct} distinct hashes needs about "
            f"{plan.work:.3g} rows keyed and pairs compared ({what}); {fix}, or dedupe a filtered subset")
    return plan
