"""A start's data as trace reads it: split index -> sample id and label (the run's cache, or its table on the raw
path), a sample's split index back from its id, and the table's rows for a set of ids, with the curation that
selected them.

The cache a run trained on is the committed folder its record names (pinned by fingerprint: a cache rebuilt
since is another folder), opened without verifying pixels (trace reads ids and labels only). A cache's rows are
sorted by sample id, and the sample id is the file's content hash (sha256 of its bytes, 32 hex characters): the
table's row id and its content hash are one value.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
from dutycycle.engine import io
from dutycycle.engine.cache.reader import CacheReader
from dutycycle.engine.errors import SourceError
from dutycycle.engine.table import format as tf
from dutycycle.engine.table.table import Table
from dutycycle.engine.transform import TransformSpec
from dutycycle.loader.raw import RawSource
from dutycycle.loader.source import ShardGatherer, chunk_block_starts, split_rows

# the table columns a trace row carries (uri_bytes: what a thumbnail opens, never shown)
TABLE_COLUMNS = ("sample_id", "uri", "label", "split", "format", "width", "height", "mode", "size_bytes",
                 "uri_bytes")


class SplitData:
    """The training split one start planned over: ids and labels by split index, the plan's blocks, and where
    the rows came from (table, version, curation)."""

    def __init__(self, data: dict, plan: dict):
        self.kind = data.get("source") or ("cache" if data.get("cache") else "raw" if data.get("table") else "")
        self.split, self.fingerprint = str(plan["split"]), str(plan["fingerprint"])
        if self.kind == "cache":
            self._open_cache(str(data["cache"]))
        elif self.kind == "raw":
            self._open_raw(str(data["table"]), data.get("spec") or {})
        else:
            raise SourceError("trace reads runs over a table: a cache (data.source = \"cache\") or the raw path; this "
                              f"run trained on {self.kind or 'data it did not record'!r} samples, which no table holds")
        if self.fingerprint != self._fingerprint:
            raise SourceError(f"the {self.kind} at {self.where!r} now has fingerprint {self._fingerprint}, but the run "
                              f"trained on {self.fingerprint}: its samples changed since, so the steps cannot be "
                              "traced from it")
        if len(self) != int(plan["num_samples"]):
            raise SourceError(f"{self.where!r} has {len(self)} {self.split!r} samples, the run planned over "
                              f"{plan['num_samples']}; it is not the data the run trained on")
        self.block_starts = None
        if int(plan["block_size"]) == 0:
            self.block_starts = self._block_starts()
            digest = hashlib.sha256(self.block_starts.tobytes()).hexdigest()
            if digest != plan.get("block_starts_sha256"):
                raise SourceError(f"{self.where!r}: its chunk boundaries differ from the ones the run's plan used "
                                  "(block_size = 0); it is not the data the run trained on")

    # -------------------------------------------------------------------------------------- the sources

    def _open_cache(self, uri: str) -> None:
        self.reader = CacheReader(uri, verify=False)  # ids and labels only; nothing here trains on pixels
        m = self.reader.manifest
        self.where, self._fingerprint, self.classes = self.reader.uri, m.fingerprint, list(m.classes)
        self.rows = split_rows(self.reader, self.split)
        self._gatherer = ShardGatherer(self.reader)
        self.table_uri, self.table_version = m.source, m.options.get("table_version")
        self.cache_where = m.options.get("where") or ""
        self.cache_skipped = dict(m.skipped)
        self._block_starts = lambda: chunk_block_starts(self.reader, self.split)

    def _open_raw(self, table: str, spec: dict) -> None:
        source = RawSource(table, TransformSpec.from_json(spec) if spec else TransformSpec(), self.split, 1)
        self.where, self._fingerprint, self.classes = table, source.fingerprint, list(source.classes)
        self._ids, self._labels = source.sample_ids, source.labels
        self.table_uri, self.cache_where, self.cache_skipped = table, "", {}
        self.table_version = tf.read_manifest(table).version
        self._block_starts = source.block_starts

    def __len__(self) -> int:
        return len(self.rows) if self.kind == "cache" else len(self._ids)

    def ids(self, indices: np.ndarray) -> tuple[list[str], list[str]]:
        """Sample ids and class names of split indices, in order."""
        idx = np.asarray(indices, dtype=np.int64)
        if self.kind == "cache":
            raw = self._gatherer.read(self.rows[idx], pixels=False)
            ids, labels = list(raw.sample_ids), raw.labels.tolist()
        else:
            ids, labels = self._ids[idx].tolist(), self._labels[idx].tolist()
        return ids, [self.classes[i] for i in labels]

    def find(self, sample_id: str) -> tuple[int | None, str | None]:
        """``(split index, None)`` of a sample in this split, or ``(None, its split)`` when the data holds it in
        another split, or ``(None, None)`` when the data does not hold it."""
        if self.kind == "raw":
            hit = np.flatnonzero(self._ids == sample_id)
            return (int(hit[0]), None) if len(hit) else (None, None)
        import pyarrow.compute as pc  # the shards' id columns, compared where they lie

        m, before = self.reader.manifest, 0
        for s in range(self.reader.num_shards):
            info = m.shards[s]
            view = self.reader.view(s)
            hit = pc.index(view.ids, sample_id).as_py()
            if hit >= 0:
                split = view.split[hit].as_py()
                if split != self.split:
                    return None, split
                mine = np.flatnonzero(pc.equal(view.split.slice(0, hit), self.split).to_numpy(zero_copy_only=False))
                return before + len(mine), None
            before += int(info.split_counts.get(self.split, 0))
        return None, None

    # ------------------------------------------------------------------------------------ the table side

    def curation(self) -> dict:
        """How the rows were selected: the table and version, its lineage (parent, filter, operations such as a
        dedupe or a resplit), how its splits were assigned, the cache's filter and what it skipped."""
        out = {"table": self.table_uri, "table_version": self.table_version, "cache_where": self.cache_where,
               "cache_skipped": self.cache_skipped, "split": self.split}
        m = self.table_manifest()
        if m is not None:
            out["lineage"] = dict(m.lineage)
            out["split_assignment"] = m.options.get("split_assignment")  # hash, folders, or a resplit
        return out

    def table_manifest(self):
        if not self.table_uri:
            return None
        try:
            return tf.read_manifest(self.table_uri, self.table_version)
        except (OSError, ValueError):
            return None  # a table vacuumed or moved since: the trace still names it and its version

    def table_rows(self, sample_ids: list[str]) -> dict[str, dict]:
        """The table's rows (``TABLE_COLUMNS``) of ``sample_ids``, by id, from the version the data was made
        from; {} when the table is gone."""
        m = self.table_manifest()
        return table_rows(self.table_uri, m, sample_ids) if m is not None else {}

    def find_uri(self, uri: str) -> str | None:
        """The sample id of the table's row at ``uri`` (None when the table has no such row)."""
        from daft import col

        m = self.table_manifest()
        if m is None:
            return None
        # a local path as the person typed it, or as the table holds it (absolute)
        names = [uri] + ([os.path.abspath(uri)] if io.protocol(uri) == "file" and not uri.startswith("/") else [])
        got = Table(self.table_uri, m).df.where(col("uri").is_in(names)).select("sample_id").limit(1).to_pylist()
        return got[0]["sample_id"] if got else None


def curation_json(curation: dict) -> str:
    return json.dumps(curation, sort_keys=True, default=str)


def table_rows(table_uri: str, manifest, sample_ids: list[str]) -> dict[str, dict]:
    """The rows (``TABLE_COLUMNS``) of ``sample_ids`` in the table version ``manifest`` names, by id: one Daft
    query that reads the sample_id column whole and the other columns of the matching rows only."""
    from daft import col

    if not sample_ids:
        return {}
    df = Table(table_uri, manifest).df
    got = df.where(col("sample_id").is_in(sorted(set(sample_ids))))
    rows = {}
    for r in got.select(*[c for c in TABLE_COLUMNS if c in df.column_names]).to_pylist():
        rows.setdefault(r["sample_id"], r)  # an exact duplicate file is one content hash: any of its rows
    return rows
