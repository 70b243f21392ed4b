"""Materialize a metadata table into a transformed-sample cache: decode and transform once, with Daft.

The work, top to bottom:

1. Reuse: a small index keyed by the table manifest, filter and spec names the fingerprint; if
   ``ROOT/<fingerprint>/manifest.json`` exists, return it without reading the table at all.
2. Plan (``plan.py``, Daft queries): the table's rows, filtered, good rows one per sample id in sample-id
   order; counts of error rows and duplicates; the fingerprint from per-block digests of the selected
   (sample id, label, split) rows, the class list, the spec and the format version. An existing
   ``ROOT/<fingerprint>/manifest.json`` is returned as is.
3. Shards (``build.py``): shard ``i`` holds rows ``[i * rows_per_shard, (i + 1) * rows_per_shard)`` of that
   order. On the Ray runner, Ray tasks build whole shards spread over the nodes; on the native runner, worker
   threads decode batches of files and this process writes each shard as its rows stream in. Either way a
   shard is written atomically, then its completion record ``shards/shard-0000i.json``; a shard whose record
   exists and verifies is not built again, so a rerun after a crash resumes without rewriting committed shards.
4. Commit: the reuse index entry, then the manifest, then ``ROOT/latest``. The manifest records the dataset's
   per-channel mean and standard deviation over the training split (``stats``), added up exactly from the
   integer pixel sums each shard's completion record carries. The index entry goes first because an entry that
   names an uncommitted fingerprint is only a miss; ``latest`` belongs to the commit (a root whose pointer still
   names an older cache would open that one), so when it cannot be written the manifest is taken back.

A write that fails (a full disk, a quota, a store that refuses it) commits nothing and leaves no temporary file:
each write is atomic and removes its own temporary file, a shard whose completion record could not be written is
removed with it, and folders the failed run left empty are removed. What stays are whole shards with their
records, which a rerun keeps. A full disk or quota is a ``NoSpaceError`` naming the device, the path and the
bytes the write needed, also when it happened in a Ray worker or in Daft's writer; never a corrupt cache.

The driver holds O(number of shards) Python objects (records, block digests) plus, on the native runner, the
rows of about one shard being assembled: never a list over all rows.
Rows that fail to download or decode are skipped and counted by reason in ``manifest.skipped`` (the reasons an
ingest records for such files, ``imageinfo``'s vocabulary); error rows of the table are counted as
``table_error``, a second row with an already selected sample id (the same content twice) as ``duplicate``, a good
row whose URI lies outside the table's source roots (``engine.roots``; extra roots: ``allowed_roots``) as
``outside_roots``, never read. A label's index is its position in the table manifest's ``classes`` (-1 if unlabeled).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from .. import formats, io
from ..errors import ConfigError, CorruptArtifactError, NoSpaceError, SourceError
from ..limits import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_PIXELS
from ..roots import OUTSIDE_ROOTS, SKIP_KEY, refusal, table_roots
from ..runner import RUNNERS, configure
from ..table import format as tf
from ..transform import TransformSpec
from . import build, selection, stats
from . import format as cf
from . import plan as mp
from .reader import CacheReader

DEFAULT_ROWS_PER_SHARD = 2048
STAGING_DIR = ".plan"  # under the cache root: the Ray runner's planned selection, deleted after the build


@dataclass(frozen=True)
class MaterializeConfig:
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD
    where: str | None = None  # Daft SQL expression over the table's columns, e.g. "split = 'train'"
    runner: str | None = None  # "native" | "ray" | None (DAFT_RUNNER, else native, else the one already fixed)
    ray_address: str | None = None  # a running Ray cluster for the ray runner; None starts a local one
    batch_size: int = 64  # files fetched and decoded at a time inside a shard (bounds the bytes held)
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES  # larger files are skipped as "too large", never read whole
    max_pixels: int = DEFAULT_MAX_PIXELS  # images whose header claims more are skipped before decoding
    allowed_roots: tuple[str, ...] = ()  # read rows under these too, besides the table's own source roots

    def __post_init__(self):
        if not isinstance(self.rows_per_shard, int) or self.rows_per_shard < 1:
            raise ConfigError(f"rows_per_shard={self.rows_per_shard!r} is invalid; use a positive integer")
        if self.runner not in (None, *RUNNERS):
            raise ConfigError(f"runner={self.runner!r} is invalid; use native or ray")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size!r} is invalid; use a positive integer")
        if not isinstance(self.max_file_bytes, int) or self.max_file_bytes < 1:
            raise ConfigError(f"max_file_bytes={self.max_file_bytes!r} is invalid; use a positive byte count")
        if not isinstance(self.max_pixels, int) or self.max_pixels < 1:
            raise ConfigError(f"max_pixels={self.max_pixels!r} is invalid; use a positive pixel count")


@dataclass
class Plan:
    """The selected good rows, sorted by sample_id, and what the table said about the rest."""

    sample_ids: list[str]
    uris: list[str]  # readable: for messages
    # the path each row opens (``io.open_path``): its URI, or the exact bytes of a name that is not text
    paths: list[str]
    labels: np.ndarray  # int64 index into classes; -1 for unlabeled rows
    splits: list[str]
    classes: list[str]
    table_errors: int
    duplicates: int  # good rows whose sample_id (content hash) was already selected: the same file twice
    fingerprint: str
    roots: list[str] = field(default_factory=list)  # where rows may point (the table's roots + allowed ones)
    outside: int = 0  # good rows outside ``roots``: never read, not selected
    outside_examples: list[str] = field(default_factory=list)  # one of their URIs, for messages


@dataclass
class MaterializeResult:
    uri: str  # the committed cache folder ROOT/<fingerprint>
    manifest: cf.CacheManifest
    reused: bool
    seconds: float
    shards_written: int = 0
    shards_resumed: int = 0

    def summary(self) -> dict[str, Any]:
        return {
            "cache": self.uri,
            "fingerprint": self.manifest.fingerprint,
            "samples": self.manifest.num_samples,
            "skipped": self.manifest.skipped,
            "channel_stats": self.manifest.channel_stats,
            "reused": self.reused,
            "shards": len(self.manifest.shards),
            "shards_written": self.shards_written,
            "shards_resumed": self.shards_resumed,
            "seconds": round(self.seconds, 3),
        }


# --------------------------------------------------------------------------------------------- planning


def plan_rows(
    table_uri: str,
    spec: TransformSpec,
    where: str | None = None,
    manifest: tf.TableManifest | None = None,
    allowed_roots=None,
    max_pixels: int | None = None,
    max_file_bytes: int | None = None,
) -> Plan:
    """The selected rows as Python lists, for callers that need every row anyway (the raw loader): the same
    selection, order and fingerprint as ``materialize`` with the same caps (which never collects rows like this),
    rows outside the table's source roots and ``allowed_roots`` left out and counted."""
    tm = manifest or tf.read_manifest(table_uri)
    roots = table_roots(tm, allowed_roots)
    df = mp.table_frame(table_uri, tm, where)
    # streamed through this process whatever Daft's runner: every row ends up here anyway
    with selection.selected(df, roots=roots, classes=list(tm.classes), rows_per_shard=DEFAULT_ROWS_PER_SHARD, runner="native",
                            staging=None, table_uri=table_uri, where=where, rows=tm.num_rows) as sel:
        n = sel.counts
        t = sel.table()
        digests = [b[2] for b in sel.blocks]
    ids = t.column("sample_id").to_pylist()
    index = mp.label_index(list(tm.classes))
    labels = np.array([index.get(v, -1) for v in t.column("label").to_pylist()], np.int64)
    splits = [s or "" for s in t.column("split").to_pylist()]
    good = n["rows"] - n["errors"] - n["outside"]
    return Plan(
        sample_ids=ids,
        uris=t.column("uri").to_pylist(),
        paths=io.open_paths(t),
        labels=labels,
        splits=splits,
        classes=list(tm.classes),
        table_errors=n["errors"],
        duplicates=good - len(ids),
        fingerprint=mp.fingerprint(digests, list(tm.classes), spec, mp.decode_settings(max_pixels, max_file_bytes)),
        roots=roots,
        outside=n["outside"],
        outside_examples=[n["outside_example"]] if n["outside"] else [],
    )


