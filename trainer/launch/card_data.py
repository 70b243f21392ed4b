"""The data section of a run's model card (card.py): what the model was trained on, read back from the data
itself after the run, not remembered by the workers.

    source          "cache", "raw" or "synthetic" (``data.source``)
    table           the metadata table's URI and version: the version the cache was materialized from (its
                    manifest's ``options.table_version``); for a raw run, the newest version committed before the
                    run's first attempt started (the one its loader read)
    curation        how the rows were chosen, nearest first: the cache's ``where`` (materialize's filter), then
                    each table's lineage up the chain of curated tables (``filter``, ``operations``: where,
                    dedupe, sample, resplit, each with its settings; the parent and its version), down to the
                    ingested table and how its splits were assigned (hash fractions, split folders, a resplit)
    splits          samples per split the run could read, and ``classes``: per split, samples per class
    cache           URI, fingerprint, transform spec, per-channel statistics, rows left out (and why)

Class counts come from the rows themselves: a cache's ``label`` and ``split`` columns (memory-mapped locally,
the small columns alone by range on an object store: never the pixels), a raw run's selected table rows (the
raw loader's own selection), synthetic data's label rule. A source that cannot be read any more (moved,
vacuumed) leaves what the run recorded, with a note saying what could not be read; the card is still written.
"""

from __future__ import annotations

import numpy as np
from dutycycle.engine.cache.materialize import plan_rows
from dutycycle.engine.cache.reader import CacheReader
from dutycycle.engine.cache.shards import ReadConfig
from dutycycle.engine.errors import DutycycleError
from dutycycle.engine.table import format as table_format
from dutycycle.engine.transform import TransformSpec

MAX_LINEAGE = 20  # curated tables followed up the chain at most (a chain longer than this is cut, and says so)


def data_facts(cfg, summary: dict, started: float | None) -> dict:
    """The card's ``data`` section for the run of ``cfg`` whose ``summary`` is given; ``started``: when the
    run's first attempt began (a raw run's table version), None when unknown."""
    recorded = summary.get("data") or {}
    lineage = recorded.get("lineage") or {}
    notes: list[str] = []
    facts: dict = {"source": cfg.data.source, "table": None, "curation": [], "splits": {}, "classes": {},
                   "class_names": list(recorded.get("classes") or []), "cache": None,
                   "fingerprint": recorded.get("fingerprint") or summary.get("data_fingerprint"),
                   "transform": recorded.get("spec"), "normalize": recorded.get("normalize"), "notes": notes}
    if cfg.data.source == "synthetic":
        facts.update(_synthetic(recorded, lineage.get("synthetic") or {}))
        return facts
    if cfg.data.source == "cache":
        cache_uri = lineage.get("cache") or cfg.data.cache
        table_uri = lineage.get("table") or None
        version = (lineage.get("options") or {}).get("table_version")
        try:
            reader = CacheReader(cache_uri, verify=False, read=ReadConfig(remote="range"))
            m = reader.manifest
            facts["cache"] = {"uri": reader.uri, "fingerprint": m.fingerprint, "transform": m.spec,
                              "shape": list(m.shape), "layout": m.layout, "num_samples": m.num_samples,
                              "shards": len(m.shards), "channel_stats": m.channel_stats,
                              "left_out": dict(m.skipped), "materialized_at": m.options.get("created_at")}
            facts["transform"] = m.spec
            where = m.options.get("where") or ""
            facts["curation"].append({"step": "materialize", "cache": reader.uri, "where": where or None})
            facts["splits"] = {k: int(v) for k, v in sorted(m.split_counts.items())}
            facts["classes"] = _cache_classes(reader, facts["class_names"])
            table_uri, version = m.source or table_uri, m.options.get("table_version", version)
        except (DutycycleError, OSError) as e:
            notes.append(f"the cache {cache_uri!r} could not be read for its class counts and curation ({e})")
            facts["cache"] = {"uri": cache_uri, "fingerprint": facts["fingerprint"], "transform": facts["transform"]}
            facts["splits"] = _recorded_splits(recorded)
    else:  # raw: the table, read at training time
        table_uri = cfg.data.table
        version = _version_at(table_uri, started, notes)
        facts["splits"], facts["classes"] = _raw_counts(cfg, table_uri, version, facts["class_names"], notes)
    if table_uri:
        facts["table"] = {"uri": table_uri, "version": version}
        facts["curation"].extend(table_lineage(table_uri, version, notes))
    return facts


# ------------------------------------------------------------------------------------------------- counts


UNLABELED = "(no class)"  # rows whose label is not one of the classes (a cache's -1: unlabeled)


def _cache_classes(reader: CacheReader, names: list[str]) -> dict[str, dict[str, int]]:
    """Per split, samples per class name, from each shard's ``label`` and ``split`` columns."""
    counts: dict[str, np.ndarray] = {}
    for i in range(reader.num_shards):
        view = reader.view(i)
        split = view.split.dictionary_encode()  # a few distinct values
        _add(counts, split.dictionary.to_pylist(), split.indices.to_numpy(zero_copy_only=False), view.labels,
             len(names))
    return {split: _named(c, names) for split, c in sorted(counts.items())}


