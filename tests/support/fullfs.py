"""A real file system that runs out of space: a small tmpfs mounted for one test and unmounted after (root only;
where mounting is not permitted the test is skipped, saying so), and a file that fills it."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(path: Path, size: str = "256k") -> Iterator[Path]:
    """``path`` (created) as a tmpfs of ``size``, private to this user, for the ``with`` block."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"mounting a tmpfs is not permitted here ({e}); the injected write failures still run")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True, timeout=30)


def fill(mount: Path, leave: int) -> Path:
    """A file taking all but about ``leave`` bytes of the free space of ``mount``; delete it to make space."""
    filler = mount / "filler"
    free = shutil.disk_usage(mount).free
    filler.write_bytes(b"\0" * max(0, free - leave))
    return filler