def _index_key(
    tm: tf.TableManifest, table_uri: str, where: str | None, spec: TransformSpec, roots: list[str], settings: dict,
) -> str:
    """Key for the reuse index. Table data files are immutable and the manifest (with its commit time) names
    them, so (where the table is, its whole manifest, filter, spec, the roots rows may lie in) fixes the cache's
    content."""
    if io.protocol(table_uri) == "file":
        table_uri = os.path.abspath(table_uri)  # "data/table" from two working directories is two tables
    d = {
        "table": table_uri,
        "manifest": asdict(tm),
        "where": where or "",
        "spec": spec.to_dict(),
        "format": formats.FORMAT,
        "roots": list(roots),
        "decode": settings,  # caps, decoder version, content check: they change the rows
    }
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:24]


# --------------------------------------------------------------------------------------------- public API


def _reuse(root: str, fp: str, t0: float, log: Callable[[str], None]) -> MaterializeResult | None:
    uri = io.resolve_inside(root, fp, "cache root")  # a fingerprint read from the index is data, not a path
    try:
        manifest = cf.read_manifest(uri)  # checks that the cache is committed: no separate existence check
    except SourceError:  # not committed (or not any more)
        return None
    if manifest.channel_stats is None:
        manifest = _add_stats(uri, manifest, log)
    _point_latest(root, fp)
    return MaterializeResult(uri=uri, manifest=manifest, reused=True, seconds=time.perf_counter() - t0)


