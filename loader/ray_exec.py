"""Ray execution of the loader: read tasks that gather rank batches from cache shards, and the in-memory split
shared through the object store. Imported only in ``"ray"`` and ``"memory"`` modes, so ``ray`` stays optional.

A read task gets ``(cache uri, global rows)`` and returns the batch as numpy arrays (images, labels, ids), which
Ray stores in shared memory and the loader maps without a copy. Tasks are plain functions with no state that
matters, so a task whose worker dies is simply run again (``max_retries``): the batch it returns is a pure
function of its arguments, so a retry neither loses nor duplicates a sample.
"""

from __future__ import annotations

import hashlib

import numpy as np
import ray
from dutycycle.engine.cache.reader import CacheReader
from dutycycle.engine.cache.shards import ReadConfig
from dutycycle.engine.errors import ConfigError
from dutycycle.engine.roots import RootCheck
from dutycycle.engine.transform import TransformSpec
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from . import shm
from .decode import decode_batch
from .inflight import RemoteBatch, get
from .source import MemorySplit, ShardGatherer, split_rows

_GATHERERS: dict[tuple, ShardGatherer] = {}  # per worker process: shards opened once
_SPLITS: dict[tuple, tuple[ShardGatherer, object]] = {}  # (uri, read, split) -> (its gatherer, split rows)


def shard_gatherer(cache_uri: str, read: ReadConfig | None, fingerprint: str | None = None) -> ShardGatherer:
    """This worker's gatherer of ``cache_uri`` (opened once per process). With ``fingerprint`` (what the caller
    planned against), a gatherer of another version of the cache at that URI is reopened, and a cache that is
    another one now is refused rather than read under the wrong plan."""
    key = (cache_uri, read)
    g = _GATHERERS.get(key)
    if g is not None and fingerprint is not None and g.reader.fingerprint != fingerprint:
        g = None
    if g is None:
        if len(_GATHERERS) >= 4 and key not in _GATHERERS:  # a worker serving many caches keeps the recent ones
            _GATHERERS.pop(next(iter(_GATHERERS)))
        g = _GATHERERS[key] = ShardGatherer(CacheReader(cache_uri, read=read))
    if fingerprint is not None and g.reader.fingerprint != fingerprint:
        raise ConfigError(f"cache {cache_uri!r} has fingerprint {g.reader.fingerprint} now, but the batches were "
                          f"planned for {fingerprint}; the cache was rewritten: plan again (to_ray_dataset)")
    return g


def split_index(gatherer: ShardGatherer, split: str):
    """Split index -> global cache row for ``gatherer``'s cache (``source.split_rows``: resolved shard by shard
    as batches need them), kept per worker process as long as its gatherer is."""
    key = (gatherer.reader.uri, gatherer.reader.read_config, split)
    got = _SPLITS.get(key)
    if got is None or got[0] is not gatherer:
        if len(_SPLITS) >= 8 and key not in _SPLITS:
            _SPLITS.pop(next(iter(_SPLITS)))
        got = _SPLITS[key] = (gatherer, split_rows(gatherer.reader, split))
    return got[1]


def read_rows(cache_uri: str, rows: np.ndarray, read: ReadConfig | None = None, handoff: shm.Handoff | None = None):
    """A read task's work: ``(pixels, labels, ids)``, the pixels gathered straight into a file of the
    consumer's shared-memory folder (``SharedBatch``: the batch's one copy) when the task runs on the consumer's
    node and there is room, else into an array returned through Ray's object store."""
    gatherer = shard_gatherer(cache_uri, read)
    rows = np.asarray(rows, dtype=np.int64)
    if handoff is not None and handoff.node_id == ray.get_runtime_context().get_node_id():
        shape = (len(rows), *gatherer.shape)
        with shm.batch_file(handoff.folder, shape, handoff.name) as (out, path):
            if out is not None:
                raw = gatherer.read(rows, out=out)
                return shm.SharedBatch(path, shape), raw.labels, raw.sample_ids
    raw = gatherer.read(rows)
    return raw.images, raw.labels, raw.sample_ids


read_rows_task = ray.remote(num_cpus=1)(read_rows)


