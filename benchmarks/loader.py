"""Loader benchmark: dutycycle's cache loader against an in-RAM upper bound and the loaders people use today.

One run, one synthetic dataset (``dutycycle.engine.synth``), batch 256, 64x64x3 uint8 samples. Every row
delivers the same thing, a dict with a uint8 ``image`` tensor [B, 3, 64, 64], ``label`` and ``sample_id``,
and runs in its own process so its peak memory is its own. Rows:

1. ``dutycycle-*``: ``CacheLoader`` over the Arrow cache; ``auto`` is the mode training uses (the loader's
   default; the ratios use it). With this benchmark's settings (a split far smaller than free memory, no
   augmentation or normalization) ``auto`` holds the split in RAM and collates in the caller's thread; with
   augmentation on it would add a prefetch thread. The row records the choice (``execution``). ``thread``
   (memory-mapped shards, prefetch thread), ``memory`` and ``ray`` are reported alongside.
2. ``ram-gather``: the whole cache copied into one numpy array, batches gathered by random index (upper bound).
3. ``torch-jpeg``: a torch ``DataLoader`` with 2 workers decoding the image files with PIL and resizing.
4. ``ray-parquet``: Ray Data ``read_parquet`` over a Parquet copy of the cache + ``iter_torch_batches``;
   ``ray-images``: Ray Data ``read_images`` + ``map_batches`` (resize) over the image files.
5. ``daft-parquet``: Daft ``to_torch_dataloader`` over the Parquet copy.
6. ``webdataset``: WebDataset tar shards holding the same pre-transformed samples, 2 loader workers.

Throughput is measured after a warm-up batch, over whole epochs until ``--min-seconds`` have passed; time to
first batch runs from constructing the loader (a Ray row starts its local Ray, 2 CPUs, before that and reports
the start separately). The streaming peers read in file order with no shuffle, which only flatters them.

    python benchmarks/loader.py                 # full run, about 3-5 minutes on 2 cores
    python benchmarks/loader.py --quick --out /tmp/loader.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import PeakRSS, emit, local_ray, markdown_table, measure, quiet_ray_data, run_row  # noqa: E402

BATCH = 256
SIZE = 64
SHARD_ROWS = 2048  # the materializer's default rows per shard
SEED = 0
PRIMARY = "dutycycle-auto"
SLOW_BATCHES = 12  # the decoding rows are timed over this many batches after the warm-up one, not an epoch
RAY_ROWS = {"dutycycle-ray", "ray-parquet", "ray-images"}  # rows that start a local Ray

# name -> (group in the list, description)
ROWS: dict[str, tuple[str, str]] = {
    "dutycycle-auto": ("1", "dutycycle CacheLoader, auto mode (training default)"),
    "dutycycle-thread": ("1", "dutycycle CacheLoader, thread mode (memory-mapped shards)"),
    "dutycycle-memory": ("1", "dutycycle CacheLoader, memory mode"),
    "dutycycle-ray": ("1", "dutycycle CacheLoader, ray mode"),
    "ram-gather": ("2", "numpy arrays in RAM, random-index gather (upper bound)"),
    "torch-jpeg": ("3", "torch DataLoader, 2 workers, PIL decode + resize of files"),
    "ray-parquet": ("4a", "Ray Data read_parquet (cache as Parquet) + iter_torch_batches"),
    "ray-images": ("4b", "Ray Data read_images + map_batches resize"),
    "daft-parquet": ("5", "Daft to_torch_dataloader over the cache as Parquet"),
    "webdataset": ("6", "WebDataset tar shards of pre-transformed samples, 2 workers"),
}

# (name, other row, target): PRIMARY's samples/s divided by the other row's must reach the target.
RATIOS = [
    ("vs_ram_gather", "ram-gather", 0.8),
    ("vs_torch_jpeg", "torch-jpeg", 10.0),
    ("vs_ray_parquet", "ray-parquet", 2.0),
    ("vs_ray_images", "ray-images", 2.0),
    ("vs_daft", "daft-parquet", 2.0),
    ("vs_webdataset", "webdataset", 1.0),
]


# ------------------------------------------------------------------------------------------ data


def prepare(root: Path, n: int, direct: bool = False) -> dict[str, Any]:
    """Write the images, the dutycycle cache and its Parquet and WebDataset copies under ``root`` once.

    The cache is made the way users make it (``ingest`` + ``materialize``) unless ``direct`` (``--quick``):
    then the engine's transform writes it straight through ``engine.cache.format``, the same pixels in less time.
    """
    info_path = root / "data.json"
    if info_path.exists():
        info = json.loads(info_path.read_text())
        if info["n"] == n and info.get("direct") == direct:
            return info
    from dutycycle.engine.synth import synthesize

    t0 = time.perf_counter()
    summary = synthesize(str(root / "images"), n, seed=SEED)
    t_synth = time.perf_counter() - t0
    t0 = time.perf_counter()
    cache = None
    if not direct:
        try:
            cache, writer = materialized_cache(root), "dutycycle ingest + materialize"
        except Exception as e:  # the direct writer keeps the benchmark usable while the engine changes
            print(f"materialize failed ({type(e).__name__}: {e}); writing the cache directly", file=sys.stderr)
    if cache is None:
        cache, writer = direct_cache(root / "cache-direct", list_files(root / "images")), "cache_format (direct)"
    t_cache = time.perf_counter() - t0
    write_parquet_copy(cache, root / "parquet")
    write_webdataset_copy(cache, root / "wds")
    info = {
        "n": n,
        "cache": cache,
        "formats": summary["formats"],
        "image_bytes": summary["bytes"],
        "synth_s": round(t_synth, 1),
        "cache_build_s": round(t_cache, 1),
        "cache_writer": writer,
        "direct": direct,
    }
    info_path.write_text(json.dumps(info))
    return info


def materialized_cache(root: Path) -> str:
    """The cache the way users make it: ``ingest`` the image folder (all train), then ``materialize``."""
    from dutycycle.engine.cache.materialize import materialize
    from dutycycle.engine.table.catalog import ingest
    from dutycycle.engine.transform import TransformSpec

    table = str(root / "table")
    ingest(str(root / "images"), table, split=(1.0, 0.0, 0.0), phash=False, progress_every=0)
    return materialize(table, str(root / "cache"), TransformSpec(size=SIZE)).uri


def list_files(images: Path) -> list[tuple[str, int]]:
    """(relative path, label index) for every image, labels from the sorted class folder names."""
    classes = sorted(p.name for p in images.iterdir() if p.is_dir())
    out = []
    for label, c in enumerate(classes):
        out += [(f"{c}/{f.name}", label) for f in sorted((images / c).iterdir())]
    return out


def direct_cache(cache: Path, files: list[tuple[str, int]]) -> str:
    """Decode + transform every file once with the engine's transform and write a committed cache directly."""
    from dutycycle.engine.cache import format as cf
    from dutycycle.engine.transform import TransformSpec, decode_and_transform

    spec = TransformSpec(size=SIZE)
    images_dir = cache.parent / "images"
    shards = []
    for s, start in enumerate(range(0, len(files), SHARD_ROWS)):
        chunk = files[start : start + SHARD_ROWS]
        pixels = np.stack([decode_and_transform((images_dir / rel).read_bytes(), spec) for rel, _ in chunk])
        shards.append(
            cf.write_shard(
                str(cache), s, [rel for rel, _ in chunk], [lab for _, lab in chunk], ["train"] * len(chunk), pixels
            )
        )
    classes = sorted({rel.split("/")[0] for rel, _ in files})
    manifest = cf.CacheManifest(
        fingerprint=f"bench-{len(files)}-{SEED}",
        shape=list(spec.shape),
        layout=spec.layout,
        dtype="uint8",
        num_samples=len(files),
        shards=shards,
        classes=classes,
        split_counts={"train": len(files)},
        spec=spec.to_dict(),
        source=str(images_dir),
    )
    cf.commit(str(cache), manifest)
    return str(cache)


