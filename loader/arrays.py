"""``ArrayLoader``: per-rank torch batches of the shared plan over a split already held in memory as arrays.

The plan, augmentation, resumable state and statistics are the cache loader's (``PlannedLoader``); only where
rows come from differs: three arrays instead of a cache, gathered the way ``mode="memory"`` gathers an in-RAM
split. For data made in the process (the trainer's synthetic shapes), tests and notebooks.
"""

from __future__ import annotations

import numpy as np
from dutycycle.engine.errors import ConfigError

from .base import PlannedLoader
from .config import LoaderConfig
from .source import MemorySplit, RawBatch


class ArrayLoader(PlannedLoader):
    """Iterate ``images`` (uint8 [N, *shape] in ``layout``) and ``labels`` (int [N]) as this rank's batches.

    ``sample_ids`` default to the row numbers. ``fingerprint`` names the data in the plan's key and in saved
    states (a state saved over other arrays is refused): pass one that changes when the arrays do.
    ``mode="ray"`` does not apply (the arrays live in this process).
    """

    _local_source = "arrays in memory"

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        rank: int = 0,
        world_size: int = 1,
        config: LoaderConfig | None = None,
        fingerprint: str = "arrays",
        sample_ids=None,
        layout: str = "HWC",
    ):
        config = config or LoaderConfig()
        if isinstance(config, LoaderConfig) and config.mode == "ray":
            raise ConfigError("LoaderConfig.mode='ray' does not apply to arrays in this process; use sync or thread")
        images = np.asarray(images)
        if images.dtype != np.uint8 or images.ndim != 4 or len(images) != len(labels):
            raise ConfigError(
                f"ArrayLoader needs uint8 images [N, *shape] and N labels; got {images.dtype} {images.shape} and "
                f"{len(labels)} labels"
            )
        ids = np.arange(len(labels)) if sample_ids is None else np.asarray(sample_ids)
        self.split = MemorySplit(images, np.asarray(labels, dtype=np.int64), ids)
        self.layout, self.shape = layout, tuple(images.shape[1:])
        super().__init__(len(labels), fingerprint, rank, world_size, config)

    def _reads_block(self) -> bool:
        return False  # a gather from RAM: nothing for a prefetch thread to overlap

    def _read_local(self, indices: np.ndarray) -> RawBatch:
        return self.split.read(indices)
