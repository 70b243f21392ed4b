"""Which on-disk format should the sample cache use? Read throughput into contiguous arrays, and size on disk.

The same samples (uint8 [N, 64, 64, 3] + int64 labels + string ids) are written as

- ``parquet``: Parquet, uncompressed, ``image`` as fixed_size_binary
- ``parquet-zstd``: Parquet, zstd
- ``arrow``: Arrow IPC file, uncompressed, memory-mapped (the cache's format)
- ``arrow-lz4``: Arrow IPC file, lz4-compressed buffers (cannot be used zero-copy: read decompresses)

and each is read the way a training epoch uses it: open the file, then random batches of 256 gathered into one
contiguous array (the file is opened again every epoch, as a loader over a dataset larger than RAM must).
``samples_per_s`` counts the open/decompress cost of every epoch; ``open_s`` is that cost alone. Run directly
for a table over synthetic photo-like samples, or import ``compare`` (benchmarks/cache.py does, on the real
materialized cache).

    python benchmarks/cache_formats.py --n 3000 --out /tmp/formats.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

if __name__ == "__main__":  # run as `python benchmarks/cache_formats.py`: the siblings import as `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import docs_format  # noqa: E402
from benchmarks._common import default_out, main_for  # noqa: E402

BATCH = 256
FORMATS = ("arrow", "arrow-lz4", "parquet", "parquet-zstd")


def _table(ids: list[str], labels: np.ndarray, images: np.ndarray) -> pa.Table:
    n, per = images.shape[0], int(np.prod(images.shape[1:]))
    col = pa.FixedSizeBinaryArray.from_buffers(pa.binary(per), n, [None, pa.py_buffer(np.ascontiguousarray(images))])
    return pa.table({"sample_id": pa.array(ids), "label": pa.array(labels, pa.int64()), "image": col})


def write(fmt: str, path: Path, table: pa.Table) -> None:
    if fmt == "arrow":
        with pa.ipc.new_file(str(path), table.schema) as w:
            w.write_table(table)
    elif fmt == "arrow-lz4":
        opts = pa.ipc.IpcWriteOptions(compression="lz4")
        with pa.ipc.new_file(str(path), table.schema, options=opts) as w:
            w.write_table(table)
    elif fmt == "parquet":
        pq.write_table(table, str(path), compression="none")
    elif fmt == "parquet-zstd":
        pq.write_table(table, str(path), compression="zstd")
    else:
        raise ValueError(fmt)


def open_arrays(fmt: str, path: Path, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Open one file as (images [N, *shape] uint8, labels int64), zero-copy where the format allows."""
    if fmt.startswith("arrow"):
        source = pa.memory_map(str(path), "r") if fmt == "arrow" else pa.OSFile(str(path), "rb")
        table = pa.ipc.open_file(source).read_all()
    else:
        table = pq.read_table(str(path), memory_map=True)
    col = table.column("image").combine_chunks()
    per = int(np.prod(shape))
    images = np.frombuffer(col.buffers()[1], np.uint8)[col.offset * per : (col.offset + len(col)) * per]
    labels = table.column("label").to_numpy()
    return images.reshape(len(col), *shape), labels


