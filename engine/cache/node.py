"""Node-local state that every process on a machine shares: a folder, file locks, and "checked once" records.

A node runs many processes that read the same cache (a training job's ranks, Ray workers, DataLoader workers).
Work that depends only on a file's content is done once per node, not once per process: the first process
takes a lock, does it, and leaves a record; the others find the record. Here:

- ``verify_once``: a shard's sha256 is computed once per node per version of the file (its path, device, inode,
  size, modification time and status-change time); a changed file is hashed again, so a rewritten or damaged
  shard is still refused. The status-change time (ctime) is there because the modification time is not proof:
  a file rewritten in place keeps its inode, and ``touch -d``, ``cp -p`` or ``os.utime`` set its mtime back to
  the recorded one, but no call sets ctime, which any such change moves to "now".
- ``file_lock``: an exclusive ``flock`` on a file under the node folder (released by the kernel when its
  process dies, so a killed process never leaves a lock behind).

The folder is ``$DUTYCYCLE_NODE_DIR`` when set, else ``<tmp>/dutycycle-node-<uid>``: node-local storage, since
a shared file system would share locks and records across nodes that do not share page caches.

Trust: the default folder sits in a shared ``/tmp``, where another user could create it first and fill it with
"verified" records, shard copies or split indexes. So the folder is created with mode 0700 and used only while
it is a directory owned by this user with no group or other permissions (otherwise ``NodeDirError``); and each
record in it counts only while it is a regular file owned by this user with a private mode (``trusted``): a
record that is not is ignored and the work it records done again (a shard hashed again, a copy fetched again,
an index rebuilt). Records are written with mode 0600.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import stat
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from .. import io
from ..errors import DutycycleError
from ..roots import under

NODE_DIR_ENV = "DUTYCYCLE_NODE_DIR"
_HASH_CHUNK = 8 * 1024 * 1024
_PRIVATE = 0o077  # group and other permission bits: none allowed on the folder or a record
_log = logging.getLogger(__name__)


class NodeDirError(DutycycleError):
    """A node folder that another user could have written: not ours, not a directory, or not private."""


def node_dir(override: str | None = None) -> str:
    """The node-local folder: created with mode 0700 on first use, refused unless this user's and private."""
    path = override or os.environ.get(NODE_DIR_ENV) or os.path.join(tempfile.gettempdir(), f"dutycycle-node-{os.getuid()}")
    path = os.path.abspath(path)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # whatever the umask
    except FileExistsError:
        pass  # checked below like any existing folder: existing is not the same as ours
    # A symlink is judged, and used, by the folder it leads to; one that another user planted (in a shared
    # /tmp, anyone may) is refused outright, since they could point it elsewhere at any time.
    real = os.path.realpath(path)
    try:
        link, st = os.lstat(path), os.lstat(real)
    except OSError as e:
        raise NodeDirError(
            f"node folder {path!r} cannot be used ({e}); set {NODE_DIR_ENV} to a private folder of yours"
        ) from e
    why = None
    if stat.S_ISLNK(link.st_mode) and link.st_uid != os.getuid():
        why = f"is a symlink owned by uid {link.st_uid}, not by this user (uid {os.getuid()})"
    elif not stat.S_ISDIR(st.st_mode):
        why = "is not a directory"
    elif st.st_uid != os.getuid():
        why = f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        why = f"has mode {stat.S_IMODE(st.st_mode):o}, writable by other users (needs 700)"
    elif st.st_mode & _PRIVATE:
        # ours and writable by no one else (say 755): nothing in it can be another user's, so it is made private
        # rather than refused; its records are still checked one by one (trusted)
        os.chmod(real, 0o700)
    if why:
        raise NodeDirError(
            f"node folder {path!r}{f' (-> {real!r})' if real != path else ''} {why}: another user could plant "
            f"verified-shard records or shard copies in it, or read them, so it is not used; remove it, "
            f"`chmod 700` it if it is yours, or set {NODE_DIR_ENV} to a private folder of yours"
        )
    return real


