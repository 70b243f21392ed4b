"""The embedded default dataset: procedurally drawn shapes, the one generator every synthetic sample comes from.

``draw_shapes`` draws images as arrays (the trainer's synthetic source, test tables, benchmarks);
``synthesize`` encodes them as files, one folder per class, on any fsspec URI; ``synthesize_cache`` writes
them as a committed cache without files or Daft. Each image is a pure function of ``(seed, index, size)``:
the same seed gives the same pixels on any machine and with any number of worker processes, and image
``index`` has class ``CLASSES[index % len(CLASSES)]``. Shapes contrast strongly with their background (a light
shape of random hue on a dark background of random hue) and cover 45-85% of the shorter side, so a small CNN
learns the classes in a few epochs at 32x32. A ``broken_fraction`` of files is replaced by deliberately broken
content so the error path shows.
"""

from __future__ import annotations

import hashlib
import io as _io
import math
import os
import time
from dataclasses import dataclass

import numpy as np

from . import io
from .errors import ConfigError, DestinationError

CLASSES = ("circle", "square", "triangle", "star")
# (format, extension, weight): mostly JPEG, some PNG and WebP
FORMATS = (("JPEG", "jpg", 0.70), ("PNG", "png", 0.15), ("WEBP", "webp", 0.15))
MIN_SIDE, MAX_SIDE = 48, 256
UPPER_EXT_FRACTION = 0.1
BROKEN_KINDS = ("truncated", "random-bytes", "text", "empty")
PARALLEL_THRESHOLD = 400  # below this, process start-up costs more than it saves
# Shapes are tilted by at most this many radians, not turned freely: at 16x16 a 3-layer CNN reached a validation
# loss of 0.2-0.3 after 100 steps on freely turned shapes and 0.04-0.07 with this tilt (measured here).
MAX_TILT = 0.4
DRAW_STREAM = 0xD2A7  # the pixels' random stream, apart from a file's (its side, format, quality)


@dataclass(frozen=True)
class SynthConfig:
    n: int
    seed: int = 0
    broken_fraction: float = 0.0
    workers: int | None = None  # None: one per CPU


def _rng(seed: int, index: int, stream: int = 0x5EED) -> np.random.Generator:
    return np.random.default_rng([seed, index, stream])


