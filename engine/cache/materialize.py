"""Materialize a metadata table into a transformed-sample cache: decode and transform once, with Daft.

The work, top to bottom:

1. ``plan_rows``: read the table's rows (Daft over the committed Parquet files), apply the optional filter,
   split good rows from error rows, sort by ``sample_id``. The fingerprint is a hash of the selected samples
   (id, label, split), the class list, the transform spec and the cache format version.
2. Reuse: ``ROOT/<fingerprint>/manifest.json`` exists -> return it, no work. A small index keyed by the table
   manifest, filter and spec answers that question without reading the table at all.
3. Shards: sorted rows are cut into fixed groups of ``rows_per_shard``; shard ``i`` always holds the same
   candidates. Each shard is decoded and transformed by a Daft batch UDF (``udf.py``),
   written atomically, then its completion record ``shards/shard-0000i.json`` is written. A rerun after a
   crash verifies and skips shards that have a record; it never reads a shard without one.
4. Commit: the manifest is written last, then ``ROOT/latest``.

Rows that fail to download or decode are skipped and counted by reason in ``manifest.skipped``; error rows of
the table are counted as ``table_error``, a second row with an already selected sample id (the same content
twice) as ``duplicate``. A label's index is its position in the table manifest's ``classes`` (-1 if unlabeled).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .. import io
from ..errors import ConfigError, SourceError
from ..runner import RUNNERS
from ..table import format as tf
from ..transform import TransformSpec
from . import format as cf
from .udf import DAFT_SCHEMES, transform_rows

DEFAULT_ROWS_PER_SHARD = 2048


@dataclass(frozen=True)
class MaterializeConfig:
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD
    where: str | None = None  # Daft SQL expression over the table's columns, e.g. "split = 'train'"
    runner: str | None = None  # "native" | "ray" | None (DAFT_RUNNER, else native, else the one already fixed)
    ray_address: str | None = None  # a running Ray cluster for the ray runner; None starts a local one
    batch_size: int = 64  # rows per UDF call

    def __post_init__(self):
        if not isinstance(self.rows_per_shard, int) or self.rows_per_shard < 1:
            raise ConfigError(f"rows_per_shard={self.rows_per_shard!r} is invalid; use a positive integer")
        if self.runner not in (None, *RUNNERS):
            raise ConfigError(f"runner={self.runner!r} is invalid; use native or ray")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size!r} is invalid; use a positive integer")


@dataclass
class Plan:
    """The selected good rows, sorted by sample_id, and what the table said about the rest."""

    sample_ids: list[str]
    uris: list[str]
    labels: np.ndarray  # int64 index into classes; -1 for unlabeled rows
    splits: list[str]
    classes: list[str]
    table_errors: int
    duplicates: int  # good rows whose sample_id (content hash) was already selected: the same file twice
    fingerprint: str


@dataclass
class MaterializeResult:
    uri: str  # the committed cache folder ROOT/<fingerprint>
    manifest: cf.CacheManifest
    reused: bool
    seconds: float
    shards_written: int = 0
    shards_resumed: int = 0
    details: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "cache": self.uri,
            "fingerprint": self.manifest.fingerprint,
            "samples": self.manifest.num_samples,
            "skipped": self.manifest.skipped,
            "reused": self.reused,
            "shards": len(self.manifest.shards),
            "shards_written": self.shards_written,
            "shards_resumed": self.shards_resumed,
            "seconds": round(self.seconds, 3),
        }


# --------------------------------------------------------------------------------------------- planning


def _read_table(table_uri: str, manifest: tf.TableManifest, where: str | None):
    """The table's rows (only the columns the cache needs) as a pyarrow Table, filtered by ``where``."""
    import daft
    import pyarrow.parquet as pq

    files = tf.file_uris(table_uri, manifest)
    if io.protocol(table_uri) in DAFT_SCHEMES:
        df = daft.read_parquet(files, io_config=io.daft_io_config())
    else:
        parts = []
        for uri in files:
            fs, path = io.filesystem(uri)
            with fs.open(path, "rb") as f:
                parts.append(pq.read_table(f, schema=tf.SCHEMA))
        import pyarrow as pa

        df = daft.from_arrow(pa.concat_tables(parts) if parts else tf.SCHEMA.empty_table())
    if where:
        try:
            df = df.where(daft.sql_expr(where))
        except Exception as e:
            raise ConfigError(
                f"--where {where!r} is not a valid filter ({_first_line(e)}); use SQL like \"split = 'train'\""
            ) from e
    df = df.select("sample_id", "uri", "label", "split", "error")
    try:
        return df.to_arrow()
    except Exception as e:
        if where and not isinstance(e, OSError):
            raise ConfigError(
                f"--where {where!r} failed on table {table_uri!r} ({_first_line(e)}); check column names"
            ) from e
        raise


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[0][:200] if lines else type(e).__name__


