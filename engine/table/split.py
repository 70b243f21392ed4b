"""Train / val / test splits: the names, the fractions a user passes, and the split of one sample.

A row's split is a pure function of its content hash and the fractions, so identical files always land in the
same split, whichever writer (ingest, a curated save) assigns it.
"""

from __future__ import annotations

import hashlib

from ..errors import ConfigError

SPLIT_NAMES = ("train", "val", "test")
DEFAULT_SPLIT = (0.8, 0.1, 0.1)


def parse_split(text: str | tuple | list) -> tuple[float, float, float]:
    """``"0.8,0.1,0.1"`` -> ``(0.8, 0.1, 0.1)``; fractions for train, val, test that sum to 1."""
    parts = text.split(",") if isinstance(text, str) else list(text)
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ConfigError(
            f"--split {text!r} is not three numbers; use train,val,test fractions like 0.8,0.1,0.1"
        ) from None
    if len(values) != 3 or any(v < 0 for v in values) or abs(sum(values) - 1.0) > 1e-6:
        raise ConfigError(
            f"--split {text!r} must be three non-negative fractions (train,val,test) that sum to 1, e.g. 0.8,0.1,0.1"
        )
    return values[0], values[1], values[2]


def assign_split(sample_id: str, fractions: tuple[float, ...]) -> str:
    """Deterministic split from the content hash: identical files always land in the same split."""
    u = int(hashlib.sha256(("split:" + sample_id).encode()).hexdigest()[:15], 16) / float(1 << 60)
    edge = 0.0
    for name, frac in zip(SPLIT_NAMES, fractions, strict=True):
        edge += frac
        if u < edge:
            return name
    return SPLIT_NAMES[-1]
