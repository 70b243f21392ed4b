"""No module of the project, nor any test or benchmark, reaches into Ray's private package: what it holds moves
without notice from one Ray release to the next."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("api", "engine", "loader", "trainer", "benchmarks", "tests")
PRIVATE = "ray" + "." + "_private"  # built from parts, so this file does not name it


def test_nothing_uses_rays_private_package():
    found = [f"{path.relative_to(ROOT)}:{n}"
             for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if PRIVATE in line]
    assert not found, f"{PRIVATE} used at: {', '.join(found)}"


def test_the_search_covers_the_project():
    assert all((ROOT / folder).is_dir() for folder in FOLDERS)
    assert (ROOT / "trainer" / "diagnose" / "run.py").exists()
