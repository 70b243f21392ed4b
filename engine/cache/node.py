"""Node-local state that every process on a machine shares: a folder, file locks, and "checked once" records.

A node runs many processes that read the same cache (a training job's ranks, Ray workers, DataLoader workers).
Work that depends only on a file's content is done once per node, not once per process: the first process
takes a lock, does it, and leaves a record; the others find the record. Here:

- ``verify_once``: a shard's sha256 is computed once per node per version of the file (its path, inode,
  size and modification time); a changed file is hashed again, so a rewritten or damaged shard is still refused.
- ``file_lock``: an exclusive ``flock`` on a file under the node folder (released by the kernel when its
  process dies, so a killed process never leaves a lock behind).

The folder is ``$DUTYCYCLE_NODE_DIR`` when set, else ``<tmp>/dutycycle-node-<uid>``: node-local storage, since
a shared file system would share locks and records across nodes that do not share page caches.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

NODE_DIR_ENV = "DUTYCYCLE_NODE_DIR"
_HASH_CHUNK = 8 * 1024 * 1024


def node_dir(override: str | None = None) -> str:
    """The node-local folder (created on first use)."""
    path = override or os.environ.get(NODE_DIR_ENV) or os.path.join(tempfile.gettempdir(), f"dutycycle-node-{os.getuid()}")
    os.makedirs(path, exist_ok=True)
    return path


@contextmanager
def file_lock(path: str) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing) for the ``with`` block; blocks until free."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
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
    and one lost in a power cut only means the work it records is done again."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _version_key(path: str, st: os.stat_result, sha256: str) -> str:
    ident = f"{os.path.realpath(path)}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{sha256}"
    return hashlib.sha256(ident.encode()).hexdigest()


def _marker(root: str, key: str) -> str:
    return os.path.join(root, "verified", key[:2], key)


def verify_once(path: str, sha256: str, size: int, root: str | None = None) -> tuple[bool, bool]:
    """``(ok, hashed)``: whether the local file ``path`` has ``size`` bytes and sha256 ``sha256``, and whether
    this call hashed it. A file is hashed at most once per node for each version (path, device, inode, size,
    mtime); concurrent callers hash it once: the others wait on the lock and then find the record."""
    root = node_dir(root)
    st = os.stat(path)
    if st.st_size != size:
        return False, False
    key = _version_key(path, st, sha256)
    marker = _marker(root, key)
    if os.path.exists(marker):
        return True, False
    with file_lock(lock_path(root, key)):
        if os.path.exists(marker):
            return True, False
        ok = sha256_file(path) == sha256
        after = os.stat(path)
        if ok and _version_key(path, after, sha256) == key:  # not rewritten while we read it
            write_file_atomic(marker, path.encode())
        return ok, True


def mark_verified(path: str, sha256: str, root: str | None = None) -> None:
    """Record that ``path`` (just written and hashed by the caller) has content ``sha256``."""
    root = node_dir(root)
    write_file_atomic(_marker(root, _version_key(path, os.stat(path), sha256)), path.encode())
