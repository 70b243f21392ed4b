"""CacheLoader in-process modes (sync, thread, memory without Ray): batches, plan, state, resume, augmentation."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from dutycycle.engine.errors import ConfigError, CorruptArtifactError
from dutycycle.loader import AugmentConfig, CacheLoader, Loader, LoaderConfig
from dutycycle.loader.augment import augment_params
from dutycycle.loader.cache_loader import CacheSource

from ..support import REPO
from ..support.cachemaker import make_cache, pixel_index, sample_pixels

TRAIN_AUG = AugmentConfig(crop_padding=2, flip=True, normalize=True, mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3))


def cfg(**kw):
    kw.setdefault("global_batch_size", 16)
    kw.setdefault("mode", "sync")
    kw.setdefault("augment", TRAIN_AUG)
    kw.setdefault("prefetch", 2)
    return LoaderConfig(**kw)


def take(loader, k):
    """The next k batches from the loader's position, continuing into the next epoch when this one ends. Each
    ``for`` starts its epoch over, so the position is loaded back first: a pass continues where the last stopped
    only from a loaded state."""
    out = []
    while len(out) < k:
        loader.load_state_dict(loader.state_dict())
        for batch in loader:
            out.append(batch)
            if len(out) == k:
                break
    return out


def as_arrays(batches):
    return [(b["image"].numpy().copy(), b["label"].numpy().copy(), list(b["sample_id"])) for b in batches]


def assert_same(a, b):
    assert len(a) == len(b)
    for (ia, la, sa), (ib, lb, sb) in zip(a, b, strict=True):
        assert sa == sb
        assert np.array_equal(la, lb)
        assert ia.dtype == ib.dtype and np.array_equal(ia, ib)  # bit-identical (float compare is exact here)


def reference_augment(img_hwc: np.ndarray, dy: int, dx: int, flip: bool, aug: AugmentConfig) -> np.ndarray:
    """Straightforward numpy version of pad + crop + flip + normalize for one sample, [C, H, W]."""
    p = aug.crop_padding
    chw = img_hwc.transpose(2, 0, 1)
    _, h, w = chw.shape
    padded = np.pad(chw, ((0, 0), (p, p), (p, p)))
    out = padded[:, dy : dy + h, dx : dx + w]
    if flip:
        out = out[:, :, ::-1]
    if not aug.normalize:
        return out
    mean = np.array(aug.mean, np.float32).reshape(-1, 1, 1)
    std = np.array(aug.std, np.float32).reshape(-1, 1, 1)
    return ((out.astype(np.float32) / np.float32(255)) - mean) / std


def test_import_is_light():
    code = "import sys, dutycycle.loader; print([m for m in ('ray', 'torch', 'daft') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_batches_have_the_promised_format_and_content(cache):
    aug = AugmentConfig(crop_padding=0, flip=False, normalize=False)
    loader = CacheLoader(cache, "train", rank=1, world_size=2, config=cfg(augment=aug))
    n = loader.num_samples
    assert len(loader) == n // 16
    batch = next(iter(loader))
    assert batch["image"].shape == (8, 3, 8, 8) and batch["image"].dtype == torch.uint8
    assert batch["label"].dtype == torch.int64 and batch["label"].shape == (8,)
    assert len(batch["sample_id"]) == 8
    # the pixels are the samples the plan names, unaltered; labels and ids belong to them
    rows = loader.rows[loader.rank_indices(0, 0)]
    for img, label, row in zip(batch["image"].numpy(), batch["label"].numpy(), rows, strict=True):
        assert np.array_equal(img.transpose(1, 2, 0), sample_pixels(int(row), (8, 8, 3)))
        assert label == row % 4
    reader = loader.reader
    ids = np.concatenate([reader.column(i, "sample_id") for i in range(reader.num_shards)])
    assert batch["sample_id"] == list(ids[rows])


def test_batch_size_must_divide_by_world_size(cache):
    with pytest.raises(ConfigError, match=r"global_batch_size=16 .*world_size=3"):
        CacheLoader(cache, "train", rank=0, world_size=3, config=cfg())
    with pytest.raises(ConfigError, match="split 'test' has no samples"):
        CacheLoader(cache, "test", config=cfg())
    with pytest.raises(ConfigError, match="fewer than global_batch_size=64"):
        CacheLoader(cache, "val", config=cfg(global_batch_size=64))
    with pytest.raises(ConfigError, match="mode='fast'"):
        cfg(mode="fast")


def test_augmentation_matches_a_per_sample_reference(cache):
    loader = CacheLoader(cache, "train", config=cfg(seed=11))
    batch = next(iter(loader))
    rows = loader.rows[loader.rank_indices(0, 0)]
    dy, dx, flip = augment_params(TRAIN_AUG, 11, 0, batch["sample_id"])
    assert flip.any() and not flip.all() and len(set(dy.tolist())) > 1  # the test exercises real variety
    for i, row in enumerate(rows):
        ref = reference_augment(sample_pixels(int(row), (8, 8, 3)), dy[i], dx[i], flip[i], TRAIN_AUG)
        np.testing.assert_allclose(batch["image"][i].numpy(), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 4])
def test_world_size_invariance_including_augmentation(cache, world_size):
    single = as_arrays(CacheLoader(cache, "train", config=cfg()))
    per_rank = [as_arrays(CacheLoader(cache, "train", r, world_size, cfg())) for r in range(world_size)]
    joined = [
        (
            np.concatenate([per_rank[r][s][0] for r in range(world_size)]),
            np.concatenate([per_rank[r][s][1] for r in range(world_size)]),
            sum((per_rank[r][s][2] for r in range(world_size)), []),
        )
        for s in range(len(single))
    ]
    assert_same(single, joined)


def test_eval_sees_every_sample_exactly_once_across_ranks(cache):
    config = LoaderConfig.for_eval(global_batch_size=12, mode="sync")
    ids = []
    sizes = []
    for r in range(3):
        loader = CacheLoader(cache, "val", r, 3, config)
        for b in loader:
            ids += b["sample_id"]
            sizes.append(len(b["sample_id"]))
            assert b["image"].dtype == torch.float32
    total = CacheLoader(cache, "val", config=config).num_samples
    assert len(ids) == total and len(set(ids)) == total
    assert min(sizes) >= 1


def test_train_epoch_is_each_sample_once_when_not_dropping(cache):
    config = cfg(drop_last=False)
    loader = CacheLoader(cache, "train", config=config)
    ids = [s for b in loader for s in b["sample_id"]]
    assert len(ids) == loader.num_samples == len(set(ids))


def test_order_differs_per_epoch_and_seed_and_iteration_continues_across_epochs(cache):
    loader = CacheLoader(cache, "train", config=cfg(augment=AugmentConfig(normalize=False)))
    epoch0 = [s for b in loader for s in b["sample_id"]]
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["step"] == 0
    epoch1 = [s for b in loader for s in b["sample_id"]]
    other_seed = [s for b in CacheLoader(cache, "train", config=cfg(seed=1)) for s in b["sample_id"]]
    assert epoch0 != epoch1 and epoch0 != other_seed
    assert len(set(epoch0)) == len(epoch0) == len(loader) * 16
    loader.set_epoch(0)
    assert [s for b in loader for s in b["sample_id"]] == epoch0


def test_modes_give_identical_batches(cache):
    expected = as_arrays(CacheLoader(cache, "train", 1, 2, cfg()))
    for mode in ("thread", "memory"):
        got = as_arrays(CacheLoader(cache, "train", 1, 2, cfg(mode=mode)))
        assert_same(expected, got)


def test_state_counts_consumed_not_prefetched_batches(cache):
    loader = CacheLoader(cache, "train", config=cfg(mode="thread", prefetch=4))
    it = iter(loader)
    next(it), next(it)
    assert loader.state_dict()["step"] == 2  # the producer is ahead, the state is not
    assert loader.stats.count == 2 and loader.stats.total_wait_s >= loader.stats.last_wait_s >= 0
    it.close()
    assert loader.state_dict()["step"] == 2


def _resume_child(cache, state_path, layouts, m, out_dir):
    """Run in a fresh interpreter: for each (rank, world_size), rebuild the loader from the saved state and dump
    its next m batches."""
    with open(state_path) as f:
        state = json.load(f)
    for rank, world_size in layouts:
        loader = CacheLoader(cache, "train", rank, world_size, cfg(mode="thread", prefetch=3))
        loader.load_state_dict(state)
        got = as_arrays(take(loader, m))
        np.savez(
            os.path.join(out_dir, f"ws{world_size}-r{rank}.npz"),
            images=np.stack([g[0] for g in got]),
            labels=np.stack([g[1] for g in got]),
            ids=np.array([g[2] for g in got]),
        )


def test_resume_in_a_new_process_is_bit_identical(cache, tmp_path):
    k, m = 3, 4
    config = cfg(mode="thread", prefetch=3)
    # run at world size 1 through the epoch boundary: k batches, save, then the expected continuation
    loader = CacheLoader(cache, "train", config=config)
    loader.set_epoch(2)
    steps = len(loader)
    take(loader, steps - k)  # leave exactly k batches of epoch 2
    state = loader.state_dict()
    assert (state["epoch"], state["step"]) == (2, steps - k)
    state_path = tmp_path / "state.json"
    state_path.write_text(json.dumps(state))
    expected = as_arrays(take(loader, m))  # crosses into epoch 3
    # restored in a new process, at world size 1 and (elastically) at world size 2
    layouts = [(0, 1), (0, 2), (1, 2)]
    code = (
        "from tests.loader.test_loader import _resume_child; "
        f"_resume_child({cache!r}, {str(state_path)!r}, {layouts!r}, {m}, {str(tmp_path)!r})"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)
    for world_size in (1, 2):
        parts = []
        for rank in range(world_size):
            with np.load(tmp_path / f"ws{world_size}-r{rank}.npz", allow_pickle=False) as z:
                parts.append((z["images"], z["labels"], z["ids"]))
        got = [
            (
                np.concatenate([p[0][s] for p in parts]),
                np.concatenate([p[1][s] for p in parts]),
                [str(x) for p in parts for x in p[2][s]],
            )
            for s in range(m)
        ]
        assert_same(expected, got)


def test_state_mismatch_errors_and_force(cache, tmp_path):
    loader = CacheLoader(cache, "train", config=cfg())
    take(loader, 2)
    state = loader.state_dict()
    other = CacheLoader(cache, "train", config=cfg(global_batch_size=32))
    with pytest.raises(ConfigError, match="global_batch_size=16 but this loader has global_batch_size=32"):
        other.load_state_dict(state)
    with pytest.warns(UserWarning, match="force=True was passed"):
        other.load_state_dict(state, force=True)
    assert other.state_dict()["step"] == 2
    bad = dict(state, fingerprint="feedface")
    with pytest.raises(ConfigError, match="fingerprint='feedface' but this loader has fingerprint="):
        CacheLoader(cache, "train", config=cfg()).load_state_dict(bad)
    # a state saved at world size 1 loads at world size 2 and continues the same global batches
    expected = as_arrays(take(loader, 1))[0]
    halves = []
    for r in range(2):
        rl = CacheLoader(cache, "train", r, 2, cfg())
        rl.load_state_dict(state)
        halves.append(as_arrays(take(rl, 1))[0])
    assert np.array_equal(expected[0], np.concatenate([halves[0][0], halves[1][0]]))


def test_the_seed_is_part_of_the_plan(cache):
    """A state saved with another seed is refused like any other plan input (test_state.py covers each one); with
    the same seed the batches and their augmentations continue exactly."""
    saved = CacheLoader(cache, "train", config=cfg(seed=5))
    take(saved, 1)
    state = saved.state_dict()
    expected = as_arrays(take(saved, 1))
    with pytest.raises(ConfigError, match="seed=5 but this loader has seed=0"):
        CacheLoader(cache, "train", config=cfg(seed=0)).load_state_dict(state)
    resumed = CacheLoader(cache, "train", config=cfg(seed=5))
    resumed.load_state_dict(state)
    assert_same(expected, as_arrays(take(resumed, 1)))


def _corrupt(tmp_path, how):
    uri = str(tmp_path / "bad")
    make_cache(uri, 40, shards=2)
    shard = os.path.join(uri, "shards", "shard-00001.arrow")
    if how == "missing":
        os.remove(shard)
    else:
        data = bytearray(open(shard, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(shard, "wb").write(bytes(data))
    return uri


@pytest.mark.parametrize("how,message", [("missing", "is missing"), ("flipped", "fails its checksum")])
@pytest.mark.parametrize("mode", ["sync", "thread", "memory"])
def test_corrupt_or_missing_shard_names_it(tmp_path, how, message, mode):
    uri = _corrupt(tmp_path, how)
    with pytest.raises(CorruptArtifactError, match=rf"shard-00001\.arrow.*{message}"):
        loader = CacheLoader(uri, "train", config=cfg(global_batch_size=8, mode=mode, drop_last=False))
        for _ in loader:
            pass


def test_uint8_and_chw_caches(tmp_path):
    uri = str(tmp_path / "chw")
    make_cache(uri, 32, shape=(3, 6, 5), shards=2, layout="CHW")
    loader = CacheLoader(uri, "train", config=cfg(global_batch_size=8, augment=AugmentConfig(normalize=False)))
    batch = next(iter(loader))
    assert batch["image"].shape == (8, 3, 6, 5) and batch["image"].dtype == torch.uint8
    rows = loader.rows[loader.rank_indices(0, 0)]
    assert [pixel_index(img.numpy()) for img in batch["image"]] == rows.tolist()


def test_pin_memory_without_cuda_is_a_no_op(cache):
    loader = CacheLoader(cache, "train", config=cfg(pin_memory=True, device="cpu"))
    batch = next(iter(loader))
    assert batch["image"].device.type == "cpu" and "_ready" not in batch


class CountingSource(CacheSource):
    """A cache source that counts the batches the executor has read or submitted (to observe back-pressure)."""

    reads = 0

    def read(self, indices):
        self.reads += 1
        return super().read(indices)

    def submit(self, indices, max_retries):
        self.reads += 1
        return super().submit(indices, max_retries)


def counting_loader(uri: str, config: LoaderConfig) -> Loader:
    return Loader(config, CountingSource(uri, "train", config.read))


def assert_bounded_prefetch(loader, prefetch):
    import time

    assert len(loader) >= 20
    it = iter(loader)
    next(it)
    time.sleep(1.0)  # give an unbounded producer time to run far ahead
    # consumed 1 + queue `prefetch` + 1 held by the blocked producer (+ `prefetch` Ray tasks in flight)
    limit = 1 + prefetch + 1 + (prefetch if loader.config.mode == "ray" else 0)
    assert 0 < loader.source.reads <= limit
    it.close()


def test_thread_mode_prefetch_is_bounded(tmp_path):
    uri = str(tmp_path / "c")
    make_cache(uri, 200, shards=2)
    loader = counting_loader(uri, cfg(mode="thread", global_batch_size=8, prefetch=2))
    assert_bounded_prefetch(loader, 2)
