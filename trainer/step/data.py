"""Batch sources: what the step loop consumes.

A batch source is an iterable of dicts ``{"image": float32 [B, C, H, W], "label": int64 [B], ...}`` (one
rank's share of one global batch per item; each ``iter()`` is one pass: an epoch from its start, or from a
restored position once after ``load_state_dict``) with ``len()`` (steps per epoch), ``set_epoch(e)`` (a no-op for
the epoch it is in, so a restored position survives), ``state_dict()`` / ``load_state_dict()`` (epoch and
next global batch; loads at any world size) and ``position()`` (``(epoch, index of the next global batch)``).
The loop times ``next()`` itself, so every source's data wait is measured the same way.

Sources:
- ``ArraySource``: arrays in memory through the loader's ``ArrayLoader`` (the same plan, flip and state as a
  cache), used for synthetic shapes in tests and smoke runs.
- ``LoaderSource``: adapts the real ``dutycycle.loader`` CacheLoader / RawLoader.

The input path to a GPU (``delivery``): the loader's prefetch thread collates each batch as uint8 (as the cache
stores it), pins it and copies it with ``non_blocking=True`` on a side stream while the step before it trains;
handing it out, the loader makes the compute stream wait for that copy (``record_stream`` keeps the allocator off
its memory) and normalizes it there (``data.normalize_on = "auto"``: on the device, a quarter of float32's bytes
on the wire, the same bits as the host's NumPy). On a CPU nothing is pinned or copied and the loader normalizes
in its thread, as it always did. ``LoaderSource.delivery()`` says which ran and what a batch sends.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np
from dutycycle.engine.synth import CLASSES, draw_shapes
from dutycycle.engine.transform import TransformSpec
from dutycycle.loader import ArrayLoader, AugmentConfig, CacheLoader, LoaderConfig, RawLoader
from dutycycle.trainer.parallel.dims import ParallelDims


@dataclass
class DataInfo:
    """What the model is trained on, as a model file, evaluation and prediction need it again: the class names,
    the sample shape, how pixels were normalized, and where the data came from."""

    num_classes: int
    channels: int
    size: int
    train_samples: int
    val_samples: int
    fingerprint: str = ""
    lineage: dict = field(default_factory=dict)  # where the data came from (cache, table), for checkpoints
    classes: list[str] = field(default_factory=list)  # label index -> class name
    # the training batches' normalization, (x / 255 - mean) / std per channel: {"mean": [...], "std": [...]};
    # None when batches arrive as x / 255 (normalization off)
    normalize: dict | None = None
    spec: dict = field(default_factory=dict)  # the transform that made a sample from its file (TransformSpec)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def normalization(loader) -> dict | None:
    """The normalization ``loader`` applies to its batches, from its own config: the values it actually uses."""
    a = loader.config.augment
    return {"mean": [float(v) for v in a.mean], "std": [float(v) for v in a.std]} if a.normalize else None


def same_normalization(config: LoaderConfig, loader) -> LoaderConfig:
    """``config`` normalizing with exactly the mean and std ``loader`` applies (its resolved ones: the dataset's
    statistics by default), so validation sees pixels scaled as training saw them."""
    a = loader.config.augment
    return dataclasses.replace(config, augment=dataclasses.replace(config.augment, mean=a.mean, std=a.std))


class LoaderSource:
    """Adapts a ``dutycycle.loader`` loader: images to float [B, C, H, W] whatever the cache layout (uint8 ones,
    normalization off, become x / 255 where the loader put them: on the device after its copy). ``delay_s``
    sleeps that long before every batch: a deliberately slow loader (``data.slow_ms``)."""

    def __init__(self, loader, delay_s: float = 0.0):
        self.loader, self.delay_s = loader, delay_s

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict, force: bool = False) -> None:
        self.loader.load_state_dict(state, force=force)

    def position(self) -> tuple[int, int]:
        return self.loader.epoch, self.loader.step

    def delivery(self) -> dict:
        """How batches reach the model (``Loader.delivery``): where they are normalized, pinned or not, copied
        on a side stream or not, and the mean bytes a batch sends host -> device."""
        return self.loader.delivery

    def reads(self) -> dict | None:
        """The shards this rank's loader opened and the bytes it fetched (a cache loader's; None otherwise)."""
        reader = getattr(self.loader, "reader", None)
        return reader.reads() if reader is not None else None

    def __iter__(self):
        """One pass of the loader (an epoch from its start, or from a restored position once), begun now: the
        position (``position()``) is the pass's first batch before the first ``next``."""
        return self._floats(iter(self.loader))

    def _floats(self, batches):
        for batch in batches:
            if self.delay_s:
                time.sleep(self.delay_s)
            x = batch["image"]  # already [B, C, H, W]
            if not x.is_floating_point():  # normalize off: the model still wants floats
                x = x.float().div_(255.0)
            yield {**batch, "image": x}


