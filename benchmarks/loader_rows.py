"""Rows of benchmarks/loader.py that run in the project's venv: dutycycle's modes, the in-RAM bound, and the
peers installed with the ``bench`` extra (torch DataLoader + PIL, Ray Data, Daft, WebDataset).

Every row delivers the same thing: a dict with a uint8 ``image`` tensor [B, 3, 64, 64], ``label`` and
``sample_id``. ``ram-bound`` is the loader's own plan and gather over the split in one array in RAM (its upper
bound); ``daft-parquet`` reads Daft's ``to_arrow_iter`` with the collate the ``ray-parquet`` row gives Ray Data.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import local_ray, measure, quiet_ray_data
from benchmarks.loader_data import SEED, SIZE, cache_arrays, list_files
from tests.support.objectstore import moto_server

BATCH = 256
SLOW_BATCHES = 12  # the decoding rows are timed over this many batches after the warm-up one, not an epoch
S3_BATCHES = 40  # batches timed from the moto S3 server (a local process: its rate says little about S3's)
# Every dutycycle row hands out uint8, as the peers do: not the default AugmentConfig, which normalizes to float32
PLAIN = {"crop_padding": 0, "flip": False, "normalize": False}


# ------------------------------------------------------------------------------------------ helpers


def to_nchw(pixels: np.ndarray):
    """uint8 [B, H, W, C] numpy -> torch [B, C, H, W] (a view, as a training step would take it)."""
    import torch

    return torch.from_numpy(pixels).permute(0, 3, 1, 2)


def from_fixed_binary(values: list[bytes]) -> np.ndarray:
    """A list of per-sample byte strings -> uint8 [B, H, W, 3]."""
    return np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), SIZE, SIZE, 3)


def cache_uri(data: Path) -> str:
    return json.loads((data / "data.json").read_text())["cache"]


def check_batch(batch: dict[str, Any]) -> None:
    """Every row's batches have the same form."""
    import torch

    img = batch["image"]
    assert isinstance(img, torch.Tensor) and img.dtype == torch.uint8, (type(img), getattr(img, "dtype", None))
    assert tuple(img.shape[1:]) == (3, SIZE, SIZE) and 0 < img.shape[0] <= BATCH, tuple(img.shape)
    assert len(batch["label"]) == img.shape[0] == len(batch["sample_id"])


# ------------------------------------------------------------------------------------------ dutycycle


def loader_config(mode: str, **kw):
    from dutycycle.loader import AugmentConfig, LoaderConfig

    return LoaderConfig(global_batch_size=BATCH, seed=SEED, drop_last=True, mode=mode, prefetch=4,
                        augment=AugmentConfig(**PLAIN), **kw)


def _set_epoch(loader, e):
    loader.set_epoch(e)
    return loader


