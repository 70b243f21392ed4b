"""Packages are found from the folders, so a new subpackage ships without anyone editing a list.

pyproject.toml maps the top-level folders into the ``dutycycle`` namespace (``package-dir``); setuptools' own
``find`` cannot combine several roots with such a mapping, so this file walks each root and names every folder
that holds an ``__init__.py``. Everything else about the build is in pyproject.toml.
"""

import os

from setuptools import setup

ROOTS = {"dutycycle.engine": "engine", "dutycycle.loader": "loader", "dutycycle.trainer": "trainer",
         "dutycycle.configs": "configs"}


def find(package: str, folder: str) -> list[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    found = []
    for path, dirs, files in os.walk(os.path.join(here, folder)):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        if "__init__.py" in files:
            rel = os.path.relpath(path, os.path.join(here, folder))
            found.append(package if rel == "." else package + "." + rel.replace(os.sep, "."))
    return found


setup(packages=[p for package, folder in ROOTS.items() for p in find(package, folder)])
