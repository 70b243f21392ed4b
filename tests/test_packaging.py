"""The project installs correctly two ways: the editable install imports from the repo, a built wheel from itself."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("dutycycle.engine", "dutycycle.loader", "dutycycle.trainer")
PROBE = f"import importlib, json; print(json.dumps({{n: importlib.import_module(n).__file__ for n in {PACKAGES!r}}}))"


def _probe(env=None, cwd=None) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env=env, cwd=cwd
    ).stdout
    return json.loads(out)


def test_editable_install_imports_from_the_repo(tmp_path):
    files = _probe(cwd=tmp_path)  # not from the repo root, so only the install can resolve the names
    for name, path in files.items():
        folder = name.split(".")[1]
        assert os.path.realpath(path) == os.path.join(REPO, folder, "__init__.py")


def test_built_wheel_installs_and_imports_from_itself(tmp_path):
    # Build from a copy of the sources so no stale build/ folder or egg-info in the checkout leaks in.
    src = tmp_path / "src"
    for name in ("engine", "loader", "trainer"):
        shutil.copytree(os.path.join(REPO, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), src / name)
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--skip-dependency-check",
            "--outdir",
            str(dist),
            str(src),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = dist.glob("dutycycle-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for pkg in PACKAGES:
        assert pkg.replace(".", "/") + "/__init__.py" in names
    for sub in ("engine/cache", "engine/table", "trainer/parallel", "trainer/checkpoint"):  # each needs a packages entry
        assert f"dutycycle/{sub}/__init__.py" in names
    assert "dutycycle/engine/table/catalog.py" in names and "dutycycle/engine/cache/materialize.py" in names
    assert not [n for n in names if n.startswith(("tests/", "notebooks/", "benchmarks/", "engine/"))]
    assert any(n.endswith("entry_points.txt") for n in names)

    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--quiet",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    files = _probe(env=env, cwd=tmp_path)
    for path in files.values():
        assert os.path.realpath(path).startswith(os.path.realpath(target) + os.sep), path
    # the installed CLI entry works from the wheel's copy too
    out = subprocess.run(
        [sys.executable, "-m", "dutycycle.trainer", "synth", "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0 and "--broken-fraction" in out.stdout
