"""Decoding a raw path batch: download, decode and transform each file a step draws (``engine.transform``).

Used by ``RawLoader`` in this process (a thread pool) and by its Ray decode tasks (``ray_exec``), so both run
the same code and refuse the same files. Reads are capped and regular-file-only (``io.read_capped``), and a file
that resolves outside the table's source roots (``roots``, a ``RootCheck``) is refused before it is read.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from dutycycle.engine import io
from dutycycle.engine.limits import DEFAULT_MAX_FILE_BYTES
from dutycycle.engine.roots import OUTSIDE_ROOTS, RootCheck, refusal
from dutycycle.engine.transform import DecodeError, TransformSpec, decode_and_transform


def decode_one(uri: str, spec: TransformSpec, roots: RootCheck) -> np.ndarray:
    if roots.outside(uri):
        raise DecodeError(OUTSIDE_ROOTS, refusal(uri, roots.roots))
    try:
        # the file's bytes, refused past the per-file cap before they are all read (as ingest and materialize do)
        return decode_and_transform(io.read_capped(uri, DEFAULT_MAX_FILE_BYTES), spec)
    except (DecodeError, io.FileTooLargeError, io.NotRegularFileError) as e:
        reason = e.reason if isinstance(e, DecodeError) else (
            "too large" if isinstance(e, io.FileTooLargeError) else "not a regular file")
        raise DecodeError(reason, f"{uri!r}: {e}; the cache skips this sample, the raw path cannot") from e


def decode_batch(
    uris: list[str], spec: TransformSpec, roots: RootCheck, pool: ThreadPoolExecutor | None = None
) -> np.ndarray:
    out = np.empty((len(uris), *spec.shape), dtype=np.uint8)
    arrays = (pool.map(lambda u: decode_one(u, spec, roots), uris) if pool is not None
              else (decode_one(u, spec, roots) for u in uris))
    for i, a in enumerate(arrays):
        out[i] = a
    return out
