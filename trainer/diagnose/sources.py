"""Which data the experiments of ``dutycycle diagnose`` read: the run's own (``data.source`` and its table or
cache), never a path a config only inherited. A raw config whose base config names a cache that was never
materialized here (as ``configs/demo.toml`` names the demo's) once failed the loader experiment on "no committed
cache at ..."; a synthetic config that names a cache read it."""

from __future__ import annotations

import os
from typing import Any

from dutycycle.engine import io, open_cache
from dutycycle.engine.errors import SourceError

from .context import variant


def _same_uri(a: str, b: str) -> bool:
    def norm(u: str) -> str:
        return os.path.abspath(u) if io.protocol(u) == "file" else u.rstrip("/")

    return bool(a) and bool(b) and norm(a) == norm(b)


def table_of(cfg) -> str | None:
    """The metadata table the run's own data comes from: ``data.table`` for the raw path; for a cache, the table
    it was materialized from (its manifest's), else ``data.table``; none for synthetic data. A ``data.table`` or
    ``data.cache`` a synthetic or raw config inherited from a base config is no path of this run's data."""
    d = cfg.data
    if d.source == "raw":
        return d.table
    if d.source == "cache":
        return open_cache(d.cache, verify=False).manifest.source or d.table or None
    return None


def own_cache(cfg) -> tuple[str | None, str]:
    """The cache of the run's own data, and why there is none: ``data.cache`` for a cache run; for a raw run,
    ``data.cache`` only when it is a committed cache materialized from ``data.table`` at ``data.size`` (a base
    config's cache, of other data or never materialized here, is not measured: the loader experiment once
    failed on "no committed cache" for a raw config whose base config named one)."""
    d = cfg.data
    if d.source == "cache":
        return d.cache, ""
    if d.source != "raw":
        return None, "synthetic data has no cache"
    if not d.cache:
        return None, "data.cache is not set: no cache of data.table to compare"
    try:
        m = open_cache(d.cache, verify=False).manifest
    except SourceError as e:
        return None, f"data.cache = {d.cache!r} is no committed cache ({e})"
    if not _same_uri(m.source, d.table):
        return None, f"data.cache = {d.cache!r} was materialized from {m.source!r}, not data.table = {d.table!r}"
    if m.spec.get("size", d.size) != d.size:
        return None, f"data.cache = {d.cache!r} holds {m.spec.get('size')} px samples, not data.size = {d.size}"
    return d.cache, ""


def loader_sources(cfg) -> tuple[list[tuple[str, Any]], dict[str, str]]:
    """The configs the loader experiment reads, by source name: the configured source, and the other path to the
    same data (a raw run's own cache, a cache's source table decoded per step); and, by name, why a path was not
    measured."""
    d = cfg.data
    out, skipped = [(d.source, variant(cfg))], {}
    if d.source == "raw":
        cache, why = own_cache(cfg)
        if cache:
            out.append(("cache", variant(cfg, "data.source=cache", f"data.cache={cache}")))
        else:
            skipped["cache"] = why
    elif d.source == "cache":
        table = table_of(cfg)
        if table:
            size = open_cache(d.cache, verify=False).manifest.spec.get("size", d.size)
            out.append(("raw", variant(cfg, "data.source=raw", f"data.table={table}", f"data.size={size}")))
        else:
            skipped["raw"] = "the cache records no source table and data.table is not set"
    return out, skipped
