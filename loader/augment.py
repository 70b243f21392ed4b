"""Batch augmentations on tensors: random crop with padding, horizontal flip, normalization to float, and the
normalization a loader resolves when it is built (``resolve_normalization``: the config's values, else the
dataset's statistics, else 0.5).

Each sample's random choices come from a counter-based hash of (seed, epoch, sample id), not from a generator
shared by the batch, so a sample is augmented the same way whatever its rank, its position in the batch, the
world size, or whether the run was resumed. The hash is SplitMix64's finalizer over
``key(seed, epoch) XOR blake2b64(sample_id)``; the 64 output bits are split into the crop's x and y offsets and
the flip bit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from collections.abc import Sequence

import numpy as np
from dutycycle.engine.errors import ConfigError

from .config import AugmentConfig  # for the annotations below; defined with the configs (no numpy there)

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= _M1
        x ^= x >> np.uint64(27)
        x *= _M2
        x ^= x >> np.uint64(31)
    return x


def sample_id_hash(sample_ids: Sequence[str]) -> np.ndarray:
    """A stable 64-bit hash per sample id (uint64)."""
    return np.array(
        [int.from_bytes(hashlib.blake2b(str(s).encode(), digest_size=8).digest(), "little") for s in sample_ids],
        dtype=np.uint64,
    )


def sample_random_bits(seed: int, epoch: int, sample_ids: Sequence[str]) -> np.ndarray:
    """64 random bits per sample, a pure function of (seed, epoch, sample id)."""
    key = hashlib.sha256(f"dutycycle-augment:v1:{int(seed)}:{int(epoch)}".encode()).digest()[:8]
    return _splitmix64(sample_id_hash(sample_ids) ^ np.uint64(int.from_bytes(key, "little")))


def augment_params(config: AugmentConfig, seed: int, epoch: int, sample_ids: Sequence[str]):
    """Per-sample (dy, dx, flip) as numpy arrays: crop offsets in ``[0, 2*padding]`` and a flip flag."""
    bits = sample_random_bits(seed, epoch, sample_ids)
    span = np.uint64(2 * config.crop_padding + 1)
    dy = ((bits & np.uint64(0xFFFF)) % span).astype(np.int64)
    dx = (((bits >> np.uint64(16)) & np.uint64(0xFFFF)) % span).astype(np.int64)
    flip = ((bits >> np.uint64(32)) & np.uint64(1)).astype(bool) if config.flip else np.zeros(len(bits), bool)
    return dy, dx, flip


def crop_flip(images: np.ndarray, config: AugmentConfig, seed: int, epoch: int, sample_ids, layout: str = "HWC"):
    """Random crop (after zero padding) and horizontal flip of a uint8 numpy batch, per sample; a new array.

    ``images`` is ``[B, H, W, C]`` (``layout="HWC"``) or ``[B, C, H, W]`` (``"CHW"``). Crops are one slice copy
    per sample from a zero-padded copy of the batch, flips a reversed copy of the flipped subset: far cheaper on
    CPU than a gather over every pixel.
    """
    if not config.random or not len(sample_ids):
        return images
    dy, dx, flip = augment_params(config, seed, epoch, sample_ids)
    p = config.crop_padding
    hw = (1, 2) if layout == "HWC" else (2, 3)
    h, w = images.shape[hw[0]], images.shape[hw[1]]
    if p:
        padded = np.zeros(images.shape[: hw[0]] + (h + 2 * p, w + 2 * p) + images.shape[hw[1] + 1 :], np.uint8)
        if layout == "HWC":
            padded[:, p : p + h, p : p + w] = images
        else:
            padded[:, :, p : p + h, p : p + w] = images
        out = np.empty_like(images)
        for i in range(len(images)):  # a crop is a rectangular slice: one fast copy per sample
            if layout == "HWC":
                out[i] = padded[i, dy[i] : dy[i] + h, dx[i] : dx[i] + w]
            else:
                out[i] = padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w]
    else:
        out = images.copy() if flip.any() else images
    sel = np.flatnonzero(flip)
    if len(sel):
        src = out[sel]
        if layout == "HWC":
            # channel by channel: a reversed run of single bytes copies far faster than reversed 3-byte pixels
            for c in range(out.shape[-1]):
                out[sel, :, :, c] = src[:, :, ::-1, c]
        else:
            out[sel] = src[..., ::-1]
    return out


def to_tensor(images: np.ndarray, config: AugmentConfig, layout: str = "HWC"):
    """uint8 numpy batch -> torch ``[B, C, H, W]``: uint8 (zero-copy; channels_last memory for HWC caches) or,
    with ``normalize``, contiguous float32 ``(x / 255 - mean) / std``."""
    import torch

    if config.normalize:
        chw = images[:, None] if images.ndim == 3 else images.transpose(0, 3, 1, 2) if layout == "HWC" else images
        scale, shift = normalize_constants(config, chw.shape[1])
        # (x / 255 - mean) / std folded into one multiply and one add, written straight into a contiguous NCHW
        # float32 array. NumPy, not torch: its loops release the GIL and do not compete with the trainer's
        # intra-op thread pool. (device.Normalizer does the same two float32 operations on a device.)
        out = np.empty(chw.shape, np.float32)
        np.multiply(chw, scale, out=out)
        np.add(out, shift, out=out)
        return torch.from_numpy(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only (object store) arrays: never written through
        x = torch.from_numpy(images)
    if x.dim() == 3:  # greyscale [B, H, W]
        return x.unsqueeze(1)
    if layout == "HWC":
        return x.permute(0, 3, 1, 2)  # zero-copy: an NCHW tensor in channels_last memory format
    return x


def normalize_constants(config: AugmentConfig, channels: int) -> tuple[np.ndarray, np.ndarray]:
    """``(scale, shift)``, float32 ``[1, C, 1, 1]``: ``(x / 255 - mean) / std`` is ``x * scale + shift``, each
    operation rounded once in float32. The one place they are computed, so that normalizing on the host
    (``to_tensor``) and on a device (``device.Normalizer``) gives the same bits."""
    std = np.asarray(_per_channel(config.std, channels, "std"), np.float32).reshape(1, channels, 1, 1)
    mean = np.asarray(_per_channel(config.mean, channels, "mean"), np.float32).reshape(1, channels, 1, 1)
    return np.float32(1.0 / 255.0) / std, -mean / std


def apply_augment(images: np.ndarray, config: AugmentConfig, seed: int, epoch: int, sample_ids, layout="HWC"):
    """The whole batch augmentation: ``crop_flip`` then ``to_tensor``."""
    return to_tensor(crop_flip(images, config, seed, epoch, sample_ids, layout), config, layout)


def _per_channel(values: Sequence[float], channels: int, name: str) -> list[float]:
    values = [float(v) for v in values]
    if not values:
        raise ConfigError(f"AugmentConfig.{name} is empty (the dataset's statistics), which a Loader resolves when it "
                          "is built; pass values to augment a batch outside a Loader")
    if len(values) == 1:
        return values * channels
    if len(values) != channels:
        raise ConfigError(f"AugmentConfig.{name} has {len(values)} values for {channels} channels; give 1 or {channels}")
    return values


DEFAULT_MEAN = DEFAULT_STD = 0.5  # what a source without statistics normalizes with: x / 255 to [-1, 1]


def resolve_normalization(config: AugmentConfig, channels: int, stats: dict | None,
                          missing: str) -> tuple[AugmentConfig, str]:
    """The augmentation a loader applies, with its effective per-channel ``mean`` and ``std``, and where they
    came from (``Loader.normalize_from``).

    Values in ``config`` win (one for all channels is expanded to ``channels``); empty ones take ``stats`` (a
    cache manifest's ``channel_stats``); without statistics, 0.5 for every channel, and ``missing`` says why
    there are none. A ``std`` of 0 in the statistics (a channel that never varies) becomes 1, so that channel
    is only centred instead of divided by zero. Normalization off: ``config`` unchanged."""
    if not config.normalize:
        return config, "off: batches are uint8"
    if not config.from_dataset:
        mean, std = _per_channel(config.mean, channels, "mean"), _per_channel(config.std, channels, "std")
        how = "config"
    elif stats is not None:
        if len(stats["mean"]) != channels:
            raise ConfigError(f"the source's channel statistics have {len(stats['mean'])} values for {channels} "
                              "channels; materialize the cache again")
        mean = [float(v) for v in stats["mean"]]
        std = [float(v) if v > 0 else 1.0 for v in stats["std"]]
        how = f"the dataset's statistics ({stats['split']} split, {stats['samples']} samples)"
    else:
        mean, std = [DEFAULT_MEAN] * channels, [DEFAULT_STD] * channels
        how = f"0.5 (no dataset statistics: {missing}; set mean and std to override)"
    return dataclasses.replace(config, mean=tuple(mean), std=tuple(std)), how
