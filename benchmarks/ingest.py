"""Ingest throughput against fully decoding the same files with PIL, measured side by side in one run.

    python benchmarks/ingest.py --n 5000 --out benchmarks/results/ingest.json

Ingest reads headers (and, with the perceptual hash on, a reduced decode); the baseline opens every file and
decodes all its pixels to RGB, in one process and in a pool of one process per CPU. Ratios above 1 mean
ingest gets through the folder faster than decoding it would.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as `python benchmarks/ingest.py`: the siblings import as `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import docs_format as fmt  # noqa: E402
from benchmarks._common import default_out, main_for  # noqa: E402


def _decode(path: str) -> int:
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.convert("RGB").size[0]
    except Exception:
        return 0


def _files(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def _photos(root: str, n: int, seed: int) -> None:
    """Camera-sized JPEGs (2048x1536): where reading headers instead of pixels matters most."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(root, "photo"), exist_ok=True)
    for i in range(n):
        small = Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8))
        big = small.resize((2048, 1536), Image.Resampling.BICUBIC)
        big.save(os.path.join(root, "photo", f"img_{i:05d}.jpg"), "JPEG", quality=90)


def _measure(ingest, src: str, work: str, name: str, runner: str | None) -> dict:
    files = _files(src)
    timings = {}
    for key, kwargs in (("ingest_no_phash", {"phash": False}), ("ingest_phash", {"phash": True})):
        t0 = time.perf_counter()
        s = ingest(src, os.path.join(work, f"{name}-{key}"), progress_every=0, runner=runner, **kwargs)
        timings[key] = time.perf_counter() - t0
        assert s["rows"] == len(files)
    t0 = time.perf_counter()
    for f in files:
        _decode(f)
    timings["pil_decode_1proc"] = time.perf_counter() - t0
    workers = os.cpu_count() or 1
    with mp.get_context("spawn").Pool(workers) as pool:
        pool.map(_decode, files[:workers])  # start-up and imports happen before the clock starts
        t0 = time.perf_counter()
        list(pool.imap(_decode, files, chunksize=8))
        timings["pil_decode_pool"] = time.perf_counter() - t0
    rate = {k: round(len(files) / v, 1) for k, v in timings.items()}
    ratios = {
        f"{a}_vs_{b}": round(rate[a] / rate[b], 2)
        for a in ("ingest_no_phash", "ingest_phash")
        for b in ("pil_decode_1proc", "pil_decode_pool")
    }
    return {
        "images": len(files),
        "seconds": {k: round(v, 3) for k, v in timings.items()},
        "images_per_s": rate,
        "ratios": ratios,
    }


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000, help="shape images to synthesize and ingest")
    parser.add_argument("--photos", type=int, default=200, help="camera-sized JPEGs (2048x1536) to ingest")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runner", default=None, help="native (default) or ray")
    parser.add_argument("--out", default=default_out("ingest"))
    return parser.parse_args(argv)


def run(args) -> dict:
    os.environ.setdefault("DAFT_ANALYTICS_ENABLED", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from dutycycle.engine.synth import synthesize
    from dutycycle.engine.table.catalog import ingest

    work = tempfile.mkdtemp(prefix="dc-bench-ingest-")
    try:
        # warm-up: imports, Daft start-up and UDF workers, so the timings compare steady work
        synthesize(os.path.join(work, "warm"), 64, seed=1)
        ingest(
            os.path.join(work, "warm"), os.path.join(work, "warm-table"), progress_every=0, runner=args.runner
        )
        datasets = {}
        shapes = os.path.join(work, "shapes")
        synthesize(shapes, args.n, seed=args.seed, broken_fraction=0.01)
        datasets["shapes_48_256px"] = _measure(ingest, shapes, work, "shapes", args.runner)
        if args.photos:
            photos = os.path.join(work, "photos")
            _photos(photos, args.photos, args.seed)
            datasets["photos_2048x1536"] = _measure(ingest, photos, work, "photos", args.runner)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    return {
        "benchmark": "ingest",
        "cpus": os.cpu_count(),
        "runner": args.runner or os.environ.get("DAFT_RUNNER", "native"),
        "datasets": datasets,
        "note": "end-to-end ingest (scan, read, hash, header parse, write Parquet, commit) vs decoding every "
        "file to RGB with PIL; ratio > 1: ingest is faster",
    }


# -- the docs' blocks (benchmarks/render_docs.py writes them between a page's render markers) --------------------------


def render(d: dict) -> str:
    cols = ["ingest_no_phash", "ingest_phash", "pil_decode_1proc", "pil_decode_pool"]
    headers = ["data", "images", "ingest, no perceptual hash", "ingest (default: with hash)",
               "PIL full decode, 1 process", f"PIL full decode, {d['cpus']} processes",
               "ingest vs the decode pool"]
    rows = []
    for name, ds in d["datasets"].items():
        ips = ds["images_per_s"]
        rows.append([f"`{name}`", fmt.count(ds["images"])] + [f"{fmt.rate(ips[c])}/s" for c in cols]
                    + [fmt.times(ds["ratios"]["ingest_phash_vs_pil_decode_pool"])])
    note = fmt.para(f"Runner: {d['runner']}. {fmt.sentence(d['note'])}")
    return "\n\n".join([fmt.table(headers, rows), note, fmt.source("ingest")])


def main(argv: list[str] | None = None) -> int:
    return main_for(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
