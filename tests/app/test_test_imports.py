"""The tests own their tools: no test imports from benchmarks/ (the benchmarks may import tests/support/). A test
that needs a benchmark runs it as a script, in a subprocess."""

from __future__ import annotations

import ast
import re

from ..support import REPO

# code a test writes for a child process (``python -c``): an import of the benchmarks there counts too, except in
# the smoke tests, whose child processes are the benchmarks
IN_A_STRING = re.compile(r"^\s*(from benchmarks(\.\w+)* import |import benchmarks(\.\w+)*\s*($|[,;#]))", re.M)
SUBPROCESS_ONLY = {"tests/app/test_benchmarks_smoke.py"}


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "benchmarks"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "benchmarks":
            found.append((node.lineno, node.module))
    return found


def _in_strings(tree: ast.AST) -> list[tuple[int, str]]:
    return [(node.lineno, node.value[:60]) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and IN_A_STRING.search(node.value)]


def test_no_test_imports_from_benchmarks():
    found = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        name = path.relative_to(REPO).as_posix()
        tree = ast.parse(path.read_text())
        hits = _imports(tree) + ([] if name in SUBPROCESS_ONLY or name == "tests/app/test_test_imports.py"
                                 else _in_strings(tree))
        found += [f"{name}:{line}: {what}" for line, what in hits]
    assert not found, "tests import from benchmarks/ (move the tool to tests/support/):\n" + "\n".join(found)
