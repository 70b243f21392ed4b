"""Naming a full disk: a write that ran out of room (ENOSPC, or EDQUOT: a quota) becomes a ``NoSpaceError`` that
names the device, the path and the bytes the write needed, also when the error crossed a process or language
boundary as text (a Ray task's, Daft's Rust writer's). ``io`` re-exports ``no_space``: writers call ``io.no_space``.
"""

from __future__ import annotations

import ast
import errno
import os
import re

from .errors import NoSpaceError


def _device_of(path: str) -> str:
    """The mount point (and its device) holding local ``path``, from ``/proc/self/mounts``: what a user frees room
    on. ``path`` itself may not exist yet, so its nearest existing ancestor is asked."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and p != os.path.dirname(p):
        p = os.path.dirname(p)
    best, device = "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                dev, mount = line.split()[:2]
                mount = mount.replace("\\040", " ")
                inside = p == mount or p.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, device = mount, dev
    except OSError:
        pass
    return f"{best} ({device})" if best else p


# How a full disk reads once it has crossed a process or language boundary as text (a Ray task error, an error
# of Daft's Rust writers): Python's strerror, Rust's ``io::Error`` ("... (os error 28)"), and this module's own
# message (a ``NoSpaceError`` raised in a worker, re-raised by Ray and Daft inside their own errors).
_NO_SPACE_TEXT = re.compile(r"No space left on device|os error 28\b|Errno 28\b")
_QUOTA_TEXT = re.compile(r"Disk quota exceeded|os error 122\b|Errno 122\b")
_OURS = re.compile(r"(no space left|quota exceeded) on (.+?) at ('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")"
                   r"(?:; the write needed ([\d,]+) bytes)?: free room there or choose another location")


def no_space(exc: BaseException, path: str, needed: int | None = None) -> NoSpaceError | None:
    """A ``NoSpaceError`` naming the device, ``path`` and the bytes ``needed`` when ``exc`` (or its cause) is ENOSPC
    or EDQUOT; None for any other error, which the caller handles as before. Use as
    ``except OSError as e: raise (io.no_space(e, path, n) or e) from e``, after removing what the write left.

    An error that crossed a process boundary (a Ray task's, Daft's) carries no errno, only text: a
    ``NoSpaceError`` raised in a worker is recovered from its message with the worker's device, path and bytes;
    an OS error's text ("No space left on device", "os error 28") is named at ``path``, the location the
    caller was writing under. A ``NoSpaceError`` in the chain is returned as it is."""
    chain = _chain(exc)
    for e in chain:
        if isinstance(e, NoSpaceError):
            return e
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return _no_space_error(path, needed, quota=e.errno == errno.EDQUOT)
    text = "\n".join(str(e) for e in chain)
    ours = _OURS.search(text)
    if ours:
        _, device, quoted, size = ours.groups()
        return NoSpaceError(ours.group(0), device=device, path=ast.literal_eval(quoted),  # a repr: literals only
                            needed=int(size.replace(",", "")) if size else None)
    quota = bool(_QUOTA_TEXT.search(text))
    if quota or _NO_SPACE_TEXT.search(text):
        return _no_space_error(path, needed, quota=quota)
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes (explicit, else implicit), each once."""
    out: list[BaseException] = []
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _no_space_error(path: str, needed: int | None, quota: bool) -> NoSpaceError:
    local = "://" not in path or path.startswith("file://")
    where = path[len("file://"):] if path.startswith("file://") else path
    device = _device_of(where) if local else path.split("://", 1)[0] + " storage"
    what = "quota exceeded" if quota else "no space left"
    size = f"; the write needed {needed:,} bytes" if needed is not None else ""
    return NoSpaceError(f"{what} on {device} at {path!r}{size}: free room there or choose another location",
                        device=device, path=path, needed=needed)
