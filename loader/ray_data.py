"""Export a cache split as a Ray Data dataset, for users who feed Ray Train through ``get_dataset_shard``.

The dataset has columns ``sample_id`` (string), ``label`` (int64) and ``image`` (a Ray tensor column of uint8 in
the cache's layout and shape). ``iter_torch_batches`` turns ``image`` and ``label`` into tensors; select those
columns first (``ds.select_columns(["image", "label"])``), since torch has no string tensors for the ids. Without a
config the rows come in cache order, one block per shard; with a config they come in the planned order of
``epoch`` (the same global batches the CacheLoader yields, concatenated), one block per global batch.

No pixels pass through the driver: the dataset starts from one small item per block (a shard number, or a global
batch's cache rows), and a read task (``map_batches``) opens the shards it needs where it runs, through the same
``ShardGatherer`` the loader uses (verified, memory-mapped or read by range), and returns its block. The order is
kept (``preserve_order`` on this dataset's own context), so the planned order is the plan's.

What this path does not give: Ray Data splits a dataset among Train workers its own way (by blocks, not by
``rank_slice``), and its iterators have no mid-epoch resume; use ``CacheLoader.for_ray_train`` when the plan's
rank assignment or resumability matters.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from dutycycle.engine.cache.reader import CacheReader

from .config import LoaderConfig
from .plan import plan_epoch
from .source import chunk_block_starts, rows_in_split, split_rows


class _ReadShards:
    """A read task: each item names a shard (its rows of ``split``) or a list of cache rows; returns them as
    numpy columns (Ray Data makes ``image`` a tensor column)."""

    def __init__(self, cache_uri: str, split: str, read):
        self.cache_uri, self.split, self.read = cache_uri, split, read

    def __call__(self, items: dict[str, Any]) -> dict[str, np.ndarray]:
        from .ray_exec import shard_gatherer  # imports ray, which only a Ray Data read task needs

        gatherer = shard_gatherer(self.cache_uri, self.read)
        reader = gatherer.reader
        parts = []
        for shard, rows in zip(items["shard"], items["rows"], strict=True):
            if int(shard) >= 0:  # a whole shard's rows of the split, in cache order
                shard = int(shard)
                rows = rows_in_split(reader.view(shard).split, self.split, int(reader.offsets[shard]))
            parts.append(gatherer.read(np.asarray(rows, dtype=np.int64)))
        return {"sample_id": np.array([s for p in parts for s in p.sample_ids], dtype=object),
                "label": np.concatenate([p.labels for p in parts]),
                "image": np.concatenate([p.images for p in parts])}


def to_ray_dataset(cache_uri: str, split: str = "train", config: LoaderConfig | None = None, epoch: int = 0):
    """A ``ray.data.Dataset`` of ``split``: cache order without ``config``, else ``epoch``'s planned order."""
    import ray.data

    reader = CacheReader(cache_uri, verify=False)  # the read tasks verify the shards they open
    rows = split_rows(reader, split)  # also validates the split name
    if config is None:
        items = [{"shard": i, "rows": np.zeros(0, np.int64)} for i in range(reader.num_shards)
                 if reader.manifest.shards[i].split_counts.get(split)]
    else:
        batches = plan_epoch(
            len(rows), config.seed, epoch, reader.fingerprint, config.global_batch_size, config.drop_last,
            shuffle=config.shuffle, block_size=config.block_size, window=config.window,
            partitions=config.partitions,
            block_starts=chunk_block_starts(reader, split) if config.block_size == 0 else None,
        )
        items = [{"shard": -1, "rows": np.asarray(rows[b], dtype=np.int64)} for b in batches]
    ds = ray.data.from_items(items, override_num_blocks=max(1, len(items)))
    ds.context.execution_options.preserve_order = True
    read = config.read if config is not None else None
    ds = ds.map_batches(_ReadShards, fn_constructor_args=(reader.uri, split, read), batch_size=1,
                        concurrency=(1, 4), zero_copy_batch=True)
    ds.context.execution_options.preserve_order = True
    return ds