def cache_sums(reader: CacheReader) -> dict[str, dict[str, Any]]:
    """Exact per-split pixel sums of a committed cache (``stats.split_sums`` over every shard, each verified as
    it is read), as materialize adds them up from its shards' records."""
    layout = reader.manifest.layout
    return stats.combine(stats.split_sums(reader.images(i), reader.column(i, "split").tolist(), layout)
                         for i in range(reader.num_shards))


def _add_stats(uri: str, manifest: cf.CacheManifest, log: Callable[[str], None]) -> cf.CacheManifest:
    """A cache committed before manifests recorded ``channel_stats``: compute them from its shards once and
    commit the manifest again with them (an atomic replace; the pixels, and so the fingerprint, are unchanged)."""
    log(f"materialize: {uri} records no channel statistics (written by an older dutycycle); computing them from "
        f"its {manifest.num_samples} samples once")
    reader = CacheReader(uri)
    if reader.manifest != manifest:  # replaced since it was read: take the newer one as it is
        return reader.manifest
    manifest = replace(manifest, channel_stats=stats.channel_stats(cache_sums(reader)))
    cf.commit(uri, manifest)
    return manifest


def _point_latest(root: str, fp: str) -> None:
    """``ROOT/latest`` names the cache the most recent materialize returned (rewritten only when it changes)."""
    if cf.read_latest(root) != fp:
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
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    allowed_roots=None,
    log: Callable[[str], None] | None = None,
) -> MaterializeResult:
    """Build (or reuse) the cache of ``table`` under the cache root ``cache``; returns the committed folder.

    Same table, filter and spec -> the existing cache, without decoding anything. Any change -> a new
    fingerprint folder beside the old one. Safe to kill at any moment and run again. Rows are read only inside
    the table's source roots and ``allowed_roots`` (extra folders or URIs, for a table built from several
    sources); other rows are skipped as ``outside_roots``, named in the log.
    """
    t0 = time.perf_counter()
    spec = spec or TransformSpec()
    cfg = MaterializeConfig(
        rows_per_shard=rows_per_shard,
        where=where,
        runner=runner,
        ray_address=ray_address,
        batch_size=batch_size,
        max_file_bytes=max_file_bytes,
        max_pixels=max_pixels,
        allowed_roots=tuple(allowed_roots or ()),
    )
    log = log or (lambda msg: None)
    tm = tf.read_manifest(table)
    roots = table_roots(tm, cfg.allowed_roots)

    settings = mp.decode_settings(cfg.max_pixels, cfg.max_file_bytes)
    index_uri = io.join(cache, cf.INDEX_DIR, _index_key(tm, table, where, spec, roots, settings) + ".json")
    try:
        entry = io.read_json(index_uri)
    except (SourceError, CorruptArtifactError):  # no entry, or a damaged one: the index is only a hint
        entry = None
    if isinstance(entry, dict) and isinstance(entry.get("fingerprint"), str):
        hit = _reuse(cache, entry["fingerprint"], t0, log)
        if hit is not None:
            return hit

    runner = configure(cfg.runner, cfg.ray_address)
    if runner == "ray" and "memory" in (io.protocol(table), io.protocol(cache)):
        raise ConfigError("memory:// lives in one process; use --runner native or a shared location")
    df = mp.table_frame(table, tm, where)
    staging = io.join(cache, STAGING_DIR)
    try:
        # the selection is planned once (counts, numbering, digests) and kept on disk until the build is done
        with selection.selected(df, roots=roots, classes=list(tm.classes), rows_per_shard=cfg.rows_per_shard,
                                runner=runner, staging=staging, table_uri=table, where=where,
                                rows=tm.num_rows) as sel:
            return _build(sel, table, tm, cache, index_uri, spec, settings, roots, cfg, runner, log, t0)
    except NoSpaceError:
        raise
    except Exception as e:
        # A full disk that reached here without a name: the selection's staging files (a local temporary folder on
        # the native runner, under the cache root on Ray's), or a write in a Ray worker or in Daft's Rust writer,
        # which arrives as text inside their errors (``io.no_space`` reads it)
        named = io.no_space(e, staging if runner == "ray" else tempfile.gettempdir())
        if named is None:
            raise
        raise named from e
    finally:
        _remove_empty(staging)  # the Ray runner's staging folder, once no materialize stages there


