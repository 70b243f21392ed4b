"""What a dedupe removed, for a person choosing its settings: rows removed as exact duplicates (same bytes) and as
near duplicates, per Hamming distance of the perceptual hash, and a few example pairs (kept, removed) per distance
(``engine/dupes.py`` draws them as a sheet, so the distance can be chosen by looking).

The counts come from the same queries that ``dedupe`` runs (``dedupe.py``): per-group aggregates and the
near-duplicate pairs, nothing per row.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from . import dedupe as dd
from .dedupe import DedupeConfig, NearSearch, uri_of

EXAMPLES = 3  # example pairs per distance (and of exact copies)


@dataclass
class DedupeStats:
    rows: int  # rows before dedupe
    kept: int
    exact_removed: int  # rows whose bytes an earlier row has
    near_removed: int  # rows within max_distance of an earlier kept row's perceptual hash
    near_by_distance: dict[int, int]  # distance -> near removals (0: the same hash, other bytes)
    examples: list[dict] = field(default_factory=list)  # {"distance": int | None (exact), "kept": uri, "removed": uri}
    search: NearSearch | None = None
    config: DedupeConfig = field(default_factory=DedupeConfig)

    def __str__(self) -> str:
        return format_dedupe(self)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["search"] = self.search.to_dict() if self.search else None
        out["near_by_distance"] = {str(k): v for k, v in self.near_by_distance.items()}
        return out


def _exact_examples(ordered, limit: int) -> list[dict]:
    """The first ``limit`` rows (in keep order) that exact dedupe removes, with the row kept in their place."""
    from daft import col

    firsts = dd.exact_firsts(ordered)
    out = (ordered.join(firsts, on="sample_id").where(col("_o") != col("_first")).select("_o", "_first")
           .sort("_o").limit(limit).to_pydict())
    return [{"distance": None, "kept": uri_of(k), "removed": uri_of(r)} for r, k in zip(out["_o"], out["_first"],
                                                                                            strict=True)]


def _same_hash_examples(rows, near: dd.NearResult, limit: int) -> list[dict]:
    """The first ``limit`` removed rows whose hash value an earlier kept row has (distance 0)."""
    import daft
    from daft import col

    reps = near.reps
    if near.dropped:
        reps = reps.join(daft.from_pydict({"phash": list(near.dropped)}), on="phash", how="anti")
    out = (rows.join(reps.select("phash", "_first"), on="phash").where(col("_o") != col("_first"))
           .select("_o", "_first").sort("_o").limit(limit).to_pydict())
    return [{"distance": 0, "kept": uri_of(k), "removed": uri_of(r)} for r, k in zip(out["_o"], out["_first"],
                                                                                         strict=True)]


def dedupe_stats(df, cfg: DedupeConfig | None = None, examples: int = EXAMPLES, run=None) -> DedupeStats:
    """Run the dedupe of ``cfg`` on ``df`` and count what it removes, exact and near (per distance). ``run``:
    ``dedupe.run(df, cfg)`` already done (a deduped view's ``dedupe_run``), so the search is not repeated."""
    from daft import col

    cfg = (cfg or DedupeConfig()).check()
    rows = df.count_rows()
    ordered = df.with_column("_o", dd.order_key())
    run = run if run is not None else dd.run(df, cfg)
    unique, near = run.rows, run.near
    after_exact = unique.count_rows() if cfg.exact else rows
    shown = _exact_examples(ordered, examples) if cfg.exact and examples else []
    by_distance = dict.fromkeys(range(cfg.max_distance + 1), 0) if cfg.near else {}
    if near is not None:
        s = near.reps.agg(col("_n").sum().alias("rows"), col("_n").count().alias("values")).to_pydict()
        hashed, values = int(s["rows"][0] or 0), int(s["values"][0] or 0)
        # every row after the first of its value goes: at distance 0 if that value is kept, else with the value
        by_distance[0] = hashed - values - sum(near.count[h] - 1 for h in near.dropped)
        for h, (_, d) in near.dropped.items():
            by_distance[d] += near.count[h]
        if examples:
            shown += _same_hash_examples(unique, near, examples)
            for d in range(1, cfg.max_distance + 1):
                at = sorted((near.first[h], near.first[o]) for h, (o, dist) in near.dropped.items() if dist == d)
                shown += [{"distance": d, "kept": uri_of(k), "removed": uri_of(r)} for r, k in at[:examples]]
    near_removed = sum(by_distance.values())
    return DedupeStats(rows=rows, kept=after_exact - near_removed, exact_removed=rows - after_exact,
                       near_removed=near_removed, near_by_distance=by_distance, examples=shown,
                       search=near.search if near else None, config=cfg)


def format_dedupe(s: DedupeStats) -> str:
    """A few human-readable lines for the terminal."""
    lines = [f"rows: {s.rows}, kept {s.kept}: removed {s.exact_removed} exact duplicates (same bytes) and "
             f"{s.near_removed} near duplicates (perceptual hash within {s.config.max_distance} bits)"]
    if s.near_by_distance:
        per = ", ".join(f"{d}: {n}" for d, n in s.near_by_distance.items())
        lines.append(f"near duplicates removed by distance: {per} (0: the same hash, other bytes)")
    if s.search is not None:
        lines.append(s.search.describe())
    for e in s.examples:
        what = "exact" if e["distance"] is None else f"distance {e['distance']}"
        lines.append(f"  {what}: kept {e['kept']}  removed {e['removed']}")
    return "\n".join(lines)
