"""Cache benchmark: how much faster is reading the transformed-sample cache than decoding files every step?

One run, the same synthetic JPEGs (128-256 px, shapes + noise, 4 classes) -> 64x64x3 uint8 samples, batch 256,
random order. Rows, each in its own process (so its peak memory is its own):

- ``materialize``: ``dutycycle.engine.materialize`` of the metadata table (Daft, native runner): images/s and
  peak RSS; then the same call again (reuse, no work) and its seconds.
- (a) ``torch-jpeg``: a torch DataLoader, 2 workers, each reading a file and running ``decode_and_transform``.
- (b) ``cache``: ``CacheLoader`` over the committed cache in ``mode="auto"``, the default mode (memory-mapped Arrow
  shards read in place), batches of 256 of its shuffled plan, uint8 tensors (``normalize=False``, no crop or
  flip: not the default ``AugmentConfig``, which normalizes to float32).
- (c) ``ram``: the same samples already in one numpy array in RAM, batched by the same plan with the loader's
  ``np.take`` gather (``loader_rows.RamBound``): the upper bound.

Targets: b/c >= 0.8 and b/a >= 10. The run also compares candidate cache formats on the materialized samples
(``benchmarks/cache_formats.py``): Parquet uncompressed and zstd, Arrow IPC memory-mapped and lz4.

    python benchmarks/cache.py --n 3000                # writes benchmarks/results/cache.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from dutycycle.engine.synth import CLASSES as SHAPES
from dutycycle.engine.synth import draw_shapes

if __name__ == "__main__":  # run as `python benchmarks/cache.py`: the siblings import as `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import docs_format as fmt  # noqa: E402
from benchmarks._common import PeakRSS, default_out, emit, machine, measure, run_row, write_result  # noqa: E402

BATCH = 256
SIZE = 64
SEED = 0
CLASSES = sorted(SHAPES)  # the table's classes, sorted as ingest sorts them
TARGETS = {"cache_vs_ram": 0.8, "cache_vs_torch_jpeg": 10.0}


# ------------------------------------------------------------------------------------------------ data


def _jpeg(i: int) -> tuple[bytes, str]:
    """Image ``i`` of the engine's synthetic shapes, 128-256 px a side, as a JPEG, and its class name."""
    import io

    from PIL import Image

    w, h = (int(v) for v in np.random.default_rng([SEED, i]).integers(128, 257, 2))
    pixels, labels = draw_shapes(1, (h, w), SEED, start=i)
    buf = io.BytesIO()
    Image.fromarray(pixels[0]).save(buf, "JPEG", quality=90)
    return buf.getvalue(), SHAPES[labels[0]]


def prepare(root: Path, n: int) -> dict[str, Any]:
    """Write ``n`` JPEGs and a committed metadata table over them (through the table writer, no ingest)."""
    import hashlib

    import pyarrow as pa
    from dutycycle.engine.table import format as tf
    from dutycycle.engine.table.commit import write_version

    info_path = root / "data.json"
    if info_path.exists() and json.loads(info_path.read_text())["n"] == n:
        return json.loads(info_path.read_text())
    rows, total = [], 0
    for i in range(n):
        data, label = _jpeg(i)
        path = root / "images" / label / f"{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        total += len(data)
        rows.append({"sample_id": hashlib.sha256(data).hexdigest()[:32], "uri": str(path), "size_bytes": len(data),
                     "format": "JPEG", "label": label, "split": "train", "orientation": 1, "error": None})
    cols = {f: pa.array([r.get(f) for r in rows], tf.SCHEMA.field(f).type) for f in tf.SCHEMA.names}
    write_version(str(root / "table"), pa.table(cols, tf.SCHEMA), classes=CLASSES, source="benchmarks/cache.py",
                  options={"roots": [str(root / "images")]})  # where its rows point (readers refuse rows outside)
    info = {"n": n, "image_bytes": total, "sides_px": [128, 256], "format": "JPEG q90"}
    info_path.write_text(json.dumps(info))
    return info


# ------------------------------------------------------------------------------------------------ rows


def row_materialize(root: Path) -> dict[str, Any]:
    from dutycycle.engine.cache.materialize import materialize
    from dutycycle.engine.transform import TransformSpec

    spec = TransformSpec(size=SIZE)
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        res = materialize(str(root / "table"), str(root / "cache"), spec)
        seconds = time.perf_counter() - t0
    assert not res.reused, "the benchmark needs a fresh cache root"
    t0 = time.perf_counter()
    again = materialize(str(root / "table"), str(root / "cache"), spec)
    reuse_s = time.perf_counter() - t0
    assert again.reused
    return {"images": res.manifest.num_samples, "seconds": round(seconds, 2),
            "images_per_s": round(res.manifest.num_samples / seconds, 1), "shards": len(res.manifest.shards),
            "reuse_s_warm_process": round(reuse_s, 4), "cache": res.uri, **mem.result()}


