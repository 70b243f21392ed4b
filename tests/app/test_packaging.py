"""The project installs correctly two ways: the editable install imports from the repo, a built wheel from itself.
The wheel running the whole demo in a fresh environment is tests/app/test_demo.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest

from ..support import REPO

PACKAGES = ("dutycycle", "dutycycle.engine", "dutycycle.loader", "dutycycle.trainer")
FOLDERS = {"dutycycle": "api", "dutycycle.engine": "engine", "dutycycle.loader": "loader", "dutycycle.trainer": "trainer"}
PROBE = f"import importlib, json; print(json.dumps({{n: importlib.import_module(n).__file__ for n in {PACKAGES!r}}}))"


def _probe(env=None, cwd=None) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env=env, cwd=cwd
    ).stdout
    return json.loads(out)


def test_editable_install_imports_from_the_repo(tmp_path):
    files = _probe(cwd=tmp_path)  # not from the repo root, so only the install can resolve the names
    for name, path in files.items():
        assert os.path.realpath(path) == os.path.join(REPO, FOLDERS[name], "__init__.py")


def _tree_packages() -> set[str]:
    """Every package in the source folders (a folder with an ``__init__.py``), as the wheel must name it."""
    roots = {"api": "dutycycle", "engine": "dutycycle/engine", "loader": "dutycycle/loader", "trainer": "dutycycle/trainer",
             "configs": "dutycycle/configs"}
    found = set()
    for folder, prefix in roots.items():
        for path, dirs, files in os.walk(os.path.join(REPO, folder)):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
            if "__init__.py" in files:
                rel = os.path.relpath(path, os.path.join(REPO, folder))
                found.add(prefix if rel == "." else f"{prefix}/{rel}")
    return found


def test_pyproject_lists_every_package_in_the_tree():
    """The package list is written by hand (setuptools' find cannot map several roots into one namespace), so it
    is checked against the folders here, without building anything: a new subpackage missing from the list fails
    this test before a wheel without it could be built."""
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    assert listed == {p.replace("/", ".") for p in _tree_packages()}


@pytest.mark.slow
def test_built_wheel_ships_every_package_and_config(tmp_path, wheel):
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {os.path.dirname(n) for n in names if n.endswith("/__init__.py")}
    assert _tree_packages() <= shipped, sorted(_tree_packages() - shipped)
    assert {"dutycycle/trainer/diagnose", "dutycycle/trainer/app", "dutycycle/engine/cache"} <= shipped
    assert "dutycycle/configs/demo.toml" in names and "dutycycle/configs/vit.toml" in names
    assert not [n for n in names if n.startswith(("tests/", "notebooks/", "benchmarks/", "engine/"))]
    assert any(n.endswith("entry_points.txt") for n in names)

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", "--target",
                    str(target), str(wheel)], check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(target)}
    files = _probe(env=env, cwd=tmp_path)
    for path in files.values():
        assert os.path.realpath(path).startswith(os.path.realpath(target) + os.sep), path
    # the documented config names resolve from any directory, through the copy installed with the package
    out = subprocess.run([sys.executable, "-c", "from dutycycle.trainer.config import load_config; "
                          "print(load_config('configs/demo.toml').parallel.zero_stage)"],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "2", out.stderr[-2000:]
