"""The loader's saved position: what ``Loader.state_dict()`` writes and ``load_state_dict()`` accepts.

A state is plain JSON: ``format`` (``STATE_FORMAT``), the position (``epoch``, ``step``: the next global batch
to hand out), every input of the plan (``PLAN_FIELDS``) and, for information, the world size it was saved at. A
state loads at any world size; it loads only into a loader whose plan inputs equal the saved ones, since the
position indexes that plan's sequence of global batches. Its integrity is the container's job (a checkpoint's
manifest checksums the file the state is saved in).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dutycycle.engine.errors import CorruptArtifactError

STATE_FORMAT = 1
PLAN_FIELDS = ("plan_version", "split", "fingerprint", "num_samples", "seed", "global_batch_size", "drop_last",
               "shuffle", "block_size", "window", "partitions", "block_starts_sha256")  # to resume: load_state_dict

def make_state(epoch: int, step: int, plan_inputs: dict[str, Any], world_size: int) -> dict[str, Any]:
    return {
        "format": STATE_FORMAT,
        "epoch": int(epoch),
        "step": int(step),  # index of the next global batch to yield in `epoch`
        **plan_inputs,
        "world_size": int(world_size),  # informational: a state loads at any world size
    }

def position(state: Any) -> tuple[int, int]:
    """``(epoch, step)`` of a loader state, or ``CorruptArtifactError`` naming what is wrong with it."""
    if not isinstance(state, Mapping):
        raise CorruptArtifactError(f"loader state is a {type(state).__name__}, not a mapping; pass what "
                                   "state_dict() returned")
    found = state.get("format")
    if type(found) is not int or found != STATE_FORMAT:
        raise CorruptArtifactError(f"loader state has format={found!r}; this dutycycle reads loader state format "
                                   f"{STATE_FORMAT} only, so the state is refused")
    out = []
    for key in ("epoch", "step"):
        v = state.get(key)
        if type(v) is not int or v < 0:
            raise CorruptArtifactError(f"loader state has {key}={v!r}; expected an integer >= 0 (the state is "
                                       "malformed)")
        out.append(v)
    return out[0], out[1]

def plan_mismatch(state: Mapping[str, Any], mine: dict[str, Any]) -> str | None:
    """Why ``state`` belongs to another plan than ``mine`` (this loader's plan inputs), or None when it does not:
    each differing or missing field with its saved value and this loader's."""
    problems = []
    for key in PLAN_FIELDS:
        if key not in state:
            problems.append(f"{key} is missing (this loader has {key}={mine[key]!r})")
        elif not _same(state[key], mine[key]):
            problems.append(f"{key}={state[key]!r} but this loader has {key}={mine[key]!r}")
    if not problems:
        return None
    missing = any(key not in state for key in PLAN_FIELDS)
    damaged = f"; a state of format {STATE_FORMAT} records them all, so this one is damaged" if missing else ""
    return (f"loader state has {'; '.join(problems)}{damaged}. The saved position refers to another sequence "
            "of batches: resume with the same cache, split and loader config (the saved values above), or "
            "pass force=True to continue this loader's own plan from the saved position")

def _same(a: Any, b: Any) -> bool:
    """Equal and of the same JSON type (``True`` is not ``1``, ``1.0`` is not ``1``)."""
    return type(a) is type(b) and a == b
