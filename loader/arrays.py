"""``ArrayLoader``: per-rank torch batches of the shared plan over a split already held in memory as arrays.

The plan, augmentation, resumable state and statistics are every loader's (``Loader``); only the source differs:
three arrays instead of a cache (``ArraySource``), gathered the way ``mode="memory"`` gathers an in-RAM split.
For data made in the process (the trainer's synthetic shapes), tests and notebooks.
"""

from __future__ import annotations

import numpy as np
from dutycycle.engine.errors import ConfigError

from .config import LoaderConfig
from .loader import Loader
from .source import MemorySplit, RawBatch


class ArraySource:
    """Images (uint8 [N, *shape] in ``layout``), labels and sample ids in this process; named by ``fingerprint``
    alone (no split)."""

    split = None
    reads_block = False  # a gather from RAM: nothing for a prefetch thread to overlap
    description = "arrays in memory"
    in_memory, memory_refused = False, None
    channel_stats, no_stats = None, "arrays in memory carry none"

    def __init__(self, images: np.ndarray, labels: np.ndarray, sample_ids: np.ndarray, fingerprint: str,
                 layout: str):
        self.arrays = MemorySplit(images, np.asarray(labels, dtype=np.int64), sample_ids)
        self.num_samples, self.fingerprint = len(labels), fingerprint
        self.layout, self.shape = layout, tuple(images.shape[1:])

    def read(self, indices: np.ndarray) -> RawBatch:
        return self.arrays.read(indices)

    def submit(self, indices: np.ndarray, max_retries: int):
        raise ConfigError("LoaderConfig.mode='ray' does not apply to arrays in this process; use sync or thread")

    def block_starts(self) -> np.ndarray:
        raise ConfigError("block_size=0 cuts shuffle blocks at a cache's checksum chunks, and this ArrayLoader "
                          "reads no cache; use a block_size >= 1")

    def close(self) -> None:
        """Nothing to release: the arrays are the caller's."""

    def reopen(self) -> ArraySource:
        """Itself: arrays hold no handle or thread, and a forked DataLoader worker shares their pages."""
        return self


class ArrayLoader(Loader):
    """Iterate ``images`` (uint8 [N, *shape] in ``layout``) and ``labels`` (int [N]) as this rank's batches.

    ``sample_ids`` default to the row numbers. ``fingerprint`` names the data in the plan's key and in saved
    states (a state saved over other arrays is refused): pass one that changes when the arrays do.
    ``mode="ray"`` does not apply (the arrays live in this process).
    """

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
        super().__init__(config, ArraySource(images, labels, ids, fingerprint, layout), rank=rank,
                         world_size=world_size)
