"""A local S3-compatible object store (moto's server) for the tests and the benchmarks' remote rows."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from dutycycle.trainer.cluster.local import free_port


@contextmanager
def moto_server() -> Iterator[str]:
    """Run a moto S3 server on 127.0.0.1 (a free port) and yield its endpoint URL; stopped on exit."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint + "/", timeout=1).read()
                break
            except Exception:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
