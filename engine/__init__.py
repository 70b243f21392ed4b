"""dutycycle.engine: what samples exist and what they look like (catalog, curation, transforms, the cache).

Importing this package is cheap: daft, PIL and pyarrow load only when a function that needs them is called.
Public names are resolved lazily from the table below.
"""

from __future__ import annotations

import importlib

from .errors import ConfigError, CorruptArtifactError, DestinationError, DutycycleError, SourceError

# public name -> module that defines it (relative to this package)
_LAZY = {
    "CacheManifest": ".cache_format",
    "CacheReader": ".cache_format",
    "synthesize": ".synth",
    "ingest": ".catalog",
    "open_table": ".table",
    "Table": ".table",
    "TransformSpec": ".transform",
    "decode_and_transform": ".transform",
    "materialize": ".cache",
    "open_cache": ".cache",
}

__all__ = [
    "ConfigError",
    "CorruptArtifactError",
    "DestinationError",
    "DutycycleError",
    "SourceError",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
