"""The samples of a split to evaluate on, preprocessed as the run's training batches were, in a fixed order.

Where a split comes from, in order:

- ``table`` given: the rows of that metadata table whose ``split`` is the split, decoded here (below);
- a run trained on a cache that holds the split: the cache itself, read in cache order (sorted by sample id)
  through the trainer's own validation path (``CacheLoader``, unshuffled, no random augmentation);
- a cache that does not hold it (a curation that kept the test split out of the training cache, materialized
  with ``where = "split != 'test'"``): the rows of the table the cache was made from (its manifest's ``source``),
  decoded with the cache's recorded transform (its manifest's spec, ``engine.transform.decode_and_transform``
  through the raw loader's ``decode_one``): what ``materialize`` would have written, without writing a cache;
- a raw-path run (``data.source = "raw"``): the rows of ``data.table``, decoded the same way;
- a synthetic run: its shapes drawn again (the same seed and indices as the run's).

Rows are chosen as ``materialize`` chooses them (``plan_rows``: good rows inside the table's roots and the cache's
extra roots, one per sample id, in sample-id order). A row that does not decode is counted by reason and left out,
not fatal (``skipped``, a few ``examples``); so are unlabeled rows and rows of a class the run never knew. Labels
are matched to the run's classes by name, so a table whose class list grew since the run still evaluates.

Every path yields ``(x, y, sample_ids)``: float ``[B, C, H, W]`` normalized as the run's batches were
(``summary.json["data"]["normalize"]``: ``(x / 255 - mean) / std`` by the loader's own ``to_tensor``, or
``x / 255`` when the run did not normalize), int64 labels and the samples' ids.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from dutycycle.engine.cache import format as cf
from dutycycle.engine.cache.materialize import plan_rows
from dutycycle.engine.errors import ConfigError, DecodeError, SourceError
from dutycycle.engine.roots import RootCheck
from dutycycle.engine.runner import configure
from dutycycle.engine.synth import draw_shapes
from dutycycle.engine.table import format as tf
from dutycycle.engine.transform import TransformSpec
from dutycycle.loader import AugmentConfig, CacheLoader
from dutycycle.loader.augment import to_tensor
from dutycycle.loader.decode import decode_one
from dutycycle.trainer.step.data import LoaderSource

SPLIT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")  # a file name too: evaluation/<split>.json
MAX_EXAMPLES = 5  # skipped rows named in the evaluation, one message each


@dataclass
class Split:
    """A split opened for evaluation: ``batches()`` yields ``(x, y, sample_ids)`` in the same order every call;
    ``rows``: the split's rows (before any is left out); ``source`` is ``"cache"``, ``"table"`` or ``"synthetic"``;
    ``provenance`` names the data (cache and fingerprint, table and version); ``skipped`` counts rows left out
    by reason, filled while iterating."""

    name: str
    source: str
    rows: int
    provenance: dict
    batches: Callable[[], Iterator]
    skipped: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what a person should know (a table newer than the cache)


def augment_for(normalize: dict | None) -> AugmentConfig:
    """The evaluation's batch transform: the run's normalization, nothing random."""
    if normalize is None:
        return AugmentConfig.eval(normalize=False)
    return AugmentConfig.eval(normalize=True, mean=tuple(normalize["mean"]), std=tuple(normalize["std"]))


def as_float(x):
    """A uint8 batch as the trainer's ``LoaderSource`` makes it float (x / 255); a normalized one as it is."""
    return x if x.is_floating_point() else x.float().div_(255.0)


