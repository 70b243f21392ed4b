"""Ray mode's batches handed over through shared memory: the read task gathers a batch's pixels straight into a
file in the consumer's shared-memory folder, and the consumer maps that file and hands out tensors over it.

Returned through Ray's object store, a batch is copied three times: the task's gather into a fresh array, Ray's
copy of that array into the object store, and the consumer's copy out of it (object-store memory is read-only
and shared, so a tensor the trainer may write cannot alias it). Here the gather is the only copy, the one torch's
DataLoader makes too (its workers collate straight into shared memory): the task opens a file the size of the
batch under the consumer's folder, reserves its pages (``posix_fallocate``: a full ``/dev/shm`` is an error to
fall back from, never a SIGBUS in the middle of a write), gathers into a writable map of it, and returns the
file's name with the labels and ids. The consumer maps the file (writable, shared with no one once the task is
done), unlinks it at once, and the pages go back to the system when the last tensor over them is freed.

Only a task on the consumer's node can use its folder: a task Ray placed on another node (its node is busy, or
gone) returns the batch through the object store, as does a task that finds no room. The folder
(``/dev/shm/dutycycle-batches-<pid>-<random>``, 0700) holds only batches in flight; it is removed when its
owner closes or exits, and a folder whose owner process is gone (killed) is removed by the next one made.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import tempfile
import uuid
import weakref
from dataclasses import dataclass

import numpy as np

ROOT = "/dev/shm"  # tmpfs on Linux; where it does not exist, batches travel through Ray's object store
PREFIX = "dutycycle-batches-"


@dataclass(frozen=True)
class Handoff:
    """Where a read task may leave its batch: the consumer's node, its folder there and the file's name (chosen
    by the consumer, so it can remove the file of a task it cancelled whatever the task's outcome)."""

    node_id: str
    folder: str
    name: str = ""  # empty: the task picks one

    @staticmethod
    def new_name() -> str:
        return f"batch-{uuid.uuid4().hex}"

    @property
    def path(self) -> str:
        return os.path.join(self.folder, self.name) if self.name else ""


@dataclass(frozen=True)
class SharedBatch:
    """A read task's batch pixels, left in a file of the consumer's folder (what travels back is this name)."""

    path: str
    shape: tuple[int, ...]


class BatchFolder:
    """A consumer's folder for the batches in flight to it; ``close()`` (or the owner's exit) removes it."""

    def __init__(self, root: str = ROOT):
        sweep(root)
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root)  # mode 0700
        self._remove = weakref.finalize(self, shutil.rmtree, self.path, True)

    def close(self) -> None:
        self._remove()

    def open(self, batch: SharedBatch) -> np.ndarray:
        """The batch's pixels as a writable array over the file's pages (no copy); the file is unlinked now, so
        the memory lives exactly as long as the array (and the tensors over it)."""
        # a name that came back from a task is data: it must be a file of this folder, not any path
        if os.path.dirname(batch.path) != self.path or not os.path.basename(batch.path).startswith("batch-"):
            raise ValueError(f"a read task returned {batch.path!r}, outside this loader's folder {self.path!r}")
        nbytes = int(np.prod(batch.shape))
        fd = os.open(batch.path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            os.unlink(batch.path)
            if nbytes == 0:
                return np.empty(batch.shape, np.uint8)
            mm = mmap.mmap(fd, nbytes)  # MAP_SHARED, read and write: the task is done with it
        finally:
            os.close(fd)
        return np.frombuffer(mm, np.uint8, nbytes).reshape(batch.shape)  # keeps ``mm`` alive as its base

    def discard(self, batch: SharedBatch) -> None:
        """Remove a batch nobody will open (its task was cancelled after it finished)."""
        self.discard_path(batch.path)

    def discard_path(self, path: str) -> None:
        if os.path.dirname(path) == self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def available() -> bool:
    return os.path.isdir(ROOT) and os.access(ROOT, os.W_OK)


@contextlib.contextmanager
def batch_file(folder: str, shape: tuple[int, ...], name: str = ""):
    """In a read task: ``(out, path)``, ``out`` a writable uint8 array of ``shape`` over the new file ``path``
    in ``folder`` with its pages reserved, or None when there is no room (ENOSPC, EDQUOT) or the folder is gone
    (its consumer closed). The file is removed if the body fails; on success the task returns
    ``SharedBatch(path, shape)`` and the consumer opens it."""
    nbytes = int(np.prod(shape))
    path = os.path.join(folder, name or Handoff.new_name())
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:  # a retried task: the attempt that died left its file under the same name
            os.unlink(path)
            fd = os.open(path, flags, 0o600)
    except FileNotFoundError:
        yield None, path
        return
    ok = False
    try:
        if nbytes:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                yield None, path
                return
            mm = mmap.mmap(fd, nbytes)
            out = np.frombuffer(mm, np.uint8, nbytes).reshape(shape)
        else:
            out = np.empty(shape, np.uint8)
        yield out, path
        ok = True
    finally:
        os.close(fd)
        if not ok:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def sweep(root: str = ROOT) -> None:
    """Remove batch folders whose owner process no longer exists (a consumer that was killed)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except PermissionError:  # another user's process, alive
            pass