def evict(folder: Path) -> None:
    """Drop ``folder``'s files from the page cache (``POSIX_FADV_DONTNEED``), so the next reads come from disk."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def row_dutycycle(data: Path, mode: str, min_seconds: float) -> dict[str, Any]:
    """``mode``: a loader mode; ``auto-cold`` is ``auto`` with the cache's pages dropped from the page cache
    before every epoch (the cache larger than the RAM a node can spare)."""
    from dutycycle.loader import CacheLoader

    cold = mode == "auto-cold"
    mode = "auto" if cold else mode
    built = []

    def open_loader():
        built.append(CacheLoader(cache_uri(data), split="train", rank=0, world_size=1,
                                 config=loader_config(mode, memory_fraction=1.0)))
        return built[-1]

    def epoch(loader, e):
        if cold:
            evict(Path(cache_uri(data)))
        return _set_epoch(loader, e)

    if mode != "ray":
        result = measure(open_loader, epoch, min_seconds=min_seconds, check=check_batch)
    else:
        with local_ray() as startup:
            result = measure(open_loader, epoch, min_seconds=min_seconds, check=check_batch)
        result["ray_start_s"] = round(startup, 2)
    loader = built[0]
    shards = loader.reader.num_shards
    if mode != "ray":  # Ray mode gathers in its tasks' processes
        # warm-up batch included: opens over every batch this loader read
        result["shard_opens_per_batch"] = round(loader.source.shard_opens / (result["batches_timed"] + 1), 3)
    return {**result, "execution": loader.execution, "shards": shards}


class RamBound:
    """The split in RAM as one array, batched by the loader's own plan and gathered with the loader's own gather
    (``source._RowSpan``, one element copy per sample): the in-RAM upper bound. The product reads the same plan
    from memory-mapped shards with the same gather, so it cannot beat this by more than noise."""

    def __init__(self, cache: str):
        from dutycycle.loader import CacheLoader
        from dutycycle.loader.source import _RowSpan

        self.images, self.labels, self.ids = cache_arrays(cache)
        self.planner = CacheLoader(cache, "train", 0, 1, loader_config("auto"))  # its plan only
        self.span = _RowSpan(1, int(np.prod(self.images.shape[1:])))
        self.span.add(0, self.images)

    def epoch(self, e: int):
        import torch

        plan = self.planner.rank_plan(e)
        shard = np.zeros(BATCH, np.int64)
        for step in range(len(plan)):
            idx = plan.indices(step)
            out = self.span.gather(shard[: len(idx)], idx).reshape(len(idx), *self.images.shape[1:])
            yield {"image": to_nchw(out), "label": torch.from_numpy(self.labels.take(idx)),
                   "sample_id": self.ids.take(idx).tolist()}


def row_ram_bound(data: Path, min_seconds: float) -> dict[str, Any]:
    return measure(lambda: RamBound(cache_uri(data)), lambda b, e: b.epoch(e), min_seconds=min_seconds,
                   check=check_batch)


def row_interleaved(data: Path, min_seconds: float) -> dict[str, Any]:
    """``dutycycle-auto`` and ``ram-bound`` in one process, alternating epochs, so both see the same load on
    this shared machine: the source of the ratio against the bound."""
    return interleave(cache_uri(data), 2 * min_seconds, "dutycycle-auto", "ram-bound")  # twice: a steadier ratio


def interleave(cache: str, min_seconds: float, loader_name: str, bound_name: str) -> dict[str, Any]:
    """Both in one process, alternating whole epochs (who goes first alternating too) until each has run
    ``min_seconds``: a neighbour's load on this shared machine lands on both alike."""
    from dutycycle.loader import CacheLoader

    loader = CacheLoader(cache, "train", 0, 1, loader_config("auto"))
    bound = RamBound(cache)
    runs = {loader_name: lambda e: _set_epoch(loader, e), bound_name: bound.epoch}
    for run in runs.values():  # warm-up epoch: page cache, mappings, allocator
        for _ in run(0):
            pass
    totals = {name: [0, 0.0] for name in runs}
    e = 1
    while min(t[1] for t in totals.values()) < min_seconds or e < 4:
        for name, run in (runs.items() if e % 2 else reversed(runs.items())):
            t0 = time.perf_counter()
            totals[name][0] += sum(len(b["label"]) for b in run(e))
            totals[name][1] += time.perf_counter() - t0
        e += 1
    rates = {name: round(n / t, 1) for name, (n, t) in totals.items()}
    return {"samples_per_s": rates, "epochs_each": e - 1, "execution": loader.execution,
            "ratio": round(rates[loader_name] / rates[bound_name], 3)}


S3_SERVER = "moto.server"  # the command line of the S3 server process (``objectstore.moto_server``)
# A child process copies the cache to the server: whatever the upload holds is not the loader row's memory (in
# the row's own process, s3fs's upload of the 3.7 GB cache peaked at 7.36 GiB resident and set the s3 rows'
# recorded peak, 7.3 GiB private, which measured the set-up, not the loader).
UPLOAD = """
import sys, s3fs
fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": sys.argv[2]})
fs.mkdir("dc-bench")
fs.put(sys.argv[1], "dc-bench/cache", recursive=True)
"""


