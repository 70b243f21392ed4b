"""The config ``dutycycle tune`` leaves behind: the base config's tree with the kept changes set on it, written as
TOML that ``dutycycle train`` and ``load_config`` read back to the same config.

Only the base tree and the kept keys are written (not every default): the file reads as the user's own config
plus what tune changed, each change named in a comment at the top.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

from dutycycle.engine.errors import ConfigError
from dutycycle.trainer.config import ALIASES, TrainConfig
from dutycycle.trainer.configtree import parse_overrides, set_dotted


def tuned_tree(base: dict, changes: list[str]) -> dict:
    """``base`` (a config's nested dict) with ``changes`` (``--set``-style ``key=value`` items) set on it, each
    value coerced to its key's type as ``--set`` does."""
    tree = copy.deepcopy(base)
    for key, value in parse_overrides(changes):
        set_dotted(TrainConfig, tree, key, value, ALIASES)
    return tree


def _value(key: str, v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string: JSON's escapes (\", \\, \n, \uXXXX) are TOML's too
    if isinstance(v, list | tuple) and not any(isinstance(x, dict) for x in v):
        return "[" + ", ".join(_value(key, x) for x in v) + "]"
    raise ConfigError(f"{key} = {v!r}: a {type(v).__name__} has no TOML form in a config")


def _bare(key: str) -> str:
    return key if key and all(c.isalnum() or c in "-_" for c in key) else json.dumps(key)


def to_toml(tree: dict, comment: list[str] | None = None) -> str:
    """``tree`` as TOML text: each section's keys, then its subsections as ``[a.b]`` tables. ``None`` (no TOML
    form) is left out, which the config reads as the key's default; ``comment``: lines put first, as comments."""
    lines = [f"# {c}" if c else "#" for c in comment or []]

    def section(node: dict, path: list[str]) -> None:
        plain = [(k, v) for k, v in node.items() if not isinstance(v, dict) and v is not None]
        if path and (plain or not any(isinstance(v, dict) for v in node.values())):
            lines.extend(["", "[" + ".".join(_bare(p) for p in path) + "]"])
        for k, v in plain:
            lines.append(f"{_bare(k)} = {_value('.'.join([*path, k]), v)}")
        for k, v in node.items():
            if isinstance(v, dict):
                section(v, [*path, k])

    section(tree, [])
    return "\n".join(lines).lstrip("\n") + "\n"
