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
        self._maps[ptr] = (mm, path)
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
            mm.madvise(mmap.MADV_DONTNEED)
            fd = os.open(path, os.O_RDONLY)  # written back and unmapped: now the page cache may drop them too
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def forget_unused(self, live: set[int]) -> None:
        """Drop the files of storages no state tensor uses any more (a checkpoint load replaced them)."""
        for ptr in [p for p in self._maps if p not in live]:
            _, path = self._maps.pop(ptr)
            FILE_BACKED.pop(ptr, None)
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
        self._maps.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(self.dir))
        except OSError:  # another rank's directory is still there (it removes the parent when it ends)
            pass


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
