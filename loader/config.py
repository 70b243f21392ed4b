"""Loader configuration: dataclasses validated on construction. Nothing here imports numpy, so a command line
or a training config that names these (``dutycycle --help`` reads them) stays light."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dutycycle.engine.cache.shards import ReadConfig
from dutycycle.engine.errors import ConfigError

MODES = ("auto", "sync", "thread", "ray", "memory")
NORMALIZE_ON = ("auto", "host", "device")  # LoaderConfig.normalize_on
DEFAULT_BLOCK_SIZE = 64  # the plan's shuffle blocks (see plan.py)
DEFAULT_WINDOW = 2048  # the plan's shuffle window (see plan.py)


@dataclass(frozen=True)
class AugmentConfig:
    """What happens to a uint8 batch before the trainer sees it (applied by ``augment``).
    ``AugmentConfig.eval()`` for validation.

    ``mean`` and ``std`` empty (the default) mean *the dataset's*: a ``Loader`` takes them from its source when it
    is built (a cache's ``channel_stats``, the training split's exact per-channel statistics) and puts the values
    it applies, one per channel, into its own ``loader.config.augment``; a source without statistics (the raw
    path, arrays, a cache written before they were recorded) uses 0.5 and says so in ``loader.normalize_from``.
    Values given here override the dataset's: one per channel, or one for all."""

    crop_padding: int = 0  # pad each side by this many zero pixels, then crop back at a random offset
    flip: bool = False  # horizontal flip with probability 1/2
    normalize: bool = True  # uint8 -> float32 (x / 255 - mean) / std; off keeps uint8
    mean: Sequence[float] = ()  # per channel, or one value for all; empty: the dataset's statistics
    std: Sequence[float] = ()  # per channel, or one value for all; empty: the dataset's statistics

    def __post_init__(self):
        if isinstance(self.crop_padding, bool) or not isinstance(self.crop_padding, int) or self.crop_padding < 0:
            raise ConfigError(f"AugmentConfig.crop_padding={self.crop_padding!r} is invalid; use an integer >= 0")
        if len(self.mean) != len(self.std):
            raise ConfigError(
                f"AugmentConfig mean={tuple(self.mean)} and std={tuple(self.std)} must be of equal length (one value "
                "per channel, or one for all), or both empty for the dataset's statistics"
            )
        for name in ("mean", "std"):
            if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in getattr(self, name)):
                raise ConfigError(f"AugmentConfig.{name}={tuple(getattr(self, name))} is invalid; use numbers")
        if any(s <= 0 for s in self.std):
            raise ConfigError(f"AugmentConfig std={tuple(self.std)} has a value <= 0; use positive values")

    @classmethod
    def eval(cls, normalize: bool = True, mean: Sequence[float] = (), std: Sequence[float] = ()):
        """No random transforms: what validation uses (pass the training loader's effective mean and std to
        normalize exactly as training does)."""
        return cls(crop_padding=0, flip=False, normalize=normalize, mean=tuple(mean), std=tuple(std))

    @property
    def random(self) -> bool:
        return self.crop_padding > 0 or self.flip

    @property
    def from_dataset(self) -> bool:
        """Whether mean and std are left to the dataset's statistics (resolved by a ``Loader``)."""
        return not self.mean