def submit_read(cache_uri: str, rows: np.ndarray, max_retries: int, read: ReadConfig | None = None,
                folder: shm.BatchFolder | None = None) -> RemoteBatch:
    """A read task for one rank batch, placed on this process's node: its shards' node-local copies and page
    cache are there, and it leaves the batch in ``folder`` (``shm``), where the loader maps it without a copy.
    Soft: when the node cannot take the task (its CPUs are all reserved by training, or it is gone), Ray places
    it elsewhere rather than waiting, and the batch comes back through the object store."""
    node = ray.get_runtime_context().get_node_id()
    here = NodeAffinitySchedulingStrategy(node_id=node, soft=True)
    task = read_rows_task.options(max_retries=max_retries, scheduling_strategy=here)
    handoff = shm.Handoff(node, folder.path, shm.Handoff.new_name()) if folder is not None else None
    return RemoteBatch(task.remote(cache_uri, rows, read, handoff), folder=folder, handoff=handoff)


def decode_rows(uris: list[str], spec_json: str, roots: list[str], handoff: shm.Handoff | None = None):
    """A decode task's work: the batch decoded, then copied once into the consumer's shared-memory folder
    (``SharedBatch``) when the task runs on its node and there is space, else returned through the object store."""
    images = decode_batch(uris, TransformSpec.from_json(spec_json), RootCheck(roots))
    if handoff is not None and handoff.node_id == ray.get_runtime_context().get_node_id():
        with shm.batch_file(handoff.folder, images.shape, handoff.name) as (out, path):
            if out is not None:
                out[...] = images
                return shm.SharedBatch(path, images.shape)
    return images


decode_task = ray.remote(num_cpus=1)(decode_rows)


def submit_decode(uris: list[str], spec_json: str, roots: list[str], max_retries: int, labels: np.ndarray,
                  sample_ids: list[str], folder: shm.BatchFolder | None = None) -> RemoteBatch:
    """A raw path batch decoded by a Ray task (which checks the table's source ``roots`` at read time, as this
    process does): pixels from Ray (left in ``folder`` when the task runs on this node), labels and ids from the
    driver."""
    handoff = (shm.Handoff(ray.get_runtime_context().get_node_id(), folder.path, shm.Handoff.new_name())
               if folder is not None else None)
    return RemoteBatch(decode_task.options(max_retries=max_retries).remote(uris, spec_json, roots, handoff),
                       labels, sample_ids, folder=folder, handoff=handoff)


# ------------------------------------------------------------------------------------------- memory mode


@ray.remote(num_cpus=0)
class _SplitHolder:
    """Owns one split's arrays in the object store; every loader on the cluster maps the same object."""

    def __init__(self, cache_uri: str, split: str, read: ReadConfig | None = None):
        self.ref, self.error = None, None
        try:
            split_data = MemorySplit.load(cache_uri, split, read)
            self.ref = ray.put((split_data.images, split_data.labels, split_data.sample_ids))
        except Exception as e:  # raised from get(), where the caller sees it as itself
            self.error = e

    def get(self):
        if self.error is not None:
            raise self.error
        return [self.ref]  # wrapped in a list so the caller receives the reference, not the value


def shared_memory_split(cache_uri: str, fingerprint: str, split: str, read: ReadConfig | None = None
                        ) -> tuple[MemorySplit, object]:
    """The split, held once in the object store (one named holder per cache and split); returns (split, ref).

    Keep the returned ref alive as long as the arrays are in use: they are zero-copy views of the object.
    """
    key = hashlib.sha256(f"{cache_uri}\0{fingerprint}\0{split}".encode()).hexdigest()[:16]
    holder = _SplitHolder.options(name=f"dutycycle-memory-{key}", get_if_exists=True).remote(cache_uri, split, read)
    try:
        (ref,) = get(holder.get.remote())
    except ray.exceptions.RayActorError as e:
        raise ConfigError(f"could not hold split {split!r} of {cache_uri!r} in the object store: {e}") from e
    except Exception:
        ray.kill(holder)  # a failed load is not cached: the next loader tries again
        raise
    images, labels, ids = get(ref)
    return MemorySplit(images, labels, ids), (holder, ref)
