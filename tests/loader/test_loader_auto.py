"""The loader's default "auto" mode (memory-mapped shards read in place), the opt-in in-RAM "memory" mode and its
node budget, and the one-gather-per-batch path behind every local mode: what each mode chooses, and that every
choice yields the sync mode's batches bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from dutycycle.engine.cache.reader import CacheReader
from dutycycle.engine.cache.shards import ReadConfig
from dutycycle.engine.errors import ConfigError
from dutycycle.loader import AugmentConfig, CacheLoader, LoaderConfig, budget
from dutycycle.loader.cache_loader import memory_limit
from dutycycle.loader.source import ShardGatherer

from ..support.cachemaker import pixel_index, sample_pixels

TRAIN_AUG = AugmentConfig(crop_padding=2, flip=True, normalize=True)
PLAIN = AugmentConfig(crop_padding=0, flip=False, normalize=False)



@pytest.fixture
def node_dir(tmp_path, monkeypatch):
    """A node folder of this test alone, so the memory ledger starts empty."""
    d = str(tmp_path / "node")
    monkeypatch.setenv("DUTYCYCLE_NODE_DIR", d)
    return d


def batches(uri, split="train", rank=0, world_size=1, config=None, **kw):
    kw.setdefault("global_batch_size", 16)
    loader = CacheLoader(uri, split, rank, world_size, config or LoaderConfig(**kw))
    got = [(b["image"].numpy().copy(), b["label"].numpy().copy(), list(b["sample_id"])) for b in loader]
    return loader, got


def assert_same(a, b):
    assert len(a) == len(b) > 0
    for (ia, la, sa), (ib, lb, sb) in zip(a, b, strict=True):
        assert sa == sb and np.array_equal(la, lb) and ia.dtype == ib.dtype and np.array_equal(ia, ib)


@pytest.mark.parametrize("augment,background", [(PLAIN, False), (TRAIN_AUG, True)])
def test_auto_reads_mapped_shards_and_matches_sync(cache, augment, background, monkeypatch):
    def per_shard(*_a, **_k):
        raise AssertionError("a local cache took the per-shard path")

    # One gather per batch over all the shards' mapped pages: the per-shard paths (remote shards, ids of
    # varying width) must not run, so they fail the test if they do.
    with monkeypatch.context() as m:
        m.setattr(ShardGatherer, "_read_by_shard", per_shard)
        m.setattr(ShardGatherer, "_ids_by_shard", per_shard)
        loader, got = batches(cache, "train", 1, 2, mode="auto", augment=augment)
    assert not loader.in_memory and loader.background == background, loader.execution
    assert loader.execution.startswith("auto: memory-mapped shards")
    _, expected = batches(cache, "train", 1, 2, mode="sync", augment=augment)
    assert_same(got, expected)


def test_auto_is_the_default_and_eval_matches_sync(cache):
    assert LoaderConfig().mode == "auto" and LoaderConfig.for_eval().mode == "auto"
    loader, got = batches(cache, "val", 1, 2, LoaderConfig.for_eval(8))
    _, expected = batches(cache, "val", 1, 2, LoaderConfig.for_eval(8, mode="sync"))
    assert not loader.in_memory
    assert_same(got, expected)


def test_memory_mode_is_granted_within_the_node_budget(cache, node_dir):
    loader, got = batches(cache, "train", 0, 1, mode="memory", augment=TRAIN_AUG)
    # in this process, or in the object store when an earlier test left Ray running: counted once either way
    assert loader.in_memory and loader.memory_refused is None and "memory: memory (" in loader.execution
    assert budget.reserved_bytes(node_dir) == len(loader.rows) * (8 * 8 * 3 + 8 + 4 * 32)
    _, expected = batches(cache, "train", 0, 1, mode="sync", augment=TRAIN_AUG)
    assert_same(got, expected)
    del loader
    import gc

    gc.collect()
    assert budget.reserved_bytes(node_dir) == 0  # released with the loader


def _reserve_in_child(node_dir, nbytes, budget_bytes):
    code = ("import sys; from dutycycle.loader import budget; "
            f"r = budget.reserve('split-x', {nbytes}, {budget_bytes}, shared=False); print(r.granted)")
    env = {**os.environ, "DUTYCYCLE_NODE_DIR": node_dir}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return out.stdout.strip() == "True"


def test_memory_mode_over_the_node_budget_falls_back_to_shards(cache, node_dir):
    """The budget is a node's, not a process's: what another live process holds counts; a split that does not
    fit is read from the mapped shards instead, with a warning, and the batches stay the same."""
    train = CacheLoader(cache, "train", config=LoaderConfig(global_batch_size=16)).num_samples
    need = train * (8 * 8 * 3 + 8 + 4 * 32)  # the train split in RAM
    limit = memory_limit()  # the node's, or the Ray object store's free memory when Ray is running
    fraction = 1.5 * need / limit  # room for one copy, not two
    holder = budget.reserve("someone-else", need, int(fraction * limit), shared=False)  # this process, another key
    assert holder.granted
    with pytest.warns(UserWarning, match="memory_fraction"):
        loader, got = batches(cache, "train", 0, 1, mode="memory", memory_fraction=fraction)
    assert not loader.in_memory and "memory refused" in loader.execution
    assert "reading memory-mapped shards instead" in loader.memory_refused
    _, expected = batches(cache, "train", 0, 1, mode="sync")
    assert_same(got, expected)
    budget.release(holder.key)
    loader, _ = batches(cache, "train", 0, 1, mode="memory", memory_fraction=fraction)
    assert loader.in_memory


def test_ledger_counts_a_shared_copy_once_and_forgets_exited_processes(node_dir):
    a = budget.reserve("cache:train", 100, 150, shared=True)
    b = budget.reserve("cache:train", 100, 150, shared=True)  # the same node copy: granted, not counted again
    assert a.granted and b.granted and budget.reserved_bytes(node_dir) == 100
    assert not _reserve_in_child(node_dir, 100, 150)  # a private copy in another process does not fit
    budget.release(a.key)
    assert budget.reserved_bytes(node_dir) == 0
    assert _reserve_in_child(node_dir, 100, 150)  # fits now; the child exits holding it...
    assert budget.reserved_bytes(node_dir) == 0  # ...and its entry is dropped as dead


def test_cgroup_limits_v1_and_v2(tmp_path):
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       16000000 kB\nMemAvailable:   9000000 kB\n")
    (proc / "self" / "cgroup").write_text("4:memory:/job/rank0\n0::/job/rank0\n")
    (cg / "memory" / "job" / "rank0").mkdir(parents=True)
    (cg / "memory" / "job" / "rank0" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited
    (cg / "memory" / "job" / "memory.limit_in_bytes").write_text(f"{8 << 30}\n")  # a parent's limit applies
    assert budget.cgroup_limit_bytes(str(proc), str(cg)) == 8 << 30
    (cg / "cgroup.controllers").write_text("memory\n")  # v2 at the root as well
    (cg / "job" / "rank0").mkdir(parents=True)
    (cg / "job" / "rank0" / "memory.max").write_text(f"{3 << 30}\n")
    (cg / "job" / "memory.max").write_text("max\n")
    assert budget.cgroup_limit_bytes(str(proc), str(cg)) == 3 << 30
    (cg / "job" / "rank0" / "memory.max").write_text("max\n")
    (cg / "memory" / "job" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert budget.cgroup_limit_bytes(str(proc), str(cg)) is None  # no limit: the machine's memory applies
    assert budget.mem_total_bytes(str(proc)) == 16000000 * 1024
    real = budget.node_memory_limit()
    assert 0 < real <= budget.mem_total_bytes("/proc")


@pytest.mark.parametrize("fraction", [-0.1, 1.5, "half", True])
def test_bad_memory_fraction_is_a_config_error(fraction):
    with pytest.raises(ConfigError, match="memory_fraction"):
        LoaderConfig(memory_fraction=fraction)


def test_gather_any_rows_in_any_order(cache):
    reader = CacheReader(cache, read=ReadConfig(max_open_shards=2))  # 4 shards: views are closed and reopened
    gatherer = ShardGatherer(reader)
    ids = np.concatenate([reader.column(i, "sample_id") for i in range(reader.num_shards)])
    labels = np.concatenate([reader.column(i, "label") for i in range(reader.num_shards)])
    rng = np.random.default_rng(0)
    n = reader.num_samples
    cases = [
        rng.permutation(n)[:40],  # shards interleaved: one gather over all of them
        np.sort(rng.permutation(n)[:40]),
        np.arange(3, 9)[::-1],  # one shard
        np.array([5, 5, n - 1, 0, 5]),  # repeats
        np.array([], dtype=np.int64),
        np.array([n - 1, 0]),  # the first and last shards, then the middle ones: views closed and reopened
        np.array([40, 80, 41]),
        np.array([0, n - 1]),
    ]
    most = 0  # views stay open up to the limit, or as many as one batch needed
    for rows in cases:
        most = max(most, len(np.unique(reader.locate(rows)[0])))
        raw = gatherer.read(rows)
        assert raw.images.shape == (len(rows), 8, 8, 3)
        assert [pixel_index(img) for img in raw.images] == rows.tolist()
        for img, row in zip(raw.images, rows, strict=True):
            assert np.array_equal(img, sample_pixels(int(row), (8, 8, 3)))
        assert raw.labels.dtype == np.int64 and raw.labels.tolist() == labels[rows].tolist()
        assert list(raw.sample_ids) == ids[rows].tolist()
        assert len(gatherer._open) <= max(2, most)
    for bad in ([0, n], [-1, 2]):
        with pytest.raises(IndexError, match="outside"):
            gatherer.read(np.array(bad))


def test_mapped_shards_stay_open_past_the_ranged_limit(tmp_path):
    """By default a mapped view is kept for the reader's life (a reopened map page-faults every row again): two
    epochs over 300 shards open each shard once. By range, the default keeps 256 views (they hold ids in the
    heap), and a set ``max_open_shards`` applies to both."""
    from dutycycle.engine.cache import shards as sh

    from ..support.cachemaker import make_cache

    uri = str(tmp_path / "many")
    make_cache(uri, 600, shape=(2, 2, 3), shards=300)
    loader = CacheLoader(uri, "train", 0, 1, LoaderConfig(global_batch_size=64, seed=0, mode="auto",
                                                          block_size=2, window=64,
                                                          augment=AugmentConfig(normalize=False)))
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        assert sum(len(b["label"]) for b in loader) == 576
    assert loader.reader.num_shards == 300 and loader.source._gatherer.opens == 300
    assert ReadConfig().open_limit(mapped=True) == sh.MAPPED_OPEN > 300
    assert ReadConfig().open_limit(mapped=False) == sh.RANGED_OPEN == 256
    assert ReadConfig(max_open_shards=7).open_limit(mapped=True) == 7


def test_ids_of_varying_width_take_the_per_shard_path(tmp_path):
    """Ids that are not all one width (or not ASCII) cannot be gathered as fixed-width bytes: same results."""
    from dutycycle.engine.cache import format as cf

    uri = str(tmp_path / "ids")
    ids = [f"id-{i}" + "é" * (i % 3) for i in range(30)]  # 4 to 9 bytes, some non-ASCII
    order = sorted(range(30), key=lambda i: ids[i])
    images = np.stack([sample_pixels(i, (4, 4, 3)) for i in range(30)])
    infos = [cf.write_shard(uri, k, [ids[i] for i in part], [i % 2 for i in part], ["train"] * len(part),
                            images[part]) for k, part in enumerate(np.array_split(np.array(order), 3))]
    cf.commit(uri, cf.CacheManifest(fingerprint="varied", shape=[4, 4, 3], layout="HWC", dtype="uint8",
                                    num_samples=30, shards=infos, classes=["a", "b"], split_counts={"train": 30},
                                    spec={}))
    reader = CacheReader(uri)
    raw = ShardGatherer(reader).read(np.array([29, 0, 15, 3]))
    flat = [ids[i] for i in order]
    assert list(raw.sample_ids) == [flat[29], flat[0], flat[15], flat[3]]
    assert [pixel_index(img) for img in raw.images] == [order[29], order[0], order[15], order[3]]
