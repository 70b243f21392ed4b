"""Lazy public names for the three packages (PEP 562), so importing a package never loads daft, ray or torch."""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, table: dict[str, str]):
    """A module ``__getattr__`` that imports ``name`` from ``table[name]`` (relative to ``package``) on first use."""

    def __getattr__(name: str):
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name], package), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    return __getattr__