@contextmanager
def s3_cache(data: Path) -> Iterator[str]:
    """A local S3-compatible server (moto) holding a copy of the benchmark's cache; yields its ``s3://`` URI
    (the AWS variables point this process at the server)."""
    import subprocess
    import sys

    with moto_server() as endpoint:
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                          AWS_DEFAULT_REGION="us-east-1")
        subprocess.run([sys.executable, "-c", UPLOAD, cache_uri(data), endpoint], check=True, env=os.environ)
        yield "s3://dc-bench/cache"


def row_dutycycle_s3(uri: str, remote: str, min_seconds: float) -> dict[str, Any]:
    """The cache on a local S3-compatible server (``s3_cache``); time to first batch from a cold node."""
    import tempfile

    from dutycycle.engine.cache.shards import ReadConfig
    from dutycycle.loader import CacheLoader

    with tempfile.TemporaryDirectory(prefix="dc-bench-node-") as node_dir:
        read = ReadConfig(remote=remote, node_dir=node_dir)
        built = []

        def open_loader():
            built.append(CacheLoader(uri, "train", 0, 1, loader_config("auto", read=read)))
            return built[-1]

        result = measure(open_loader, _set_epoch, min_seconds=min_seconds, max_batches=S3_BATCHES, check=check_batch)
        stats = built[0].stats  # the loader's counters, its reader's fetches among them
        total = sum(s.bytes for s in built[0].reader.manifest.shards)
    return {**result, "execution": built[0].execution, "bytes_fetched": stats.bytes_fetched,
            "requests": stats.requests, "cache_bytes": total}


# ------------------------------------------------------------------------------------------ peers


class JpegFiles:
    """A map-style torch Dataset over image files: read, PIL decode, the cache's resize + crop."""

    def __init__(self, root: Path):
        self.root = root
        self.files = list_files(root)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        import torch
        from dutycycle.engine.transform import TransformSpec, decode_and_transform

        rel, label = self.files[i]
        pixels = decode_and_transform((self.root / rel).read_bytes(), TransformSpec(size=SIZE))
        return torch.from_numpy(pixels).permute(2, 0, 1), label, rel


def collate_jpeg(items):
    import torch

    return {
        "image": torch.stack([x[0] for x in items]),
        "label": torch.tensor([x[1] for x in items]),
        "sample_id": [x[2] for x in items],
    }


def row_torch_jpeg(data: Path, min_seconds: float) -> dict[str, Any]:
    import torch

    def open_loader():
        return torch.utils.data.DataLoader(
            JpegFiles(data / "images"),
            batch_size=BATCH,
            shuffle=True,
            num_workers=2,
            collate_fn=collate_jpeg,
            persistent_workers=True,
            drop_last=True,
        )

    return measure(open_loader, lambda dl, e: dl, min_seconds=min_seconds, max_batches=SLOW_BATCHES, check=check_batch)


def collate_arrow(batch) -> dict[str, Any]:
    """An Arrow batch of the cache's columns -> tensors, the pixels viewed straight from the fixed-size-binary
    buffer (no copy): what the Ray Data and Daft rows both hand to torch."""
    import torch

    col = batch.column("image")
    col = col.combine_chunks() if hasattr(col, "combine_chunks") else col
    n = len(col)
    flat = np.frombuffer(col.buffers()[1], dtype=np.uint8)[col.offset * SIZE * SIZE * 3 :]
    pixels = flat[: n * SIZE * SIZE * 3].reshape(n, SIZE, SIZE, 3)
    labels = batch.column("label").to_numpy()
    return {"image": to_nchw(pixels), "label": torch.from_numpy(labels),
            "sample_id": batch.column("sample_id").to_pylist()}


def _ray_parquet_collate():
    from ray.data.collate_fn import ArrowBatchCollateFn

    class CacheCollate(ArrowBatchCollateFn):
        def __call__(self, batch):
            return collate_arrow(batch)

    return CacheCollate()


