"""dutycycle: the names a notebook or a script reaches for first, from the three packages underneath.

    import dutycycle
    cfg = dutycycle.load_config("configs/demo.toml")      # or a run directory's config.json
    model = dutycycle.load_model("runs/demo")             # the trained network, its classes and preprocessing

The work lives in ``dutycycle.engine`` (tables and the cache), ``dutycycle.loader`` (batches) and
``dutycycle.trainer`` (training, diagnosis, the CLI); this package only re-exports. Importing it is cheap: every
name resolves when it is first used.
"""

from __future__ import annotations

from dutycycle.engine._lazy import lazy_exports

# public name -> module that defines it
_LAZY = {
    "load_config": "dutycycle.trainer.config",
    "train": "dutycycle.trainer.launch.train",
    "load_model": "dutycycle.trainer.serve.load",
    "export_model": "dutycycle.trainer.serve.export",
    "ingest": "dutycycle.engine.table.catalog",
    "open_table": "dutycycle.engine.table.table",
    "materialize": "dutycycle.engine.cache.materialize",
    "TransformSpec": "dutycycle.engine.transform",
    "CacheLoader": "dutycycle.loader.cache_loader",
    "LoaderConfig": "dutycycle.loader.config",
    "TorchDataset": "dutycycle.loader.torch_data",
    "TorchDataLoader": "dutycycle.loader.torch_data",
    "evaluate": "dutycycle.trainer.serve.evaluate",
    "trace": "dutycycle.trainer.trace.trace",
    "sample_losses": "dutycycle.trainer.trace.trace",
}

__all__ = list(_LAZY)

__getattr__ = lazy_exports(__name__, _LAZY)
