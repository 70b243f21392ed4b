"""The raw path: the same plan as the cache loader, executed over the metadata table, decoding every step.

``RawLoader`` selects the table's rows exactly as ``materialize`` does
(``engine.cache.materialize.plan_rows``: good rows, one per sample id, sorted by sample id), keeps ``split``, and
uses the same fingerprint, so with the same config it yields the same samples in the same batches as a
``CacheLoader`` over the cache built from that table, with the same augmentation. The difference is the work
per step: every sample is downloaded, decoded and transformed (``engine.transform.decode_and_transform``) each
time it is drawn: Ray tasks (one per rank batch) in ``"ray"`` mode, a thread pool otherwise. Comparing the two
on your own data shows what the cache saves.

A sample that ``materialize`` would have skipped (it fails to decode) raises ``DecodeError`` here, naming its
URI: the plan cannot drop samples without changing every later batch. Rows outside the table's source roots
(``engine.roots``) are left out of the plan as ``materialize`` leaves them out of the cache: never read, counted
in ``outside`` and named in a warning; ``allowed_roots`` names extra roots for a table built from several
sources. A file that resolves outside the roots when a step reads it is refused (``DecodeError``).
"""

from __future__ import annotations

import copy
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from dutycycle.engine.cache.materialize import plan_rows
from dutycycle.engine.errors import ConfigError
from dutycycle.engine.roots import OUTSIDE_ROOTS, RootCheck, refusal
from dutycycle.engine.runner import configure
from dutycycle.engine.transform import TransformSpec

from . import shm
from .config import LoaderConfig
from .decode import decode_batch
from .inflight import RemoteBatch
from .loader import Loader
from .source import RawBatch


class RawSource:
    """``split`` of the table at ``table_uri``, the rows ``materialize`` would cache, decoded when read."""

    reads_block = True  # every read downloads and decodes: overlap it
    description = "per-batch reads"
    in_memory, memory_refused = False, None
    channel_stats, no_stats = None, "the raw path decodes per step and computes none (a cache records them)"

    def __init__(self, table_uri: str, spec: TransformSpec, split: str, raw_threads: int, where: str | None = None,
                 allowed_roots=None):
        self.spec, self.split, self.table_uri = spec, split, table_uri
        self.layout, self.shape = spec.layout, tuple(spec.shape)
        # The row plan is a small Daft query: run it where Daft's default says (native unless DAFT_RUNNER), not
        # on a Ray runner Daft would infer inside a Ray Train worker, whose CPUs the workers already hold.
        configure()
        plan = plan_rows(table_uri, spec, where, allowed_roots=allowed_roots)
        self.roots, self.outside = RootCheck(plan.roots), plan.outside
        if plan.outside:
            warnings.warn(f"raw loader: {plan.outside} rows {OUTSIDE_ROOTS} are left out: "
                          + refusal(plan.outside_examples[0], plan.roots), stacklevel=3)
        keep = [i for i, s in enumerate(plan.splits) if s == split]
        if not keep:
            raise ConfigError(
                f"split {split!r} has no readable samples in table {table_uri!r}; splits there: "
                f"{', '.join(sorted(set(plan.splits))) or 'none'}"
                + (f" ({plan.outside} rows {OUTSIDE_ROOTS} were left out)" if plan.outside else "")
            )
        self.uris = [plan.uris[i] for i in keep]  # readable, for messages
        self.paths = [plan.paths[i] for i in keep]  # what a read opens (io.open_path)
        self.sample_ids = np.asarray([plan.sample_ids[i] for i in keep], dtype=str)
        self.labels = np.asarray(plan.labels, dtype=np.int64)[keep]
        self.classes = list(plan.classes)
        self.num_samples, self.fingerprint = len(keep), plan.fingerprint
        self.raw_threads = raw_threads
        self._pool: ThreadPoolExecutor | None = None
        self._batches: shm.BatchFolder | None = None

    def read(self, indices: np.ndarray) -> RawBatch:
        if self._pool is None and self.raw_threads > 1:
            self._pool = ThreadPoolExecutor(self.raw_threads, thread_name_prefix="dutycycle-raw")
        images = decode_batch([self.paths[i] for i in indices], self.spec, self.roots, self._pool)
        return RawBatch(images, self.labels[indices], self.sample_ids[indices].tolist())

    def submit(self, indices: np.ndarray, max_retries: int) -> RemoteBatch:
        from .ray_exec import submit_decode  # imports ray, which only the Ray modes need

        paths = [self.paths[i] for i in indices]
        if self._batches is None and shm.available():
            self._batches = shm.BatchFolder()  # where this node's decode tasks leave batches
        return submit_decode(paths, self.spec.to_json(), self.roots.roots, max_retries, self.labels[indices],
                             self.sample_ids[indices].tolist(), self._batches)

    def block_starts(self) -> np.ndarray:
        raise ConfigError("block_size=0 cuts shuffle blocks at a cache's checksum chunks, and this RawLoader reads "
                          "no cache; use a block_size >= 1")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def reopen(self) -> RawSource:
        """The same rows for another process (a DataLoader worker): the row plan shared, no thread pool (each
        process starts its own at its first read)."""
        return copy.copy(self)  # without the pool and the folder: __getstate__ leaves them behind

    def __getstate__(self) -> dict:
        # threads and the shared-memory folder (this process's) do not travel to another process
        return {**self.__dict__, "_pool": None, "_batches": None}


class RawLoader(Loader):
    """Per-rank batches of the shared plan, decoded from the files named by a metadata table at every step.
    ``spec``, ``table_uri``, ``uris``, ``labels``, ``sample_ids``, ``classes``, ``roots`` and ``outside`` are the
    source's."""

    def __init__(
        self,
        table_uri: str,
        spec: TransformSpec | dict | str | None = None,
        split: str = "train",
        rank: int = 0,
        world_size: int = 1,
        config: LoaderConfig | None = None,
        where: str | None = None,
        allowed_roots=None,
    ):
        config = config or LoaderConfig()
        if config.mode == "memory":
            raise ConfigError("LoaderConfig.mode='memory' does not apply to the raw path; use sync, thread or ray")
        if spec is None:
            spec = TransformSpec()
        elif not isinstance(spec, TransformSpec):
            spec = TransformSpec.from_json(spec)
        source = RawSource(table_uri, spec, split, config.raw_threads, where, allowed_roots)
        super().__init__(config, source, rank=rank, world_size=world_size)
        self.spec, self.table_uri, self.classes = source.spec, source.table_uri, source.classes
        self.uris, self.labels, self.sample_ids = source.uris, source.labels, source.sample_ids
        self.roots, self.outside = source.roots, source.outside
