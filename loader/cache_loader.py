"""``CacheLoader``: per-rank torch batches from a committed transformed-sample cache."""

from __future__ import annotations

from typing import Any

import numpy as np
from dutycycle.engine.cache.format import CacheReader

from .base import PlannedLoader
from .config import LoaderConfig
from .source import MemorySplit, RawBatch, ShardGatherer, split_rows


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
        self.reader = CacheReader(cache_uri)
        self.cache_uri, self.split = self.reader.uri, split  # a cache root resolves to its committed folder
        manifest = self.reader.manifest
        self.layout = manifest.layout
        self.shape = tuple(manifest.shape)
        self.classes = list(manifest.classes)
        self.rows = split_rows(self.reader, split)  # split index -> global cache row
        super().__init__(len(self.rows), manifest.fingerprint, rank, world_size, config)
        self._gatherer = ShardGatherer(self.reader)
        self._memory: MemorySplit | None = None
        self._memory_keepalive: Any = None
        if self.in_memory:
            self._load_memory()

    @classmethod
    def for_ray_train(cls, cache_uri: str, split: str = "train", config: LoaderConfig | None = None) -> CacheLoader:
        """Inside a Ray Train worker: this worker's iterator of the shared plan (rank and world size from the
        train context)."""
        import ray.train

        ctx = ray.train.get_context()
        return cls(cache_uri, split, ctx.get_world_rank(), ctx.get_world_size(), config)

    _local_source = "memory-mapped shards"

    def _auto_in_memory(self) -> bool:
        """``mode="auto"``: hold the split in RAM when it fits the memory budget (see ``LoaderConfig``)."""
        need = len(self.rows) * self.reader.manifest.sample_bytes
        return need <= self.config.auto_memory_fraction * free_memory_bytes()

    def _load_memory(self) -> None:
        import sys

        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            from .ray_exec import shared_memory_split

            self._memory, self._memory_keepalive = shared_memory_split(self.cache_uri, self.fingerprint, self.split)
        else:
            self._memory = MemorySplit.load(self.cache_uri, self.split)

    def _read_local(self, indices: np.ndarray) -> RawBatch:
        if self._memory is not None:
            return self._memory.read(indices)
        return self._gatherer.read(self.rows[indices])

    def _submit_remote(self, indices: np.ndarray, step: int):
        from .ray_exec import submit_read

        return submit_read(self.cache_uri, self.rows[indices], step, self.config.ray_max_retries)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["split"] = self.split
        return state


def free_memory_bytes() -> int:
    """Memory a new in-RAM split may use: the kernel's MemAvailable (0 when unknown, so "auto" reads shards in
    place), and no more than the Ray object store has free when Ray is initialized (memory mode puts it there)."""
    import sys

    free = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except OSError:  # not Linux
        pass
    ray = sys.modules.get("ray")
    if free and ray is not None and ray.is_initialized():
        free = min(free, int(ray.available_resources().get("object_store_memory", 0)))
    return free