def row_reuse_fresh_process(root: Path) -> dict[str, Any]:
    """Reuse as the CLI sees it: a new process, imports included, nothing decoded."""
    t0 = time.perf_counter()
    from dutycycle.engine.cache.materialize import materialize
    from dutycycle.engine.transform import TransformSpec

    res = materialize(str(root / "table"), str(root / "cache"), TransformSpec(size=SIZE))
    return {"reused": res.reused, "seconds_including_imports": round(time.perf_counter() - t0, 4)}


def _as_batch(images: np.ndarray, labels: np.ndarray):
    import torch

    return torch.from_numpy(images), torch.from_numpy(labels)


def open_cache_loader(root: Path):
    """(b) ``CacheLoader`` itself, in ``mode="auto"`` (memory-mapped shards, read in place), uint8 out
    (``normalize=False``: ``loader_rows.loader_config``)."""
    from dutycycle.loader import CacheLoader

    from benchmarks.loader_rows import loader_config

    return CacheLoader(str(root / "cache"), "train", 0, 1, loader_config("auto"))


def open_ram_state(root: Path):
    """(c) the upper bound: the split in one array in RAM, the loader's plan, the loader's ``np.take`` gather."""
    from benchmarks.loader_rows import RamBound

    return RamBound(str(root / "cache"))


def ram_epoch(bound, e: int):
    return bound.epoch(e)


def row_cache(root: Path, min_seconds: float) -> dict[str, Any]:
    import torch  # noqa: F401 - imported before timing, so the first batch measures reading only

    # the loader benchmark's epoch step: set_epoch(e), then iterate it
    from benchmarks.loader_rows import _set_epoch

    with PeakRSS() as mem:
        r = measure(lambda: open_cache_loader(root), _set_epoch, min_seconds=min_seconds)
    return {**r, **mem.result()}


def row_ram(root: Path, min_seconds: float) -> dict[str, Any]:
    import torch  # noqa: F401 - imported before timing, so the first batch measures reading only

    with PeakRSS() as mem:
        r = measure(lambda: open_ram_state(root), ram_epoch, min_seconds=min_seconds)
    return {**r, **mem.result()}


def row_interleaved(root: Path, min_seconds: float) -> dict[str, Any]:
    """(b) and (c) in one process, alternating epochs, so both see the same machine load (the ratio's source)."""
    from benchmarks.loader_rows import interleave

    r = interleave(str(root / "cache"), min_seconds, "cache", "ram")
    return {name: {"samples_per_s": v} for name, v in r["samples_per_s"].items()} | {"execution": r["execution"]}


class JpegFiles:
    """Map-style dataset: read a file, decode + transform it with the same spec as the cache."""

    def __init__(self, table: str):
        from dutycycle.engine.table.table import read_arrow

        t = read_arrow(table, columns=["uri", "label"])
        self.uris = t.column("uri").to_pylist()
        self.labels = [CLASSES.index(v) for v in t.column("label").to_pylist()]

    def __len__(self) -> int:
        return len(self.uris)

    def __getitem__(self, i: int):
        from dutycycle.engine.transform import TransformSpec, decode_and_transform

        with open(self.uris[i], "rb") as f:
            return decode_and_transform(f.read(), TransformSpec(size=SIZE)), self.labels[i]


def _collate(items):
    return _as_batch(np.stack([x[0] for x in items]), np.array([x[1] for x in items], np.int64))


def row_torch_jpeg(root: Path, min_seconds: float) -> dict[str, Any]:
    import torch

    def open_loader():
        return torch.utils.data.DataLoader(JpegFiles(str(root / "table")), batch_size=BATCH, shuffle=True,
                                           num_workers=2, collate_fn=_collate, persistent_workers=True,
                                           drop_last=True)

    with PeakRSS() as mem:
        r = measure(open_loader, lambda dl, e: dl, min_seconds=min_seconds)
    return {**r, **mem.result()}


def row_formats(root: Path, min_seconds: float) -> dict[str, Any]:
    from benchmarks.cache_formats import compare
    from benchmarks.loader_data import cache_arrays

    images, labels, ids = cache_arrays(str(root / "cache"))
    with tempfile.TemporaryDirectory(prefix="dc-formats-", dir=root) as d:
        return compare(ids.tolist(), labels, images, Path(d), min_seconds)


