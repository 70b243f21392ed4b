"""JSON artifacts that carry a checksum of their own content (table and cache manifests, shard completion
records, checkpoint manifests, loader states), and the type check their readers share.

A sealed artifact holds, under one key, the sha256 of its canonical JSON without that key. A reader that finds
the key and a different digest refuses the artifact: a byte flipped in a count or a name after the commit would
otherwise read as a different, valid-looking value. Manifests (``unseal``) and completion records must carry it;
``intact`` alone also passes a dict without the key (a loader state made by hand, judged by its fields).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .errors import CorruptArtifactError

MANIFEST_DIGEST = "manifest_sha256"  # the key manifests seal themselves under


def digest(d: dict[str, Any], key: str) -> str:
    """sha256 of ``d``'s canonical JSON (sorted keys, no spaces) without ``d[key]``, its own checksum."""
    body = {k: v for k, v in d.items() if k != key}
    # through JSON and back first, so a writer's tuples and non-string keys hash as a reader will parse them
    canonical = json.dumps(json.loads(json.dumps(body)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def seal(d: dict[str, Any], key: str = MANIFEST_DIGEST) -> dict[str, Any]:
    """``d`` (without a checksum, or with a stale one) with its checksum under ``key``."""
    body = {k: v for k, v in d.items() if k != key}
    return {**body, key: digest(body, key)}


def intact(d: dict[str, Any], key: str = MANIFEST_DIGEST) -> bool:
    """False when ``d`` carries a checksum under ``key`` that its content no longer matches."""
    return key not in d or d[key] == digest(d, key)


def is_count(v: Any) -> bool:
    """A JSON count: a non-negative integer (``true`` is not 1)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def unseal(d: Any, where: str, fix: str, key: str = MANIFEST_DIGEST) -> dict[str, Any]:
    """The fields of a sealed artifact read from ``where`` without its checksum, or ``CorruptArtifactError``
    naming it and ``fix`` when it is not a JSON object, has no checksum or its checksum no longer matches."""
    if not isinstance(d, dict):
        raise CorruptArtifactError(f"{where} is not a JSON object; {fix}")
    if key not in d:
        raise CorruptArtifactError(f"{where} has no checksum ({key}); {fix}")
    if not intact(d, key):
        raise CorruptArtifactError(f"{where} fails its own checksum ({key}): it was changed after it was written "
                                   f"and is refused; {fix}")
    return {k: v for k, v in d.items() if k != key}
