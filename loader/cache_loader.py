"""``CacheLoader``: per-rank torch batches from a committed transformed-sample cache.

``CacheSource`` is the cache as a loader's source: the split's rows (``split_rows``), read by one gather per
batch over the memory-mapped (or ranged) shards, or, in ``mode="memory"``, from a copy of the split in RAM
reserved in the node's budget (``budget``). ``CacheLoader`` is a ``Loader`` over it.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any

import numpy as np
from dutycycle.engine.cache.reader import CacheReader
from dutycycle.engine.cache.shards import ReadConfig, ReadStats

from . import budget, shm
from .config import LoaderConfig
from .inflight import RemoteBatch
from .loader import Loader, LoaderStats
from .source import MemorySplit, RawBatch, ShardGatherer, chunk_block_starts, split_rows

LOCAL_DESCRIPTIONS = {None: "memory-mapped shards", "disk": "node-local copies of remote shards (memory-mapped)",
                      "range": "ranged reads of remote shards"}  # by ``reader.remote``, for ``Loader.execution``


class CacheSource:
    """``split`` of the cache at ``cache_uri``: split index -> global cache row (``rows``) -> a gathered row."""

    def __init__(self, cache_uri: str, split: str, read: ReadConfig | None = None, stats: ReadStats | None = None):
        self.reader = CacheReader(cache_uri, read=read, stats=stats)
        self.cache_uri, self.split = self.reader.uri, split  # a cache root resolves to its committed folder
        manifest = self.reader.manifest
        self.fingerprint = manifest.fingerprint
        self.layout = manifest.layout
        self.shape = tuple(manifest.shape)
        self.classes = list(manifest.classes)
        self.channel_stats = manifest.channel_stats
        self.no_stats = (f"cache {self.cache_uri!r} was written before dutycycle recorded them; `dutycycle "
                         "materialize` of the same table and transform adds them")
        self.rows = split_rows(self.reader, split)  # split index -> global cache row (node-shared, mapped)
        self.num_samples = len(self.rows)
        self.reads_block = not self.reader.is_local  # remote reads wait on the network: overlap them
        self.in_memory, self.memory_refused = False, None
        self._chunk_starts: np.ndarray | None = None  # block_size = 0: where the split's rows cross chunks
        self._memory: MemorySplit | None = None
        self._memory_keepalive: Any = None  # the object-store reference the in-RAM arrays are views of
        self._gatherer = ShardGatherer(self.reader)
        self._batches: shm.BatchFolder | None = None  # Ray mode: where this node's read tasks leave batches

    @property
    def shard_opens(self) -> int:
        """Shard views this source's reads opened, reopens included (past the open limit: the churn)."""
        return self._gatherer.opens

    @property
    def description(self) -> str:
        if self.in_memory:
            return "memory (Ray object store, one copy per node)" if _ray_running() else "memory (this process)"
        return LOCAL_DESCRIPTIONS[self.reader.remote]

    def hold_in_memory(self, config: LoaderConfig) -> None:
        """``mode="memory"``: reserve the split's bytes in the node's budget (see ``budget``) and read the split
        into RAM, or say why not (``memory_refused``, and a warning) and keep reading the mapped shards."""
        need = len(self.rows) * (self.reader.manifest.sample_bytes + 8 + 4 * _id_chars(self.reader))
        shared = _ray_running()
        limit = memory_limit()
        allowed = int(config.memory_fraction * limit)
        key = f"{self.reader.fingerprint}:{self.split}"
        res = budget.reserve(key, need, allowed, shared, config.read.node_dir)
        if not res.granted:
            mib = 1024**2
            self.memory_refused = (
                f"mode='memory' needs {need / mib:,.0f} MiB for split {self.split!r} but the node's in-RAM budget "
                f"is {allowed / mib:,.0f} MiB (memory_fraction={config.memory_fraction} of a {limit / mib:,.0f} MiB "
                f"limit) with {res.used / mib:,.0f} MiB already reserved; reading memory-mapped shards instead "
                "(the same batches). Raise memory_fraction or use mode='auto'"
            )
            warnings.warn(self.memory_refused, stacklevel=3)
            return
        weakref.finalize(self, budget.release, res.key, config.read.node_dir)  # the ledger entry lives as long
        self.in_memory = True
        if shared:
            from .ray_exec import shared_memory_split  # imports ray, which only the Ray modes need

            self._memory, self._memory_keepalive = shared_memory_split(
                self.cache_uri, self.fingerprint, self.split, config.read
            )
        else:  # this source's reader and split index, not a second reader that would read them again
            self._memory = MemorySplit.gather(self.reader, self.rows)

    def read(self, indices: np.ndarray) -> RawBatch:
        if self._memory is not None:
            return self._memory.read(indices)
        return self._gatherer.read(self.rows[indices])

    def submit(self, indices: np.ndarray, max_retries: int) -> RemoteBatch:
        from .ray_exec import submit_read  # imports ray, which only the Ray modes need

        if self._batches is None and shm.available():
            self._batches = shm.BatchFolder()
        return submit_read(self.cache_uri, self.rows[indices], max_retries, self.reader.read_config, self._batches)

    def block_starts(self) -> np.ndarray:
        if self._chunk_starts is None:
            self._chunk_starts = chunk_block_starts(self.reader, self.split)
        return self._chunk_starts

    def close(self) -> None:
        """Nothing to release between epochs: the mapped shards stay open for the next one."""

    def reopen(self) -> CacheSource:
        """This split of the same committed cache opened again, for another process (a DataLoader worker): its
        own reader and mappings of the same files (so the same pages), read in place even in ``memory`` mode."""
        return CacheSource(self.cache_uri, self.split, self.reader.read_config)

    def __reduce__(self):
        # pickled for a spawned process: it opens the cache again where it lands, never carrying mappings
        return CacheSource, (self.cache_uri, self.split, self.reader.read_config)


