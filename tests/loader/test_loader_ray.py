"""CacheLoader on Ray: read tasks, retries after a worker dies, the object-store memory mode, Ray Train and
Ray Data export. Uses the session's local 2-CPU cluster."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from dutycycle.engine.errors import CorruptArtifactError
from dutycycle.loader import AugmentConfig, CacheLoader, Loader, LoaderConfig, to_ray_dataset
from dutycycle.loader.executor import RayTasks

from ..support.cachemaker import make_cache
from ..support.dying_source import DyingSource
from ..support.memory import mapping_of
from .test_loader import _corrupt, as_arrays, assert_bounded_prefetch, assert_same, counting_loader

pytestmark = pytest.mark.ray

AUG = AugmentConfig(crop_padding=2, flip=True, normalize=True)



def cfg(**kw):
    kw.setdefault("global_batch_size", 16)
    kw.setdefault("augment", AUG)
    kw.setdefault("prefetch", 2)
    return LoaderConfig(**kw)


@pytest.mark.parametrize("mode", ["ray", "memory"])
def test_ray_modes_match_sync(ray_cluster, cache, mode):
    for rank in range(2):
        expected = as_arrays(CacheLoader(cache, "train", rank, 2, cfg(mode="sync")))
        got = as_arrays(CacheLoader(cache, "train", rank, 2, cfg(mode=mode)))
        assert len(got) == len(expected) > 0
        assert_same(expected, got)


def test_ray_mode_keeps_a_bounded_number_of_tasks_in_flight(ray_cluster, tmp_path):
    uri = str(tmp_path / "c")
    make_cache(uri, 200, shards=2)
    loader = counting_loader(uri, cfg(mode="ray", global_batch_size=8, prefetch=2))
    assert_bounded_prefetch(loader, 2)


def test_ray_mode_copies_each_batch_once(ray_cluster, tmp_path):
    """A Ray-mode batch is copied once: the read task gathers the rows straight into a shared-memory file (its
    heap never holds the batch: traced allocations stay far below one batch, where the object-store path
    allocates a whole one, which shows the measure sees a copy), and the loader hands out tensors over that
    file's pages (no copy: each batch's storage is a writable shared mapping of a file in its batch folder).
    On main a batch was copied three times: the gather, into the object store, and out of it in collate.
    Batches left in flight by a pass cut short are removed, and so are folders of killed consumers."""
    import subprocess
    import time
    import tracemalloc

    import ray
    from dutycycle.loader import ray_exec, shm

    uri = str(tmp_path / "c")
    make_cache(uri, 384, shape=(64, 64, 3), shards=3)
    batch_bytes = 64 * 64 * 64 * 3  # 786 KB: far above what Ray's own threads allocate meanwhile
    # the task's side, run in this process: the same function a read task runs
    folder = shm.BatchFolder()
    handoff = shm.Handoff(ray.get_runtime_context().get_node_id(), folder.path)
    rows = np.random.default_rng(0).permutation(384)[:64]
    folder.open(ray_exec.read_rows(uri, rows, None, handoff)[0])  # warm: shards mapped
    peaks = {}
    for name, h in (("shared", handoff), ("object store", None)):
        tracemalloc.start()
        try:
            got = ray_exec.read_rows(uri, rows, None, h)
            peaks[name] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert isinstance(got[0], np.ndarray) and peaks["object store"] >= batch_bytes, peaks
    assert peaks["shared"] < batch_bytes / 4, peaks  # measured: 17 KB (ids, labels, the file's bookkeeping)
    # a task on another node, or whose consumer's folder is gone, returns its batch through the object store
    for elsewhere in (shm.Handoff("another-node", folder.path), shm.Handoff(handoff.node_id, str(tmp_path / "gone"))):
        assert np.array_equal(ray_exec.read_rows(uri, rows, None, elsewhere)[0], got[0])
    folder.close()
    assert not os.path.exists(folder.path)
    # the consumer's side: a loader in Ray mode, uint8 batches (nothing for collate to compute)
    config = cfg(mode="ray", global_batch_size=64, augment=AugmentConfig(crop_padding=0, flip=False, normalize=False))
    loader = CacheLoader(uri, "train", config=config)
    expected = as_arrays(CacheLoader(uri, "train", config=cfg(mode="sync", global_batch_size=64,
                                                              augment=config.augment)))
    got = []
    for b in loader:
        image = b["image"]
        line = mapping_of(image.data_ptr())
        assert "rw-s" in line and f"{loader.source._batches.path}/batch-" in line, line  # the task's pages
        assert image.numpy().flags.writeable
        got.append((image.numpy().copy(), b["label"].numpy().copy(), list(b["sample_id"])))
    assert_same(expected, got)
    batches = iter(loader)
    next(batches)
    batches.close()  # a pass cut short with batches in flight: the cancelled ones' files are removed
    deadline = time.monotonic() + 30  # a task still running when cancelled drops its file when it ends
    while os.listdir(loader.source._batches.path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.listdir(loader.source._batches.path) == []
    dead = subprocess.Popen(["true"])
    dead.wait()
    killed = tmp_path / "shm" / f"{shm.PREFIX}{dead.pid}-x"  # a folder whose consumer is gone
    killed.mkdir(parents=True)
    shm.BatchFolder(root=str(tmp_path / "shm")).close()
    assert not killed.exists()


def test_a_full_shared_memory_folder_is_a_fallback_not_a_crash(tmp_path):
    """A batch that does not fit the shared-memory file system is refused before a byte is written (its pages
    are reserved first: a write into a mapped file past a full tmpfs is a SIGBUS), leaves no file, and the task
    returns its batch through the object store instead; one that fits is handed over whole. A real 64 KiB tmpfs."""
    import subprocess

    from dutycycle.loader import shm

    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        folder = shm.BatchFolder(root=str(mnt))
        with shm.batch_file(folder.path, (64, 32, 32, 3)) as (out, path):  # 192 KiB
            assert out is None
        assert os.listdir(folder.path) == []
        with shm.batch_file(folder.path, (4, 32, 32, 3)) as (out, path):  # 12 KiB
            out[...] = np.arange(4, dtype=np.uint8)[:, None, None, None]
        got = folder.open(shm.SharedBatch(path, (4, 32, 32, 3)))
        assert got.flags.writeable and [int(v) for v in got.reshape(4, -1).max(1)] == [0, 1, 2, 3]
        assert os.listdir(folder.path) == []  # unlinked once mapped
        with pytest.raises(ValueError, match="outside this loader's folder"):  # a returned name is data
            folder.open(shm.SharedBatch(str(tmp_path / "batch-x"), (1,)))
        folder.close()
        assert not os.path.exists(folder.path)
        del got
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_memory_mode_shares_one_object_store_copy(ray_cluster, cache):
    a = CacheLoader(cache, "train", 0, 2, cfg(mode="memory"))
    b = CacheLoader(cache, "train", 1, 2, cfg(mode="memory"))
    assert a.source._memory_keepalive[1] == b.source._memory_keepalive[1]  # the same object, mapped twice
    assert not a.source._memory.images.flags.writeable  # a view of shared memory, not a private copy


def test_killed_read_task_is_retried_without_loss_or_duplicates(ray_cluster, cache, tmp_path):
    marker = tmp_path / "killed"
    config = cfg(mode="ray", drop_last=False, prefetch=3)
    source = DyingSource(cache, "train", kill_at=2, marker=str(marker))  # the task reading step 2 dies, once
    loader = Loader(config, source, RayTasks(config.prefetch, config.ray_max_retries))
    got = as_arrays(loader)
    assert marker.exists()  # the crash really happened
    pid = int(marker.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # and that worker process is gone
    expected = as_arrays(CacheLoader(cache, "train", config=cfg(mode="sync", drop_last=False)))
    assert_same(expected, got)
    ids = [s for _, _, batch_ids in got for s in batch_ids]
    assert len(ids) == len(set(ids)) == loader.num_samples


@pytest.mark.parametrize("mode", ["ray", "memory"])
def test_corrupt_shard_surfaces_as_itself(ray_cluster, tmp_path, mode):
    uri = _corrupt(tmp_path, "flipped")
    with pytest.raises(CorruptArtifactError, match=r"shard-00001\.arrow.*fails its checksum") as info:
        for _ in CacheLoader(uri, "train", config=cfg(mode=mode, global_batch_size=8, drop_last=False)):
            pass
    assert type(info.value) is CorruptArtifactError  # not a RayTaskError wrapper


def test_to_ray_dataset_reads_nothing_in_the_driver(ray_cluster, tmp_path):
    """Every sample once, in cache order or in the loader's planned order. The driver plans from the manifest alone: with every shard moved away while the dataset is built, building
    succeeds (on main it read each shard's split column in the driver, and a remote cache was downloaded there
    whole); the read tasks then read the shards, in the loader's planned order. ``block_size=0`` plans blocks at
    the cache's checksum chunks, also from the manifest."""
    uri = str(tmp_path / "c")
    make_cache(uri, 60, shape=(4, 4, 3), shards=3, splits={"train": 0.5, "val": 0.5})
    config = cfg(mode="sync", global_batch_size=8, drop_last=False, augment=AugmentConfig(normalize=False),
                 block_size=0)
    shards, aside = os.path.join(uri, "shards"), str(tmp_path / "aside")
    os.rename(shards, aside)
    planned = to_ray_dataset(uri, "val", config=config, epoch=1)
    whole = to_ray_dataset(uri, "val")
    os.rename(aside, shards)
    loader = CacheLoader(uri, "val", config=config)
    loader.set_epoch(1)
    want = as_arrays(loader)
    batches = list(planned.iter_batches(batch_size=None, batch_format="numpy"))
    assert len(batches) == len(want) == len(loader)  # one block per global batch
    for b, (images, labels, ids) in zip(batches, want, strict=True):
        assert list(b["sample_id"]) == ids and np.array_equal(b["label"], labels)
        assert np.array_equal(b["image"], images.transpose(0, 2, 3, 1))  # the cache's HWC layout
    rows = whole.take_all()  # cache order: every sample of the split once
    assert [r["sample_id"] for r in rows] == sorted(s for _, _, ids in want for s in ids)
    assert rows[0]["image"].shape == (4, 4, 3) and rows[0]["image"].dtype == np.uint8
    # the image and label columns go straight to torch
    tb = next(iter(planned.select_columns(["image", "label"]).iter_torch_batches(batch_size=8)))
    assert tuple(tb["image"].shape) == (8, 4, 4, 3) and str(tb["label"].dtype) == "torch.int64"


def _train_worker(config):
    import ray.train

    loader = CacheLoader.for_ray_train(config["cache"], "train", LoaderConfig(global_batch_size=8, mode="thread"))
    ctx = ray.train.get_context()
    seen = [batch["sample_id"] for batch in loader][:3]
    out = os.path.join(config["out"], f"rank{ctx.get_world_rank()}.json")
    with open(out, "w") as f:
        json.dump({"world_size": ctx.get_world_size(), "seen": seen}, f)


@pytest.mark.slow
def test_for_ray_train_gives_each_worker_its_plan_slice(ray_cluster, cache, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        _train_worker,
        train_loop_config={"cache": cache, "out": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(tmp_path / "ray_results"), name="loader"),
    )
    trainer.fit()
    single = CacheLoader(cache, "train", config=LoaderConfig(global_batch_size=8, mode="sync"))
    for rank in range(2):
        rec = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rec["world_size"] == 2
        reference = CacheLoader(cache, "train", rank, 2, LoaderConfig(global_batch_size=8, mode="sync"))
        assert rec["seen"] == [b["sample_id"] for b in reference][:3]
    assert len(single) > 3