def write_parquet_copy(cache: str, out: Path) -> None:
    """The same columns as the cache, one uncompressed Parquet file per shard (no decompression to pay)."""
    import pyarrow.parquet as pq
    from dutycycle.engine.cache.format import CacheReader

    out.mkdir(parents=True, exist_ok=True)
    reader = CacheReader(cache)
    for i in range(reader.num_shards):
        pq.write_table(reader.shard(i), out / f"part-{i:05d}.parquet", compression="none", use_dictionary=False)


def write_webdataset_copy(cache: str, out: Path, shards: int = 8) -> None:
    """The cache's pixels as WebDataset tar shards: per sample raw uint8 bytes (``.u8``) and a class (``.cls``)."""
    import webdataset as wds
    from dutycycle.engine.cache.format import CacheReader

    out.mkdir(parents=True, exist_ok=True)
    reader = CacheReader(cache)
    images = np.concatenate([reader.images(i) for i in range(reader.num_shards)])
    labels = np.concatenate([reader.column(i, "label") for i in range(reader.num_shards)])
    for s, idx in enumerate(np.array_split(np.arange(len(images)), shards)):
        with wds.TarWriter(str(out / f"shard-{s:05d}.tar"), encoder=False, mtime=0) as w:
            for i in idx:
                w.write({"__key__": f"{i:08d}", "u8": images[i].tobytes(), "cls": str(int(labels[i])).encode()})


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
    import torch

    img = batch["image"]
    assert isinstance(img, torch.Tensor) and img.dtype == torch.uint8, (type(img), getattr(img, "dtype", None))
    assert tuple(img.shape[1:]) == (3, SIZE, SIZE) and 0 < img.shape[0] <= BATCH, tuple(img.shape)
    assert len(batch["label"]) == img.shape[0] == len(batch["sample_id"])


