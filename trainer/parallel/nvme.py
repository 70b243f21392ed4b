"""Optimizer state in files on local disk (``parallel.offload = "nvme"``): ZeRO-Infinity's way to train a model
whose optimizer state does not fit in host memory.

Parameters and gradients are offloaded as with ``offload = "optimizer"`` (FSDP2's ``CPUOffloadPolicy``). Every
state tensor of this rank's shard (Adam's two moments, SGD's momentum, ...) lives in its own memory-mapped file
under ``parallel.offload_dir`` (``FileStore``): the tensor keeps its identity and its values, only its storage is
the file's pages. The optimizer steps the parameters in chunks of about ``CHUNK_BYTES`` of state
(``attach``): before a chunk steps, the next chunk's files are asked in (``madvise(WILLNEED)``: the kernel reads
them while this chunk computes); after it steps, its pages are written (``msync``) and dropped from the process
and from the page cache (``madvise(DONTNEED)``, ``posix_fadvise(DONTNEED)``). So between steps the state holds no
host memory, and during a step about two chunks of it.

This setting serves fitting, not speed: every step reads the whole state from disk and writes it back once. The
update is the optimizer's own, elementwise, on the same tensors: training is bit-identical to ``offload =
"optimizer"`` (tested), and checkpoints save and load the state through DCP as they would any tensor (a state
loaded from a checkpoint arrives in host memory; the next step moves it back into files).

Checkpoints read the state from its files without bringing it back into memory (``FileSnapshot``,
``drop_pages``): an asynchronous save's snapshot of it is a copy of its files on the same disk, made by the kernel
(``copy_file_range``: no pages in this process; a reflink where the file system has them), which the save's writer
reads through read-only maps; a save, asynchronous or not, drops each tensor's pages once DCP has written it. So
a save holds at most one state tensor (this rank's shard of one parameter's moment) of it in memory at a time,
never more than a step holds (a step's chunk is at least one parameter's state), and none once it is written.

The files are this run's scratch, not a checkpoint: ``<offload_dir>/dutycycle-offload-<run>/rank<r>-<attempt>``,
removed when the rank ends; a rank that starts removes its earlier attempts' (a crash leaves them). A directory
on a network or shared file system is refused: every step rewrites the state, and another node's rank of the same
number would share the files.
"""

from __future__ import annotations

import atexit
import glob
import hashlib
import itertools
import mmap
import os
import shutil
import tempfile
import uuid

import torch
from dutycycle.engine.errors import ConfigError

from .fsdp_api import local_tensor as _local  # a DTensor's shard on this rank

CHUNK_BYTES = 64 * 2**20  # state stepped at once: the host memory a step needs beyond parameters and gradients
# file systems whose pages another machine can see or that live across a network: refused for offload_dir
IN_MEMORY_FS = {"tmpfs", "ramfs"}  # refused too: files there are host memory, the opposite of the point
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "9p", "ceph", "glusterfs", "lustre", "gpfs", "beegfs",
              "afs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone", "fuse.juicefs", "fuse.glusterfs",
              "virtiofs", "davfs", "fuse.davfs2"}
# storages that live in an offload file: data pointer -> bytes (memory.py counts them apart from host memory)
FILE_BACKED: dict[int, int] = {}
# every map of a file this module made, the live state's and snapshots': storage data pointer -> (map, path)
_MAPPED: dict[int, tuple[mmap.mmap, str]] = {}
COPY_BYTES = 64 * 2**20  # one copy_file_range call of a snapshot (the kernel copies; no pages in this process)


def mount_table() -> str:
    """This machine's mount table (the text of ``/proc/mounts``), empty where there is none."""
    try:
        with open("/proc/mounts") as f:
            return f.read()
    except OSError:
        return ""


