"""Notebook helpers for a cache: open it, look at samples as thumbnails, and read its statistics.

    from dutycycle.engine.cache.view import view
    v = view("cache/")          # a committed cache folder or a cache root
    v                           # summary + a thumbnail grid (rendered by Jupyter through _repr_html_)
    v.stats()                   # dict: samples, shards, bytes, per-class and per-split counts, channel mean/std

Grey caches (``mode="L"``, one channel) show as grey thumbnails; RGB caches in colour.
    v.thumbnails(48, label="circle")
"""

from __future__ import annotations

import base64
import html
import io as _io
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from .reader import CacheReader


@dataclass
class Thumbnails:
    """A grid of samples that Jupyter renders inline (PNG data URIs, captioned with label and split)."""

    images: np.ndarray  # [n, H, W, C] uint8, C = 3 (RGB) or 1 (grey)
    captions: list[str]
    scale: int = 2

    def _png(self, img: np.ndarray) -> str:
        from PIL import Image

        im = Image.fromarray(img[:, :, 0], "L") if img.ndim == 3 and img.shape[2] == 1 else Image.fromarray(img)
        im = im.resize((im.width * self.scale, im.height * self.scale), Image.NEAREST)
        buf = _io.BytesIO()
        im.save(buf, "PNG")
        return base64.b64encode(buf.getvalue()).decode()

    def _repr_html_(self) -> str:
        cells = [
            f'<figure style="display:inline-block;margin:2px;text-align:center">'
            f'<img src="data:image/png;base64,{self._png(img)}"/>'
            f'<figcaption style="font-size:10px">{html.escape(cap)}</figcaption></figure>'
            for img, cap in zip(self.images, self.captions, strict=True)
        ]
        return '<div class="dutycycle-thumbnails">' + "".join(cells) + "</div>"

    def __len__(self) -> int:
        return len(self.captions)


class CacheView:
    """Read-only, notebook-friendly view of a committed cache."""

    def __init__(self, uri: str, verify: bool = True):
        self.reader = CacheReader(uri, verify=verify)
        self.manifest = self.reader.manifest

    def _hwc(self, images: np.ndarray) -> np.ndarray:
        return images.transpose(0, 2, 3, 1) if self.manifest.layout == "CHW" else images

    def labels(self) -> np.ndarray:
        return np.concatenate([self.reader.column(i, "label") for i in range(self.reader.num_shards)])

    def sample(self, index: int) -> dict[str, Any]:
        """One sample by global index: image (HWC uint8), label name, split, sample id."""
        s, r = (int(v[0]) for v in self.reader.locate(np.array([index])))
        label = int(self.reader.column(s, "label")[r])
        return {
            "image": self._hwc(self.reader.images(s)[r : r + 1])[0],
            "label": self.manifest.classes[label] if label >= 0 else None,
            "split": self.reader.column(s, "split")[r],
            "sample_id": self.reader.column(s, "sample_id")[r],
        }

    def thumbnails(self, n: int = 32, label: str | None = None, split: str | None = None, seed: int = 0,
                   scale: int = 2) -> Thumbnails:
        """``n`` random samples (optionally of one class or split), reproducible for a given seed."""
        labels = self.labels()
        splits = np.concatenate([self.reader.column(i, "split") for i in range(self.reader.num_shards)])
        keep = np.ones(len(labels), bool)
        if label is not None:
            keep &= labels == self.manifest.classes.index(label)
        if split is not None:
            keep &= splits == split
        candidates = np.flatnonzero(keep)
        pick = np.sort(np.random.default_rng(seed).permutation(candidates)[:n])
        shard, row = self.reader.locate(pick)
        images = np.stack([self.reader.images(int(s))[int(r)] for s, r in zip(shard, row, strict=True)]) if len(pick) \
            else np.zeros((0, *self.manifest.shape), np.uint8)
        names = self.manifest.classes
        captions = [f"{names[labels[i]] if labels[i] >= 0 else '?'} / {splits[i]}" for i in pick]
        return Thumbnails(self._hwc(images), captions, scale)

    def stats(self, max_pixels_samples: int = 2048) -> dict[str, Any]:
        """Counts from the manifest and the label column; the per-channel mean and standard deviation of the
        pixels on a 0..1 scale: the manifest's exact statistics of the training split when it records them
        (``channel_stats_from`` says so), else an estimate from up to ``max_pixels_samples`` samples."""
        m = self.manifest
        labels = self.labels()
        counts = Counter(labels.tolist())
        if m.channel_stats is not None:
            cs = m.channel_stats
            mean, std = list(cs["mean"]), list(cs["std"])
            origin = f"manifest: exact, {cs['split']} split, {cs['samples']} samples"
        else:
            n = min(m.num_samples, max_pixels_samples)
            pick = np.sort(np.random.default_rng(0).permutation(m.num_samples)[:n])
            shard, row = self.reader.locate(pick)
            px = self._hwc(np.stack([self.reader.images(int(s))[int(r)] for s, r in zip(shard, row, strict=True)]))
            px = px.reshape(-1, m.channels).astype(np.float64) / 255.0
            mean, std = px.mean(0).tolist(), px.std(0).tolist()
            origin = f"estimate from {n} samples (the manifest records none)"
        return {
            "cache": self.reader.uri,
            "fingerprint": m.fingerprint,
            "samples": m.num_samples,
            "shards": len(m.shards),
            "bytes": sum(s.bytes for s in m.shards),
            "shape": m.shape,
            "layout": m.layout,
            "classes": {name: counts.get(k, 0) for k, name in enumerate(m.classes)},
            "splits": dict(m.split_counts),
            "skipped": dict(m.skipped),
            "spec": dict(m.spec),
            "channel_mean": [round(float(v), 4) for v in mean],
            "channel_std": [round(float(v), 4) for v in std],
            "channel_stats_from": origin,
            "source": m.source,
        }

    def _repr_html_(self) -> str:
        s = self.stats()
        rows = "".join(
            f"<tr><th style='text-align:left'>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
            for k, v in s.items()
            if k != "spec"
        )
        return f"<table>{rows}</table>" + self.thumbnails(16)._repr_html_()


def view(uri: str, verify: bool = True) -> CacheView:
    return CacheView(uri, verify=verify)