def open_split(cfg, info, split: str, *, batch_size: int, table: str | None = None) -> Split:
    """``split`` of the run's data (``cfg``: the run's config; ``info``: its ``DataInfo``), per the module doc."""
    if not SPLIT_NAME.match(split or ""):
        raise ConfigError(f"split {split!r} is not a split name; use test, val or train")
    if cfg.data.source == "synthetic" and not table:
        return _synthetic(cfg, info, split, batch_size)
    if cfg.data.source == "raw" or (cfg.data.source == "synthetic" and table):
        return _from_table(table or info.lineage.get("table") or cfg.data.table, split, info, batch_size)
    cache = info.lineage.get("cache") or cfg.data.cache
    try:
        cache = cf.resolve(cache)
        manifest = cf.read_manifest(cache)
    except SourceError as e:
        if table:  # the table alone will do: its rows, the run's recorded transform
            return _from_table(table, split, info, batch_size)
        raise SourceError(f"the run's cache is not readable ({e}); pass --table with the metadata table to read "
                          f"the {split!r} split from") from None
    if table:  # asked for: the table's rows, with the cache's extra roots and versions beside them
        return _from_table(table, split, info, batch_size, cache=(cache, manifest))
    if manifest.split_counts.get(split):
        return _from_cache(cfg, cache, manifest, split, info, batch_size)
    source = manifest.source or info.lineage.get("table", "")
    if not source:
        raise SourceError(f"the cache {cache!r} holds no {split!r} split ({_splits(manifest.split_counts)}) and "
                          "names no source table; pass --table with the metadata table that holds it")
    held = _from_table(source, split, info, batch_size, cache=(cache, manifest))
    held.notes.insert(0, f"the cache holds no {split!r} split ({_splits(manifest.split_counts)}): its rows were "
                         f"read from the table {source} and decoded with the cache's transform")
    return held


def _splits(counts: dict) -> str:
    return "splits there: " + (", ".join(f"{k} ({v})" for k, v in sorted(counts.items())) or "none")


# ---------------------------------------------------------------------------------------------------- cache


def _from_cache(cfg, cache: str, manifest, split: str, info, batch_size: int) -> Split:
    """Through the trainer's validation path: the run's own loader settings (how shards are reached), one rank,
    cache order, the run's normalization."""
    _, val = cfg.data.loader_configs(cfg.run.seed, 1)
    config = dataclasses.replace(val, mode="sync", global_batch_size=batch_size, augment=augment_for(info.normalize))
    classes = list(manifest.classes)
    if classes != list(info.classes):
        raise SourceError(f"the cache {cache!r} lists classes {classes[:6]}... but the run trained on "
                          f"{list(info.classes)[:6]}...; evaluate the cache the run trained on")

    def batches():
        source = LoaderSource(CacheLoader(cache, split, 0, 1, config=config))
        for batch in source:
            yield batch["image"], batch["label"], list(batch["sample_id"])

    provenance = {"cache": cache, "fingerprint": manifest.fingerprint, "table": manifest.source,
                  "table_version": manifest.options.get("table_version")}
    return Split(split, "cache", int(manifest.split_counts[split]), provenance, batches)


# ---------------------------------------------------------------------------------------------------- table


