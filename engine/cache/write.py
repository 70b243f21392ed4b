"""Write a committed cache from samples already in memory: the same shards and manifest ``materialize`` writes,
for callers whose pixels are already decoded (synthetic data, tests, benchmark baselines).

Rows are sorted by sample id, as every cache is; shards are written atomically, then the manifest, last, with
the per-channel statistics of the training split (``stats``) as materialize records them. A write that fails (a
full disk: ``NoSpaceError``) commits nothing and removes the shards this call wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from typing import Any

import numpy as np

from .. import io
from ..errors import ConfigError
from ..transform import LAYOUTS
from . import format as cf
from . import stats


def write_cache(
    cache_uri: str,
    sample_ids,
    labels,
    splits,
    images: np.ndarray,
    *,
    classes: list[str],
    rows_per_shard: int = 2048,
    layout: str = "HWC",
    spec: dict[str, Any] | None = None,
    source: str = "",
    fingerprint: str | None = None,
    options: dict[str, Any] | None = None,
) -> cf.CacheManifest:
    """Write ``images`` (uint8 [N, *sample shape] in ``layout``) with their ids, label indices and split names as
    a committed cache at ``cache_uri``; returns its manifest. Without ``fingerprint``, one is derived from the
    shards' checksums and the classes, so the same content gets the same fingerprint."""
    ids = [str(s) for s in sample_ids]
    n = len(ids)
    if not len(labels) == len(splits) == images.shape[0] == n:
        raise ConfigError(f"write_cache needs one id, label, split and image per sample (got {n} ids, "
                          f"{len(labels)} labels, {len(splits)} splits, {images.shape[0]} images)")
    if layout not in LAYOUTS:
        raise ConfigError(f"layout={layout!r} is invalid; use one of {', '.join(LAYOUTS)}")
    if not isinstance(rows_per_shard, int) or rows_per_shard < 1:
        raise ConfigError(f"rows_per_shard={rows_per_shard!r} is invalid; use a positive integer")
    # the statistics materialize records (``stats``), from the pixels at hand (sums need no order); samples of
    # another rank than [H, W, C] / [C, H, W] (some tests' caches) have no channels to describe
    sums = stats.split_sums(np.asarray(images, np.uint8), [str(s) for s in splits], layout) \
        if images.ndim == 4 and n else {}
    order = sorted(range(n), key=ids.__getitem__)  # a cache's rows are in sample-id order
    labels = np.asarray(labels, np.int64)[order]
    splits = [str(splits[i]) for i in order]
    ids = [ids[i] for i in order]
    shards: list[cf.ShardInfo] = []
    try:
        for k, lo in enumerate(range(0, n, rows_per_shard)):
            shards.append(cf.write_shard(cache_uri, k, ids[lo : lo + rows_per_shard], labels[lo : lo + rows_per_shard],
                                         splits[lo : lo + rows_per_shard], images[order[lo : lo + rows_per_shard]]))
    except BaseException:
        _remove(cache_uri, [s.path for s in shards])  # a failed write (a full disk) leaves no uncommitted shards
        raise
    if fingerprint is None:
        content = json.dumps([[s.sha256 for s in shards], list(classes)]).encode()
        fingerprint = hashlib.sha256(content).hexdigest()[:16]
    manifest = cf.CacheManifest(
        fingerprint=fingerprint,
        shape=list(images.shape[1:]),
        layout=layout,
        dtype="uint8",
        num_samples=n,
        shards=shards,
        classes=list(classes),
        split_counts=dict(Counter(splits)),
        spec=dict(spec or {}),
        source=source,
        options=dict(options or {}),
        channel_stats=stats.channel_stats(sums),
    )
    try:
        cf.commit(cache_uri, manifest)
    except BaseException:
        _remove(cache_uri, [s.path for s in shards])
        raise
    return manifest


def _remove(cache_uri: str, paths: list[str]) -> None:
    """Remove the shards this call wrote, and the folders they leave empty (local ones; stores have none)."""
    fs, root = io.filesystem(cache_uri)
    for rel in paths:
        try:
            fs.rm(io.filesystem(io.join(cache_uri, rel))[1])
        except (FileNotFoundError, OSError):
            pass
    if io.protocol(cache_uri) == "file":
        for folder in (os.path.join(root, cf.SHARD_DIR), root):
            try:
                os.rmdir(folder)
            except OSError:  # not empty (other files were there before), or never made
                pass