# ------------------------------------------------------------------------------------------ rows


def row_dutycycle(data: Path, mode: str, min_seconds: float) -> dict[str, Any]:
    from dutycycle.loader import AugmentConfig, CacheLoader, LoaderConfig

    cfg = LoaderConfig(
        global_batch_size=BATCH,
        seed=SEED,
        drop_last=True,
        mode=mode,
        prefetch=4,
        augment=AugmentConfig(crop_padding=0, flip=False, normalize=False),
    )

    def epoch(loader, e):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(e)
        return loader

    built = []

    def open_loader():
        built.append(CacheLoader(cache_uri(data), split="train", rank=0, world_size=1, config=cfg))
        return built[-1]

    if mode != "ray":
        result = measure(open_loader, epoch, min_seconds=min_seconds, check=check_batch)
        return {**result, "execution": built[0].execution}
    with local_ray() as startup:
        result = measure(open_loader, epoch, min_seconds=min_seconds, check=check_batch)
    return {**result, "execution": built[0].execution, "ray_start_s": round(startup, 2)}


def row_ram_gather(data: Path, min_seconds: float) -> dict[str, Any]:
    import torch
    from dutycycle.engine.cache.format import CacheReader

    def open_loader():
        reader = CacheReader(cache_uri(data))
        images = np.concatenate([np.array(reader.images(i)) for i in range(reader.num_shards)])
        labels = np.concatenate([reader.column(i, "label") for i in range(reader.num_shards)])
        return images, labels

    def epoch(arrays, e):
        images, labels = arrays
        order = np.random.default_rng([SEED, e]).permutation(len(images))
        for b in range(len(order) // BATCH):
            idx = order[b * BATCH : (b + 1) * BATCH]
            yield {"image": to_nchw(images[idx]), "label": torch.from_numpy(labels[idx]), "sample_id": idx}

    return measure(open_loader, epoch, min_seconds=min_seconds, check=check_batch)


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


def _ray_parquet_collate():
    from ray.data.collate_fn import ArrowBatchCollateFn

    class CacheCollate(ArrowBatchCollateFn):
        """Arrow batch -> tensors, the pixels viewed straight from the fixed-size-binary buffer."""

        def __call__(self, batch):
            import torch

            col = batch.column("image").combine_chunks()
            n = len(col)
            flat = np.frombuffer(col.buffers()[1], dtype=np.uint8)[col.offset * SIZE * SIZE * 3 :]
            pixels = flat[: n * SIZE * SIZE * 3].reshape(n, SIZE, SIZE, 3)
            labels = batch.column("label").to_numpy()
            return {
                "image": to_nchw(pixels),
                "label": torch.from_numpy(labels),
                "sample_id": batch.column("sample_id").to_pylist(),
            }

    return CacheCollate()


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
    import daft

    def open_loader():
        df = daft.read_parquet(str(data / "parquet" / "*.parquet")).select("image", "label", "sample_id")
        return df.to_torch_dataloader(batch_size=BATCH, prefetch_count=4)

    def epoch(dl, e):
        for b in dl:
            yield {"image": to_nchw(from_fixed_binary(b["image"])), "label": b["label"], "sample_id": b["sample_id"]}

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


def process_groups(names: list[str], quick: bool) -> list[list[str]]:
    """Which rows share a process: each its own for real figures; in --quick, one for the Ray rows and one for
    the rest (Ray start-up dominates a tiny run). Daft goes last in its process: its threads must not exist
    when the torch and WebDataset rows fork their workers."""
    if not quick:
        return [[n] for n in names]
    local = sorted((n for n in names if n not in RAY_ROWS), key=lambda n: n == "daft-parquet")
    return [g for g in (local, [n for n in names if n in RAY_ROWS]) if g]


def run_group(names: list[str], data: Path, min_seconds: float) -> dict[str, Any]:
    if sum(n in RAY_ROWS for n in names) > 1:
        with local_ray():
            return {n: run_one(n, data, min_seconds) for n in names}
    return {n: run_one(n, data, min_seconds) for n in names}


def run_one(name: str, data: Path, min_seconds: float) -> dict[str, Any]:
    import torch  # noqa: F401  (every row feeds torch; its import time is no loader's first-batch time)

    if name.startswith("dutycycle-"):
        fn = lambda: row_dutycycle(data, name.split("-", 1)[1], min_seconds)  # noqa: E731
    else:
        row_fn = globals()["row_" + name.replace("-", "_")]
        fn = lambda: row_fn(data, min_seconds)  # noqa: E731
    with PeakRSS() as rss:
        result = fn()
    return {**result, **rss.result()}


# ------------------------------------------------------------------------------------------ driver


def summarize(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    primary = rows.get(PRIMARY, {}).get("samples_per_s")
    out = []
    for name, other, target in RATIOS:
        base = rows.get(other, {}).get("samples_per_s")
        value = round(primary / base, 2) if primary and base else None
        out.append({"name": name, "against": other, "value": value, "target": target,
                    "met": None if value is None else value >= target})
    return out


def render_markdown(rows: dict[str, dict[str, Any]], ratios: list[dict[str, Any]]) -> str:
    table = []
    for name, r in rows.items():
        group, desc = ROWS[name]
        table.append([group, name, r.get("samples_per_s"), r.get("samples_per_cpu_s"), r.get("time_to_first_batch_s"),
                      r.get("peak_rss_mb"), r.get("error", desc)])
    headers = ["#", "loader", "samples/s", "samples/CPU-s", "first batch (s)", "peak RSS (MiB)", "notes"]
    text = markdown_table(headers, table)
    ratio_rows = [[f"{PRIMARY} / {r['against']}", r["value"], f">= {r['target']:g}",
                   {True: "yes", False: "NO", None: "-"}[r["met"]]] for r in ratios]
    return text + "\n\n" + markdown_table(["ratio", "value", "target", "met"], ratio_rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "loader.json"))
    p.add_argument("--n", type=int, default=None, help="number of synthetic images (default 6000, 600 with --quick)")
    p.add_argument("--quick", action="store_true", help="a tiny run for the smoke test (n=600, short timing)")
    p.add_argument("--min-seconds", type=float, default=None, help="steady-state seconds per row")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of: " + ", ".join(ROWS))
    p.add_argument("--workdir", default=None, help="keep generated data here (reused when --n matches)")
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)  # internal: measure one row in this process
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    n = args.n or (600 if args.quick else 6000)
    min_seconds = args.min_seconds if args.min_seconds is not None else (0.2 if args.quick else 4.0)

    if args.row:
        emit(run_group(args.row.split(","), Path(args.data), min_seconds))
        return 0

    names = [r for r in args.rows.split(",") if r]
    unknown = [r for r in names if r not in ROWS]
    if unknown:
        p.error(f"unknown row {unknown[0]!r}; choose from {', '.join(ROWS)}")
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="dc-bench-loader-")
    root = Path(args.workdir or tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        info = prepare(root, n, direct=args.quick)
        print(f"data ready in {root} ({n} images): {info}", file=sys.stderr)
        rows: dict[str, dict[str, Any]] = {}
        groups = process_groups(names, args.quick)
        argvs = [[__file__, "--row", ",".join(g), "--data", str(root), "--min-seconds", str(min_seconds)] for g in groups]
        # Real figures: one row at a time. --quick: its two processes side by side (only that they run matters).
        with ThreadPoolExecutor(max_workers=2 if args.quick else 1) as pool:
            results = list(pool.map(lambda a: run_row(a, timeout=180 if args.quick else 600), argvs))
        for group, (got, wall) in zip(groups, results, strict=True):
            for name in group:
                r = got.get(name) or {"error": got.get("error", "no result")}
                r["process_wall_s"] = wall
                rows[name] = r
                shown = r.get("error") or f"{r['samples_per_s']:,.0f} samples/s, first batch {r['time_to_first_batch_s']} s"
                print(f"{name}: {shown}", file=sys.stderr)
        rows = {n: rows[n] for n in names}
    finally:
        if tmp is not None:
            tmp.cleanup()
    ratios = summarize(rows)
    result = {
        "benchmark": "loader",
        "config": {"n": n, "batch_size": BATCH, "sample_shape": [3, SIZE, SIZE], "min_seconds": min_seconds,
                   "quick": args.quick, "primary": PRIMARY,
                   "one_process_per_row": not args.quick},
        "data": info,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "rows": [{"name": k, "group": ROWS[k][0], "description": ROWS[k][1], **v} for k, v in rows.items()],
        "ratios": ratios,
        "total_s": round(time.perf_counter() - t0, 1),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(render_markdown(rows, ratios))
    print(f"\nwrote {out} in {result['total_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
