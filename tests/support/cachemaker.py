"""Build small committed caches of known content with the engine's cache writer (no materialize), for loader
tests.

Every sample's pixels encode its global index, so a test can tell from a batch exactly which samples it got:
``pixel_index(image)`` recovers it from the first pixels (see ``sample_pixels``).
"""

from __future__ import annotations

import hashlib

import numpy as np
from dutycycle.engine.cache.write import write_cache


def sample_pixels(index: int, shape) -> np.ndarray:
    """Distinct uint8 content for sample ``index``: a random-looking image whose first two bytes hold the index."""
    rng = np.random.default_rng(index)
    img = rng.integers(0, 256, size=int(np.prod(shape)), dtype=np.uint8)
    img[0], img[1] = index & 0xFF, (index >> 8) & 0xFF
    return img.reshape(shape)


def pixel_index(image: np.ndarray) -> int:
    flat = np.asarray(image).reshape(-1)
    return int(flat[0]) | (int(flat[1]) << 8)


def sample_id(index: int) -> str:
    # Content-hash-like ids, like the real pipeline; cache order is sorted by id.
    return hashlib.sha256(f"sample-{index}".encode()).hexdigest()[:32]


def make_cache(
    uri: str,
    n: int,
    shape=(8, 8, 3),
    shards: int = 3,
    splits: dict[str, float] | None = None,
    num_classes: int = 4,
    layout: str = "HWC",
    fingerprint: str | None = None,
):
    """Write and commit a cache of ``n`` samples in ``shards`` shards; returns the manifest.

    Samples are sorted by sample id (as materialize writes them); sample ``i`` in cache order has pixels
    ``sample_pixels(i, shape)`` and label ``i % num_classes``. ``splits`` maps split name to fraction
    (default all ``train``); splits are interleaved deterministically so every shard holds several splits.
    """
    ids = sorted(sample_id(i) for i in range(n))
    images = np.stack([sample_pixels(i, shape) for i in range(n)]) if n else np.zeros((0, *shape), np.uint8)
    labels = np.arange(n) % num_classes
    splits = splits or {"train": 1.0}
    names = list(splits)
    cum = np.cumsum([splits[k] for k in names]) / sum(splits.values())
    # a low-discrepancy assignment: sample i goes to the split whose cumulative fraction covers frac(i * phi)
    u = (np.arange(n) * 0.6180339887498949) % 1.0
    split_of = [names[int(np.searchsorted(cum, x, side="right"))] if x < cum[-1] else names[-1] for x in u]
    return write_cache(
        uri, ids, labels, split_of, images, classes=[f"class{c}" for c in range(num_classes)],
        rows_per_shard=max(1, -(-n // shards)), layout=layout,
        fingerprint=fingerprint or hashlib.sha256(f"test-cache-{n}-{shape}-{shards}".encode()).hexdigest()[:16],
    )
