"""``vacuum``: delete the data files of a table that no committed manifest names.

Writers never delete: a killed ingest, or one that lost a commit race, leaves its data files behind, and a
copy-on-write rewrite leaves the old file to the versions that still name it. ``vacuum`` removes what no
manifest references, but only files older than a grace period, so the files of a writer that is still running
(written, not yet committed) survive. ``keep_versions`` first expires old manifests (all but the newest K),
which frees the files only they named; by default every version is kept.

Only what a table writer creates is considered: ``*.parquet`` files inside version folders (``v00001-xxxx/``)
and leftover temporary files (``*.tmp-*``); anything else in the folder (a contact sheet, notes) is left alone.
"""

from __future__ import annotations

import posixpath
import re
import time
from typing import Any

from .. import io
from ..errors import ConfigError
from . import format as tf

DEFAULT_GRACE_SECONDS = 3600.0
_DATA_FOLDER = re.compile(r"^v\d+(-[0-9a-f]+)?$")


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
        if is_data or ".tmp-" in parts[-1] or parts[-1].startswith(".write-probe-"):
            out[rel] = info
    return out


def vacuum(
    table: str,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    keep_versions: int | None = None,
    dry_run: bool = False,
) -> dict[str, Any]:
    """Remove unreferenced data files older than ``grace_seconds``; returns what was (or would be) removed."""
    if grace_seconds < 0:
        raise ConfigError(f"--grace-seconds {grace_seconds} must be >= 0 (seconds a file is left alone)")
    if keep_versions is not None and keep_versions < 1:
        raise ConfigError(f"--keep-versions {keep_versions} must be at least 1, or omitted to keep all")
    versions = tf.committed_versions(table)
    if not versions:
        tf.read_manifest(table)  # raises the usual "no committed metadata table" error
    expired = versions[:-keep_versions] if keep_versions else []
    fs, _ = io.filesystem(table)
    if not dry_run:
        for v in expired:  # the newest manifest is never expired, so the table stays readable throughout
            fs.rm(io.filesystem(io.join(table, tf.manifest_path(v)))[1])
    # Candidates are listed before the manifests are read: a writer that commits in between is then seen
    # through its manifest, and a file written after the listing is no candidate at all.
    candidates = _candidates(table)
    live = [v for v in tf.committed_versions(table) if v not in expired]
    referenced: set[str] = set()
    for v in live:
        referenced.update(tf.read_manifest(table, v).files)
    now = time.time()
    removed, recent, freed = [], 0, 0
    for rel, info in sorted(candidates.items()):
        if rel in referenced:
            continue
        mtime = _mtime(info)
        if mtime is None or now - mtime < grace_seconds:
            recent += 1  # possibly an ingest still running: its files are not committed yet
            continue
        removed.append(rel)
        freed += int(info.get("size") or 0)
        if not dry_run:
            fs.rm(io.filesystem(io.resolve_inside(table, rel, "table"))[1])
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
