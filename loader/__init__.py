"""dutycycle.loader: turn a transformed-sample cache into deterministic, resumable per-rank torch batches.

Importing this package is cheap: torch and ray load only when a loader is built or iterated. ::

    from dutycycle.loader import AugmentConfig, CacheLoader, LoaderConfig

    cfg = LoaderConfig(global_batch_size=256, seed=0, mode="thread",
                       augment=AugmentConfig(crop_padding=4, flip=True, normalize=True))
    loader = CacheLoader(cache_uri, "train", rank, world_size, cfg)   # or CacheLoader.for_ray_train(...)
    loader.load_state_dict(saved)        # optional: the next pass continues where a run stopped (any world size)
    for epoch in range(epochs):          # len(loader): steps per epoch
        for batch in loader:             # one epoch (or, once after load_state_dict, the rest of the saved one)
            batch["image"], batch["label"], batch["sample_id"]   # [B,C,H,W], int64 [B], list[str]
        # a pass run to the end moves to the next epoch; loader.set_epoch(e) works as DistributedSampler's
    saved = loader.state_dict()          # after the batches handed out, never those prefetched
    first = loader.peek()                # the next pass's first batch, consuming nothing
    loader.stats.total_wait_s, loader.stats.count, loader.stats.last_wait_s   # the consumer's data wait
    loader.stats.bytes_fetched, loader.stats.requests   # what the reader fetched from remote storage
    loader.config.augment.mean, loader.normalize_from   # the normalization applied: by default the cache's statistics

Evaluation: ``CacheLoader(cache_uri, "val", rank, world_size, LoaderConfig.for_eval(global_batch_size))``
(cache order, no random augmentation, ``drop_last=False``): every sample exactly once across ranks; the last
short global batch is split as evenly as possible (the first ``len % world_size`` ranks get one more sample,
and a rank may get an empty batch when it is shorter than the world size).

Arrays already in memory (synthetic data, tests): ``ArrayLoader(images, labels, rank, world_size, cfg)``, the
same plan, augmentation and state.

A loader behaves like a torch ``DataLoader``: each ``for`` is one pass that starts its epoch over (a ``break``
leaves ``state_dict()`` after the last batch handed out, for a checkpoint, and the next ``for`` starts that epoch
again). ``TorchDataset(loader)`` is the same batches as a ``torch.utils.data.IterableDataset``, for
``DataLoader(view, batch_size=None, num_workers=...)`` and PyTorch Lightning (``torch_data``).

Every loader is a ``Loader(config, source, executor)``: the source says what rows exist and how to read one
(``CacheSource``, ``RawSource``, ``ArraySource``), the executor where reading runs (the caller's thread, a
prefetch thread, Ray tasks); ``CacheLoader``, ``RawLoader`` and ``ArrayLoader`` build one over their source.

Modules: ``plan`` (pure sample plan), ``augment`` (batch augmentation), ``source`` (one gather per batch over
memory-mapped shards, the split index), ``loader`` (the plan, collation, stats), ``parts`` (the source and
executor protocols), ``state`` (the saved position), ``executor`` (where reads run, the prefetch thread),
``cache_loader``, ``arrays`` (a split given as arrays), ``budget`` (the node's in-RAM budget for ``memory``
mode), ``decode`` and ``raw`` (decode per step), ``inflight`` (waiting on Ray tasks in plan order), ``ray_exec``
(the Ray tasks, object-store memory mode), ``ray_data`` (Ray Data export), ``torch_data`` (the torch Dataset
view), ``device`` (pinning, CUDA copies), ``cli``.
"""

from __future__ import annotations

from dutycycle.engine._lazy import lazy_exports

# public name -> module that defines it (relative to this package)
_LAZY = {
    "AugmentConfig": ".config",
    "LoaderConfig": ".config",
    "CacheLoader": ".cache_loader",
    "ArrayLoader": ".arrays",
    "Loader": ".loader",
    "LoaderStats": ".loader",
    "RawLoader": ".raw",
    "plan_epoch": ".plan",
    "epoch_order": ".plan",
    "rank_slice": ".plan",
    "num_steps": ".plan",
    "to_ray_dataset": ".ray_data",
    "TorchDataset": ".torch_data",
    "TorchDataLoader": ".torch_data",
}

__all__ = list(_LAZY)

__getattr__ = lazy_exports(__name__, _LAZY)