def fingerprint(sample_ids, labels, splits, classes, spec: TransformSpec) -> str:
    """Hash of what the cache holds: selected samples (sorted), their labels and splits, classes, spec, format."""
    h = hashlib.sha256()
    h.update(
        json.dumps(
            {"format_version": cf.FORMAT_VERSION, "spec": spec.to_dict(), "classes": classes}, sort_keys=True
        ).encode()
    )
    for sid, lab, spl in zip(sample_ids, labels, splits, strict=True):
        h.update(f"\n{sid}\t{int(lab)}\t{spl}".encode())
    return h.hexdigest()[:20]


def plan_rows(
    table_uri: str, spec: TransformSpec, where: str | None = None, manifest: tf.TableManifest | None = None
) -> Plan:
    tm = manifest or tf.read_manifest(table_uri)
    t = _read_table(table_uri, tm, where)
    errors = t.column("error").to_pylist()
    good = [i for i, e in enumerate(errors) if e is None]
    ids = t.column("sample_id").to_pylist()
    uris = t.column("uri").to_pylist()
    labels = t.column("label").to_pylist()
    splits = t.column("split").to_pylist()
    # Content hashes make duplicates possible (the same file twice): keep each sample id once.
    seen: dict[str, int] = {}
    for i in good:
        seen.setdefault(ids[i], i)
    order = sorted(seen)
    class_index = {c: k for k, c in enumerate(tm.classes)}
    rows = [seen[s] for s in order]
    lab = np.array([class_index.get(labels[i], -1) if labels[i] is not None else -1 for i in rows], np.int64)
    spl = [splits[i] or "" for i in rows]
    return Plan(
        sample_ids=order,
        uris=[uris[i] for i in rows],
        labels=lab,
        splits=spl,
        classes=list(tm.classes),
        table_errors=len(errors) - len(good),
        duplicates=len(good) - len(order),
        fingerprint=fingerprint(order, lab, spl, list(tm.classes), spec),
    )


def _index_key(tm: tf.TableManifest, table_uri: str, where: str | None, spec: TransformSpec) -> str:
    """Key for the reuse index. Table data files are immutable and the manifest (with its commit time) names
    them, so (where the table is, its whole manifest, filter, spec) fixes the cache's content."""
    if io.protocol(table_uri) == "file":
        table_uri = os.path.abspath(table_uri)  # "data/table" from two working directories is two tables
    d = {
        "table": table_uri,
        "manifest": asdict(tm),
        "where": where or "",
        "spec": spec.to_dict(),
        "format": cf.FORMAT_VERSION,
    }
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:24]


# --------------------------------------------------------------------------------------------- shards


def shard_ranges(n: int, rows_per_shard: int) -> list[tuple[int, int]]:
    """Deterministic assignment: shard i holds sorted rows [i*R, (i+1)*R)."""
    return [(s, min(n, s + rows_per_shard)) for s in range(0, n, rows_per_shard)]


def record_name(index: int) -> str:
    return f"{cf.SHARD_DIR}/shard-{index:05d}.json"


