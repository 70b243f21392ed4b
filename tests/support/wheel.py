"""Build the project's wheel from a copy of the sources and install it into a fresh virtual environment, the
way a user gets dutycycle: nothing from the source tree is importable there, so a module missing from the
package list fails the same way it would for them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from . import REPO

SOURCES = ("api", "engine", "loader", "trainer", "configs", "pyproject.toml", "README.md")


def build_wheel(workdir: Path) -> Path:
    # a copy, so no stale build/ folder or egg-info in the checkout leaks into the wheel
    src = workdir / "src"
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, src / name)
    dist = workdir / "dist"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--skip-dependency-check",
                    "--outdir", str(dist), str(src)], check=True, capture_output=True, cwd=workdir)
    (wheel,) = dist.glob("dutycycle-*.whl")
    return wheel


def venv_with(wheel: Path, where: Path) -> Path:
    """A new virtual environment with the wheel installed; returns its ``bin`` folder.

    The third-party dependencies are the ones this test run already has (a ``.pth`` line adds their folder, which
    puts that folder on the path without running the editable install's hook in it), so no package is
    downloaded and only the wheel provides ``dutycycle``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    env_bin = where / "bin"
    purelib = subprocess.run([str(env_bin / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "_deps_of_the_test_run.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(env_bin / "python"), "install", "--no-deps",
                    "--no-index", "--quiet", str(wheel)], check=True, capture_output=True)
    return env_bin


def clean_env() -> dict[str, str]:
    """The environment for a command in the wheel's venv: nothing points back at the source tree."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return dict(env, RAY_USAGE_STATS_ENABLED="0", DAFT_ANALYTICS_ENABLED="0")
