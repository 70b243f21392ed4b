"""Batch sources: what the step loop consumes.

A batch source is an iterable of dicts ``{"image": float32 [B, C, H, W], "label": int64 [B], ...}`` (one
rank's share of one global batch per item) with ``len()`` (steps per epoch), ``set_epoch(e)`` (a no-op when
already in epoch ``e``, so a restored position survives), ``state_dict()`` / ``load_state_dict()`` (epoch and
next global batch; loads at any world size) and ``position()`` (``(epoch, index of the next global batch)``).
The loop times ``next()`` itself, so every source's data wait is measured the same way.

Sources:
- ``ArraySource``: arrays in memory, the same plan as the loader (a permutation per (seed, epoch), a rank
  takes a contiguous slice of each global batch), used for synthetic shapes in tests and smoke runs.
- ``LoaderSource``: adapts the real ``dutycycle.loader`` CacheLoader / RawLoader.
- ``SlowSource``: wraps any source and sleeps before each batch (to show what a slow loader costs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from dutycycle.engine.errors import ConfigError


@dataclass
class DataInfo:
    num_classes: int
    channels: int
    size: int
    train_samples: int
    val_samples: int
    fingerprint: str = ""
    lineage: dict = field(default_factory=dict)  # where the data came from (cache, table), for checkpoints


# ------------------------------------------------------------------------------------------- synthetic data

SHAPES = ("circle", "square", "triangle", "cross")


def draw_shapes(n: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images [n, size, size, 3] uint8 of bright shapes on dark noisy backgrounds, labels [n]."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(SHAPES), n)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    images = np.empty((n, size, size, 3), np.uint8)
    for i in range(n):
        r = rng.uniform(0.18, 0.32) * size
        cx, cy = rng.uniform(r, size - r, 2)
        dx, dy = xx - cx, yy - cy
        kind = SHAPES[labels[i]]
        if kind == "circle":
            mask = dx**2 + dy**2 <= r**2
        elif kind == "square":
            mask = (np.abs(dx) <= r * 0.8) & (np.abs(dy) <= r * 0.8)
        elif kind == "triangle":
            mask = (dy <= r * 0.7) & (dy >= -r) & (np.abs(dx) <= (dy + r) * 0.6)
        else:
            w = r * 0.3
            mask = ((np.abs(dx) <= w) | (np.abs(dy) <= w)) & (np.abs(dx) <= r) & (np.abs(dy) <= r)
        bg = rng.uniform(0, 60, 3) + rng.normal(0, 8, (size, size, 3))
        fg = rng.uniform(150, 255, 3)
        img = np.where(mask[..., None], fg, bg)
        images[i] = np.clip(img, 0, 255).astype(np.uint8)
    return images, labels.astype(np.int64)


class ArraySource:
    """One rank's batches over arrays in memory (uint8 [N, H, W, C]) with the loader's plan semantics."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, global_batch_size: int, rank: int,
                 world_size: int, seed: int = 0, shuffle: bool = True, drop_last: bool = True, flip: bool = False):
        assert global_batch_size % world_size == 0
        self.images, self.labels = images, labels
        self.global_batch_size, self.rank, self.world_size = global_batch_size, rank, world_size
        self.seed, self.shuffle, self.drop_last, self.flip = seed, shuffle, drop_last, flip
        self.epoch = 0
        self.batch_index = 0  # global batches consumed in this epoch (for resume)

    def __len__(self) -> int:
        n = len(self.labels)
        return n // self.global_batch_size if self.drop_last else -(-n // self.global_batch_size)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.batch_index = epoch, 0

    def position(self) -> tuple[int, int]:
        return self.epoch, self.batch_index

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch_index": self.batch_index, "seed": self.seed,
                "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("global_batch_size", self.global_batch_size) != self.global_batch_size:
            raise ConfigError(f"the saved position is for data.global_batch_size = {state['global_batch_size']}, "
                              f"this run has {self.global_batch_size}; use the same global batch size")
        self.epoch, self.batch_index = int(state["epoch"]), int(state["batch_index"])

    def _order(self) -> np.ndarray:
        n = len(self.labels)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, self.epoch]).permutation(n)

    def __iter__(self):
        import torch

        order = self._order()
        per_rank = self.global_batch_size // self.world_size
        for b in range(self.batch_index, len(self)):
            g = order[b * self.global_batch_size : (b + 1) * self.global_batch_size]
            if len(g) == self.global_batch_size:
                idx = g[self.rank * per_rank : (self.rank + 1) * per_rank]
            else:  # last partial batch (drop_last off): near-equal contiguous slices
                idx = np.array_split(g, self.world_size)[self.rank]
            x = self.images[idx]
            if self.flip:
                # seeded by (seed, epoch, global batch, position in the global batch): world-size invariant
                flips = np.random.default_rng([self.seed, self.epoch, b, 1]).random(len(g)) < 0.5
                start = self.rank * per_rank if len(g) == self.global_batch_size else 0
                f = flips[start : start + len(idx)]
                x = x.copy()
                x[f] = x[f, :, ::-1]
            self.batch_index = b + 1
            image = torch.from_numpy(np.ascontiguousarray(x)).permute(0, 3, 1, 2).float().div_(255.0)
            yield {"image": image, "label": torch.from_numpy(self.labels[idx]), "sample_id": idx.tolist()}
        self.batch_index = 0  # a finished epoch leaves nothing to resume


