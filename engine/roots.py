"""Where a table's rows may point: the source roots its ingest recorded, and the check that a row lies inside them.

A table's ``uri`` column is data, not a command: a crafted or shared table could name ``/etc/passwd``, another
user's files or any URL, and materialize, thumbnails and the raw loader would read them. So an ingest records the
source it listed (``options["roots"]`` in the table manifest; curated subsets inherit their parent's), and every
reader of rows refuses a row whose URI is not inside one of those roots or of the roots the caller allows
explicitly (``allowed_roots=[...]``, ``--allow-root``) for tables assembled from several sources. Inside means:
after normalization (``..`` resolved, one spelling per location) the URI is the root or below it, and for a local
path, below it once symlinks are resolved too (the containing folder, and the file itself when it is a link).

A table that records no roots (written by hand, or by a version before roots were recorded) counts its ``source``
as the root when that is a location and the table is not a subset; otherwise it has no roots and every row is
refused until roots are allowed explicitly.
"""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Iterable

OUTSIDE_ROOTS = "outside the table's source roots"
SKIP_KEY = "outside_roots"  # the key a cache manifest's ``skipped`` counts such rows under
_DIR_CACHE_LIMIT = 1 << 16  # resolved folders remembered per check (rows of one folder share one realpath)


def is_local(uri: str) -> bool:
    # a string test, not fsspec's protocol parse: it runs for every row a plan or a read checks
    return "://" not in uri or uri.startswith("file://")


def canonical(uri: str) -> str:
    """One spelling per location: a local path absolute and normalized (``file://`` dropped), ``memory://`` with
    one leading slash (as fsspec lists it), any other URI as ``scheme://`` plus its normalized path."""
    if is_local(uri):
        path = uri[len("file://"):] if uri.startswith("file://") else uri
        return os.path.abspath(path) if path else ""
    scheme, rest = uri.split("://", 1)
    scheme = scheme.lower()
    if scheme == "memory":
        rest = "/" + rest.lstrip("/")
    rest = posixpath.normpath(rest) if rest else ""
    return f"{scheme}://{'' if rest == '.' else rest}"


def under(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or inside it (both canonical, or both resolved local paths)."""
    if not root:
        return False
    if path == root:
        return True
    prefix = root if root.endswith("/") else root + "/"
    return path.startswith(prefix)


def is_location(value: str) -> bool:
    return isinstance(value, str) and ("://" in value or os.path.isabs(value))


def recorded_roots(manifest) -> list[str]:
    """The roots a table manifest records (see the module docstring for tables that record none)."""
    options = getattr(manifest, "options", None) or {}
    roots = options.get("roots")
    if isinstance(roots, list) and all(isinstance(r, str) and r for r in roots):
        return list(roots)
    lineage = getattr(manifest, "lineage", None) or {}
    source = getattr(manifest, "source", "")
    if roots is None and not lineage.get("parent") and is_location(source):
        return [source]
    return []


def table_roots(manifest, allowed: Iterable[str] | None = None) -> list[str]:
    """The table's recorded roots plus ``allowed``, canonical and without repeats."""
    out: list[str] = []
    for r in [*recorded_roots(manifest), *(allowed or ())]:
        if not isinstance(r, str) or not r.strip():
            continue
        c = canonical(r)
        if c and c not in out:
            out.append(c)
    return out


def describe(roots: list[str]) -> str:
    return ", ".join(roots) if roots else "none recorded"


def refusal(uri: str, roots: list[str]) -> str:
    """The message for a row refused as outside ``roots``, naming it and the way to allow it."""
    return (f"{OUTSIDE_ROOTS} ({describe(roots)}): {uri!r} is not read; if the table really spans several "
            "sources, name the extra ones with allowed_roots=[...] (--allow-root)")


class RootCheck:
    """``outside(uri)``: whether a row's URI lies outside every one of ``roots`` (canonical, see ``table_roots``).
    Remembers resolved folders, so checking many rows costs one ``lstat`` per local file."""

    def __init__(self, roots: Iterable[str]):
        self.roots = [canonical(r) for r in roots]
        self._real_roots = [os.path.realpath(r) for r in self.roots if is_local(r)]
        self._dirs: dict[str, str] = {}

    def _realdir(self, folder: str) -> str:
        real = self._dirs.get(folder)
        if real is None:
            if len(self._dirs) >= _DIR_CACHE_LIMIT:
                self._dirs.clear()
            real = self._dirs[folder] = os.path.realpath(folder)
        return real

    def outside(self, uri) -> bool:
        if not isinstance(uri, str) or not uri or "\x00" in uri:
            return True
        c = canonical(uri)
        if not any(under(c, r) for r in self.roots):
            return True
        if not is_local(c):
            return False
        folder, _, name = c.rpartition(os.sep)
        real = os.path.join(self._realdir(folder or os.sep), name)
        try:
            if stat.S_ISLNK(os.lstat(c).st_mode):
                real = os.path.realpath(c)
        except OSError:  # missing or unreadable: the read reports that; where it would be is what counts here
            pass
        return not any(under(real, r) for r in self._real_roots)

    def outside_mask(self, uris: Iterable[str | None]) -> list[bool]:
        return [self.outside(u) for u in uris]