class CacheLoader(Loader):
    """Iterate ``split`` of the cache at ``cache_uri`` as this rank's batches of the shared plan.

    ``len(loader)`` is the number of steps per epoch; each ``for batch in loader`` is one epoch from its start
    (from a restored position once after ``load_state_dict``) and, run to the end, moves to the next epoch;
    ``set_epoch``, ``peek()`` and ``state_dict()`` / ``load_state_dict()`` (at any world size) as ``Loader``'s.
    Each batch is ``{"image": [B, C, H, W] float32 (normalized) or uint8, "label": int64 [B], "sample_id":
    list[str]}`` with ``B = global_batch_size // world_size`` (a short last batch when ``drop_last=False``). ``reader``, ``rows``, ``cache_uri`` and ``classes`` are the source's.
    """

    def __init__(
        self,
        cache_uri: str,
        split: str = "train",
        rank: int = 0,
        world_size: int = 1,
        config: LoaderConfig | None = None,
    ):
        config = config or LoaderConfig()
        stats = LoaderStats()  # the reader counts its fetches where the loader counts its waits
        source = CacheSource(cache_uri, split, config.read if isinstance(config, LoaderConfig) else None, stats)
        super().__init__(config, source, rank=rank, world_size=world_size, stats=stats)
        self.reader, self.rows = source.reader, source.rows
        self.cache_uri, self.classes = source.cache_uri, source.classes
        if config.mode == "memory":
            source.hold_in_memory(config)

    @classmethod
    def for_ray_train(cls, cache_uri: str, split: str = "train", config: LoaderConfig | None = None) -> CacheLoader:
        """Inside a Ray Train worker: this worker's iterator of the shared plan (rank and world size from the
        train context)."""
        import ray.train

        ctx = ray.train.get_context()
        return cls(cache_uri, split, ctx.get_world_rank(), ctx.get_world_size(), config)


def memory_limit() -> int:
    """What in-RAM splits are sized against: the node's limit (``budget.node_memory_limit``), and, when Ray is
    running (the split then lives in its object store), no more than the object store has free."""
    limit = budget.node_memory_limit()
    if _ray_running():
        import ray

        limit = min(limit, int(ray.available_resources().get("object_store_memory", 0)) or limit)
    return limit


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _id_chars(reader: CacheReader) -> int:
    """Characters per sample id (from the first shard's first id), for sizing an in-RAM split."""
    if not reader.num_shards or not reader.manifest.shards[0].rows:
        return 0
    return len(str(reader.view(0).ids[0].as_py()))  # one value, not the whole column converted to numpy