def trusted(path: str) -> bool:
    """Whether the record ``path`` in the node folder may be believed: a regular file (not a link), owned by
    this user, with no group or other permissions, as ``write_file_atomic`` leaves it. False when missing."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & _PRIVATE


@contextmanager
def file_lock(path: str) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing) for the ``with`` block; blocks until free."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def lock_path(root: str, key: str) -> str:
    """One of 256 lock files for ``key``: enough to keep unrelated work apart without a file per shard."""
    return os.path.join(root, "locks", f"{key[:2]}.lock")


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_file_atomic(path: str, data: bytes) -> None:
    """Replace ``path`` atomically. Not fsynced, unlike ``io.write_bytes_atomic``: these are node-local records,
    and one lost in a power cut only means the work it records is done again. The temporary file is removed on
    any failure; a full disk is a ``NoSpaceError`` naming the device and ``path``."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        # 0600 and O_EXCL: what ``trusted`` expects of a record, on a name nobody else can have prepared
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:  # never created (no folder, no room for the name): the write's own error is the news
            pass
        if isinstance(e, OSError):
            raise (io.no_space(e, path, len(data)) or e) from e
        raise


def _version_key(path: str, st: os.stat_result, sha256: str, root: str) -> str:
    """The record name of ``path``'s current version (``st``) holding ``sha256``. A node copy of a remote shard
    (a file inside the node folder ``root``) is keyed without its ctime: dutycycle moves that ctime itself, by
    the rename that lands the copy and by the access-time touch of every use (eviction goes by access time), and
    the copy lives in a folder only this user writes, where it is only ever replaced by a rename (a new inode),
    never rewritten in place."""
    real = os.path.realpath(path)
    ctime = 0 if under(real, root) else st.st_ctime_ns
    ident = f"{real}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{ctime}\0{sha256}"
    return hashlib.sha256(ident.encode()).hexdigest()


def _marker(root: str, key: str) -> str:
    return os.path.join(root, "verified", key[:2], key)


def _recorded(marker: str, path: str, root: str) -> bool:
    """Whether ``marker`` vouches for ``path``: only a trusted record does, and for a file inside the node
    folder (a node copy of a shard) only when that file is trusted too."""
    if not trusted(marker):
        return False
    inside = under(os.path.realpath(path), root)
    return not inside or trusted(path)


def verify_once(path: str, sha256: str, size: int, root: str) -> tuple[bool, bool]:
    """``(ok, hashed)``: whether the local file ``path`` has ``size`` bytes and sha256 ``sha256``, and whether
    this call hashed it. A file is hashed at most once per node for each version (path, device, inode, size,
    mtime); concurrent callers hash it once: the others wait on the lock and then find the record. A record
    that is not ``trusted`` is ignored: the file is hashed again and the record rewritten. ``root``: the node
    folder, as ``node_dir`` returned it."""
    st = os.stat(path)
    if st.st_size != size:
        return False, False
    key = _version_key(path, st, sha256, root)
    marker = _marker(root, key)
    if _recorded(marker, path, root):
        return True, False
    with file_lock(lock_path(root, key)):
        if _recorded(marker, path, root):
            return True, False
        ok = sha256_file(path) == sha256
        after = os.stat(path)
        if ok and _version_key(path, after, sha256, root) == key:  # not rewritten while we read it
            try:
                write_file_atomic(marker, path.encode())
            except (OSError, DutycycleError) as e:  # a full node disk: the shard is good, only not remembered
                _log.warning("could not record that %s was verified (%s); it is hashed again when next opened",
                             path, e)
        return ok, True


def mark_verified(path: str, sha256: str, root: str, *, landing: str | None = None) -> None:
    """Record that ``path`` (just written and hashed by the caller) has content ``sha256``; ``root`` as for
    ``verify_once``. ``landing``: the temporary file about to be renamed to ``path``. Recording it before the
    rename closes a window: a process that finds the file at ``path`` finds its record too, and does not hash
    it again (a rename keeps the inode, size and mtime the record names)."""
    st = os.stat(landing or path)
    write_file_atomic(_marker(root, _version_key(path, st, sha256, root)), path.encode())
