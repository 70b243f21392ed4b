"""A cache source whose Ray read of one chosen batch kills its own worker process the first time it runs, for
proving that a dead read task is run again by Ray without losing or repeating a sample.

Every other batch goes through the cache source's own read task. The chosen one runs ``read_or_die`` in a Ray
worker: the first run creates ``marker`` (``O_EXCL``, so only one run can) with its PID and ends the process
with ``os._exit(1)``, a crash rather than an exception; the retry finds the marker and reads the rows as the
cache source's task does.
"""

from __future__ import annotations

import os

import numpy as np
import ray
from dutycycle.engine.cache.shards import ReadConfig
from dutycycle.loader.cache_loader import CacheSource
from dutycycle.loader.inflight import RemoteBatch
from dutycycle.loader.ray_exec import shard_gatherer


@ray.remote(num_cpus=1)
def read_or_die(marker: str, cache_uri: str, rows: np.ndarray, read: ReadConfig | None):
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:  # the retry: read as the cache source's read task does
        raw = shard_gatherer(cache_uri, read).read(rows)
        return raw.images, raw.labels, raw.sample_ids
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    os._exit(1)


class DyingSource(CacheSource):
    """``CacheSource`` whose ``kill_at``-th Ray read (0-based, in the order the executor submits them: plan order)
    dies once as described above."""

    def __init__(self, cache_uri: str, split: str, kill_at: int, marker: str, read: ReadConfig | None = None):
        super().__init__(cache_uri, split, read)
        self.kill_at, self.marker, self.submitted = kill_at, marker, 0

    def submit(self, indices: np.ndarray, max_retries: int) -> RemoteBatch:
        n, self.submitted = self.submitted, self.submitted + 1
        if n != self.kill_at:
            return super().submit(indices, max_retries)
        task = read_or_die.options(max_retries=max_retries)
        return RemoteBatch(task.remote(self.marker, self.cache_uri, self.rows[indices], self.reader.read_config))
