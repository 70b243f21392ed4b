"""Reading a committed cache: ``CacheReader`` opens shards as views (memory-mapped in place, from a node-local copy,
or by byte range), checks them once per node, and maps global rows to shards. The format it reads (schema,
manifest, shard entries) is ``format.py``; how one shard is opened is ``shards.py``, ``remote.py`` and ``node.py``.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from dataclasses import replace

import numpy as np
import pyarrow as pa

from .. import io
from ..errors import CorruptArtifactError
from . import node
from .format import read_manifest, resolve
from .remote import ChunkCache, DiskCache, open_ranged
from .shards import ReadConfig, ReadStats, ShardView, open_mapped, view_of_table


class CacheReader:
    """Read-only access to a committed cache, one ``ShardView`` per open shard (see ``shards``): local shards are
    memory-mapped in place, remote ones read by range or from a node-local copy; a shard's sha256 is checked
    once per node, not on every open (``read.verify``). At most ``read.open_limit(mapped)`` views stay open."""

    def __init__(self, uri: str, verify: bool = True, read: ReadConfig | None = None, stats: ReadStats | None = None):
        self.uri = resolve(uri)  # a committed cache folder, or a cache root holding one
        self.manifest = read_manifest(self.uri)
        read = read or ReadConfig()
        if not verify:
            read = replace(read, verify="never")
        self.read_config, self.verify = read, read.verify != "never"
        self.stats = stats if stats is not None else ReadStats()  # a loader passes its own, to count in one place
        self._views: OrderedDict[int, ShardView] = OrderedDict()
        self.opened: set[int] = set()  # shards this reader has opened at least once (``reads``: locality figures)
        self._lock = threading.RLock()
        self.offsets = np.concatenate([[0], np.cumsum([s.rows for s in self.manifest.shards])]).astype(
            np.int64
        )
        self._fs, _ = io.filesystem(self.uri)
        self.is_local = io.protocol_of(self._fs) == "file"
        self.remote = None if self.is_local else read.remote
        self._disk = self._chunks = None
        self._node_root: str | None = None  # the node folder, checked once, when first needed
        if self.remote in ("auto", "disk"):
            self._disk = DiskCache(self.node_root(), read.disk_cache_bytes, self.stats)
            total = sum(s.bytes for s in self.manifest.shards)
            self.remote = "disk" if self.remote == "disk" or total <= self._disk.limit else "range"
        if self.remote == "range":
            self._chunks = ChunkCache(read.range_cache_bytes, read.range_chunk_bytes, self.stats)

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    @property
    def num_samples(self) -> int:
        return self.manifest.num_samples

    @property
    def num_shards(self) -> int:
        return len(self.manifest.shards)

    @property
    def mapped(self) -> bool:
        """Whether shard pixels are memory-mapped files (local, or node-local copies) rather than ranged reads."""
        return self.remote != "range"

    def shard_uri(self, i: int) -> str:
        # a path read from a manifest is data: it must stay inside the cache (read_manifest checked it too)
        return io.resolve_inside(self.uri, self.manifest.shards[i].path, "cache")

    def view(self, i: int) -> ShardView:
        """Shard ``i``'s open view (opened, and verified where that applies, on first use)."""
        with self._lock:
            got = self._views.get(i)
            if got is not None:
                self._views.move_to_end(i)
                return got
            got = self._open_view(i)
            self._views[i] = got
            while len(self._views) > self.read_config.open_limit(self.mapped):
                self._views.popitem(last=False)  # a caller still holding the view keeps its memory map alive
            return got

    def _open_view(self, i: int) -> ShardView:
        self.opened.add(i)  # every open counts, this reader's views and a gatherer's alike
        info, uri = self.manifest.shards[i], self.shard_uri(i)
        shape = tuple(self.manifest.shape)
        try:
            if self.mapped:
                try:
                    table = open_mapped(self.local_path(i))
                except FileNotFoundError:
                    if self.is_local:
                        raise
                    table = open_mapped(self.local_path(i))  # another process evicted the node copy: land it again
                if table.num_rows != info.rows:
                    raise CorruptArtifactError(
                        f"cache shard {uri!r} has {table.num_rows} rows, manifest says {info.rows}"
                    )
                return view_of_table(i, table, shape, uri)
            return open_ranged(self._fs, io.filesystem(uri)[1], i, info, shape, self.stats, self._chunks)
        except FileNotFoundError as e:
            raise CorruptArtifactError(
                f"cache shard {uri!r} listed in the manifest is missing; materialize the cache again"
            ) from e
        except (pa.ArrowInvalid, OSError) as e:
            # a node disk too full for the shard's copy (or a lock) is not a damaged cache: say which disk
            full = io.no_space(e, self._disk.path_for(info.sha256) if self._disk else self.node_root(),
                               info.bytes if self._disk else None)
            raise (full or CorruptArtifactError(f"cache shard {uri!r} cannot be read as Arrow IPC ({e}); "
                                                "delete the cache folder and materialize it again")) from e

    def reads(self) -> dict:
        """Which shards this reader opened (as runs of consecutive indices) and what it fetched: how local a
        rank's reads were."""
        runs: list[list[int]] = []
        for i in sorted(self.opened):
            if runs and runs[-1][1] == i - 1:
                runs[-1][1] = i
            else:
                runs.append([i, i])
        return {"shards": len(self.opened), "shard_runs": runs, "of_shards": self.num_shards,
                "bytes_fetched": self.stats.bytes_fetched, "requests": self.stats.requests}

    def node_root(self) -> str:
        """This node's folder for verified-shard records and shard copies (``engine.cache.node``)."""
        if self._node_root is None:
            self._node_root = node.node_dir(self.read_config.node_dir)
        return self._node_root

    def local_path(self, i: int) -> str:
        """A local file with shard ``i``'s bytes (the shard itself, or its node-local copy), checked per ``verify``."""
        info, uri = self.manifest.shards[i], self.shard_uri(i)
        if self.is_local:
            path = io.filesystem(uri)[1]
        else:
            path = self._disk.fetch(self._fs, io.filesystem(uri)[1], info.sha256, info.bytes)
        if self.read_config.verify == "always":
            ok, hashed = os.path.getsize(path) == info.bytes and node.sha256_file(path) == info.sha256, True
        elif self.read_config.verify == "once":
            ok, hashed = node.verify_once(path, info.sha256, info.bytes, self.node_root())
        else:
            ok, hashed = os.path.getsize(path) == info.bytes, False
        self.stats.shards_hashed += hashed
        if not ok:
            raise CorruptArtifactError(
                f"cache shard {uri!r} fails its checksum (expected sha256 {info.sha256[:12]}..., {info.bytes} "
                "bytes); delete the cache folder and materialize it again"
            )
        return path

    def shard(self, i: int) -> pa.Table:
        """Shard ``i`` as a whole Arrow table (zero-copy over a memory map when mapped; a ranged cache downloads
        it for this call only). Checked like every read: a mapped shard per ``read.verify`` (``local_path``), a
        downloaded one always, against its size and sha256, before Arrow parses a byte of it (a ranged view
        checks every piece it fetches too, whatever ``verify`` says: bytes that crossed a network are not the
        bytes this node verified once)."""
        if self.mapped:
            return open_mapped(self.local_path(i))
        info, uri = self.manifest.shards[i], self.shard_uri(i)
        fs, path = io.filesystem(uri)
        try:
            data = fs.cat_file(path)
        except FileNotFoundError as e:
            raise CorruptArtifactError(
                f"cache shard {uri!r} listed in the manifest is missing; materialize the cache again") from e
        self.stats.add_fetch(len(data))
        self.stats.shards_hashed += 1
        if len(data) != info.bytes or hashlib.sha256(data).hexdigest() != info.sha256:
            raise CorruptArtifactError(
                f"cache shard {uri!r} fails its checksum (expected sha256 {info.sha256[:12]}..., {info.bytes} "
                f"bytes; fetched {len(data)} bytes); its bytes were not used. Materialize the cache again"
            )
        return pa.ipc.open_file(pa.py_buffer(data)).read_all()

    def images(self, i: int) -> np.ndarray:
        """Shard ``i``'s pixels as a read-only uint8 array [rows, *shape] (zero-copy when mapped)."""
        v = self.view(i)
        return v.pixels if v.pixels is not None else v.ranged.take(np.arange(v.rows))

    def column(self, i: int, name: str) -> np.ndarray:
        v = self.view(i)
        if name == "label":
            return v.labels
        if name in ("sample_id", "split"):
            return (v.ids if name == "sample_id" else v.split).to_numpy(zero_copy_only=False)
        return self.shard(i).column(name).to_numpy(zero_copy_only=False)

    def locate(self, global_index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Map global row indices to (shard, row-in-shard)."""
        shard = np.searchsorted(self.offsets, global_index, side="right") - 1
        return shard, global_index - self.offsets[shard]
