"""Imports of the project's own modules sit at module level, where the import graph shows them.

A function-local import of a ``dutycycle`` module (absolute, or relative) hides a real tie between modules and
usually guards nothing: the heavy libraries are ray, torch and daft, not our own files. One may stay inside a
function only with a reason written on its line or the line before, and only two reasons count: a cycle that
cannot be cut (the comment names the ``cycle``), or a module that loads a heavy library at its top (the comment
names that library: ray, torch, daft, or says ``heavy``). One without such a reason fails, and so do more than
``LIMIT`` with one: each is a boundary (a command's handlers, a Ray-only path), and there are few.
"""

from __future__ import annotations

import ast
import re

from ..support import REPO

FOLDERS = ("api", "engine", "loader", "trainer")
LIMIT = 20
# A reason that lets an import stay inside a function: a cycle, or a heavy third-party library it would load.
REASON = re.compile(r"#.*\b(cycle|circular|heavy|ray|torch|daft)\b", re.I)


def _own(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "dutycycle"
    return any(a.name.split(".")[0] == "dutycycle" for a in node.names)


def _local_imports(tree: ast.AST):
    """Every import statement inside a function (at any depth), once."""
    seen: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in seen:
                    seen.add(id(node))
                    yield node


def _has_reason(lines: list[str], lineno: int) -> bool:
    """A reason comment on the import's line or on the line before it."""
    here = lines[lineno - 1]
    before = lines[lineno - 2] if lineno >= 2 else ""
    return bool(REASON.search(here) or (before.lstrip().startswith("#") and REASON.search(before)))


def function_local_imports(root=REPO) -> tuple[list[str], list[str]]:
    """``(counted, excused)``: the function-local imports of our own modules, each as ``file:line: source``;
    ``excused`` are those with a reason comment that names a cycle or a heavy library."""
    counted, excused = [], []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            lines = text.splitlines()
            for node in sorted(_local_imports(ast.parse(text, str(path))), key=lambda n: n.lineno):
                if not _own(node):
                    continue
                where = f"{path.relative_to(root)}:{node.lineno}: {lines[node.lineno - 1].strip()}"
                (excused if _has_reason(lines, node.lineno) else counted).append(where)
    return counted, excused


def test_few_imports_of_our_own_modules_sit_inside_functions():
    counted, excused = function_local_imports()
    assert not counted, "function-local imports of dutycycle modules without a reason (a cycle or a heavy " \
        "library): move them to the top of the module, or say why they stay:\n" + "\n".join(counted)
    assert len(excused) <= LIMIT, f"{len(excused)} function-local imports of dutycycle modules (limit {LIMIT}):\n" + (
        "\n".join(excused))


def test_the_counter_sees_local_imports_and_accepts_only_named_reasons(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "m.py").write_text(
        "import json\n"
        "from dutycycle.engine import io\n"  # module level: fine
        "def f():\n"
        "    import numpy\n"  # third party: not ours
        "    from . import a\n"
        "    from dutycycle.engine import b  # tidy\n"  # a comment, but no reason that counts
        "    # b imports this module at its top: a cycle\n"
        "    from .b import c\n"
        "    def g():\n"
        "        import dutycycle.loader  # loads ray at import\n"
        "    return a, b, c, g\n"
    )
    counted, excused = function_local_imports(tmp_path)
    assert [w.split(": ")[0] for w in counted] == ["engine/m.py:5", "engine/m.py:6"]
    assert [w.split(": ")[0] for w in excused] == ["engine/m.py:8", "engine/m.py:10"]
