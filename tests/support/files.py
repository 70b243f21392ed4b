"""What a folder holds, for tests that check a failed launch left it as it was."""

from __future__ import annotations

import hashlib
import os


def tree(root) -> dict[str, str]:
    """Every file under ``root`` with the sha256 of its bytes: what "as it was" compares."""
    out = {}
    for folder, _, files in os.walk(root):
        for f in files:
            path = os.path.join(folder, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out