def read_throughput(fmt: str, path: Path, shape: tuple[int, ...], min_seconds: float, seed: int = 0) -> dict:
    samples, epochs, open_s, t0 = 0, 0, 0.0, time.perf_counter()
    while epochs < 2 or time.perf_counter() - t0 < min_seconds:
        t_open = time.perf_counter()
        images, labels = open_arrays(fmt, path, shape)
        open_s += time.perf_counter() - t_open
        order = np.random.default_rng([seed, epochs]).permutation(len(images))
        for b in range(len(order) // BATCH):
            idx = order[b * BATCH : (b + 1) * BATCH]
            _ = images[idx]  # fancy indexing: one copy into a fresh contiguous array
            _ = labels[idx]
            samples += BATCH
        epochs += 1
    elapsed = time.perf_counter() - t0
    return {"samples_per_s": round(samples / elapsed, 1), "open_s": round(open_s / epochs, 4), "epochs": epochs}


def compare(ids: list[str], labels: np.ndarray, images: np.ndarray, workdir: Path, min_seconds: float = 2.0) -> dict:
    """Write the samples in every format under ``workdir``; return rows + the in-RAM gather baseline."""
    table = _table(ids, labels, images)
    shape = tuple(images.shape[1:])
    raw = images.nbytes
    rows = []
    for fmt in FORMATS:
        path = workdir / f"samples.{fmt}"
        t = time.perf_counter()
        write(fmt, path, table)
        write_s = time.perf_counter() - t
        r = read_throughput(fmt, path, shape, min_seconds)
        rows.append({"format": fmt, "bytes": path.stat().st_size, "size_vs_raw_pixels": round(path.stat().st_size / raw, 3),
                     "write_s": round(write_s, 3), **r})
    # Upper bound: the arrays already in RAM, same gather.
    ram = np.ascontiguousarray(images)
    samples, epochs, t0 = 0, 0, time.perf_counter()
    while epochs < 2 or time.perf_counter() - t0 < min_seconds:
        order = np.random.default_rng([0, epochs]).permutation(len(ram))
        for b in range(len(order) // BATCH):
            _ = ram[order[b * BATCH : (b + 1) * BATCH]]
            _ = labels[order[b * BATCH : (b + 1) * BATCH]]
            samples += BATCH
        epochs += 1
    ram_rate = samples / (time.perf_counter() - t0)
    for r in rows:
        r["vs_ram"] = round(r["samples_per_s"] / ram_rate, 3)
    return {"rows": rows, "ram_samples_per_s": round(ram_rate, 1), "n": len(ids), "sample_shape": list(shape)}


def synthetic(n: int, seed: int = 0) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Photo-like 64x64 samples (smooth fields + noise) so compression sees realistic entropy."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:64, 0:64].astype(np.float32)
    images = np.empty((n, 64, 64, 3), np.uint8)
    for i in range(n):
        f = rng.uniform(0.02, 0.2, 3)
        base = 128 + 100 * np.sin(x[..., None] * f + y[..., None] * f[::-1] + rng.uniform(0, 6, 3))
        images[i] = np.clip(base + rng.normal(0, 8, base.shape), 0, 255)
    return [f"{i:032x}" for i in range(n)], rng.integers(0, 4, n), images


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=3000)
    p.add_argument("--min-seconds", type=float, default=2.0)
    p.add_argument("--out", default=default_out("cache_formats"))
    return p.parse_args(argv)


def run(args) -> dict:
    ids, labels, images = synthetic(args.n)
    with tempfile.TemporaryDirectory(prefix="dc-formats-") as d:
        return {"benchmark": "cache_formats", "data": "synthetic photo-like",
                **compare(ids, labels, images, Path(d), args.min_seconds)}


# -- the docs' blocks (benchmarks/render_docs.py writes them between a page's render markers) --------------------------


FORMAT_LABELS = {"arrow": "Arrow IPC, memory-mapped", "arrow-lz4": "Arrow IPC, lz4",
                 "parquet": "Parquet, uncompressed", "parquet-zstd": "Parquet, zstd"}


def render(d: dict) -> str:
    rows = [[FORMAT_LABELS.get(r["format"], r["format"]), f"{r['size_vs_raw_pixels']:.3f}", docs_format.rate(r["samples_per_s"]),
             f"{r['vs_ram']:.2f}"] for r in d["rows"]]
    rows.append(["the same samples in one array in RAM", "-", docs_format.rate(d["ram_samples_per_s"]), "1"])
    return "\n\n".join([docs_format.table(["format", "size vs raw pixels", "samples/s", "vs in-RAM gather"], rows),
                        docs_format.source("cache_formats")])


def main(argv: list[str] | None = None) -> int:
    return main_for(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