def _polygon(kind: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    if kind == "square":
        pts = [(math.pi / 4 + k * math.pi / 2, r) for k in range(4)]
    elif kind == "triangle":
        pts = [(-math.pi / 2 + k * 2 * math.pi / 3, r) for k in range(3)]
    else:  # star: 5 outer points, inner radius 0.42 r
        pts = [(-math.pi / 2 + k * math.pi / 5, r if k % 2 == 0 else 0.42 * r) for k in range(10)]
    return [(cx + rad * math.cos(a + angle), cy + rad * math.sin(a + angle)) for a, rad in pts]


def _colours(rng) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Background and shape colours far apart in luminance, random hues.

    The shape is always the light one: with random polarity a small CNN needs many more epochs to learn
    the outlines (measured here: about 60% validation accuracy after 6 epochs at 32x32).
    """
    dark = tuple(int(v) for v in rng.integers(0, 80, 3))
    light = tuple(int(v) for v in rng.integers(175, 256, 3))
    return dark, light


def _draw(rng: np.random.Generator, label: str, height: int, width: int) -> np.ndarray:
    """One shape of class ``label`` on its background with sensor-like noise: uint8 [height, width, 3]."""
    from PIL import Image, ImageDraw

    bg, fg = _colours(rng)
    im = Image.new("RGB", (width, height), bg)
    draw = ImageDraw.Draw(im)
    r = float(rng.uniform(0.45, 0.85)) * min(width, height) / 2  # the shape's size as a fraction of the side
    cx = float(rng.uniform(r, width - r))
    cy = float(rng.uniform(r, height - r))
    angle = float(rng.uniform(-MAX_TILT, MAX_TILT))
    if label == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fg)
    else:
        draw.polygon(_polygon(label, cx, cy, r, angle), fill=fg)
    noisy = np.asarray(im, dtype=np.int16) + rng.normal(0, 6, (height, width, 3)).astype(np.int16)
    return np.clip(noisy, 0, 255).astype(np.uint8)


def draw_shapes(n: int, size: int | tuple[int, int], seed: int = 0, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Images ``start .. start + n - 1`` of the dataset ``seed``: uint8 [n, H, W, 3] (``size``: the side, or
    ``(height, width)``) and their labels, indices into ``CLASSES``, int64 [n]."""
    height, width = (size, size) if isinstance(size, int) else size
    labels = np.arange(start, start + n, dtype=np.int64) % len(CLASSES)
    images = np.empty((n, height, width, 3), np.uint8)
    for k in range(n):
        images[k] = _draw(_rng(seed, start + k, DRAW_STREAM), CLASSES[labels[k]], height, width)
    return images, labels


def render(seed: int, index: int) -> tuple[str, str, bytes]:
    """Draw image ``index`` as a file: returns ``(label, relative_path, encoded_bytes)``."""
    from PIL import Image

    rng = _rng(seed, index)
    side = int(rng.integers(MIN_SIDE, MAX_SIDE + 1))
    pixels, labels = draw_shapes(1, side, seed, start=index)
    label = CLASSES[labels[0]]
    im = Image.fromarray(pixels[0])

    weights = np.array([w for _, _, w in FORMATS])
    fmt, ext, _ = FORMATS[int(rng.choice(len(FORMATS), p=weights / weights.sum()))]
    if rng.random() < UPPER_EXT_FRACTION:
        ext = ext.upper()
    buf = _io.BytesIO()
    if fmt == "JPEG":
        im.save(buf, "JPEG", quality=int(rng.integers(80, 96)))
    elif fmt == "WEBP":
        im.save(buf, "WEBP", quality=85, method=0)
    else:
        im.save(buf, "PNG", compress_level=1)
    return label, f"{label}/{label}_{index:06d}.{ext}", buf.getvalue()


def _broken(seed: int, index: int, data: bytes) -> tuple[str, bytes]:
    """Replace good bytes with one kind of deliberately broken content; returns ``(kind, bytes)``."""
    rng = _rng(seed, index + 1_000_000_007)
    kind = BROKEN_KINDS[int(rng.integers(len(BROKEN_KINDS)))]
    if kind == "truncated":
        return kind, data[: max(16, len(data) // 3)]
    if kind == "random-bytes":
        return kind, rng.integers(0, 256, 512, dtype="uint8").tobytes()
    if kind == "text":
        return kind, b"<html><body>this is not an image</body></html>\n"
    return kind, b""


def _make(args: tuple[int, int, bool]) -> tuple[str, str, bytes, str | None]:
    seed, index, broken = args
    label, rel, data = render(seed, index)
    kind = None
    if broken:
        kind, data = _broken(seed, index, data)
    return label, rel, data, kind


def _broken_indices(n: int, seed: int, fraction: float) -> set[int]:
    k = int(round(n * fraction))
    if k == 0:
        return set()
    rng = np.random.default_rng([seed, 0xB20CE])
    return {int(i) for i in rng.choice(n, size=min(k, n), replace=False)}


def synthesize(
    out_uri: str, n: int, seed: int = 0, broken_fraction: float = 0.0, workers: int | None = None
) -> dict:
    """Write ``n`` shape images under ``out_uri/<class>/``; returns a summary dict."""
    cfg = SynthConfig(n=n, seed=seed, broken_fraction=broken_fraction, workers=workers)
    if cfg.n < 1:
        raise ConfigError(f"--n {cfg.n} must be at least 1; pass the number of images to draw, e.g. --n 1000")
    if not 0.0 <= cfg.broken_fraction < 1.0:
        raise ConfigError(f"--broken-fraction {cfg.broken_fraction} must be in [0, 1), e.g. 0.01")
    t0 = time.time()
    fs, root = io.filesystem(out_uri)
    try:
        fs.makedirs(root, exist_ok=True)
        for c in CLASSES:
            fs.makedirs(f"{root}/{c}", exist_ok=True)
    except OSError as e:
        raise DestinationError(f"cannot create {out_uri!r}: {e}; choose a writable location") from e

    broken = _broken_indices(cfg.n, cfg.seed, cfg.broken_fraction)
    jobs = [(cfg.seed, i, i in broken) for i in range(cfg.n)]
    nworkers = cfg.workers or os.cpu_count() or 1
    classes: dict[str, int] = dict.fromkeys(CLASSES, 0)
    formats: dict[str, int] = {}
    broken_kinds: dict[str, int] = {}
    total_bytes = 0

    def write(item):
        nonlocal total_bytes
        label, rel, data, kind = item
        try:
            with fs.open(f"{root}/{rel}", "wb") as f:
                f.write(data)
        except OSError as e:
            raise DestinationError(f"cannot write under {out_uri!r}: {e}; choose a writable location") from e
        classes[label] += 1
        ext = rel.rsplit(".", 1)[1].lower()
        formats[ext] = formats.get(ext, 0) + 1
        if kind:
            broken_kinds[kind] = broken_kinds.get(kind, 0) + 1
        total_bytes += len(data)

    if nworkers > 1 and cfg.n >= PARALLEL_THRESHOLD:
        import multiprocessing as mp

        # Workers only draw and encode; the parent writes, so memory:// and other in-process filesystems work.
        with mp.get_context("spawn").Pool(nworkers) as pool:
            for item in pool.imap(_make, jobs, chunksize=64):
                write(item)
    else:
        for job in jobs:
            write(_make(job))
    return {
        "out": out_uri,
        "n": cfg.n,
        "seed": cfg.seed,
        "classes": classes,
        "formats": formats,
        "broken": sum(broken_kinds.values()),
        "broken_kinds": broken_kinds,
        "bytes": total_bytes,
        "seconds": round(time.time() - t0, 3),
    }


def synthesize_cache(cache_uri: str, n_train: int, n_val: int, size: int = 32, seed: int = 0,
                     rows_per_shard: int = 256) -> str:
    """Write a committed cache (HWC uint8) of ``n_train + n_val`` shape images drawn in memory, no image files or
    Daft involved: for tests and benchmarks that need a cache quickly. Returns the cache URI."""
    # heavy: pyarrow, only when a cache is written, not in every synth worker
    from .cache.write import write_cache

    images, labels = draw_shapes(n_train + n_val, size, seed)
    ids = [hashlib.sha256(f"{seed}-{i}".encode()).hexdigest()[:16] for i in range(len(labels))]
    write_cache(cache_uri, ids, labels, ["train"] * n_train + ["val"] * n_val, images, classes=list(CLASSES),
                spec={"size": size, "synthetic": True}, source="synthetic", rows_per_shard=rows_per_shard,
                fingerprint=hashlib.sha256(f"synthetic-{n_train}-{n_val}-{size}-{seed}".encode()).hexdigest()[:16])
    return cache_uri