class SlowSource:
    """Wraps a source and sleeps ``delay_s`` before every batch: a deliberately slow loader."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def position(self) -> tuple[int, int]:
        return self.inner.position()

    def __iter__(self):
        for batch in self.inner:
            time.sleep(self.delay_s)
            yield batch


class LoaderSource:
    """Adapts a ``dutycycle.loader`` loader: images to float [B, C, H, W] whatever the cache layout."""

    def __init__(self, loader):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    def position(self) -> tuple[int, int]:
        return self.loader.epoch, self.loader.step

    def __iter__(self):
        for batch in self.loader:
            x = batch["image"]  # already [B, C, H, W]
            if not x.is_floating_point():  # normalize off: the model still wants floats
                x = x.float().div_(255.0)
            yield {**batch, "image": x}


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


def make_sources(cfg, rank: int, world_size: int):
    """Build ``(train_source, val_source, DataInfo)`` for one rank from the config's data section."""
    d = cfg.data
    if d.source == "synthetic":
        n_train, n_val = d.synthetic_samples, max(d.synthetic_samples // 4, world_size)
        # one draw for both splits so they share a distribution; the seed is fixed by run.seed
        images, labels = draw_shapes(n_train + n_val, d.size, seed=cfg.run.seed + 1000)
        train = ArraySource(images[:n_train], labels[:n_train], d.global_batch_size, rank, world_size,
                            seed=cfg.run.seed, drop_last=d.drop_last, flip=d.augment.flip)
        val = ArraySource(images[n_train:], labels[n_train:], d.eval_batch_size * world_size, rank, world_size,
                          shuffle=False, drop_last=False)
        info = DataInfo(len(SHAPES), 3, d.size, n_train, n_val, fingerprint=f"synthetic-{cfg.run.seed}",
                        lineage={"synthetic": {"samples": n_train, "size": d.size, "seed": cfg.run.seed + 1000}})
    elif d.source in ("cache", "raw"):
        train, val, info = _loader_sources(cfg, rank, world_size)
    else:  # validated in config
        raise AssertionError(d.source)
    if d.slow_ms > 0:
        train = SlowSource(train, d.slow_ms / 1000.0)
    return train, val, info


def _loader_sources(cfg, rank: int, world_size: int):
    d = cfg.data
    try:
        from dutycycle.loader import AugmentConfig, CacheLoader, LoaderConfig
    except ImportError as e:  # the loader room is built in parallel; say so plainly
        raise ConfigError(f"data.source = {d.source!r} needs dutycycle.loader ({e})") from e

    aug = AugmentConfig(crop_padding=d.augment.crop_padding, flip=d.augment.flip, normalize=d.augment.normalize)
    train_cfg = LoaderConfig(global_batch_size=d.global_batch_size, seed=cfg.run.seed, drop_last=d.drop_last,
                             mode=d.loader_mode, prefetch=d.prefetch, augment=aug)
    # validation: every sample once across ranks, fixed order, no random augmentation, same normalization
    val_cfg = LoaderConfig.for_eval(global_batch_size=d.eval_batch_size * world_size, mode=d.loader_mode,
                                    prefetch=d.prefetch,
                                    augment=AugmentConfig(normalize=d.augment.normalize, mean=aug.mean, std=aug.std))
    if d.source == "cache":
        train = CacheLoader(d.cache, "train", rank, world_size, config=train_cfg)
        val = CacheLoader(d.cache, "val", rank, world_size, config=val_cfg)
    else:
        from dutycycle.engine.transform import TransformSpec
        from dutycycle.loader import RawLoader

        spec = TransformSpec(size=d.size)
        train = RawLoader(d.table, spec, "train", rank, world_size, config=train_cfg)
        val = RawLoader(d.table, spec, "val", rank, world_size, config=val_cfg)
    shape, layout = tuple(train.shape), train.layout
    channels, size = (shape[0], shape[1]) if layout == "CHW" else (shape[2], shape[0])
    if d.source == "cache":
        m = train.reader.manifest
        lineage = {"cache": train.cache_uri, "table": m.source, "options": m.options}
    else:
        lineage = {"table": d.table}
    info = DataInfo(len(train.classes), channels, size, train.num_samples, val.num_samples,
                    fingerprint=train.fingerprint, lineage=lineage)
    return LoaderSource(train), LoaderSource(val), info


def write_synthetic_cache(cache_uri: str, n_train: int, n_val: int, size: int = 32, seed: int = 0,
                          shard_rows: int = 256) -> str:
    """Write a committed cache of synthetic shapes (HWC uint8) with the open cache format, no images or
    Daft involved: for tests and benchmarks that need a cache quickly. Returns the cache URI."""
    import hashlib

    from dutycycle.engine.cache import format as cf

    images, labels = draw_shapes(n_train + n_val, size, seed)
    splits = ["train"] * n_train + ["val"] * n_val
    ids = [hashlib.sha256(f"{seed}-{i}".encode()).hexdigest()[:16] for i in range(len(labels))]
    order = np.argsort(ids)  # caches are sorted by sample id
    shards = []
    for s, start in enumerate(range(0, len(order), shard_rows)):
        rows = order[start : start + shard_rows]
        shards.append(cf.write_shard(cache_uri, s, [ids[i] for i in rows], labels[rows], [splits[i] for i in rows],
                                     images[rows]))
    fingerprint = hashlib.sha256(f"synthetic-{n_train}-{n_val}-{size}-{seed}".encode()).hexdigest()[:16]
    cf.commit(cache_uri, cf.CacheManifest(
        fingerprint=fingerprint, shape=[size, size, 3], layout="HWC", dtype="uint8", num_samples=len(labels),
        shards=shards, classes=list(SHAPES), split_counts={"train": n_train, "val": n_val},
        spec={"size": size, "synthetic": True}, source="synthetic"))
    return cache_uri