def filesystem_type(path: str, mounts: str) -> str:
    """The file system type of ``path`` in the mount table ``mounts`` (``mount_table()``'s text): the entry with
    the longest mount point that contains it; ``"unknown"`` when none does."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind


def check_offload_dir(path: str) -> None:
    """Refuse a remote or shared ``parallel.offload_dir``, naming it and what to set instead."""
    if "://" in path:
        raise ConfigError(f"parallel.offload_dir = {path!r} is remote: offloaded optimizer state is rewritten every "
                          "step and must be on this node's local disk (an NVMe mount); set a local path")
    check_offload_filesystem(path, filesystem_type(path, mount_table()))


def check_offload_filesystem(path: str, kind: str) -> None:
    """Refuse an ``offload_dir`` on file system type ``kind`` that keeps files in memory or shares them."""
    if kind in IN_MEMORY_FS:
        raise ConfigError(f"parallel.offload_dir = {path!r} is on {kind}, which keeps its files in host memory, "
                          "the memory the offload is meant to free; set a path on local disk (an NVMe mount)"
                          + ("" if path != tempfile.gettempdir() else
                             " (the default is the system's temporary directory, in memory on this machine)"))
    if kind in NETWORK_FS or kind.startswith("nfs"):
        raise ConfigError(f"parallel.offload_dir = {path!r} is on a {kind} file system, shared or across a network: "
                          "offloaded optimizer state is rewritten every step and is this node's own; set a path on "
                          "local disk (an NVMe mount)")


def offload_root(parallel) -> str:
    """``parallel.offload_dir``, or the system's temporary directory when it is empty."""
    return parallel.offload_dir or tempfile.gettempdir()


