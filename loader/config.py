"""Loader configuration: one dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dutycycle.engine.errors import ConfigError

from .augment import AugmentConfig
from .plan import DEFAULT_BLOCK_SIZE, DEFAULT_WINDOW

MODES = ("auto", "sync", "thread", "ray", "memory")


@dataclass(frozen=True)
class LoaderConfig:
    """How batches are planned, read and delivered.

    ``mode``:
      - ``"auto"`` (the default, what training uses): hold the split in RAM when it takes at most
        ``auto_memory_fraction`` of the memory available (in the Ray object store, shared by the node's loaders,
        when Ray is initialized; it is read whole before the first batch), else read the memory-mapped shards
        in place (a batch spanning several shards then costs a second copy); collate in a background thread
        when a batch needs CPU work beyond gathering its rows (random augmentation, normalization, pinning or a
        device copy) or its rows come from shards on disk, and in the caller's thread otherwise (a gather from
        RAM costs well under a millisecond per batch, less than handing the batch between threads).
        ``loader.execution`` says what it chose. The raw path (which decodes every step) uses ``"thread"``.
      - ``"sync"``: read and collate in the caller's thread; no threads, no Ray (tests, notebooks, debugging).
      - ``"thread"``: a background thread reads memory-mapped shards into a bounded queue of ``prefetch``
        finished batches (back-pressure).
      - ``"ray"``: Ray tasks read and collate each rank batch from the shards, at most ``prefetch`` in flight,
        retried up to ``ray_max_retries`` times if their worker dies; a background thread augments.
      - ``"memory"``: the whole split is read once into RAM (into the Ray object store when Ray is initialized,
        so the loaders of one node share one copy), then served like ``"thread"``.
    """

    global_batch_size: int = 256
    seed: int = 0
    drop_last: bool = True
    shuffle: bool = True  # False: cache order (sorted by sample id), for evaluation
    mode: str = "auto"
    prefetch: int = 4  # finished batches queued ahead (and Ray tasks in flight) per loader
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    pin_memory: bool = False
    device: Any = None  # e.g. "cuda:0": batches arrive on it, copied on a side stream
    block_size: int = DEFAULT_BLOCK_SIZE  # shuffle blocks of consecutive samples (see plan.py)
    window: int = DEFAULT_WINDOW  # window shuffle size (see plan.py)
    ray_max_retries: int = 3
    raw_threads: int = 4  # decode threads per batch for the raw path outside Ray
    auto_memory_fraction: float = 0.25  # "auto" holds a split in RAM when it needs at most this share of free memory

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"LoaderConfig.mode={self.mode!r} is invalid; use one of {', '.join(MODES)}")
        for name in ("global_batch_size", "prefetch", "block_size", "window", "raw_threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"LoaderConfig.{name}={v!r} is invalid; use an integer >= 1")
        if not isinstance(self.ray_max_retries, int) or self.ray_max_retries < 0:
            raise ConfigError(f"LoaderConfig.ray_max_retries={self.ray_max_retries!r} is invalid; use an integer >= 0")
        f = self.auto_memory_fraction
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 <= f <= 1:
            raise ConfigError(f"LoaderConfig.auto_memory_fraction={f!r} is invalid; use a number in [0, 1]")
        if not isinstance(self.augment, AugmentConfig):
            raise ConfigError(f"LoaderConfig.augment={self.augment!r} is invalid; pass an AugmentConfig")

    @classmethod
    def for_eval(cls, global_batch_size: int = 256, mode: str = "auto", **kw) -> LoaderConfig:
        """Every sample exactly once across ranks, in a fixed order, without random augmentation."""
        kw.setdefault("augment", AugmentConfig.eval())
        return cls(global_batch_size=global_batch_size, mode=mode, drop_last=False, shuffle=False, **kw)
