"""Export a cache split as a Ray Data dataset, for users who feed Ray Train through ``get_dataset_shard``.

The dataset has columns ``sample_id`` (string), ``label`` (int64) and ``image`` (a Ray tensor column of uint8 in
the cache's layout and shape). ``iter_torch_batches`` turns ``image`` and ``label`` into tensors; select those
columns first (``ds.select_columns(["image", "label"])``), since torch has no string tensors for the ids. Without a config the rows come
in cache order, one block per shard; with a config they come in the planned order of ``epoch`` (the same global
batches the CacheLoader yields, concatenated), one block per global batch.

What this path does not give: Ray Data splits a dataset among Train workers its own way (by blocks, not by
``rank_slice``), and its iterators have no mid-epoch resume; use ``CacheLoader.for_ray_train`` when the plan's
rank assignment or resumability matters.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from dutycycle.engine.cache.format import CacheReader

from .config import LoaderConfig
from .plan import plan_epoch
from .source import split_rows


def _with_tensor_images(table: pa.Table, shape: tuple[int, ...]) -> pa.Table:
    from ray.data.extensions import ArrowTensorArray

    col = table.column("image").combine_chunks()
    flat = np.frombuffer(col.buffers()[1], dtype=np.uint8)
    per = int(np.prod(shape))
    images = flat[col.offset * per : (col.offset + len(col)) * per].reshape(len(col), *shape)
    return pa.table(
        {
            "sample_id": table.column("sample_id"),
            "label": table.column("label"),
            "image": ArrowTensorArray.from_numpy(images),
        }
    )


def to_ray_dataset(cache_uri: str, split: str = "train", config: LoaderConfig | None = None, epoch: int = 0):
    """A ``ray.data.Dataset`` of ``split``: cache order without ``config``, else ``epoch``'s planned order."""
    import ray.data

    reader = CacheReader(cache_uri)
    shape = tuple(reader.manifest.shape)
    rows = split_rows(reader, split)  # also validates the split name
    if config is None:
        tables = []
        for i in range(reader.num_shards):
            t = reader.shard(i)
            t = t.filter(pc.equal(t.column("split"), split))
            if t.num_rows:
                tables.append(_with_tensor_images(t, shape))
        return ray.data.from_arrow(tables)
    whole = pa.concat_tables([reader.shard(i) for i in range(reader.num_shards)])
    batches = plan_epoch(
        len(rows), config.seed, epoch, reader.fingerprint, config.global_batch_size, config.drop_last,
        shuffle=config.shuffle, block_size=config.block_size, window=config.window,
    )
    return ray.data.from_arrow([_with_tensor_images(whole.take(pa.array(rows[b])), shape) for b in batches])
