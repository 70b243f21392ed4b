"""Data for benchmarks/loader.py: one synthetic image set, the dutycycle cache made from it, and the copies the
peers read (Parquet, WebDataset tar shards, and the raw arrays the MDS and LitData writers start from).

Every copy holds the same pre-transformed 64x64x3 uint8 samples as the cache, so rows that read a cache compare
readers, not transforms; the JPEG rows decode the original files.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

SIZE = 64
SEED = 0
SHARD_ROWS = 2048  # the materializer's default rows per shard
SCALE_SHARD_ROWS = 1000  # rows per shard of the scaled cache: 300k samples make 300 shards, past max_open_shards


def prepare(root: Path, n: int, direct: bool = False, samples: int = 0) -> dict[str, Any]:
    """Write the images, the dutycycle cache and its copies under ``root`` once (reused when the arguments match).

    The cache is made the way users make it (``ingest`` + ``materialize``) unless ``direct`` (``--quick``):
    then the engine's transform decodes every file and the engine's cache writer (``write_cache``) writes it, the
    same pixels in less time. With ``samples``, the cache every reading row uses is scaled up to that many samples
    (``scaled_cache``) in shards of ``SCALE_SHARD_ROWS``; the JPEG rows still decode the ``n`` files.
    """
    info_path = root / "data.json"
    if info_path.exists():
        info = json.loads(info_path.read_text())
        if info["n"] == n and info.get("direct") == direct and info.get("samples", 0) == samples:
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
        cache, writer = direct_cache(root / "cache-direct", list_files(root / "images")), "write_cache (direct)"
    if samples:
        cache = scaled_cache(cache, root / "cache-scaled", samples)
        writer += f", scaled to {samples} samples (scaled_cache)"
    t_cache = time.perf_counter() - t0
    write_parquet_copy(cache, root / "parquet")
    arrays = cache_arrays(cache)  # read once for both copies
    write_webdataset_copy(arrays, root / "wds")
    write_raw_arrays(arrays, root / "raw.npz")
    info = {
        "n": n,
        "samples": samples,
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
    from dutycycle.engine.cache.write import write_cache
    from dutycycle.engine.transform import TransformSpec, decode_and_transform

    spec = TransformSpec(size=SIZE)
    images_dir = cache.parent / "images"
    pixels = np.stack([decode_and_transform((images_dir / rel).read_bytes(), spec) for rel, _ in files])
    write_cache(str(cache), [rel for rel, _ in files], [lab for _, lab in files], ["train"] * len(files), pixels,
                classes=sorted({rel.split("/")[0] for rel, _ in files}), rows_per_shard=SHARD_ROWS,
                layout=spec.layout, spec=spec.to_dict(), source=str(images_dir), fingerprint=f"bench-{len(files)}-{SEED}")
    return str(cache)


def scaled_cache(source: str, out: Path, samples: int) -> str:
    """A cache of ``samples`` samples from the materialized one: copy k of sample i is its pixels with every byte
    XOR k (distinct content, the same statistics), id ``sha256(k:id)``, in shards of ``SCALE_SHARD_ROWS``, all ``train``
    (every peer reads every row). Real-sized: several GB, more shards than a reader keeps open (``max_open_shards``)."""
    import hashlib

    from dutycycle.engine.cache.reader import CacheReader
    from dutycycle.engine.cache.write import write_cache

    images, labels, ids = cache_arrays(source)
    reader = CacheReader(source)
    reps = -(-samples // len(images))
    pixels = np.empty((samples, *images.shape[1:]), np.uint8)
    new_ids, new_labels = [], np.empty(samples, np.int64)
    for k in range(reps):
        lo, hi = k * len(images), min(samples, (k + 1) * len(images))
        np.bitwise_xor(images[: hi - lo], np.uint8(k % 256), out=pixels[lo:hi])
        new_ids += [hashlib.sha256(f"{k}:{i}".encode()).hexdigest()[:32] for i in ids[: hi - lo]]
        new_labels[lo:hi] = labels[: hi - lo]
    write_cache(str(out), new_ids, new_labels, ["train"] * samples, pixels, classes=list(reader.manifest.classes),
                rows_per_shard=SCALE_SHARD_ROWS, layout=reader.manifest.layout, spec=reader.manifest.spec,
                source=source, fingerprint=f"bench-scaled-{samples}-{SEED}")
    return str(out)


def cache_arrays(cache: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The whole cache as (images uint8 [N, H, W, C], labels int64 [N], sample ids str [N]) in cache order."""
    from dutycycle.engine.cache.reader import CacheReader

    reader = CacheReader(cache)
    images = np.concatenate([np.asarray(reader.images(i)) for i in range(reader.num_shards)])
    labels = np.concatenate([reader.column(i, "label") for i in range(reader.num_shards)])
    ids = np.concatenate([reader.column(i, "sample_id") for i in range(reader.num_shards)]).astype(str)
    return images, labels.astype(np.int64), ids


def write_parquet_copy(cache: str, out: Path) -> None:
    """The same columns as the cache, one uncompressed Parquet file per shard (no decompression to pay)."""
    import pyarrow.parquet as pq
    from dutycycle.engine.cache.reader import CacheReader

    out.mkdir(parents=True, exist_ok=True)
    reader = CacheReader(cache)
    for i in range(reader.num_shards):
        pq.write_table(reader.shard(i), out / f"part-{i:05d}.parquet", compression="none", use_dictionary=False)


def write_webdataset_copy(arrays: tuple[np.ndarray, np.ndarray, np.ndarray], out: Path, shards: int = 8) -> None:
    """The cache's pixels (``cache_arrays``) as WebDataset tar shards: per sample raw uint8 bytes (``.u8``) and a
    class (``.cls``)."""
    import webdataset as wds

    out.mkdir(parents=True, exist_ok=True)
    images, labels, _ = arrays
    for s, idx in enumerate(np.array_split(np.arange(len(images)), shards)):
        with wds.TarWriter(str(out / f"shard-{s:05d}.tar"), encoder=False, mtime=0) as w:
            for i in idx:
                w.write({"__key__": f"{i:08d}", "u8": images[i].tobytes(), "cls": str(int(labels[i])).encode()})


def write_raw_arrays(arrays: tuple[np.ndarray, np.ndarray, np.ndarray], out: Path) -> None:
    """The samples (``cache_arrays``) as one .npz (no pickle) for the peers' writers (MDS, LitData), which run in
    their own venv."""
    images, labels, ids = arrays
    np.savez(out, images=images, labels=labels, ids=ids)