ROWS = {
    "materialize": lambda root, s: row_materialize(root),
    "reuse": lambda root, s: row_reuse_fresh_process(root),
    "torch-jpeg": row_torch_jpeg,
    "cache": row_cache,
    "ram": row_ram,
    "interleaved": row_interleaved,
    "formats": row_formats,
}


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=3000, help="number of synthetic JPEGs (default 3000)")
    p.add_argument("--min-seconds", type=float, default=3.0, help="steady-state seconds per throughput row")
    p.add_argument("--out", default=default_out("cache"))
    p.add_argument("--workdir", default=None, help="keep the images and table here (the cache is rebuilt)")
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run(args) -> dict:
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="dc-bench-cache-")
    root = Path(args.workdir or tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        info = prepare(root, args.n)
        import shutil

        shutil.rmtree(root / "cache", ignore_errors=True)
        rows: dict[str, Any] = {}
        for name in ROWS:
            got, wall = run_row([__file__, "--row", name, "--data", str(root), "--min-seconds", str(args.min_seconds)],
                                timeout=900)
            rows[name] = {**got, "process_wall_s": wall}
            print(f"{name}: {json.dumps(got)[:300]}", file=sys.stderr)
    finally:
        if tmp is not None:
            tmp.cleanup()
    # (b)/(c) comes from the interleaved row (same load for both); the separate rows give memory and first batch.
    inter = rows["interleaved"]
    rate = {"torch-jpeg": rows["torch-jpeg"].get("samples_per_s"),
            "cache": inter.get("cache", {}).get("samples_per_s"), "ram": inter.get("ram", {}).get("samples_per_s")}
    ratios = {}
    if all(rate.values()):
        ratios = {
            "cache_vs_ram": round(rate["cache"] / rate["ram"], 3),
            "cache_vs_torch_jpeg": round(rate["cache"] / rate["torch-jpeg"], 1),
        }
        ratios["met"] = {k: ratios[k] >= v for k, v in TARGETS.items()}
    mat = rows["materialize"]
    summary = {"materialize_images_per_s": mat.get("images_per_s"), "materialize_peak_rss_mb": mat.get("peak_rss_mb"),
               "reuse_s_fresh_process": rows["reuse"].get("seconds_including_imports"),
               "reuse_s_warm_process": mat.get("reuse_s_warm_process")}
    return {
        "benchmark": "cache",
        "config": {"n": args.n, "batch_size": BATCH, "sample_shape": [SIZE, SIZE, 3], "min_seconds": args.min_seconds},
        "data": info,
        "machine": machine(),
        "samples_per_s": rate,
        "ratios": ratios,
        "materialization": summary,
        "targets": TARGETS,
        "rows": rows,
        "total_s": round(time.perf_counter() - t0, 1),
    }


# -- the docs' blocks (benchmarks/render_docs.py writes them between a page's render markers) --------------------------


def render(d: dict) -> str:
    r, ratio, tgt, m = d["rows"], d["ratios"], d["targets"], d["materialization"]
    inter = r["interleaved"]
    rows = [
        ["(b) `CacheLoader`, `auto` mode, uint8 out", fmt.rate(inter["cache"]["samples_per_s"]),
         fmt.rate(r["cache"]["samples_per_s"]), fmt.secs(r["cache"]["time_to_first_batch_s"])],
        ["(c) the same split in one array in RAM, same plan and gather", fmt.rate(inter["ram"]["samples_per_s"]),
         fmt.rate(r["ram"]["samples_per_s"]), fmt.secs(r["ram"]["time_to_first_batch_s"])],
        ["(a) torch DataLoader, 2 workers, PIL decode of the JPEGs", "-", fmt.rate(r["torch-jpeg"]["samples_per_s"]),
         fmt.secs(r["torch-jpeg"]["time_to_first_batch_s"])],
    ]
    reads = fmt.table(["loader", "samples/s, alternating epochs in one process", "samples/s, own process",
                   "first batch"], rows)
    ratios = fmt.table(["ratio", "value", "target"], [
        ["(b) / (c), alternating epochs", fmt.times(ratio["cache_vs_ram"]), fmt.times(tgt["cache_vs_ram"])],
        ["(b) / (a)", fmt.times(ratio["cache_vs_torch_jpeg"]), fmt.times(tgt["cache_vs_torch_jpeg"])],
    ])
    made = fmt.table(["materialization", "value"], [
        ["images/s", fmt.rate(m["materialize_images_per_s"])],
        ["peak RSS", fmt.mib(m["materialize_peak_rss_mb"])],
        ["reusing the existing cache, fresh process (imports included)", fmt.secs(m["reuse_s_fresh_process"])],
        ["reusing it again in the same process", fmt.secs(m["reuse_s_warm_process"])],
    ])
    return "\n\n".join([reads, ratios, made, fmt.source("cache")])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.row:
        emit(ROWS[args.row](Path(args.data), args.min_seconds))
        return 0
    write_result(args.out, run(args), ("samples_per_s", "ratios", "materialization"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
