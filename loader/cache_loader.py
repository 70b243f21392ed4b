"""``CacheLoader``: per-rank torch batches from a committed transformed-sample cache."""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any

import numpy as np
from dutycycle.engine.cache.reader import CacheReader

from .base import LoaderStats, PlannedLoader
from .config import LoaderConfig
from .inflight import RemoteBatch
from .source import MemorySplit, RawBatch, ShardGatherer, chunk_block_starts, split_rows


class CacheLoader(PlannedLoader):
    """Iterate ``split`` of the cache at ``cache_uri`` as this rank's batches of the shared plan.

    ``len(loader)`` is the number of steps per epoch; ``for batch in loader`` runs from the saved position to
    the end of the epoch and then advances to the next; ``state_dict()`` / ``load_state_dict()`` save and restore
    the position (at any world size). Each batch is ``{"image": [B, C, H, W] float32 (normalized) or uint8,
    "label": int64 [B], "sample_id": list[str]}`` with ``B = global_batch_size // world_size`` (a short last
    batch when ``drop_last=False``).
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
        self.reader = CacheReader(cache_uri, read=config.read if isinstance(config, LoaderConfig) else None,
                                  stats=stats)
        self.cache_uri, self.split = self.reader.uri, split  # a cache root resolves to its committed folder
        manifest = self.reader.manifest
        self.layout = manifest.layout
        self.shape = tuple(manifest.shape)
        self.classes = list(manifest.classes)
        self.rows = split_rows(self.reader, split)  # split index -> global cache row (node-shared, mapped)
        self._chunk_starts: np.ndarray | None = None  # block_size = 0: where the split's rows cross chunks
        self._memory: MemorySplit | None = None
        self._memory_keepalive: Any = None
        super().__init__(len(self.rows), manifest.fingerprint, rank, world_size, config, stats)
        self._gatherer = ShardGatherer(self.reader)
        if self.in_memory:
            self._load_memory()

    @classmethod
    def for_ray_train(cls, cache_uri: str, split: str = "train", config: LoaderConfig | None = None) -> CacheLoader:
        """Inside a Ray Train worker: this worker's iterator of the shared plan (rank and world size from the
        train context)."""
        import ray.train

        ctx = ray.train.get_context()
        return cls(cache_uri, split, ctx.get_world_rank(), ctx.get_world_size(), config)

    @property
    def _local_source(self) -> str:  # for `execution`
        return {None: "memory-mapped shards", "disk": "node-local copies of remote shards (memory-mapped)",
                "range": "ranged reads of remote shards"}[self.reader.remote]

    @property
    def _memory_source(self) -> str:
        return "memory (Ray object store, one copy per node)" if _ray_running() else "memory (this process)"

    def _reads_block(self) -> bool:
        return not self.reader.is_local  # remote reads wait on the network: overlap them

    def _hold_in_memory(self) -> bool:
        """``mode="memory"``: reserve the split's bytes in the node's budget (see ``budget``), or say why not."""
        from . import budget

        c = self.config
        need = len(self.rows) * (self.reader.manifest.sample_bytes + 8 + 4 * _id_chars(self.reader))
        shared = _ray_running()
        limit = memory_limit()
        allowed = int(c.memory_fraction * limit)
        key = f"{self.reader.fingerprint}:{self.split}"
        res = budget.reserve(key, need, allowed, shared, c.read.node_dir)
        if not res.granted:
            mib = 1024**2
            self.memory_refused = (
                f"mode='memory' needs {need / mib:,.0f} MiB for split {self.split!r} but the node's in-RAM budget "
                f"is {allowed / mib:,.0f} MiB (memory_fraction={c.memory_fraction} of a {limit / mib:,.0f} MiB "
                f"limit) with {res.used / mib:,.0f} MiB already reserved; reading memory-mapped shards instead "
                "(the same batches). Raise memory_fraction or use mode='auto'"
            )
            warnings.warn(self.memory_refused, stacklevel=3)
            return False
        weakref.finalize(self, budget.release, res.key, c.read.node_dir)  # the ledger entry lives as long as self
        return True

    def _load_memory(self) -> None:
        if _ray_running():
            from .ray_exec import shared_memory_split  # imports ray

            self._memory, self._memory_keepalive = shared_memory_split(
                self.cache_uri, self.fingerprint, self.split, self.config.read
            )
        else:  # this loader's reader and split index, not a second reader that would read them again
            self._memory = MemorySplit.gather(self.reader, self.rows)

    def _read_local(self, indices: np.ndarray) -> RawBatch:
        if self._memory is not None:
            return self._memory.read(indices)
        return self._gatherer.read(self.rows[indices])

    def _block_starts(self) -> np.ndarray | None:
        if self.config.block_size != 0:
            return None
        if self._chunk_starts is None:
            self._chunk_starts = chunk_block_starts(self.reader, self.split)
        return self._chunk_starts

    def _submit_remote(self, indices: np.ndarray, step: int) -> RemoteBatch:
        from .ray_exec import submit_read  # imports ray

        return submit_read(self.cache_uri, self.rows[indices], step, self.config.ray_max_retries, self.config.read)


def memory_limit() -> int:
    """What in-RAM splits are sized against: the node's limit (``budget.node_memory_limit``), and, when Ray is
    running (the split then lives in its object store), no more than the object store has free."""
    from . import budget

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
