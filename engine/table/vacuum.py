"""``vacuum``: delete the data files of a table that no committed manifest names.

Writers never delete: a killed ingest, or one that lost a commit race, leaves its data files behind, and a
copy-on-write rewrite leaves the old file to the versions that still name it. ``vacuum`` removes what no
manifest references, but only once a grace period has passed, counted in the table's own time:

- a file that a committed version named and a later one dropped counts from when it left the table (the
  dropping version's commit time, recorded in the manifests' ``removed`` lists, as Delta Lake's remove actions
  do), so a reader that opened an older version (a notebook, a running materialize whose lazy plan reads the
  files again) keeps its files for the whole grace, however old the files themselves are;
- a file no version ever named (a killed or losing writer's) counts from its modification time.

Three rules keep it from ever making a version unreadable:

- it refuses to run while a write is in progress. A writer puts the new files of version N in its own folder
  ``vN-xxxxxxxx/`` and commits exactly version N (``format.py``), so a folder of a version above the newest
  committed one that holds a file written within ``MIN_GRACE_SECONDS`` is a write in progress (or one killed
  moments ago), and so is a manifest's temporary file that young: vacuum then raises ``WriteInProgress``
  before it expires or deletes anything, whatever the grace. A writer silent for longer than that is taken for
  killed; if it comes back, its commit finds its files gone and writes them again (``commit.try_commit``);
- the grace is at least ``MIN_GRACE_SECONDS`` (ten minutes) unless ``allow_short_grace`` (Delta Lake refuses a
  retention under seven days the same way unless its check is turned off): the grace is measured between this
  machine's clock and the store's modification times or a writer's commit time, so it must outlast the clock
  skew between machines (five minutes is the usual bound, e.g. Kerberos's default) and the pauses of a live
  writer between its writes;
- the files of the newest readable version are never removed: every manifest is read before anything is
  removed (one that is damaged, or that is not the version its name says, stops vacuum: it could name the
  files to keep), the ``_manifest.json`` copy's files are kept too, and the versions are listed once more
  right before the removals, so a version committed meanwhile keeps its files.

``keep_versions`` first expires old manifests (all but the newest K), which frees the files only they named
once their grace has passed; by default every version is kept.

Only what a table writer creates is considered: ``*.parquet`` files inside version folders (``v00001-xxxx/``)
and leftover temporary and probe files; anything else in the folder (a contact sheet, notes) is left alone.
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import Iterable
from typing import Any

from .. import io
from ..errors import ConfigError, DestinationError, SourceError
from . import format as tf
from .commit import WRITE_PROBE_PREFIX

DEFAULT_GRACE_SECONDS = 3600.0
# The shortest grace vacuum accepts without ``allow_short_grace``, and how long a writer's folder counts as in
# progress after its last write: ten minutes outlasts the clock skew between machines (five minutes is the
# usual bound) and a live writer's pauses between writes (an ingest commits seconds after its last file).
MIN_GRACE_SECONDS = 600.0
_LEFTOVER_PREFIXES = (WRITE_PROBE_PREFIX, io.PROBE_PREFIX)


class WriteInProgress(DestinationError):
    """A writer is writing or committing a version of the table: vacuum runs after it commits."""


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
        is_data = len(parts) == 2 and tf.folder_version(parts[0]) is not None and parts[1].endswith(".parquet")
        if is_data or ".tmp-" in parts[-1] or parts[-1].startswith(_LEFTOVER_PREFIXES):
            out[rel] = info
    return out


def _read_versions(table: str, versions: Iterable[int]) -> dict[int, tf.TableManifest]:
    out = {}
    for v in versions:
        try:
            out[v] = tf.read_manifest(table, v)
        except SourceError:
            pass  # expired meanwhile by another vacuum (never the newest: the table stays readable)
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
    allow_short_grace: bool = False,
) -> dict[str, Any]:
    """Remove unreferenced data files whose grace has passed; returns what was (or would be) removed.

    A file's grace counts from when it left the table, or, for a file no version named, from its last write.
    Raises ``WriteInProgress`` (and changes nothing) while a writer is writing or committing a version."""
    if not grace_seconds >= 0:  # NaN compares false both ways: as a grace it would remove everything at once
        raise ConfigError(f"--grace-seconds {grace_seconds} must be a number >= 0 (seconds a file is left alone)")
    if grace_seconds < MIN_GRACE_SECONDS and not allow_short_grace:
        raise ConfigError(
            f"--grace-seconds {grace_seconds:g} is below the minimum of {MIN_GRACE_SECONDS:g}: a reader that opened "
            "an older version, or a machine whose clock is behind, could lose files it reads; pass "
            "--allow-short-grace (allow_short_grace=True) only when no one reads older versions of the table"
        )
    if keep_versions is not None and keep_versions < 1:
        raise ConfigError(f"--keep-versions {keep_versions} must be at least 1, or omitted to keep all")
    versions = tf.committed_versions(table)
    # Every manifest is read before anything changes: together they say which files to keep and when each file
    # left the table. A damaged one raises here (it could name files to keep), as does the usual "no committed
    # metadata table" when there is neither a versioned manifest nor the ``_manifest.json`` copy.
    manifests = _read_versions(table, versions)
    pointer = tf.read_pointer(table) if versions else tf.read_manifest(table)
    # Candidates are listed before the versions are listed again: a writer that commits in between is then seen
    # through its manifest, and a file written after the listing is no candidate at all.
    candidates = _candidates(table)
    clock = time.time()
    versions = tf.committed_versions(table)
    manifests.update(_read_versions(table, [v for v in versions if v not in manifests]))
    # the newest version anyone reads: the ``_manifest.json`` copy's is the only one in a table that has no other
    busy = _in_progress(candidates, max([*versions, pointer.version if pointer else 0]), clock)
    if busy:
        raise WriteInProgress(
            f"table {table!r} has a write in progress ({busy}); vacuum does not run during a write, which "
            f"could commit files it removed: run it after the write commits, or, if the writer was killed, "
            f"{MIN_GRACE_SECONDS:g} s after its last write"
        )
    expired = versions[:-keep_versions] if keep_versions else []
    fs, _ = io.filesystem(table)
    if not dry_run:
        for v in expired:  # the newest manifest is never expired, so the table stays readable throughout
            try:
                fs.rm(io.filesystem(io.join(table, tf.manifest_path(v)))[1])
            except FileNotFoundError:
                pass  # another vacuum expired it first
    live = [v for v in versions if v not in expired]
    keep = _files_of([manifests[v] for v in live if v in manifests] + ([pointer] if pointer else []))
    left_at = _left_at(manifests)
    removed, recent, freed = [], 0, 0
    for rel, info in sorted(candidates.items()):
        if rel in keep:
            continue
        mtime = _mtime(info)
        since = left_at.get(rel)
        if since is None:
            since = mtime  # never committed: a killed or losing writer's
        elif mtime is not None:
            since = max(since, mtime)  # a file cannot have left before it was written (clocks disagree)
        if since is None or clock - since < grace_seconds:
            recent += 1
            continue
        removed.append(rel)
    # The last look before removing: versions committed since the listing above keep their files.
    late = [v for v in tf.committed_versions(table) if v not in manifests]
    late_keep = _files_of(_read_versions(table, late).values())
    removed = [rel for rel in removed if rel not in late_keep]
    for rel in removed:
        freed += int(candidates[rel].get("size") or 0)
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


def _files_of(manifests: Iterable[tf.TableManifest]) -> set[str]:
    return {f for m in manifests for f in m.files}


def _in_progress(candidates: dict[str, dict[str, Any]], newest: int, clock: float) -> str:
    """What shows a write in progress, in words ("" when nothing does): a data folder of a version above
    ``newest`` (no commit can have named its files) or a manifest's temporary file (a local commit between its
    write and its link), with a file written less than ``MIN_GRACE_SECONDS`` ago, or at an unknown time."""
    youngest: dict[str, float] = {}
    for rel, info in candidates.items():
        top = rel.split("/", 1)[0]
        version = tf.folder_version(top)
        if (version is not None and version > newest) or (top == tf.MANIFEST_DIR and ".tmp-" in rel):
            mtime = _mtime(info)
            age = clock - mtime if mtime is not None else float("-inf")
            youngest[top] = min(age, youngest.get(top, float("inf")))
    busy = sorted((age, top) for top, age in youngest.items() if age < MIN_GRACE_SECONDS)
    return "; ".join(
        f"{top}/ " + ("is being committed" if top == tf.MANIFEST_DIR else "holds files no version has committed")
        + (f", written {max(age, 0.0):.0f} s ago" if age > float("-inf") else ", written at an unknown time")
        for age, top in busy
    )


def _remove_empty_folders(table: str, folders: set[str]) -> None:
    fs, _ = io.filesystem(table)
    for name in folders:
        _, path = io.filesystem(io.join(table, name))
        try:
            if not fs.ls(path, detail=False):
                fs.rmdir(path)
        except (FileNotFoundError, OSError, NotImplementedError):
            pass  # object stores have no folders to remove
