"""Decoding a raw path batch: download, decode and transform each file a step draws (``engine.transform``).

Used by ``RawLoader`` in this process (a thread pool) and by its Ray decode tasks (``ray_exec``), so both run
the same code and refuse the same files. Reads are capped and regular-file-only (``io.read_capped``); with
``roots`` (a ``RootCheck``), a file that resolves outside the table's source roots is refused before it is read.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from dutycycle.engine import io
from dutycycle.engine.limits import DEFAULT_MAX_FILE_BYTES
from dutycycle.engine.roots import OUTSIDE_ROOTS, RootCheck, refusal
from dutycycle.engine.transform import DecodeError, TransformSpec, decode_and_transform


def decode_one(uri: str, spec: TransformSpec, roots: RootCheck | None = None) -> np.ndarray:
    if roots is not None and roots.outside(uri):
        raise DecodeError(OUTSIDE_ROOTS, refusal(uri, roots.roots))
    try:
        # the file's bytes, refused past the per-file cap before they are all read (as ingest and materialize do)
        return decode_and_transform(io.read_capped(uri, DEFAULT_MAX_FILE_BYTES), spec)
    except DecodeError as e:
        raise DecodeError(e.reason, f"{uri!r}: {e}; the cache skips this sample, the raw path cannot") from e
    except io.FileTooLargeError as e:
        raise DecodeError("too large", f"{e}; the cache skips this sample, the raw path cannot") from e
    except io.NotRegularFileError as e:
        raise DecodeError("not a regular file", f"{e}; the cache skips this sample, the raw path cannot") from e


def decode_batch(
    uris: list[str], spec: TransformSpec, pool: ThreadPoolExecutor | None = None, roots: RootCheck | None = None
) -> np.ndarray:
    out = np.empty((len(uris), *spec.shape), dtype=np.uint8)
    arrays = (pool.map(lambda u: decode_one(u, spec, roots), uris) if pool is not None
              else (decode_one(u, spec, roots) for u in uris))
    for i, a in enumerate(arrays):
        out[i] = a
    return out
