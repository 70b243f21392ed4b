"""Export a cache split as a Ray Data dataset, for users who feed Ray Train through ``get_dataset_shard``.

The dataset has columns ``sample_id`` (string), ``label`` (int64) and ``image`` (a Ray tensor column of uint8 in
the cache's layout and shape). ``iter_torch_batches`` turns ``image`` and ``label`` into tensors; select those
columns first (``ds.select_columns(["image", "label"])``), since torch has no string tensors for the ids. Without a
config the rows come in cache order, one block per shard; with a config they come in the planned order of
``epoch`` (the same global batches the CacheLoader yields, concatenated), one block per global batch.

The driver reads the manifest and nothing else: the plan is computed over split indices from the manifest's
counts (``plan_epoch`` needs only the split's size and, for ``block_size = 0``, its chunk counts), and each block
starts as one small item (a shard number, or a global batch's split indices). A read task (``map_batches``) maps
split indices to cache rows through its own ``SplitIndex`` (reading the split column of only the shards its
batch lies in), opens those shards where it runs through the same ``ShardGatherer`` the loader uses (verified,
memory-mapped, node-local copies or read by range) and returns its block. So no shard is opened, mapped, hashed
or downloaded by the driver, whatever the cache's size or where it lives. The order is kept
(``preserve_order`` on this dataset's own context), so the planned order is the plan's.

What this path does not give: Ray Data splits a dataset among Train workers its own way (by blocks, not by
``rank_slice``), and its iterators have no mid-epoch resume; use ``CacheLoader.for_ray_train`` when the plan's
rank assignment or resumability matters.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from dutycycle.engine.cache.format import read_manifest, resolve

from .config import LoaderConfig
from .plan import plan_epoch
from .source import manifest_block_starts, rows_in_split, split_size


def _read_block(items: dict[str, Any], cache_uri: str, fingerprint: str, split: str, read) -> dict[str, np.ndarray]:
    """A read task: each item names a shard (its rows of ``split``) or a global batch's split indices; returns
    their rows as numpy columns (Ray Data makes ``image`` a tensor column). A plain function, run as Ray tasks
    on the cluster's pooled workers (an actor pool would start new processes for every pass over the dataset);
    each worker process keeps its gatherer and split index (``ray_exec``) across tasks."""
    # imports ray, which only a Ray Data read task needs
    from .ray_exec import shard_gatherer, split_index

    gatherer = shard_gatherer(cache_uri, read, fingerprint)
    reader = gatherer.reader
    parts = []
    for shard, indices in zip(items["shard"], items["indices"], strict=True):
        if int(shard) >= 0:  # a whole shard's rows of the split, in cache order
            shard = int(shard)
            rows = rows_in_split(reader.view(shard).split, split, int(reader.offsets[shard]))
        else:  # a planned global batch: split indices -> cache rows, resolved here, not in the driver
            rows = split_index(gatherer, split)[np.asarray(indices, dtype=np.int64)]
        parts.append(gatherer.read(np.asarray(rows, dtype=np.int64)))
    return {"sample_id": np.array([s for p in parts for s in p.sample_ids], dtype=object),
            "label": np.concatenate([p.labels for p in parts]),
            "image": np.concatenate([p.images for p in parts]) if len(parts) > 1 else parts[0].images}


def to_ray_dataset(cache_uri: str, split: str = "train", config: LoaderConfig | None = None, epoch: int = 0):
    """A ``ray.data.Dataset`` of ``split``: cache order without ``config``, else ``epoch``'s planned order. The
    driver reads only the cache's manifest; the blocks are read on the workers (see the module doc)."""
    import ray.data

    uri = resolve(cache_uri)  # a cache root names its committed folder; the tasks open exactly that one
    manifest = read_manifest(uri)
    n = split_size(manifest, uri, split)  # validates the split name
    if config is None:
        items = [{"shard": i, "indices": np.zeros(0, np.int64)} for i, s in enumerate(manifest.shards)
                 if s.split_counts.get(split)]
    else:
        batches = plan_epoch(
            n, config.seed, epoch, manifest.fingerprint, config.global_batch_size, config.drop_last,
            shuffle=config.shuffle, block_size=config.block_size, window=config.window,
            partitions=config.partitions,
            block_starts=manifest_block_starts(manifest, split) if config.block_size == 0 else None,
        )
        items = [{"shard": -1, "indices": np.asarray(b, dtype=np.int64)} for b in batches]
    ds = ray.data.from_items(items, override_num_blocks=max(1, len(items)))
    ds.context.execution_options.preserve_order = True
    read = config.read if config is not None else None
    ds = ds.map_batches(_read_block, fn_kwargs={"cache_uri": uri, "fingerprint": manifest.fingerprint, "split": split,
                                                "read": read}, batch_size=1, zero_copy_batch=True)
    ds.context.execution_options.preserve_order = True
    return ds
