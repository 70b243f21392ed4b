"""The version every on-disk artifact carries: table and cache manifests, checkpoint manifests, run files.

Each JSON artifact holds ``"format": FORMAT``. A reader calls ``check`` before it reads any other field and refuses
an artifact of another version (or of none) with an error naming the file, the version found and the fix: an
artifact is only ever read by the dutycycle whose format it carries.
"""

from __future__ import annotations

from typing import Any

from .errors import FormatError

FORMAT = 1
KEY = "format"


def stamp(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with ``"format": FORMAT`` first."""
    return {KEY: FORMAT, **{k: v for k, v in d.items() if k != KEY}}


def check(d: Any, where: str) -> None:
    """Refuse ``d`` (parsed JSON read from ``where``) unless it is an object of format ``FORMAT``."""
    if not isinstance(d, dict):
        said = "is not a JSON object"
    elif KEY not in d:
        said = "has no `format` field"
    elif type(d[KEY]) is int and d[KEY] == FORMAT:
        return
    else:
        said = f"has format {d[KEY]!r}"
    raise FormatError(f"{where} {said}; this dutycycle reads format {FORMAT} only: re-create it with this version "
                      "of dutycycle")