class FileStore:
    """This rank's state files: one memory map per state tensor, ``back`` moves a tensor's storage into one."""

    def __init__(self, root: str, run_key: str, rank: int):
        check_offload_dir(root)
        run = os.path.join(root, f"dutycycle-offload-{run_key}")
        # Earlier attempts of this rank (a crash leaves their files): removed. Unlinking is safe even for an old
        # process still running: its maps stay valid until it unmaps them. Each attempt has its own directory,
        # so an old attempt that ends late removes only its own.
        for old in glob.glob(os.path.join(glob.escape(run), f"rank{rank}-*")):
            shutil.rmtree(old, ignore_errors=True)
        self.dir = os.path.join(run, f"rank{rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(self.dir)
        self._maps: dict[int, tuple[mmap.mmap, str]] = {}  # storage data pointer -> (map, path)
        self._names = itertools.count()
        self.bytes_written = 0
        self._closed = False
        _allow_open_files()
        atexit.register(self.close)

    def backed(self, t: torch.Tensor) -> bool:
        return _local(t).untyped_storage().data_ptr() in self._maps

    def back(self, t: torch.Tensor) -> None:
        """Move ``t``'s values into a new file and make the file's pages its storage (in place: the optimizer's
        state dict keeps the same tensor). A tensor already in a file stays."""
        local = _local(t)
        nbytes = local.untyped_storage().nbytes()
        if nbytes == 0 or self.backed(local):
            return
        assert local.is_contiguous() and local.storage_offset() == 0, "optimizer state is a whole contiguous tensor"
        path = os.path.join(self.dir, f"state-{next(self._names)}.bin")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the map holds its own descriptor (Python duplicates it): one per state tensor
        mapped = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
        with torch.no_grad():
            mapped.copy_(local.view(-1).view(torch.uint8))
            local.set_(mapped.untyped_storage(), 0, local.size(), local.stride())
        ptr = local.untyped_storage().data_ptr()
        self._maps[ptr] = _MAPPED[ptr] = (mm, path)
        FILE_BACKED[ptr] = nbytes

    def _entries(self, tensors):
        for t in tensors:
            entry = self._maps.get(_local(t).untyped_storage().data_ptr())
            if entry is not None:
                yield entry

    def prefetch(self, tensors) -> None:
        """Ask the kernel to read these tensors' files now (asynchronously)."""
        for mm, _ in self._entries(tensors):
            mm.madvise(mmap.MADV_WILLNEED)

    def release(self, tensors) -> None:
        """Write these tensors' pages to their files and drop them from this process and the page cache."""
        for mm, path in self._entries(tensors):
            mm.flush()
            self.bytes_written += len(mm)
            _drop(mm, path)

    def forget_unused(self, live: set[int]) -> None:
        """Drop the files of storages no state tensor uses any more (a checkpoint load replaced them)."""
        for ptr in [p for p in self._maps if p not in live]:
            _, path = self._maps.pop(ptr)
            FILE_BACKED.pop(ptr, None)
            _MAPPED.pop(ptr, None)
            os.unlink(path)  # the map itself goes with its last tensor

    def file_bytes(self) -> int:
        return sum(len(mm) for mm, _ in self._maps.values())

    def close(self) -> None:
        """Remove this attempt's files (the maps stay valid while tensors use them: an unlinked file lives until
        unmapped), and the run's directory once no other rank of this node has files in it. Once only: the loop
        closes it, and the exit handler calls it again."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for ptr in self._maps:
            FILE_BACKED.pop(ptr, None)
            _MAPPED.pop(ptr, None)
        self._maps.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(self.dir))
        except OSError:  # another rank's directory is still there (it removes the parent when it ends)
            pass


def _drop(mm: mmap.mmap, path: str) -> None:
    """Drop a map's pages from this process (a file's map: they are read again from the file if touched) and its
    clean pages from the page cache."""
    mm.madvise(mmap.MADV_DONTNEED)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # a snapshot already removed: its pages leave the cache with the file
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def mapped(t) -> bool:
    """Whether ``t`` is a tensor (or a DTensor whose shard is one) that lives in a file map of this module (the
    state's or a snapshot's)."""
    return isinstance(t, torch.Tensor) and _local(t).untyped_storage().data_ptr() in _MAPPED


def any_mapped() -> bool:
    return bool(_MAPPED)


def drop_pages(t: torch.Tensor) -> bool:
    """Drop the pages of ``t``'s file map from this process (and the page cache); the values stay, in the file.
    False (nothing done) for a tensor in ordinary memory, where dropping pages would lose it."""
    entry = _MAPPED.get(_local(t).untyped_storage().data_ptr())
    if entry is None:
        return False
    _drop(*entry)
    return True


class FileSnapshot:
    """A point-in-time copy of some state tensors' files, for a checkpoint to read while training goes on.

    ``FileSnapshot(tensors)`` copies each tensor's file (all of them in offload files: ``mapped``) to a new
    file beside it (this rank's scratch directory, the same file system) with ``copy_file_range``: the kernel
    moves the bytes, ``COPY_BYTES`` per call, through the page cache (both files' clean pages dropped after each
    file), never through this process, so the copy costs no host memory however large the state; on a file
    system with reflinks (XFS, Btrfs) it shares the blocks instead. ``copy(t)`` is a tensor like ``t`` (a DTensor
    too) over a private map of its copy that nothing writes to: it holds no pages until read, and ``drop_pages``
    drops them again. ``close()`` drops the pages and removes the files (a map still referenced stays valid: an
    unlinked file lives until it is unmapped).

    The copies need as much free space as the files they copy (none with reflinks), for as long as the save
    writes; on a disk without it the save fails (ENOSPC, raised as a ``DestinationError`` naming the checkpoint
    at the next wait), and the earlier commits stay.

    The live files are current when the copy starts (``release`` wrote every chunk back, and a page written
    through a map since is the page cache's own page, which the copy reads), and must not change until it ends:
    the optimizer step waits for it, as it waits for the stager's copy of the rest of the state."""

    _ids = itertools.count()

    def __init__(self, tensors):
        self.files: list[str] = []
        self._copies: dict[int, torch.Tensor] = {}  # live storage pointer -> the copy's tensor (local shard)
        tag = f"snapshot-{os.getpid()}-{next(self._ids)}"
        try:
            for t in tensors:
                local = _local(t)
                ptr = local.untyped_storage().data_ptr()
                if ptr in self._copies:
                    continue
                mm_live, source = _MAPPED[ptr]
                path = os.path.join(os.path.dirname(source), f"{tag}-{len(self.files)}.bin")
                self.files.append(path)
                _copy_file(source, path, len(mm_live))
                self._copies[ptr] = self._map(path, local)
        except BaseException:
            self.close()
            raise
        self.bytes = sum(os.path.getsize(p) for p in self.files)

    @staticmethod
    def _map(path: str, like: torch.Tensor) -> torch.Tensor:
        nbytes = like.untyped_storage().nbytes()
        fd = os.open(path, os.O_RDONLY)
        try:
            # private and writable only so that torch takes the buffer without a warning; nothing writes to it
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
        out = torch.empty(0, dtype=like.dtype).set_(raw.untyped_storage(), 0, like.size(), like.stride())
        _MAPPED[out.untyped_storage().data_ptr()] = (mm, path)
        return out

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """The snapshot of ``t`` (one of the tensors it was taken of), as ``t`` is: a DTensor keeps its mesh,
        placements and global shape."""
        local = self._copies[_local(t).untyped_storage().data_ptr()]
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                      stride=t.stride())
        return local

    def close(self) -> None:
        for local in self._copies.values():
            entry = _MAPPED.pop(local.untyped_storage().data_ptr(), None)
            if entry is not None:
                entry[0].madvise(mmap.MADV_DONTNEED)
        self._copies.clear()
        for path in self.files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.files = []


def _copy_file(source: str, dest: str, nbytes: int) -> None:
    """Copy ``nbytes`` of ``source`` into the new file ``dest`` inside the kernel, then drop both files' clean
    pages from the page cache."""
    src = os.open(source, os.O_RDONLY)
    try:
        dst = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            done = 0
            while done < nbytes:
                try:
                    n = os.copy_file_range(src, dst, min(COPY_BYTES, nbytes - done), done, done)
                except OSError:  # not supported here (an old kernel, another system): bounded reads and writes
                    n = _copy_chunk(src, dst, min(COPY_BYTES, nbytes - done), done)
                if n == 0:
                    raise OSError(f"{source} ended at byte {done} of {nbytes} while it was copied for a checkpoint")
                done += n
            os.posix_fadvise(dst, 0, 0, os.POSIX_FADV_DONTNEED)  # starts writing it back; clean pages go
        finally:
            os.close(dst)
        os.posix_fadvise(src, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(src)


def _copy_chunk(src: int, dst: int, n: int, offset: int) -> int:
    data = os.pread(src, n, offset)
    os.pwrite(dst, data, offset)
    return len(data)


def _allow_open_files() -> None:
    """Raise this process's soft limit on open files to its hard limit: every state tensor's map holds a
    descriptor (two per parameter with Adam), past the common soft limit of 1,024 at a few hundred parameters."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):  # not POSIX, or not allowed: the limit stays
        pass


_LIBC = None


def return_freed_memory() -> None:
    """Give the heap's free memory back to the kernel (glibc's ``malloc_trim``; nothing elsewhere). glibc keeps
    memory freed in the heap for reuse: the state created in memory by the first step and moved into files, a
    step's temporaries. Measured here (150 x 4 MiB parameters, AdamW, 1.2 GB of state): 2.75 GB private after the
    steps without it, 0.9 GB with it, 0.6 GB of which are the parameters."""
    global _LIBC
    try:
        if _LIBC is None:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
        _LIBC.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        _LIBC = False


def run_key(run_dir: str | None) -> str:
    """The same for every attempt of one run (its directory), different for two runs."""
    return hashlib.sha256(os.path.abspath(run_dir or os.getcwd()).encode()).hexdigest()[:12]


def _state_tensors(optimizer, params) -> list[torch.Tensor]:
    """The state tensors of ``params`` that grow with the parameter (Adam's ``step`` scalar stays in memory)."""
    out = []
    for p in params:
        for v in optimizer.state.get(p, {}).values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                out.append(v)
    return out


def _chunks(groups: list[list[torch.Tensor]], per_param_bytes, limit: int) -> list[list[list[torch.Tensor]]]:
    """Cut the parameters (kept in their groups and order) into chunks of about ``limit`` bytes of state; each
    chunk is a list of per-group parameter lists."""
    chunks, current, size = [], [[] for _ in groups], 0
    for gi, params in enumerate(groups):
        for p in params:
            if size and size + per_param_bytes(p) > limit:
                chunks.append(current)
                current, size = [[] for _ in groups], 0
            current[gi].append(p)
            size += per_param_bytes(p)
    if size or not chunks:
        chunks.append(current)
    return chunks


def attach(optimizer, store: FileStore, state_per_param: int = 2):
    """Make ``optimizer.step`` step in chunks with the state in ``store``'s files (module docstring). Returns the
    optimizer (its ``step`` replaced on the instance; everything else, ``state_dict`` included, as it was).
    ``state_per_param``: full-size state tensors per parameter, for cutting chunks before the state exists."""
    inner = optimizer.step

    def per_param_bytes(p) -> int:  # this rank's shard of it, not the whole parameter
        return max(1, _local(p).numel() * p.element_size() * state_per_param)

    def step(closure=None):
        assert closure is None, "a closure would run forward once per chunk"
        groups = optimizer.param_groups
        kept = [g["params"] for g in groups]
        chunks = _chunks(kept, per_param_bytes, CHUNK_BYTES)
        try:
            for i, chunk in enumerate(chunks):
                params = [p for ps in chunk for p in ps]
                if i + 1 < len(chunks):
                    store.prefetch(_state_tensors(optimizer, [p for ps in chunks[i + 1] for p in ps]))
                for g, ps in zip(groups, chunk, strict=True):
                    g["params"] = ps
                inner()  # (its pre-hooks first: an asynchronous save's copy of the state is done before it)
                state = _state_tensors(optimizer, params)
                for t in state:  # the first step creates the state in memory, a checkpoint load leaves it there
                    store.back(t)
                store.release(state)
        finally:
            for g, ps in zip(groups, kept, strict=True):
                g["params"] = ps
        live = {_local(t).untyped_storage().data_ptr()
                for t in _state_tensors(optimizer, [p for ps in kept for p in ps])}
        store.forget_unused(live)
        return_freed_memory()

    optimizer.step = step
    optimizer.offload_store = store
    return optimizer
