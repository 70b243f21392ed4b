"""A storage path throttled to a stated write bandwidth, for benchmarks: the fsspec protocol ``throttled://``.

``throttled:///some/dir`` is the local directory ``/some/dir`` (fsspec's ``LocalFileSystem``, every operation
unchanged) except that bytes written through files it opens are paced to ``DUTYCYCLE_THROTTLE_MB_S`` (10^6
bytes per second). Metadata operations (mkdir, rename, list, delete) and reads are not slowed. To the product
it is an unknown fsspec protocol like any object store's: dutycycle's checkpoint code takes it unchanged (no
fsync, one ``open(..., "wb")`` per file, the manifest written last).

The pace is one link shared by every process that names the same state file (``DUTYCYCLE_THROTTLE_STATE``; the
benchmark gives all ranks of a job one, so the stated bandwidth is the path's total, as a node's link to its
storage is). Every write is cut into chunks of at most ``CHUNK`` bytes; each chunk reserves its transfer time on
the link (under an ``flock`` on the state file, which holds the moment the link is next free, in
``time.monotonic()`` seconds: one clock for every process on Linux; time the link stood idle is not banked), and
the writer sleeps until its reservation ends once that is more than ``SLACK_S`` ahead, then writes. Two ranks
writing at once share the bandwidth chunk by chunk. Without a state file each process paces itself alone.

Training ranks started by torchrun do not import the benchmark; this file is their entry point instead of the
module, registers the protocol, then runs the module as ``__main__``::

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/throttle.py dutycycle.trainer.launch.torchrun CONFIG
"""

from __future__ import annotations

import fcntl
import os
import runpy
import struct
import sys
import threading
import time
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

PROTOCOL = "throttled"
RATE_ENV = "DUTYCYCLE_THROTTLE_MB_S"
STATE_ENV = "DUTYCYCLE_THROTTLE_STATE"
CHUNK = 1 << 20  # bytes per reservation at most: the grain at which two writers interleave
# A writer sleeps only once its reservations run this far ahead of the clock: many small writes (torch.save
# writes a record at a time) then cost one sleep, not one each, whose wake-up latency would each be lost bandwidth.
# The link's timeline stays exact: the bytes are never ahead of the stated rate by more than this much time.
SLACK_S = 0.005


class Link:
    """The shared link: ``take(n)`` returns once ``n`` bytes may have gone through at ``bytes_per_s``."""

    def __init__(self, bytes_per_s: float, state_path: str | None = None):
        if bytes_per_s <= 0:
            raise ValueError(f"{RATE_ENV} must be positive, got {bytes_per_s}")
        self.rate, self.state_path = bytes_per_s, state_path
        self._lock = threading.Lock()  # flock excludes processes; threads of one process share its descriptor
        self._free_at = 0.0  # without a state file: this process's own link
        self._fd: int | None = None

    def _reserve(self, n: int) -> float:
        with self._lock:
            now = time.monotonic()
            if not self.state_path:
                self._free_at = max(now, self._free_at) + n / self.rate
                return self._free_at
            if self._fd is None:
                self._fd = os.open(self.state_path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(self._fd, 8, 0)
                free_at = struct.unpack("d", raw)[0] if len(raw) == 8 else 0.0
                end = max(now, free_at) + n / self.rate
                os.pwrite(self._fd, struct.pack("d", end), 0)
                return end
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def take(self, n: int) -> None:
        wait = self._reserve(n) - time.monotonic()
        if wait > SLACK_S:
            time.sleep(wait)


_LINK: Link | None = None


def link() -> Link:
    global _LINK
    if _LINK is None:
        rate = float(os.environ.get(RATE_ENV, "100")) * 1e6
        _LINK = Link(rate, os.environ.get(STATE_ENV) or None)
    return _LINK


class ThrottledFile(LocalFileOpener):
    """A local file whose writes pass the link chunk by chunk."""

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = 0
        for start in range(0, len(view), CHUNK):
            piece = view[start:start + CHUNK]
            link().take(len(piece))
            n = self.f.write(piece)
            written += len(piece) if n is None else n
        return written


class ThrottledFileSystem(LocalFileSystem):
    """``throttled:///path``: the local file system, writes paced by ``link()``."""

    protocol = PROTOCOL
    root_marker = "/"

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        if not any(c in mode for c in "wxa+"):
            return super()._open(path, mode, block_size=block_size, **kwargs)
        path = self._strip_protocol(path)
        if self.auto_mkdir:
            self.makedirs(self._parent(path), exist_ok=True)
        return ThrottledFile(path, mode, fs=self, **kwargs)

    def unstrip_protocol(self, name: str) -> str:
        return f"{PROTOCOL}://{self._strip_protocol(name)}"


def register() -> None:
    fsspec.register_implementation(PROTOCOL, ThrottledFileSystem, clobber=True)


def main(argv: list[str]) -> None:
    """Register the protocol, then run the module ``argv[0]`` as ``__main__`` with ``argv[1:]``."""
    if not argv:
        raise SystemExit("usage: throttle.py MODULE [ARGS...]")
    register()
    # this script's folder holds benchmark modules named like common ones (cache, loader, train): keep it off the
    # path, put the checkout's root there instead (the benchmarks import each other as benchmarks.<name>)
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path.insert(0, str(Path(here).parent))
    sys.argv = list(argv)
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