def _from_table(table: str, split: str, info, batch_size: int, cache: tuple | None = None) -> Split:
    """The table's rows of ``split``, decoded with the run's transform (its spec: the cache's recorded one).
    ``cache``: ``(uri, manifest)`` of the run's cache when it did not hold the split (its extra roots apply, and
    its table version is recorded beside the table's)."""
    if not info.spec:
        raise SourceError("the run recorded no transform spec (summary.json data.spec), so its samples cannot be "
                          "made again from files; evaluate a split its cache holds")
    spec = TransformSpec.from_json(info.spec)
    tm = tf.read_manifest(table)
    cache_uri, manifest = cache or ("", None)
    extra_roots = (manifest.options.get("roots") or []) if manifest is not None else []
    configure()  # a small Daft query, on Daft's default runner (not a Ray runner Daft would infer)
    plan = plan_rows(table, spec, f"split = '{split}'", manifest=tm, allowed_roots=extra_roots)
    skipped = Counter({k: n for k, n in (("table_error", plan.table_errors), ("duplicate", plan.duplicates),
                                          ("outside_roots", plan.outside)) if n})
    rows = len(plan.uris) + sum(skipped.values())
    if not rows:
        parent = (tm.lineage or {}).get("parent")
        hint = (f"; it was curated from {parent!r} ({', '.join(tm.lineage.get('operations') or []) or 'a subset'}): "
                f"pass --table {parent} to read the split there" if parent else
                "; check the split's name (`dutycycle inspect` lists a table's splits)")
        raise SourceError(f"table {table!r} holds no rows of split {split!r}{hint}")
    index = {name: i for i, name in enumerate(info.classes)}
    labels = np.full(len(plan.uris), -1, np.int64)
    unknown: Counter = Counter()
    for row, label in enumerate(plan.labels):
        if label < 0:
            skipped["unlabeled"] += 1
        elif plan.classes[label] not in index:
            unknown[plan.classes[label]] += 1
        else:
            labels[row] = index[plan.classes[label]]
    if unknown:
        skipped["unknown_class"] = sum(unknown.values())
    keep = np.flatnonzero(labels >= 0)
    uris, ids, labels = [plan.paths[i] for i in keep], [plan.sample_ids[i] for i in keep], labels[keep]
    aug, roots = augment_for(info.normalize), RootCheck(plan.roots)
    out = Split(split, "table", rows, {"table": table, "table_version": tm.version, "spec": spec.to_dict()},
                lambda: iter(()), skipped)
    if unknown:
        out.notes.append(f"{sum(unknown.values())} rows of classes the run never trained on were left out: "
                         + ", ".join(sorted(unknown)[:8]))
    if manifest is not None:
        trained = manifest.options.get("table_version")
        out.provenance.update(cache=cache_uri, fingerprint=manifest.fingerprint, table_version_trained=trained)
        if trained is not None and trained != tm.version:
            out.notes.append(f"the table is at version {tm.version}; the run's cache was made from version {trained}")
        if manifest.options.get("where"):  # the cache's filter selected training rows; this split is not among them
            out.notes.append(f"the cache was materialized with where = {manifest.options['where']!r}; the "
                             f"{split!r} rows were selected by their split alone")

    def batches():
        out.skipped = skipped.copy()  # each pass counts its own decode failures
        out.examples = []
        with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="dutycycle-eval") as pool:
            for lo in range(0, len(uris), batch_size):
                decoded = list(pool.map(lambda u: _decode(u, spec, roots), uris[lo:lo + batch_size]))
                good = [i for i, (image, _) in enumerate(decoded) if image is not None]
                for image, problem in decoded:
                    if image is None:
                        out.skipped[problem.reason] += 1
                        if len(out.examples) < MAX_EXAMPLES:
                            out.examples.append(str(problem))
                if good:
                    x = as_float(to_tensor(np.stack([decoded[i][0] for i in good]), aug, spec.layout))
                    yield x, _labels(labels[lo:lo + batch_size][good]), [ids[lo + i] for i in good]

    out.batches = batches
    return out


def _decode(uri: str, spec: TransformSpec, roots: RootCheck):
    """``(sample, None)`` or ``(None, DecodeError)``: a file that cannot become a sample is counted, not raised."""
    try:
        return decode_one(uri, spec, roots), None
    except DecodeError as e:
        return None, e


def _labels(values: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(values, np.int64))


# ------------------------------------------------------------------------------------------------ synthetic


def _synthetic(cfg, info, split: str, batch_size: int) -> Split:
    """The run's shapes drawn again: training samples ``[0, train)``, validation ``[train, train + val)``."""
    starts = {"train": (0, info.train_samples), "val": (info.train_samples, info.val_samples)}
    if split not in starts:
        raise SourceError(f"a synthetic run (data.source = 'synthetic') has the splits train and val, not {split!r}")
    start, n = starts[split]
    seed = int(info.lineage.get("synthetic", {}).get("seed", cfg.run.seed + 1000))
    aug = augment_for(info.normalize)

    def batches():
        for lo in range(0, n, batch_size):
            m = min(batch_size, n - lo)
            images, labels = draw_shapes(m, info.size, seed=seed, start=start + lo)
            yield as_float(to_tensor(images, aug, "HWC")), _labels(labels), [str(start + lo + i) for i in range(m)]

    return Split(split, "synthetic", n, {"synthetic": {"seed": seed, "start": start, "samples": n,
                                                      "size": info.size}}, batches)
