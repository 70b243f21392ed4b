"""The tests own their tools: no test imports from benchmarks/ (the benchmarks may import tests/support/). A test
runs a benchmark as a script, in a subprocess, instead."""

from __future__ import annotations

import re

from ..support import REPO

IMPORT = re.compile(r"^\s*(from\s+benchmarks[\s.]|import\s+benchmarks\b)|[\"'](from|import) benchmarks\b", re.M)


def test_no_test_imports_from_benchmarks():
    found = [f"{p.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}"
             for p in sorted((REPO / "tests").rglob("*.py")) if p != REPO / "tests" / "app" / "test_test_imports.py"
             for text in [p.read_text()] for m in IMPORT.finditer(text)]
    assert not found, "tests import from benchmarks/ (move the tool to tests/support/): " + ", ".join(found)