def _build(sel: selection.Selection, table: str, tm: tf.TableManifest, cache: str, index_uri: str,
           spec: TransformSpec, settings: dict, roots: list[str], cfg: MaterializeConfig, runner: str,
           log: Callable[[str], None], t0: float) -> MaterializeResult:
    """From a planned selection to a committed cache (or the committed cache of the same fingerprint)."""
    where = cfg.where
    n = sel.counts
    if n["outside"]:
        log(f"materialize: {n['outside']} rows {OUTSIDE_ROOTS} skipped: "
            + refusal(n["outside_example"], roots))
    if runner == "ray" and n["memory"]:
        raise ConfigError("the table names memory:// images, which live in one process; use --runner native")
    selected = sel.selected
    fp = mp.fingerprint([b[2] for b in sel.blocks], list(tm.classes), spec, settings)
    hit = _reuse(cache, fp, t0, log)
    if hit is not None:
        io.write_json_atomic(index_uri, {"fingerprint": fp})
        return hit
    if not selected:
        if n["outside"]:
            raise SourceError(
                f"table {table!r}: every readable row{f' matching {where!r}' if where else ''} is "
                f"{OUTSIDE_ROOTS} ({n['outside']} rows); " + refusal(n["outside_example"], roots)
            )
        raise SourceError(
            f"table {table!r} has no readable rows{f' matching {where!r}' if where else ''} "
            f"({n['errors']} error rows); check the table with `dutycycle inspect` or the filter"
        )

    out = io.join(cache, fp)
    num_shards = -(-selected // cfg.rows_per_shard)
    log(f"materialize: {selected} samples in {num_shards} shards -> {out} ({runner} runner)")
    try:
        if runner == "ray":
            records = build.build_on_ray(sel, out, spec, list(tm.classes), cfg, num_shards, log)
        else:
            records = build.build_native(sel, out, spec, list(tm.classes), cfg, num_shards, selected, log)
        assert sorted(records) == list(range(num_shards)), "every shard must report exactly once"
        return _commit(records, sel, fp, table, tm, cache, index_uri, spec, cfg, runner, roots, t0)
    finally:
        # whole shards and their records stay for a rerun; the folders of a run that wrote nothing go
        _remove_empty(io.join(out, cf.SHARD_DIR))
        _remove_empty(out)


def _commit(records: dict[int, dict], sel: selection.Selection, fp: str, table: str, tm: tf.TableManifest,
            cache: str, index_uri: str, spec: TransformSpec, cfg: MaterializeConfig, runner: str, roots: list[str],
            t0: float) -> MaterializeResult:
    """The manifest of the built shards, committed: the index entry, the manifest, ``latest`` (module doc, 4)."""
    where, n, out = cfg.where, sel.counts, io.join(cache, fp)
    num_shards, selected = len(records), sel.selected

    skipped: Counter[str] = Counter()
    if n["errors"]:
        skipped["table_error"] = n["errors"]
    if n["outside"]:
        skipped[SKIP_KEY] = n["outside"]
    if n["rows"] - n["errors"] - n["outside"] - selected:
        skipped["duplicate"] = n["rows"] - n["errors"] - n["outside"] - selected
    split_counts: Counter[str] = Counter()
    for rec in records.values():
        skipped.update(rec["skipped"])
        split_counts.update(rec["split_counts"])
    # exact integer sums per shard, added in shard order: the same statistics on either runner
    totals = stats.combine(records[i]["pixel_sums"] for i in range(num_shards))
    shards = [cf.ShardInfo(**records[i]["shard"]) for i in range(num_shards) if records[i]["shard"]]
    seconds = time.perf_counter() - t0
    manifest = cf.CacheManifest(
        fingerprint=fp,
        shape=list(spec.shape),
        layout=spec.layout,
        dtype=spec.dtype,
        num_samples=sum(s.rows for s in shards),
        shards=shards,
        classes=list(tm.classes),
        split_counts=dict(split_counts),
        spec=spec.to_dict(),
        source=table,
        skipped=dict(skipped),
        options={
            "where": where or "",
            "table_version": tm.version,
            "roots": roots,
            "rows_per_shard": cfg.rows_per_shard,
            "runner": runner,
            "seconds": round(seconds, 3),
            "created_at": time.time(),
        },
        channel_stats=stats.channel_stats(totals),
    )
    if manifest.num_samples == 0:
        raise SourceError(
            f"no row of table {table!r} could be decoded (skipped: {dict(skipped)}); check the source images"
        )
    try:
        io.write_json_atomic(index_uri, {"fingerprint": fp})
        cf.commit(out, manifest)
        try:
            _point_latest(cache, fp)
        except BaseException:
            _take_back(out, manifest)
            raise
    except BaseException:
        _remove_quietly(index_uri)  # written by this run for this fingerprint, which is not committed
        _remove_empty(io.join(cache, cf.INDEX_DIR))
        raise
    resumed = sum(rec["status"] == "resumed" for rec in records.values())
    return MaterializeResult(
        uri=out,
        manifest=manifest,
        reused=False,
        seconds=seconds,
        shards_written=num_shards - resumed,
        shards_resumed=resumed,
    )


def _take_back(out: str, manifest: cf.CacheManifest) -> None:
    """Remove the manifest this run committed at ``out`` (its ``latest`` could not be written), unless another
    run's manifest has replaced it meanwhile (its commit time differs): the shards stay, and a rerun commits."""
    uri = io.join(out, cf.MANIFEST)
    try:
        if io.read_json(uri) == manifest.to_json():
            _remove_quietly(uri)
    except (SourceError, CorruptArtifactError, OSError):
        pass


def _remove_quietly(uri: str) -> None:
    fs, path = io.filesystem(uri)
    try:
        fs.rm(path)
    except (FileNotFoundError, OSError):
        pass


def _remove_empty(uri: str) -> None:
    """Remove the local folder ``uri`` if it exists and is empty (object stores have no folders to leave)."""
    if io.protocol(uri) != "file":
        return
    try:
        os.rmdir(uri[len("file://"):] if uri.startswith("file://") else uri)
    except OSError:  # missing, or not empty: in use by a run, or holding whole shards for a rerun
        pass


def open_cache(uri: str, verify: bool = True) -> CacheReader:
    """A reader over a committed cache folder or a cache root (its ``latest`` or only committed cache)."""
    return CacheReader(uri, verify=verify)


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
