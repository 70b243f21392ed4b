"""The docs a newcomer reads: a short README, pages whose figures are rendered from benchmarks/results/*.json, and
links and paths that lead somewhere.

The renderer runs as the command a person runs (``python benchmarks/render_docs.py``), in a subprocess: the tests
do not import the benchmarks.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ..support import REPO

ROOT = REPO
RENDER = ROOT / "benchmarks" / "render_docs.py"
# a render block: its opening marker on a line of its own, its body, its closing marker (as the renderer reads them)
BLOCK = re.compile(r"^<!-- render:(?P<name>[\w-]+) -->\n(?P<body>.*?)^<!-- /render:(?P=name) -->$", re.S | re.M)


def render(root: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RENDER), *flags, "--root", str(root)], capture_output=True,
                          text=True, timeout=120)


def block(page: str, name: str) -> str:
    return next(m.group("body") for m in BLOCK.finditer(page) if m.group("name") == name)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _copy_tree(dest: Path) -> Path:
    """The pages and the results they are rendered from, copied so a test may rewrite them."""
    shutil.copy(ROOT / "README.md", dest / "README.md")
    shutil.copytree(ROOT / "docs", dest / "docs")
    shutil.copytree(ROOT / "benchmarks" / "results", dest / "benchmarks" / "results")
    return dest


def test_committed_pages_are_what_the_renderer_writes(tmp_path):
    root = _copy_tree(tmp_path)
    done = render(root)
    assert done.returncode == 0, done.stderr
    stale = [p.relative_to(ROOT).as_posix() for p in _pages()
             if (root / p.relative_to(ROOT)).read_text() != p.read_text()]
    assert not stale, f"{stale} differ from benchmarks/results: run python benchmarks/render_docs.py"


def test_every_results_file_is_rendered_somewhere():
    """Every results file is the source of a block (the committed blocks are what the renderer writes: above)."""
    text = "\n".join(p.read_text() for p in _pages())
    bodies = "\n".join(m.group("body") for m in BLOCK.finditer(text) if m.group("name") != "results-index")
    cited = set(re.findall(r"benchmarks/results/(\w+)\.json", bodies))
    results = {p.stem for p in (ROOT / "benchmarks" / "results").glob("*.json")}
    assert results <= cited, f"results files no page renders: {sorted(results - cited)}"


def test_a_changed_result_changes_the_page_and_fails_the_check(tmp_path):
    root = _copy_tree(tmp_path)
    path = root / "benchmarks" / "results" / "loader.json"
    data = json.loads(path.read_text())
    primary = data["config"]["primary"]
    auto = next(r for r in data["rows"] if r["name"] == primary)
    auto["samples_per_s"] = 123456.0
    path.write_text(json.dumps(data))
    row = f"| {auto['group']} | {auto['description']} | "
    before = next(line for line in block((ROOT / "docs" / "benchmarks.md").read_text(), "loader").splitlines()
                  if line.startswith(row))

    checked = render(root, "--check")
    assert checked.returncode == 1 and "docs/benchmarks.md" in checked.stderr
    assert render(root).returncode == 0
    after = next(line for line in block((root / "docs" / "benchmarks.md").read_text(), "loader").splitlines()
                 if line.startswith(row))
    assert after.startswith(row + "123k |") and after != before
    assert render(root, "--check").returncode == 0


def test_a_missing_value_or_unknown_block_is_an_error_not_an_empty_table(tmp_path):
    root = _copy_tree(tmp_path)
    path = root / "benchmarks" / "results" / "checkpoint.json"
    data = json.loads(path.read_text())
    del data["ratios"]
    path.write_text(json.dumps(data))
    broken = render(root, "--check")
    assert broken.returncode == 2 and "checkpoint" in broken.stderr

    for text, error in [("<!-- render:nope -->\n<!-- /render:nope -->\n", "unknown render block"),
                        ("<!-- render:zero -->\n", "do not pair up")]:
        page = tmp_path / "one" / "docs" / "page.md"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(text)
        broken = render(page.parent.parent, "--check")
        assert broken.returncode == 2 and error in broken.stderr, broken.stderr


def test_readme_is_short_and_keeps_the_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 210
    assert "./run.sh demo" in text and "./run.sh test" in text


def _without_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _without_code(page.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            base = _slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_every_relative_link_resolves():
    broken = []
    for page in _pages():
        for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", _without_code(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or ROOT not in dest.parents and dest != ROOT:
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


# Paths the docs name that a run creates rather than the repository holding them (placeholders such as
# configs/NAME.toml are skipped by their capitals).
GENERATED = {"benchmarks/.peers-venv"}
TOP = ("engine/", "loader/", "trainer/", "tests/", "benchmarks/", "configs/", "notebooks/", "docs/")


def test_every_repository_path_the_docs_name_exists():
    missing = []
    for page in _pages():
        for span in re.findall(r"`([^`\s]+)`", page.read_text()):
            path = span.rstrip(".,:;")
            if not path.startswith(TOP) or path in GENERATED or re.search(r"[<>*{}]|\b[A-Z]{3,}\b", path):
                continue
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "\n".join(missing)


def test_docs_speak_about_the_code_not_how_the_work_was_organised():
    words = re.compile(r"\b(rooms?|issues?|talks?|sessions?)\b", re.I)
    found = [f"{p.relative_to(ROOT)}: {m.group(0)!r} in {line.strip()[:80]!r}"
             for p in _pages() for line in p.read_text().splitlines() for m in words.finditer(line)]
    assert not found, "\n".join(found)