def _ids_digest(ids: list[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:20]


def _completed(cache_uri: str, index: int, ids_digest: str) -> dict[str, Any] | None:
    """The shard's completion record if it exists, matches this plan and its shard passes the checksum."""
    rec_uri = io.join(cache_uri, record_name(index))
    if not io.exists(rec_uri):
        return None
    rec = io.read_json(rec_uri)
    if rec.get("ids_digest") != ids_digest:
        return None
    info = cf.ShardInfo(**rec["shard"]) if rec.get("shard") else None
    if info is None:  # every candidate of this shard was skipped; nothing to verify
        return rec
    fs, path = io.filesystem(io.join(cache_uri, info.path))
    try:
        with fs.open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    if len(data) != info.bytes or hashlib.sha256(data).hexdigest() != info.sha256:
        return None
    return rec


def _write_one_shard(
    cache_uri: str,
    index: int,
    plan: Plan,
    lo: int,
    hi: int,
    spec: TransformSpec,
    cfg: MaterializeConfig,
    scheme: str,
) -> dict[str, Any]:
    images, errors = transform_rows(plan.uris[lo:hi], spec, cfg.batch_size, scheme)
    keep = [i for i, e in enumerate(errors) if e is None]
    skipped = Counter(e for e in errors if e is not None)
    info = None
    split_counts: Counter[str] = Counter()
    if keep:
        pixels = np.frombuffer(b"".join(images[i] for i in keep), np.uint8).reshape(len(keep), *spec.shape)
        ids = [plan.sample_ids[lo + i] for i in keep]
        splits = [plan.splits[lo + i] for i in keep]
        split_counts.update(splits)
        info = cf.write_shard(cache_uri, index, ids, plan.labels[lo:hi][keep], splits, pixels)
    rec = {
        "index": index,
        "ids_digest": _ids_digest(plan.sample_ids[lo:hi]),
        "shard": None
        if info is None
        else {"path": info.path, "rows": info.rows, "bytes": info.bytes, "sha256": info.sha256},
        "skipped": dict(skipped),
        "split_counts": dict(split_counts),
    }
    # The record is written after the shard: a record always describes a complete shard.
    io.write_json_atomic(io.join(cache_uri, record_name(index)), rec)
    return rec


# --------------------------------------------------------------------------------------------- public API


def _reuse(root: str, fp: str, t0: float) -> MaterializeResult | None:
    uri = io.join(root, fp)
    if not cf.is_committed(uri):
        return None
    _point_latest(root, fp)
    return MaterializeResult(uri=uri, manifest=cf.read_manifest(uri), reused=True, seconds=time.perf_counter() - t0)


def _point_latest(root: str, fp: str) -> None:
    """``ROOT/latest`` names the cache the most recent materialize returned (rewritten only when it changes)."""
    latest = io.join(root, cf.LATEST)
    if io.exists(latest):
        fs, path = io.filesystem(latest)
        with fs.open(path, "rb") as f:
            if f.read().decode().strip() == fp:
                return
    cf.write_latest(root, fp)


def materialize(
    table: str,
    cache: str,
    spec: TransformSpec | None = None,
    *,
    where: str | None = None,
    runner: str | None = None,
    ray_address: str | None = None,
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    batch_size: int = 64,
    log: Callable[[str], None] | None = None,
) -> MaterializeResult:
    """Build (or reuse) the cache of ``table`` under the cache root ``cache``; returns the committed folder.

    Same table, filter and spec -> the existing cache, without decoding anything. Any change -> a new
    fingerprint folder beside the old one. Safe to kill at any moment and run again.
    """
    t0 = time.perf_counter()
    spec = spec or TransformSpec()
    cfg = MaterializeConfig(
        rows_per_shard=rows_per_shard,
        where=where,
        runner=runner,
        ray_address=ray_address,
        batch_size=batch_size,
    )
    log = log or (lambda msg: None)
    tm = tf.read_manifest(table)

    index_uri = io.join(cache, cf.INDEX_DIR, _index_key(tm, table, where, spec) + ".json")
    if io.exists(index_uri):
        hit = _reuse(cache, io.read_json(index_uri)["fingerprint"], t0)
        if hit is not None:
            return hit

    from ..runner import configure

    runner = configure(cfg.runner, cfg.ray_address)
    plan = plan_rows(table, spec, where, tm)
    hit = _reuse(cache, plan.fingerprint, t0)
    if hit is not None:
        io.write_json_atomic(index_uri, {"fingerprint": plan.fingerprint})
        return hit
    if not plan.sample_ids:
        raise SourceError(
            f"table {table!r} has no readable rows{f' matching {where!r}' if where else ''} "
            f"({plan.table_errors} error rows); check the table with `dutycycle inspect` or the filter"
        )
    if runner == "ray" and io.protocol(table) == "memory":
        raise ConfigError("memory:// tables live in one process; use --runner native or a shared location")

    out = io.join(cache, plan.fingerprint)
    scheme = io.protocol(plan.uris[0])
    ranges = shard_ranges(len(plan.sample_ids), cfg.rows_per_shard)
    records, written, resumed = [], 0, 0
    for index, (lo, hi) in enumerate(ranges):
        rec = _completed(out, index, _ids_digest(plan.sample_ids[lo:hi]))
        if rec is not None:
            resumed += 1
            how = "already committed"
        else:
            rec = _write_one_shard(out, index, plan, lo, hi, spec, cfg, scheme)
            written += 1
            how = "written"
        records.append(rec)
        log(f"shard {index + 1}/{len(ranges)}: {rec['shard']['rows'] if rec['shard'] else 0} samples, {how}")

    skipped: Counter[str] = Counter()
    if plan.table_errors:
        skipped["table_error"] = plan.table_errors
    if plan.duplicates:
        skipped["duplicate"] = plan.duplicates
    split_counts: Counter[str] = Counter()
    for rec in records:
        skipped.update(rec["skipped"])
        split_counts.update(rec["split_counts"])
    shards = [cf.ShardInfo(**rec["shard"]) for rec in records if rec["shard"]]
    seconds = time.perf_counter() - t0
    manifest = cf.CacheManifest(
        fingerprint=plan.fingerprint,
        shape=list(spec.shape),
        layout=spec.layout,
        dtype=spec.dtype,
        num_samples=sum(s.rows for s in shards),
        shards=shards,
        classes=plan.classes,
        split_counts=dict(split_counts),
        spec=spec.to_dict(),
        source=table,
        skipped=dict(skipped),
        options={
            "where": where or "",
            "table_version": tm.version,
            "rows_per_shard": cfg.rows_per_shard,
            "runner": cfg.runner or "",
            "seconds": round(seconds, 3),
            "created_at": time.time(),
        },
    )
    if manifest.num_samples == 0:
        raise SourceError(
            f"no row of table {table!r} could be decoded (skipped: {dict(skipped)}); check the source images"
        )
    cf.commit(out, manifest)
    _point_latest(cache, plan.fingerprint)
    io.write_json_atomic(index_uri, {"fingerprint": plan.fingerprint})
    return MaterializeResult(
        uri=out,
        manifest=manifest,
        reused=False,
        seconds=seconds,
        shards_written=written,
        shards_resumed=resumed,
    )


def open_cache(uri: str, verify: bool = True) -> cf.CacheReader:
    """A reader over a committed cache folder or a cache root (its ``latest`` or only committed cache)."""
    return cf.CacheReader(uri, verify=verify)


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