class ArraySource(LoaderSource):
    """One rank's batches over arrays in memory (uint8 [N, H, W, C]): a ``dutycycle.loader.ArrayLoader``, so
    the plan, the flip, the position and its state are the loader's own. Images arrive as float in [0, 1]."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, global_batch_size: int, rank: int,
                 world_size: int, seed: int = 0, shuffle: bool = True, drop_last: bool = True, flip: bool = False,
                 fingerprint: str = "arrays", device=None, partitions: int = 1):
        to_device = delivery(device)
        # on CUDA a prefetch thread, so the next batches' copies start while a step trains; otherwise the
        # caller's thread (a gather from RAM costs less than a hand-over between threads)
        mode = "thread" if to_device["device"] is not None else "sync"
        config = LoaderConfig(global_batch_size=global_batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last,
                              mode=mode, augment=AugmentConfig(flip=flip, normalize=False), partitions=partitions,
                              **to_device)
        super().__init__(ArrayLoader(images, labels, rank, world_size, config, fingerprint=fingerprint))


def take(it, source, skip: set[tuple[int, int]]):
    """The next batch of ``it`` (an iterator over ``source``) and its global batch index, leaving out the global
    batches in ``skip`` (``(epoch, index)`` pairs: batches set aside after a non-finite loss). ``(None, -1)`` at
    the end of the epoch."""
    while True:
        epoch, index = source.position()
        batch = next(it, None)
        if batch is None:
            return None, -1
        if (epoch, index) not in skip:
            return batch, index


# ---------------------------------------------------------------------------------------------- factories


def delivery(device) -> dict:
    """The ``LoaderConfig`` fields for batches bound for ``device`` (a torch device or None: the CPU). On CUDA the
    loader pins each batch in its prefetch thread and copies it there on a side stream (``non_blocking``) while
    the step before it trains; elsewhere batches stay where they are, unpinned (pinning raises without an
    accelerator), as they always did."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        return {"device": torch.device(device), "pin_memory": True}
    return {"device": None, "pin_memory": False}


def make_sources(cfg, world, dims: ParallelDims | None = None, device=None):
    """Build ``(train_source, val_source, DataInfo)`` for one rank of ``world`` (a ``cluster.world.World``) from
    the config's data section. ``dims``: the run's parallel degrees; under tensor parallelism the batch is split
    over the data-parallel ranks (a tensor-parallel group's ranks read the same samples). None: every rank is a
    data-parallel rank. ``device``: where the model is (``delivery``); None: the CPU."""
    d = cfg.data
    rank, world_size = dims.data_ranks(world.rank) if dims is not None else (world.rank, world.size)
    if d.source == "synthetic":
        n_train, n_val = d.synthetic_samples, max(d.synthetic_samples // 4, world_size)
        # one draw for both splits so they share a distribution; the seed is fixed by run.seed
        images, labels = draw_shapes(n_train + n_val, d.size, seed=cfg.run.seed + 1000)
        # the fingerprint names the data, so a resume with another seed or size is refused, not reordered
        fingerprint = f"synthetic-{n_train}-{d.size}-{cfg.run.seed}"
        train = ArraySource(images[:n_train], labels[:n_train], d.global_batch_size, rank, world_size,
                            seed=cfg.run.seed, drop_last=d.drop_last, flip=d.augment.flip, fingerprint=fingerprint,
                            device=device, partitions=d.partitions or 1)  # 0: a config built without load_config
        val = ArraySource(images[n_train:], labels[n_train:], d.eval_batch_size * world_size, rank, world_size,
                          shuffle=False, drop_last=False, fingerprint=fingerprint, device=device)
        info = DataInfo(len(CLASSES), 3, d.size, n_train, n_val, fingerprint=fingerprint,
                        lineage={"synthetic": {"samples": n_train, "size": d.size, "seed": cfg.run.seed + 1000}},
                        classes=list(CLASSES), normalize=None)
    elif d.source in ("cache", "raw"):
        train, val, info = _loader_sources(cfg, rank, world_size, device)
    else:  # validated in config
        raise AssertionError(d.source)
    train.delay_s = d.slow_ms / 1000.0
    return train, val, info


def _loader_sources(cfg, rank: int, world_size: int, device=None):
    d = cfg.data
    to_device = delivery(device)
    train_cfg, val_cfg = (dataclasses.replace(c, **to_device) for c in d.loader_configs(cfg.run.seed, world_size))
    if d.source == "cache":
        train = CacheLoader(d.cache, "train", rank, world_size, config=train_cfg)
        val = CacheLoader(d.cache, "val", rank, world_size, config=same_normalization(val_cfg, train))
    else:
        spec = TransformSpec(size=d.size)
        train = RawLoader(d.table, spec, "train", rank, world_size, config=train_cfg)
        val = RawLoader(d.table, spec, "val", rank, world_size, config=same_normalization(val_cfg, train))
    shape, layout = tuple(train.shape), train.layout
    channels, size = (shape[0], shape[1]) if layout == "CHW" else (shape[2], shape[0])
    if d.source == "cache":
        m = train.reader.manifest
        lineage = {"cache": train.cache_uri, "table": m.source, "options": m.options}
        spec = dict(m.spec)
    else:
        lineage = {"table": d.table}
        spec = train.spec.to_dict()
    info = DataInfo(len(train.classes), channels, size, train.num_samples, val.num_samples,
                    fingerprint=train.fingerprint, lineage=lineage, classes=list(train.classes),
                    normalize=normalization(train), spec=spec)
    return LoaderSource(train), LoaderSource(val), info
