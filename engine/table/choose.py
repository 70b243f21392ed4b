"""Which rows a curation keeps, defined by plain functions over Python lists (metadata only, no pixels): the
specification that ``queries.py`` and ``dedupe.py`` run as Daft queries and are tested against (``dedupe.py``
keeps ``choose_unique``'s rows exactly while its near search is exact: pigeonhole bands, no bucket over the cap).
"""

from __future__ import annotations

import hashlib
from typing import Any

from ..errors import ConfigError
from .split import SPLIT_NAMES, parse_split

SIZE_BINS = (0, 64, 128, 256, 512, 1024, 4096)
MAX_NEAR_DISTANCE = 16


def size_bin(side: int) -> str:
    for lo, hi in zip(SIZE_BINS, SIZE_BINS[1:], strict=False):
        if side < hi:
            return f"{lo}-{hi - 1}"
    return f">={SIZE_BINS[-1]}"


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