def _add(counts: dict[str, np.ndarray], splits: list[str], codes: np.ndarray, labels: np.ndarray, k: int) -> None:
    """Add to ``counts`` (split -> samples per label, ``k + 1`` slots: the last for labels outside the classes)
    the rows whose split is ``splits[codes]`` and label ``labels``."""
    labels = np.where((labels >= 0) & (labels < k), labels, k)
    for j, split in enumerate(splits):
        counts[split] = counts.get(split, 0) + np.bincount(labels[codes == j], minlength=k + 1)


def _named(counts: np.ndarray, names: list[str]) -> dict[str, int]:
    """Samples per label slot as class name -> samples, in class order, classes without samples left out."""
    out = {names[j]: int(c) for j, c in enumerate(counts[:len(names)]) if c}
    if counts[len(names):].sum():
        out[UNLABELED] = int(counts[len(names):].sum())
    return out


def _raw_counts(cfg, table_uri: str, version: int | None, names: list[str], notes: list[str]):
    """A raw run's splits and classes: the rows its loader selects (materialize's selection: readable,
    inside the table's roots, one per content hash)."""
    try:
        manifest = table_format.read_manifest(table_uri, version)
        plan = plan_rows(table_uri, TransformSpec(size=cfg.data.size), manifest=manifest)
    except (DutycycleError, OSError) as e:
        notes.append(f"the table {table_uri!r} could not be read for its class counts ({e})")
        return {}, {}
    names = names or list(plan.classes)
    splits, codes = np.unique(np.asarray(plan.splits, dtype=object).astype(str), return_inverse=True)
    counts: dict[str, np.ndarray] = {}
    _add(counts, splits.tolist(), codes, np.asarray(plan.labels, np.int64), len(names))
    return ({k: int(c.sum()) for k, c in sorted(counts.items())},
            {k: _named(c, names) for k, c in sorted(counts.items())})


def _synthetic(recorded: dict, synthetic: dict) -> dict:
    """Synthetic shapes: image ``i`` has label ``i mod classes`` (engine.synth.draw_shapes); the training split
    is the first ``train_samples`` images, validation the next ``val_samples``."""
    names = list(recorded.get("classes") or [])
    k = len(names)
    splits, classes, start = {}, {}, 0
    for split in ("train", "val"):
        n = int(recorded.get(f"{split}_samples") or 0)
        splits[split] = n
        classes[split] = _named(np.bincount(np.arange(start, start + n) % k, minlength=k + 1), names)
        start += n
    return {"splits": splits, "classes": classes,
            "curation": [{"step": "synthesize", "samples": synthetic.get("samples"), "size": synthetic.get("size"),
                          "seed": synthetic.get("seed")}]}


def _recorded_splits(recorded: dict) -> dict[str, int]:
    return {s: int(recorded[f"{s}_samples"]) for s in ("train", "val") if recorded.get(f"{s}_samples") is not None}


# ------------------------------------------------------------------------------------------------ lineage


def _version_at(table_uri: str, started: float | None, notes: list[str]) -> int | None:
    """The newest version of the table committed before ``started`` (the one a raw run's loader read); the
    newest one when ``started`` is unknown."""
    try:
        versions = table_format.committed_versions(table_uri)
        if not versions:
            return None
        if started is None:
            return versions[-1]
        for v in reversed(versions):
            if table_format.read_manifest(table_uri, v).created_at <= started:
                return v
        return versions[0]
    except (DutycycleError, OSError) as e:
        notes.append(f"the table {table_uri!r} could not be read for its version ({e})")
        return None


def table_lineage(table_uri: str, version: int | None, notes: list[str]) -> list[dict]:
    """The curation that made ``table_uri`` at ``version``, table by table up the chain of curated tables: each
    its ``filter`` and ``operations`` (a curated table) or its ingest (source, how splits were assigned)."""
    out: list[dict] = []
    uri, v = table_uri, version
    while uri and len(out) < MAX_LINEAGE:
        try:
            m = table_format.read_manifest(uri, v)
        except (DutycycleError, OSError) as e:
            notes.append(f"the table {uri!r} (version {v}) could not be read for its lineage ({e})")
            return out
        parent = (m.lineage or {}).get("parent")
        options = m.options or {}
        if parent:
            out.append({"step": "curate", "table": uri, "version": m.version, "rows": m.num_rows,
                        "filter": m.lineage.get("filter") or None, "operations": list(m.lineage.get("operations") or []),
                        "parent": parent, "parent_version": m.lineage.get("parent_version"),
                        "split_assignment": options.get("split_assignment")})
            uri, v = parent, m.lineage.get("parent_version")
            continue
        # as catalog records it; a table ingested before it was recorded was split by hash with its fractions
        assignment = options.get("split_assignment") or (
            {"by": "hash", "fractions": options["split"]} if options.get("split") else None)
        out.append({"step": "ingest", "table": uri, "version": m.version, "rows": m.num_rows, "source": m.source,
                    "split_assignment": assignment, "phash": options.get("phash"), "labels": options.get("labels")})
        return out
    if uri:
        notes.append(f"the lineage goes on beyond {MAX_LINEAGE} curated tables (next: {uri!r}); cut there")
    return out
