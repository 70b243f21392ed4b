"""dutycycle.engine: what samples exist and what they look like (catalog, curation, transforms, the cache).

Importing this package is cheap: daft, PIL and pyarrow load only when a function that needs them is called.
Public names are resolved lazily from the table below.
"""

from __future__ import annotations

from ._lazy import lazy_exports
from .errors import ConfigError, CorruptArtifactError, DestinationError, DutycycleError, SourceError

# public name -> module that defines it (relative to this package)
_LAZY = {
    "CacheManifest": ".cache.format",
    "CacheReader": ".cache.reader",
    "ReadConfig": ".cache.shards",
    "synthesize": ".synth",
    "draw_shapes": ".synth",
    "write_cache": ".cache.write",
    "ingest": ".table.catalog",
    "open_table": ".table.table",
    "Table": ".table.table",
    "DedupeConfig": ".table.dedupe",
    "near_recall": ".table.dedupe",
    "dedupe_stats": ".table.dedupe_stats",
    "pair_sheet": ".dupes",
    "TransformSpec": ".transform",
    "decode_and_transform": ".transform",
    "materialize": ".cache.materialize",
    "open_cache": ".cache.materialize",
}

__all__ = [
    "ConfigError",
    "CorruptArtifactError",
    "DestinationError",
    "DutycycleError",
    "SourceError",
    *_LAZY,
]

__getattr__ = lazy_exports(__name__, _LAZY)
