"""``vacuum``: delete the data files of a table that no committed manifest names.

Writers never delete: a killed ingest, or one that lost a commit race, leaves its data files behind, and a
copy-on-write rewrite leaves the old file to the versions that still name it. ``vacuum`` removes what no
manifest references, but only once a grace period has passed, counted in the table's own time:

- a file that a committed version named and a later one dropped counts from when it left the table (the
  dropping version's commit time, recorded in the manifests' ``removed`` lists, as Delta Lake's remove actions
  do), so a reader that opened an older version (a notebook, a running materialize whose lazy plan reads the
  files again) keeps its files for the whole grace, however old the files themselves are;
- a file no version ever named (an ingest still running, or one that was killed) counts from its modification
  time, so a running writer's uncommitted files survive.

``keep_versions`` first expires old manifests (all but the newest K), which frees the files only they named
once their grace has passed; by default every version is kept.

Only what a table writer creates is considered: ``*.parquet`` files inside version folders (``v00001-xxxx/``)
and leftover temporary and probe files; anything else in the folder (a contact sheet, notes) is left alone.
"""

from __future__ import annotations

import posixpath
import re
import time
from collections.abc import Iterable
from typing import Any

from .. import io
from ..errors import ConfigError, SourceError
from . import format as tf
from .commit import WRITE_PROBE_PREFIX

DEFAULT_GRACE_SECONDS = 3600.0
_DATA_FOLDER = re.compile(r"^v\d+(-[0-9a-f]+)?$")
_LEFTOVER_PREFIXES = (WRITE_PROBE_PREFIX, io.PROBE_PREFIX)


def _mtime(info: dict[str, Any]) -> float | None:
    """Seconds since the epoch at which a file was last written, from an fsspec ``info`` dict."""
    for key in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        try:
            return float(value)
        except (TypeError, ValueError):
            continue
    return None


def _candidates(table_uri: str) -> dict[str, dict[str, Any]]:
    """Writer-made files under the table: path relative to the root -> fsspec info."""
    fs, root = io.filesystem(table_uri)
    root = root.rstrip("/")
    fs.invalidate_cache(root)
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        return {}
    out = {}
    for path, info in found.items():
        if info.get("type") != "file":
            continue
        rel = path[len(root) + 1 :] if path.startswith(root + "/") else posixpath.basename(path)
        parts = rel.split("/")
        is_data = len(parts) == 2 and _DATA_FOLDER.match(parts[0]) and parts[1].endswith(".parquet")
        if is_data or ".tmp-" in parts[-1] or parts[-1].startswith(_LEFTOVER_PREFIXES):
            out[rel] = info
    return out


def _read_versions(table: str, versions: Iterable[int]) -> dict[int, tf.TableManifest]:
    out = {}
    for v in versions:
        try:
            out[v] = tf.read_manifest(table, v)
        except SourceError:
            pass  # expired meanwhile by another vacuum
    return out


def _left_at(manifests: dict[int, tf.TableManifest]) -> dict[str, float]:
    """When each file left the table: the latest time a manifest recorded its removal."""
    left: dict[str, float] = {}
    for m in manifests.values():
        for record in m.removed:
            left[record["path"]] = max(float(record["at"]), left.get(record["path"], 0.0))
    return left


def vacuum(
    table: str,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    keep_versions: int | None = None,
    dry_run: bool = False,
) -> dict[str, Any]:
    """Remove unreferenced data files whose grace has passed; returns what was (or would be) removed.

    A file's grace counts from when it left the table, or, for a file no version named, from its last write."""
    if grace_seconds < 0:
        raise ConfigError(f"--grace-seconds {grace_seconds} must be >= 0 (seconds a file is left alone)")
    if keep_versions is not None and keep_versions < 1:
        raise ConfigError(f"--keep-versions {keep_versions} must be at least 1, or omitted to keep all")
    versions = tf.committed_versions(table)
    if not versions:
        tf.read_manifest(table)  # raises the usual "no committed metadata table" error
    expired = versions[:-keep_versions] if keep_versions else []
    # Every manifest is read before any expires: together they say when each file left the table.
    manifests = _read_versions(table, versions)
    fs, _ = io.filesystem(table)
    if not dry_run:
        for v in expired:  # the newest manifest is never expired, so the table stays readable throughout
            try:
                fs.rm(io.filesystem(io.join(table, tf.manifest_path(v)))[1])
            except FileNotFoundError:
                pass  # another vacuum expired it first
    # Candidates are listed before the manifests are read again: a writer that commits in between is then seen
    # through its manifest, and a file written after the listing is no candidate at all.
    candidates = _candidates(table)
    live = [v for v in tf.committed_versions(table) if v not in expired]
    manifests.update(_read_versions(table, [v for v in live if v not in manifests]))
    referenced: set[str] = set()
    for v in live:
        if v in manifests:
            referenced.update(manifests[v].files)
    left_at = _left_at(manifests)
    clock = time.time()
    removed, recent, freed = [], 0, 0
    for rel, info in sorted(candidates.items()):
        if rel in referenced:
            continue
        mtime = _mtime(info)
        since = left_at.get(rel)
        if since is None:
            since = mtime  # never committed: possibly a running writer's, whose commit has not come yet
        elif mtime is not None:
            since = max(since, mtime)  # a file cannot have left before it was written (clocks disagree)
        if since is None or clock - since < grace_seconds:
            recent += 1
            continue
        removed.append(rel)
        freed += int(info.get("size") or 0)
        if not dry_run:
            try:
                fs.rm(io.filesystem(io.resolve_inside(table, rel, "table"))[1])
            except FileNotFoundError:
                pass  # another vacuum removed it first
    if not dry_run:
        _remove_empty_folders(table, {rel.split("/")[0] for rel in removed if "/" in rel})
    return {
        "table": table,
        "versions": len(live),
        "expired_versions": expired,
        "removed_files": removed,
        "removed_bytes": freed,
        "kept_recent": recent,
        "dry_run": dry_run,
    }


def _remove_empty_folders(table: str, folders: set[str]) -> None:
    fs, _ = io.filesystem(table)
    for name in folders:
        _, path = io.filesystem(io.join(table, name))
        try:
            if not fs.ls(path, detail=False):
                fs.rmdir(path)
        except (FileNotFoundError, OSError, NotImplementedError):
            pass  # object stores have no folders to remove