@dataclass(frozen=True)
class LoaderConfig:
    """How batches are planned, read and delivered.

    ``mode``:
      - ``"auto"`` (the default, what training uses): read the cache in place. Local shards are memory-mapped,
        so every process on a node shares one copy of the pages through the page cache and a process holds
        only its batches and the shard index; a remote cache is read by range or from a node-local copy
        (``read``). Batches are collated in a background thread when that overlaps work: random augmentation,
        normalization, pinning or a device copy, or reads from a remote cache; otherwise in the caller's
        thread (a gather from mapped pages costs well under a millisecond per batch, less than handing the
        batch between threads). ``loader.execution`` says what it chose.
      - ``"sync"``: read and collate in the caller's thread; no threads, no Ray (tests, notebooks, debugging).
      - ``"thread"``: like ``auto``, always with a background thread keeping ``prefetch`` finished batches ready.
      - ``"ray"``: Ray tasks read and collate each rank batch from the shards, at most ``prefetch`` in flight,
        retried up to ``ray_max_retries`` times if their worker dies; a background thread augments.
      - ``"memory"`` (opt-in, for small datasets): the split is read once into RAM (into the Ray object store
        when Ray is initialized, which the loaders of a node share), then served like ``"thread"``. It must
        fit ``memory_fraction`` of the node's memory limit (the cgroup's when it is tighter than the
        machine's), counted once per node across every loader's in-RAM splits (``budget``); a split that does
        not fit is read from the memory-mapped shards instead, with a warning and ``loader.memory_refused``
        saying why. The raw path (which decodes every step) uses ``"thread"``.

    ``read`` says how shards are reached (verification once per node, ranged reads or node-local copies of
    remote caches); see ``dutycycle.engine.cache.shards.ReadConfig``.
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
    # Where augment.normalize's (x / 255 - mean) / std runs: "host" (NumPy, in the collating thread: float32
    # crosses to the device), "device" (torch, after the copy, on the consumer's thread: uint8 crosses, a
    # quarter of the bytes), "auto" (device when ``device`` is a CUDA device, host otherwise). The values are
    # bit for bit the same either way (device.Normalizer).
    normalize_on: str = "auto"
    # Canonical partitions of the plan (see plan.py): global batches draw from each of them, and a node reads only
    # its own when the node count divides this number and the global batch. A plan input: fixed for a run.
    # 0 = sized for the world (plan.default_partitions): a Loader takes its own world size's; the trainer takes
    # the one for every size parallel.num_workers allows and records the number in the run's config
    partitions: int = 1
    # shuffle blocks of consecutive samples (see plan.py); 0: a cache's checksum chunks (one block per chunk, what
    # ranged reads of a remote cache want: each fetched chunk serves one block)
    block_size: int = DEFAULT_BLOCK_SIZE
    window: int = DEFAULT_WINDOW  # window shuffle size (see plan.py)
    ray_max_retries: int = 3
    raw_threads: int = 4  # decode threads per batch for the raw path outside Ray
    memory_fraction: float = 0.5  # "memory": in-RAM splits on a node together use at most this share of its limit
    read: ReadConfig = field(default_factory=ReadConfig)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"LoaderConfig.mode={self.mode!r} is invalid; use one of {', '.join(MODES)}")
        if self.normalize_on not in NORMALIZE_ON:
            raise ConfigError(f"LoaderConfig.normalize_on={self.normalize_on!r} is invalid; use one of "
                              f"{', '.join(NORMALIZE_ON)}")
        for name in ("global_batch_size", "prefetch", "partitions", "block_size", "window", "raw_threads"):
            v = getattr(self, name)
            least = 0 if name in ("block_size", "partitions") else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                hint = {"block_size": " (0: the cache's checksum chunks)",
                        "partitions": " (0: sized for the world size)"}.get(name, "")
                raise ConfigError(f"LoaderConfig.{name}={v!r} is invalid; use an integer >= {least}{hint}")
        if self.partitions > self.global_batch_size:
            raise ConfigError(
                f"LoaderConfig.partitions={self.partitions} is more than global_batch_size={self.global_batch_size}; "
                "every global batch takes at least one sample from every partition, so use at most that many"
            )
        if not isinstance(self.ray_max_retries, int) or self.ray_max_retries < 0:
            raise ConfigError(f"LoaderConfig.ray_max_retries={self.ray_max_retries!r} is invalid; use an integer >= 0")
        f = self.memory_fraction
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 <= f <= 1:
            raise ConfigError(f"LoaderConfig.memory_fraction={f!r} is invalid; use a number in [0, 1]")
        if not isinstance(self.read, ReadConfig):
            raise ConfigError(f"LoaderConfig.read={self.read!r} is invalid; pass a dutycycle.engine ReadConfig")
        if not isinstance(self.augment, AugmentConfig):
            raise ConfigError(f"LoaderConfig.augment={self.augment!r} is invalid; pass an AugmentConfig")

    @classmethod
    def for_eval(cls, global_batch_size: int = 256, mode: str = "auto", **kw) -> LoaderConfig:
        """Every sample exactly once across ranks, in a fixed order, without random augmentation."""
        kw.setdefault("augment", AugmentConfig.eval())
        return cls(global_batch_size=global_batch_size, mode=mode, drop_last=False, shuffle=False, **kw)
