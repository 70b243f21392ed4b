"""Every name a package exports (its ``__all__``) can be imported: a lazy table that points at the wrong module
would otherwise raise AttributeError only in the user's code."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil

PACKAGES = ("dutycycle", "dutycycle.engine", "dutycycle.loader", "dutycycle.trainer")


def _declares_all(path: str) -> bool:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    targets = [t for node in tree.body if isinstance(node, ast.Assign) for t in node.targets]
    targets += [node.target for node in tree.body if isinstance(node, ast.AnnAssign)]
    return any(getattr(t, "id", "") == "__all__" for t in targets)


def _exporting_modules() -> list[str]:
    """The project's modules (packages included) that define ``__all__``, found without importing them."""
    out = []
    for top in PACKAGES:
        pkg = importlib.import_module(top)
        names = [top] + [info.name for info in pkgutil.walk_packages(pkg.__path__, top + ".")]
        out += [n for n in names if _declares_all(importlib.util.find_spec(n).origin)]
    return out


def test_every_exported_name_imports():
    modules = _exporting_modules()
    assert {"dutycycle", "dutycycle.engine", "dutycycle.loader", "dutycycle.trainer"} <= set(modules)
    broken = []
    for name in modules:
        module = importlib.import_module(name)
        for export in module.__all__:
            try:
                getattr(module, export)
            except (AttributeError, ImportError) as e:
                broken.append(f"{name}.{export}: {type(e).__name__}: {e}")
    assert not broken, "exported names that do not import:\n" + "\n".join(broken)