def rebatch(tables, size: int):
    """Arrow record batches of any sizes -> tables of exactly ``size`` rows (the last short one dropped, as
    ``drop_last``): slices are zero-copy; only a batch that spans two inputs is concatenated."""
    import pyarrow as pa

    held, count = [], 0
    for t in tables:
        t = t if isinstance(t, pa.Table) else pa.Table.from_batches([t])
        held.append(t)
        count += len(t)
        while count >= size:
            whole = pa.concat_tables(held) if len(held) > 1 else held[0]
            out = whole.slice(0, size)
            yield out.combine_chunks() if out.column(0).num_chunks > 1 else out
            rest = whole.slice(size)
            held, count = ([rest] if len(rest) else []), len(rest)


def row_ray_parquet(data: Path, min_seconds: float) -> dict[str, Any]:
    with local_ray() as startup:
        import ray

        quiet_ray_data()
        collate = _ray_parquet_collate()

        def epoch(ds, e):
            return ds.iter_torch_batches(batch_size=BATCH, collate_fn=collate, prefetch_batches=4, drop_last=True)

        result = measure(
            lambda: ray.data.read_parquet(str(data / "parquet")), epoch, min_seconds=min_seconds, check=check_batch
        )
    return {**result, "ray_start_s": round(startup, 2)}


def row_ray_images(data: Path, min_seconds: float) -> dict[str, Any]:
    with local_ray() as startup:
        import ray

        quiet_ray_data()
        classes = sorted(p.name for p in (data / "images").iterdir() if p.is_dir())

        def resize(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            from dutycycle.engine.transform import TransformSpec, transform_image
            from PIL import Image

            spec = TransformSpec(size=SIZE)
            pixels = np.stack([transform_image(Image.fromarray(a), spec) for a in batch["image"]])
            labels = np.array([classes.index(Path(p).parent.name) for p in batch["path"]], dtype=np.int64)
            return {"image": pixels, "label": labels, "sample_id": batch["path"]}

        def collate(batch: dict[str, np.ndarray]):
            import torch

            return {
                "image": to_nchw(batch["image"]),
                "label": torch.from_numpy(batch["label"]),
                "sample_id": list(batch["sample_id"]),
            }

        def open_loader():
            exts = ["jpg", "jpeg", "png", "webp"]
            ds = ray.data.read_images(
                str(data / "images"), mode="RGB", include_paths=True, file_extensions=exts + [e.upper() for e in exts]
            )
            return ds.map_batches(resize, batch_format="numpy", batch_size=64)

        def epoch(ds, e):
            return ds.iter_torch_batches(batch_size=BATCH, collate_fn=collate, prefetch_batches=4, drop_last=True)

        result = measure(open_loader, epoch, min_seconds=min_seconds, max_batches=SLOW_BATCHES, check=check_batch)
    return {**result, "ray_start_s": round(startup, 2)}


def row_daft_parquet(data: Path, min_seconds: float) -> dict[str, Any]:
    """Daft's documented streaming path, ``to_arrow_iter``, cut into batches of 256 and handed to torch with the
    Ray Data row's zero-copy collate."""
    import daft

    def open_loader():
        return daft.read_parquet(str(data / "parquet" / "*.parquet")).select("image", "label", "sample_id")

    def epoch(df, e):
        return (collate_arrow(t) for t in rebatch(df.to_arrow_iter(), BATCH))

    return measure(open_loader, epoch, min_seconds=min_seconds, check=check_batch)


def collate_wds(samples):
    import torch

    pixels, labels, keys = zip(*samples, strict=True)
    return {
        "image": to_nchw(from_fixed_binary(list(pixels))),
        "label": torch.tensor([int(c) for c in labels]),
        "sample_id": list(keys),
    }


def row_webdataset(data: Path, min_seconds: float) -> dict[str, Any]:
    import webdataset as wds

    def open_loader():
        urls = sorted(str(p) for p in (data / "wds").glob("*.tar"))
        ds = (
            wds.WebDataset(urls, shardshuffle=False, empty_check=False)
            .to_tuple("u8", "cls", "__key__")
            .batched(BATCH, collation_fn=collate_wds)
        )
        return wds.WebLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)

    return measure(open_loader, lambda dl, e: dl, min_seconds=min_seconds, check=check_batch)


