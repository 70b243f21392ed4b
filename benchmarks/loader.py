"""Loader benchmark: dutycycle's cache loader against an in-RAM upper bound and the loaders people use today.

One run, one synthetic dataset (``dutycycle.engine.synth``), batch 256, 64x64x3 uint8 samples. The rows that
read pre-transformed samples read a real-sized cache (``--samples``, default 300,000: about 3.7 GB in 300 shards
of 1,000, more than a reader keeps open, so shards churn; ``loader_data.scaled_cache``) and its copies; the JPEG
rows decode the ``--n`` files they were made from (timed over a few batches: decoding, not the data's size, sets
their rate). Every row
delivers the same thing, a dict with a uint8 ``image`` tensor [B, 3, 64, 64], ``label`` and ``sample_id``,
and runs in its own process so its peak memory is its own. Rows (code in ``loader_rows.py`` and, for the two
peers that need their own virtual environment, ``loader_peers.py``):

1. ``dutycycle-auto``: ``CacheLoader`` in ``mode="auto"`` (the default mode), the figure the ratios use: the shards
   memory-mapped and read in place (nothing copied into the process; the page cache is shared by every process on
   a node). Every dutycycle row hands out uint8 (``normalize=False``, no crop or flip; ``loader_rows.PLAIN``), as
   the peers do, so it is not the default ``AugmentConfig`` (which normalizes to float32, and then ``auto`` adds a
   prefetch thread).
   ``auto-cold`` is the same with the cache dropped from the page cache before every epoch (read from disk);
   ``thread`` (the same with a prefetch thread), ``memory`` (opt-in: the split copied into RAM) and ``ray``
   (Ray read tasks) are reported alongside, and ``s3-range`` / ``s3-disk`` read the same cache from a local
   S3-compatible server (moto) by range or through node-local copies: their time to first batch is from a
   cold node (nothing downloaded yet).
2. ``ram-bound``: the split in one array in RAM, the loader's own plan and its own gather (``source._RowSpan``)
   into a fresh array per batch: the loader without the files, its upper bound (the product beating it by more
   than noise would mean the bound is wrong). ``interleaved`` runs ``dutycycle-auto`` and
   ``ram-bound`` in one process, alternating epochs, so both see the same load; the ratio comes from it.
3. Peers that decode JPEGs: ``torch-jpeg`` (torch DataLoader, 2 workers, PIL) and ``ray-images`` (Ray Data
   ``read_images`` + ``map_batches``).
4. Peers that read the same pre-transformed samples: ``ray-parquet`` (Ray Data over a Parquet copy),
   ``daft-parquet`` (Daft ``to_arrow_iter``, batches cut to 256 and the Ray row's zero-copy Arrow collate), ``webdataset`` (tar shards, 2 workers), ``mds`` (MosaicML
   Streaming, 2 workers) and ``litdata`` (LitData, 2 workers), the last two in their own venv.

Targets, same run: ``dutycycle-auto`` >= 0.8x ``ram-bound``, >= 2x each peer of group 4, >= 10x each of group 3.
Throughput is measured after a warm-up batch, over whole epochs until ``--min-seconds`` have passed; time to
first batch runs from constructing the loader (a Ray row starts its local Ray, 2 CPUs, before that). Peak memory
per row: resident (``peak_rss_mb``, which counts memory-mapped cache pages in every process that maps them)
and private (``peak_private_mb``, without mapped files and shared memory).

    python benchmarks/loader.py                 # full run, about 25 minutes on 2 cores (data made once per --workdir)
    python benchmarks/loader.py --quick --no-peers-venv --out /tmp/loader.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as `python benchmarks/loader.py`: the siblings import as `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import docs_format as fmt  # noqa: E402
from benchmarks._common import (  # noqa: E402
    PeakRSS,
    default_out,
    emit,
    local_ray,
    machine,
    markdown_table,
    run_row,
    write_result,
)

PRIMARY = "dutycycle-auto"
HERE = Path(__file__).resolve().parent
RAY_ROWS = {"dutycycle-ray", "ray-parquet", "ray-images"}  # rows that start a local Ray
VENV_ROWS = {"mds", "litdata"}  # rows run by loader_peers.py in the peers' venv

# name -> (group, description)
ROWS: dict[str, tuple[str, str]] = {
    "dutycycle-auto": ("1", "dutycycle CacheLoader, auto mode, uint8 out (normalize=False, like the peers): "
                            "memory-mapped shards read in place"),
    "dutycycle-auto-cold": ("1", "dutycycle CacheLoader, auto mode, the cache dropped from the page cache before "
                                 "every epoch: read from disk"),
    "dutycycle-thread": ("1", "dutycycle CacheLoader, thread mode: mapped shards, prefetch thread"),
    "dutycycle-memory": ("1", "dutycycle CacheLoader, opt-in memory mode: the split copied into RAM"),
    "dutycycle-ray": ("1", "dutycycle CacheLoader, ray mode: Ray read tasks"),
    "dutycycle-s3-range": ("1", "dutycycle CacheLoader, s3:// cache on moto, ranged reads"),
    "dutycycle-s3-disk": ("1", "dutycycle CacheLoader, s3:// cache on moto, node-local copies"),
    "ram-bound": ("2", "split in RAM as one array, the loader's own plan and gather (upper bound)"),
    "interleaved": ("2", "dutycycle-auto and ram-bound alternating epochs in one process"),
    "torch-jpeg": ("3", "torch DataLoader, 2 workers, PIL decode + resize of files"),
    "ray-images": ("3", "Ray Data read_images + map_batches resize"),
    "ray-parquet": ("4", "Ray Data read_parquet (cache as Parquet) + iter_torch_batches"),
    "daft-parquet": ("4", "Daft read_parquet + to_arrow_iter over the cache as Parquet, the Ray Data row's collate"),
    "webdataset": ("4", "WebDataset tar shards of pre-transformed samples, 2 workers"),
    "mds": ("4", "MosaicML Streaming (MDS) of pre-transformed samples, 2 workers (own venv)"),
    "litdata": ("4", "LitData StreamingDataLoader of pre-transformed samples, 2 workers (own venv)"),
}
TARGETS = {"2": 0.8, "3": 10.0, "4": 2.0}  # PRIMARY's samples/s over a row of this group must reach the target


# ------------------------------------------------------------------------------------------ rows


def process_groups(names: list[str], quick: bool) -> list[list[str]]:
    """Which rows share a process: each its own for real figures; in --quick, one for the Ray rows, one per
    venv row and one for the rest (start-up dominates a tiny run). Daft goes last in its process: its threads
    must not exist when the torch and WebDataset rows fork their workers."""
    if not quick:
        return [[n] for n in names]
    local = sorted((n for n in names if n not in RAY_ROWS | VENV_ROWS), key=lambda n: n == "daft-parquet")
    groups = [local, [n for n in names if n in RAY_ROWS], *[[n] for n in names if n in VENV_ROWS]]
    return [g for g in groups if g]


def run_group(names: list[str], data: Path, min_seconds: float) -> dict[str, Any]:
    if sum(n in RAY_ROWS for n in names) > 1:
        with local_ray():
            return {n: run_one(n, data, min_seconds) for n in names}
    return {n: run_one(n, data, min_seconds) for n in names}


def run_one(name: str, data: Path, min_seconds: float) -> dict[str, Any]:
    import torch  # noqa: F401  (every row feeds torch; its import time is no loader's first-batch time)

    from benchmarks import loader_rows as rows

    if name.startswith("dutycycle-s3-"):
        # the S3 server and the upload of the cache to it are the set-up, not the row: the upload runs in a
        # child process before measuring starts, and the server (a child process) is measured apart
        with rows.s3_cache(data) as uri, PeakRSS(exclude=rows.S3_SERVER) as rss:
            result = rows.row_dutycycle_s3(uri, name.rsplit("-", 1)[1], min_seconds)
        out = {**result, **rss.result()}
        out["server_peak_private_mb"] = out.pop("excluded_peak_private_mb")
        return out
    if name.startswith("dutycycle-"):
        fn = lambda: rows.row_dutycycle(data, name.split("-", 1)[1], min_seconds)  # noqa: E731
    else:
        row_fn = getattr(rows, "row_" + name.replace("-", "_"))
        fn = lambda: row_fn(data, min_seconds)  # noqa: E731
    with PeakRSS() as rss:
        result = fn()
    return {**result, **rss.result()}


def peers_python(venv: Path) -> str:
    from benchmarks.loader_peers import ensure_venv

    t0 = time.perf_counter()
    python = ensure_venv(venv)
    print(f"peers' venv ready at {venv} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return str(python)


# ------------------------------------------------------------------------------------------ driver


def rate(rows: dict[str, dict[str, Any]], name: str) -> float | None:
    r = rows.get(name, {}).get("samples_per_s")
    return r.get(name) if isinstance(r, dict) else r  # the interleaved row reports both of its rates


def summarize(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    primary = rate(rows, PRIMARY)
    out = []
    if "interleaved" in rows and "ratio" in rows["interleaved"]:
        value = rows["interleaved"]["ratio"]
        out.append({"name": "vs_ram-bound", "against": "ram-bound (interleaved, one process)", "value": value,
                    "target": TARGETS["2"], "met": value >= TARGETS["2"]})
    for name, (group, _) in ROWS.items():
        if group not in ("3", "4") or name not in rows:
            continue
        base = rate(rows, name)
        value = round(primary / base, 2) if primary and base else None
        out.append({"name": f"vs_{name}", "against": name, "value": value, "target": TARGETS[group],
                    "met": None if value is None else value >= TARGETS[group]})
    return out


def render_markdown(rows: dict[str, dict[str, Any]], ratios: list[dict[str, Any]]) -> str:
    table = []
    for name, r in rows.items():
        group, desc = ROWS[name]
        if name == "interleaved":
            shown = r.get("samples_per_s") or {}
            notes = r.get("error") or ", ".join(f"{k} {v:,.0f}/s" for k, v in shown.items())
            table.append([group, name, None, None, None, None, None, notes])
            continue
        table.append([group, name, r.get("samples_per_s"), r.get("samples_per_cpu_s"), r.get("time_to_first_batch_s"),
                      r.get("peak_rss_mb"), r.get("peak_private_mb"), r.get("error", desc)])
    headers = ["#", "loader", "samples/s", "samples/CPU-s", "first batch (s)", "peak RSS (MiB)", "peak private (MiB)",
               "notes"]
    text = markdown_table(headers, table)
    ratio_rows = [[f"{PRIMARY} / {r['against']}", r["value"], f">= {r['target']:g}",
                   {True: "yes", False: "NO", None: "-"}[r["met"]]] for r in ratios]
    return text + "\n\n" + markdown_table(["ratio", "value", "target", "met"], ratio_rows)


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=default_out("loader"))
    p.add_argument("--n", type=int, default=None, help="number of synthetic images (default 6000, 600 with --quick)")
    p.add_argument("--samples", type=int, default=None,
                   help="samples in the cache the reading rows use (default 300,000: about 3.7 GB in 300 shards; "
                        "0 with --quick: the n materialized images)")
    p.add_argument("--quick", action="store_true", help="a tiny run for the smoke test (n=600, short timing)")
    p.add_argument("--min-seconds", type=float, default=None, help="steady-state seconds per row")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of: " + ", ".join(ROWS))
    p.add_argument("--workdir", default=None, help="keep generated data here (reused when --n matches)")
    p.add_argument("--peers-venv", default=str(HERE / ".peers-venv"),
                   help="virtual environment for the MDS and LitData rows (made on first use)")
    p.add_argument("--no-peers-venv", action="store_true", help="leave out the rows that need the peers' venv")
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)  # internal: measure rows in this process
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.n = args.n or (600 if args.quick else 6000)
    args.samples = args.samples if args.samples is not None else (0 if args.quick else 300_000)
    args.min_seconds = args.min_seconds if args.min_seconds is not None else (0.2 if args.quick else 4.0)
    args.names = [r for r in args.rows.split(",") if r and not (args.no_peers_venv and r in VENV_ROWS)]
    unknown = [r for r in args.names if r not in ROWS]
    if unknown and not args.row:
        p.error(f"unknown row {unknown[0]!r}; choose from {', '.join(ROWS)}")
    return args


def run(args) -> dict:
    n, samples, min_seconds, names = args.n, args.samples, args.min_seconds, args.names
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="dc-bench-loader-")
    root = Path(args.workdir or tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        from benchmarks.loader_data import prepare

        info = prepare(root, n, direct=args.quick, samples=samples)
        print(f"data ready in {root} ({n} images): {info}", file=sys.stderr)
        python = peers_python(Path(args.peers_venv)) if any(r in VENV_ROWS for r in names) else None
        groups = process_groups(names, args.quick)
        jobs = []
        for g in groups:
            if g[0] in VENV_ROWS:
                jobs.append(([str(HERE / "loader_peers.py"), "--row", g[0]], python))
            else:
                jobs.append(([__file__, "--row", ",".join(g)], None))
        jobs = [(a + ["--data", str(root), "--min-seconds", str(min_seconds)], py) for a, py in jobs]
        # Real figures: one row at a time. --quick: two processes side by side (only that they run matters).
        with ThreadPoolExecutor(max_workers=2 if args.quick else 1) as pool:
            results = list(pool.map(lambda j: run_row(j[0], timeout=240 if args.quick else 600, python=j[1]), jobs))
        rows: dict[str, dict[str, Any]] = {}
        for group, (got, wall) in zip(groups, results, strict=True):
            for name in group:
                r = got.get(name) or {"error": got.get("error", "no result")}
                r["process_wall_s"] = wall
                rows[name] = r
                shown = r.get("error") or f"{r['samples_per_s']} samples/s, first batch {r.get('time_to_first_batch_s')} s"
                print(f"{name}: {shown}", file=sys.stderr)
        rows = {n: rows[n] for n in names}
        local = rows.get(PRIMARY, {}).get("peak_private_mb")
        for name, r in rows.items():  # the remote rows' memory against the local read's, measured in this run
            if name.startswith("dutycycle-s3-") and local is not None:
                r["local_peak_private_mb"] = local
    finally:
        if tmp is not None:
            tmp.cleanup()
    return {
        "benchmark": "loader",
        "config": {"n": n, "samples": samples, "batch_size": 256, "sample_shape": [3, 64, 64], "min_seconds": min_seconds,
                   "quick": args.quick, "primary": PRIMARY, "targets_by_group": TARGETS,
                   "one_process_per_row": not args.quick},
        "data": info,
        "machine": machine(),
        "rows": [{"name": k, "group": ROWS[k][0], "description": ROWS[k][1], **v} for k, v in rows.items()],
        "ratios": summarize(rows),
        "total_s": round(time.perf_counter() - t0, 1),
    }


# -- the docs' blocks (benchmarks/render_docs.py writes them between a page's render markers) --------------------------


def _loader_rows(d: dict) -> list[dict]:
    return [r for r in d["rows"] if isinstance(r.get("samples_per_s"), (int, float))]


def render(d: dict) -> str:
    data = d["data"]
    shape = "x".join(str(s) for s in d["config"]["sample_shape"])
    formats = ", ".join(f"{fmt.count(n)} {k.upper()}" for k, n in data["formats"].items())
    caption = (f"{fmt.count(data['n'])} synthetic images ({formats}, {fmt.nbytes(data['image_bytes'])}) made into a cache of "
               f"{shape} uint8 samples by {data['cache_writer']}; batch {d['config']['batch_size']}; "
               f"each row in its own process on a {d['machine']['cpus']}-core machine.")
    rows = [[r["group"], r["description"], fmt.rate(r["samples_per_s"]), fmt.secs(r["time_to_first_batch_s"]),
             fmt.mib(r["peak_rss_mb"]), fmt.mib(r["peak_private_mb"])] for r in _loader_rows(d)]
    headers = ["group", "loader", "samples/s", "first batch", "peak RSS", "peak private"]
    return "\n\n".join([fmt.para(caption), fmt.table(headers, rows), fmt.source("loader")])


def render_ratios(d: dict) -> str:
    by_name = {r["name"]: r for r in d["rows"]}
    rows = [[f"`{d['config']['primary']}` vs {r['against']}", fmt.times(r["value"]), fmt.times(r["target"]),
             "yes" if r["met"] else "no"] for r in d["ratios"]]
    inter = by_name["interleaved"]
    rates = ", ".join(f"`{k}` {fmt.rate(v)} samples/s" for k, v in inter["samples_per_s"].items())
    auto, thread = by_name["dutycycle-auto"], by_name["dutycycle-thread"]
    batch = d["config"]["batch_size"]
    handoff = batch / thread["samples_per_s"] - batch / auto["samples_per_s"]
    lines = (f"Alternating epochs in one process ({fmt.count(inter['epochs_each'])} epochs each): {rates}. "
             f"The prefetch thread's hand-off, when the consumer does no work: {fmt.secs(handoff)} per batch "
             f"(`dutycycle-thread` against `dutycycle-auto`, batch {batch}).")
    return "\n\n".join([fmt.table(["ratio", "value", "target", "met"], rows), fmt.para(lines), fmt.source("loader")])


def render_remote(d: dict) -> str:
    rows = [[r["description"], fmt.secs(r["time_to_first_batch_s"]), fmt.nbytes(r["bytes_fetched"]),
             fmt.count(r["requests"]), fmt.nbytes(r["cache_bytes"]), fmt.times(r["bytes_fetched"] / r["cache_bytes"]),
             fmt.mib(r["peak_private_mb"]), fmt.mib(r["local_peak_private_mb"]), fmt.mib(r["server_peak_private_mb"])]
            for r in _loader_rows(d) if "requests" in r]
    headers = ["remote cache", "first batch (cold node)", "fetched", "requests", "cache size", "fetched / cache",
               "peak private", "local read's, same run", "S3 server's (apart)"]
    return "\n\n".join([fmt.table(headers, rows), fmt.source("loader")])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.row:
        emit(run_group(args.row.split(","), Path(args.data), args.min_seconds))
        return 0
    result = run(args)
    write_result(args.out, result)
    print(render_markdown({r["name"]: r for r in result["rows"]}, result["ratios"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
