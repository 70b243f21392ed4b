"""Materialize benchmark: how fast does ``materialize`` turn a table of JPEGs into a cache, and with how much memory?

One run, the synthetic JPEGs of ``benchmarks/cache.py`` (128-256 px) -> 64x64x3 uint8 samples. Rows, each in its
own process (imports included in ``process_wall_s``, a fresh cache root each time), repeated ``--repeat`` times;
the reported figure is the median:

- ``materialize``: ``dutycycle.engine.materialize`` on Daft's native runner (the default), the product path.
- ``serial``: the hand-written single-process baseline: read each file, ``decode_and_transform``, write the same
  shards with ``engine.cache.format.write_shard`` in a plain loop (one core).
- ``pool``: the same loop over a process pool with one worker per CPU (what a careful single-node script does),
  each worker writing whole shards.
- ``ray`` (``--ray``): ``materialize`` on the Ray runner with a local 2-CPU cluster (its start-up reported apart).

Reported per row: seconds inside the call, images/s, CPU seconds of the process tree during the call (steadier than
wall time on a shared machine), process wall time, the driver's peak resident memory
(``peak_rss_self_mb``, the kernel's high-water mark of the calling process) and that of its whole process tree.
Ratios: materialize over serial and over pool (target: at least 0.8 of the pool, same run).

Planning at scale, on a metadata-only table of ``--plan-rows`` rows (default 1,000,000; no images):

- ``plan_daft``: what materialize runs before decoding (``engine.cache.selection``: one streaming Daft query
  into buckets by sample-id prefix, then counts, one row per sample id numbered in order, per-block and per-shard
  digests, bucket by bucket; the fingerprint).
- ``plan_daft_large``: the same on a table of ``--plan-rows-large`` rows (default 10,000,000): time should grow
  about linearly (``plan_seconds_large_over_small`` against ``plan_rows_large_over_small``) and the driver's
  peak stay within 1 GB (target ``plan_large_peak_mb``).
- ``plan_lists``: ``plan_rows``, the same selection and fingerprint as Python lists per row (what the raw
  loader needs, and how materialize planned before it moved to Daft).
- ``plan_daft_ray`` (``--ray``): ``plan_daft`` on the Ray runner: the workers write the buckets (Parquet, staged
  in a shared folder) and the driver numbers them one bucket at a time.

    python benchmarks/materialize.py --n 3000          # writes benchmarks/results/materialize.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

if __name__ == "__main__":  # run as `python benchmarks/materialize.py`: the siblings import as `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import docs_format as fmt  # noqa: E402
from benchmarks._common import (  # noqa: E402
    PeakRSS,
    default_out,
    emit,
    local_ray,
    machine,
    run_row,
    tree_cpu_seconds,
    write_result,
)
from benchmarks.cache import prepare  # noqa: E402

SIZE = 64
ROWS_PER_SHARD = 2048
TARGETS = {"materialize_vs_pool": 0.8}


def _spec():
    from dutycycle.engine.transform import TransformSpec

    return TransformSpec(size=SIZE)


def row_materialize(root: Path, out: Path, runner: str) -> dict[str, Any]:
    from dutycycle.engine.cache.materialize import materialize

    if runner == "ray":  # a local cluster of this row's own (start-up excluded), never one found on the machine
        with local_ray() as startup_s:
            return {**row_materialize(root, out, "ray-started"), "ray_startup_s": round(startup_s, 2)}
    runner = "ray" if runner == "ray-started" else runner
    with PeakRSS() as mem:
        t0, cpu0 = time.perf_counter(), tree_cpu_seconds()
        res = materialize(str(root / "table"), str(out), _spec(), runner=runner, rows_per_shard=ROWS_PER_SHARD)
        seconds, cpu = time.perf_counter() - t0, tree_cpu_seconds() - cpu0
    assert not res.reused, "the benchmark needs a fresh cache root"
    return {"images": res.manifest.num_samples, "seconds": seconds, "cpu_s": cpu, "shards": len(res.manifest.shards),
            "sha256": [s.sha256 for s in res.manifest.shards], **mem.result()}


def _rows(root: Path) -> list[dict[str, Any]]:
    from dutycycle.engine.table import format as tf
    from dutycycle.engine.table.table import read_arrow

    table = str(root / "table")
    t = read_arrow(table, columns=["sample_id", "uri", "label", "split"])
    classes = tf.read_manifest(table).classes
    rows = sorted(t.to_pylist(), key=lambda r: r["sample_id"])
    for r in rows:
        r["label"] = classes.index(r["label"])
    return rows


def _write(args) -> dict[str, Any]:
    """Baseline worker: one whole shard, read + decode + transform + write, in a plain loop."""
    out, index, rows = args
    from dutycycle.engine.cache import format as cf
    from dutycycle.engine.transform import decode_and_transform

    spec = _spec()
    images = np.empty((len(rows), *spec.shape), np.uint8)
    for k, r in enumerate(rows):
        with open(r["uri"], "rb") as f:
            images[k] = decode_and_transform(f.read(), spec)
    info = cf.write_shard(out, index, [r["sample_id"] for r in rows], [r["label"] for r in rows],
                          [r["split"] for r in rows], images)
    return {"rows": info.rows, "sha256": info.sha256}


def row_baseline(root: Path, out: Path, workers: int) -> dict[str, Any]:
    with PeakRSS() as mem:
        t0, cpu0 = time.perf_counter(), tree_cpu_seconds()
        rows = _rows(root)
        jobs = [(str(out), i, rows[s : s + ROWS_PER_SHARD]) for i, s in enumerate(range(0, len(rows), ROWS_PER_SHARD))]
        if workers == 1:
            infos = [_write(j) for j in jobs]
        else:
            from concurrent.futures import ProcessPoolExecutor

            # Small work units keep every worker busy to the end: each shard is cut into pieces here, so the
            # pool is not limited to one worker per shard. Pieces are written as shards of their own (the
            # baseline's bytes differ from the cache's; its speed is what counts).
            piece = max(1, min(ROWS_PER_SHARD, len(rows) // (4 * workers) or 1))
            jobs = [(str(out), i, rows[s : s + piece]) for i, s in enumerate(range(0, len(rows), piece))]
            with ProcessPoolExecutor(workers) as ex:
                infos = list(ex.map(_write, jobs))
                cpu_workers = tree_cpu_seconds() - cpu0  # the pool's processes count only while they live
        seconds = time.perf_counter() - t0
        cpu = cpu_workers if workers > 1 else tree_cpu_seconds() - cpu0
    return {"images": sum(i["rows"] for i in infos), "seconds": seconds, "cpu_s": cpu, "shards": len(infos),
            **mem.result()}


def prepare_plan_table(root: Path, n: int) -> str:
    """A committed metadata table of ``n`` rows (1% error rows, 0.5% duplicate content), no image files."""
    import hashlib

    import pyarrow as pa
    from dutycycle.engine.table import format as tf
    from dutycycle.engine.table.commit import write_version

    table = root / f"plan-table-{n}"
    if (table / tf.MANIFEST).exists():
        return str(table)
    ids = [hashlib.sha256(str(i % (n - n // 200)).encode()).hexdigest()[:32] for i in range(n)]
    labels = [("circle", "square", "star", "triangle")[i % 4] for i in range(n)]
    cols = {
        "sample_id": ids,
        "uri": [f"/data/{lab}/{i:09d}.jpg" for i, lab in enumerate(labels)],
        "label": labels,
        "split": [("train", "train", "train", "val", "test")[int(s[:2], 16) % 5] for s in ids],
        "error": [("corrupt: x" if i % 100 == 7 else None) for i in range(n)],
    }
    t = pa.table({f: pa.array(cols.get(f, [None] * n), tf.SCHEMA.field(f).type) for f in tf.SCHEMA.names}, tf.SCHEMA)
    write_version(str(table), t, classes=["circle", "square", "star", "triangle"], source="benchmark",
                  options={"roots": ["/data"]})  # where its rows point (readers refuse rows outside)
    return str(table)


def row_plan(table: str, how: str) -> dict[str, Any]:
    if how == "daft-ray":  # a local cluster of this row's own (start-up excluded)
        with local_ray() as startup_s:
            return {**_plan(table, "daft", "ray"), "ray_startup_s": round(startup_s, 2)}
    return _plan(table, how, "native")


def _plan(table: str, how: str, runner: str) -> dict[str, Any]:
    from dutycycle.engine.cache import plan as mp
    from dutycycle.engine.cache import selection
    from dutycycle.engine.cache.materialize import plan_rows
    from dutycycle.engine.roots import table_roots
    from dutycycle.engine.runner import configure
    from dutycycle.engine.table import format as tf

    configure(runner)
    spec = _spec()
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        if how == "lists":
            p = plan_rows(table, spec)
            fp, selected = p.fingerprint, len(p.sample_ids)
        else:
            tm = tf.read_manifest(table)
            df = mp.table_frame(table, tm, None)
            with tempfile.TemporaryDirectory(prefix="plan-staging-") as staging, \
                    selection.selected(df, roots=table_roots(tm), classes=list(tm.classes), rows_per_shard=ROWS_PER_SHARD, runner=runner,
                                       staging=staging, table_uri=table, where=None,
                                       rows=tm.num_rows) as sel:
                fp = mp.fingerprint([b[2] for b in sel.blocks], list(tm.classes), spec, mp.decode_settings())
                selected = sel.selected
        seconds = time.perf_counter() - t0
    return {"rows": tf.read_manifest(table).num_rows, "selected": selected, "fingerprint": fp, "seconds": seconds,
            **mem.result()}


ROWS = {
    "materialize": lambda root, out: row_materialize(root, out, "native"),
    "serial": lambda root, out: row_baseline(root, out, 1),
    "pool": lambda root, out: row_baseline(root, out, os.cpu_count() or 1),
    "ray": lambda root, out: row_materialize(root, out, "ray"),
    "plan_daft": lambda root, out: row_plan(str(out), "daft"),
    "plan_lists": lambda root, out: row_plan(str(out), "lists"),
    "plan_daft_ray": lambda root, out: row_plan(str(out), "daft-ray"),
    "plan_daft_large": lambda root, out: row_plan(str(out), "daft"),
}
PLAN_ROWS = ("plan_daft", "plan_lists", "plan_daft_ray", "plan_daft_large")
PLAN_LARGE_PEAK_MB = 1024  # target: planning the large table (10M rows) within 1 GB of driver memory


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=3000, help="number of synthetic JPEGs (default 3000)")
    p.add_argument("--repeat", type=int, default=3, help="processes per row; the median is reported")
    p.add_argument("--ray", action="store_true", help="add the Ray-runner row (starts a local Ray cluster)")
    p.add_argument("--plan-rows", type=int, default=1_000_000, help="rows of the planning table (0: skip)")
    p.add_argument("--plan-rows-large", type=int, default=10_000_000,
                   help="rows of the large planning table, for linearity and the 1 GB target (0: skip)")
    p.add_argument("--out", default=default_out("materialize"))
    p.add_argument("--workdir", default=None, help="keep the images and table here")
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dest", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run(args) -> dict:
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="dc-bench-materialize-")
    root = Path(args.workdir or tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    names = [n for n in ROWS if (args.ray or n not in ("ray", "plan_daft_ray")) and (n not in PLAN_ROWS or args.plan_rows)
             and (n != "plan_daft_large" or args.plan_rows_large)]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    try:
        info = prepare(root, args.n)
        plan_table = prepare_plan_table(root, args.plan_rows) if args.plan_rows else ""
        large_table = prepare_plan_table(root, args.plan_rows_large) if args.plan_rows_large else ""
        for k in range(args.repeat):
            for name in names:  # interleaved, so a neighbour's burst on this shared machine hits every row alike
                with tempfile.TemporaryDirectory(prefix=f"out-{name}-", dir=root) as dest:
                    where = large_table if name == "plan_daft_large" else plan_table if name in PLAN_ROWS else dest
                    got, wall = run_row([__file__, "--row", name, "--data", str(root), "--dest", where], timeout=1800)
                runs[name].append({**got, "process_wall_s": wall})
                print(f"{name} #{k}: {json.dumps(got)[:200]}", file=sys.stderr)
    finally:
        if tmp is not None:
            tmp.cleanup()
    rows: dict[str, Any] = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            rows[name] = {"error": rs[0].get("error")}
            continue
        sec = statistics.median(r["seconds"] for r in ok)
        rows[name] = {
            **({"rows": ok[0]["rows"], "selected": ok[0]["selected"], "fingerprint": ok[0]["fingerprint"]}
               if name in PLAN_ROWS else
               {"images": ok[0]["images"], "shards": ok[0]["shards"], "images_per_s": round(ok[0]["images"] / sec, 1)}),
            "seconds": round(sec, 2),
            "process_wall_s": statistics.median(r["process_wall_s"] for r in ok),
            **({"cpu_s": round(statistics.median(r["cpu_s"] for r in ok), 2)} if "cpu_s" in ok[0] else {}),
            "peak_rss_self_mb": statistics.median(r["peak_rss_self_mb"] for r in ok),
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in ok),
            "runs_seconds": [round(r["seconds"], 2) for r in ok],
        }
    if "ray" in rows and "sha256" in runs["ray"][0] and "sha256" in runs["materialize"][0]:
        rows["ray"]["same_shards_as_native"] = runs["ray"][0]["sha256"] == runs["materialize"][0]["sha256"]
    ratios: dict[str, Any] = {}
    if all("seconds" in rows[n] for n in ("materialize", "serial", "pool")):
        ratios = {
            "materialize_vs_serial": round(rows["serial"]["seconds"] / rows["materialize"]["seconds"], 2),
            "materialize_vs_pool": round(rows["pool"]["seconds"] / rows["materialize"]["seconds"], 2),
        }
        ratios["met"] = {k: ratios[k] >= v for k, v in TARGETS.items()}
    for name in ("plan_daft", "plan_daft_ray"):  # driver memory of the Python-list plan over the Daft plan's
        if "seconds" in rows.get(name, {}) and "seconds" in rows.get("plan_lists", {}):
            assert rows[name]["fingerprint"] == rows["plan_lists"]["fingerprint"], "the plans must agree"
            ratios[f"driver_memory_plan_lists_over_{name}"] = round(
                rows["plan_lists"]["peak_rss_self_mb"] / rows[name]["peak_rss_self_mb"], 2)
    if "seconds" in rows.get("plan_daft_large", {}) and "seconds" in rows.get("plan_daft", {}):
        small, large = rows["plan_daft"], rows["plan_daft_large"]
        ratios["plan_seconds_large_over_small"] = round(large["seconds"] / small["seconds"], 2)
        ratios["plan_rows_large_over_small"] = round(large["rows"] / small["rows"], 2)
        ratios["plan_large_peak_mb"] = large["peak_rss_self_mb"]
        ratios.setdefault("met", {})["plan_large_peak_mb"] = large["peak_rss_self_mb"] <= PLAN_LARGE_PEAK_MB
    return {
        "benchmark": "materialize",
        "config": {"n": args.n, "size": SIZE, "rows_per_shard": ROWS_PER_SHARD, "repeat": args.repeat,
                   "plan_rows": args.plan_rows, "plan_rows_large": args.plan_rows_large},
        "data": info,
        "machine": machine(),
        "rows": rows,
        "ratios": ratios,
        "targets": {**TARGETS, "plan_large_peak_mb_at_most": PLAN_LARGE_PEAK_MB},
        "total_s": round(time.perf_counter() - t0, 1),
    }


# -- the docs' blocks (benchmarks/render_docs.py writes them between a page's render markers) --------------------------


MATERIALIZE_ROWS = {
    "materialize": "`materialize`, native runner (the default)",
    "serial": "hand-written loop, one process",
    "pool": "hand-written loop, process pool",
    "ray": "`materialize`, Ray runner",
}


PLAN_ROWS = {
    "plan_daft": "one bucketing query, then bucket by bucket, native runner (what `materialize` runs)",
    "plan_lists": "Python lists per row",
    "plan_daft_ray": "the same, Ray runner",
    "plan_daft_large": "what `materialize` runs, native runner, the large table",
}


def render(d: dict) -> str:
    r = d["rows"]
    build = fmt.table(
        ["row", "median", "runs (min-max)", "images/s", "CPU seconds", "shards", "driver peak RSS"],
        [[label, fmt.secs(r[k]["seconds"]), f"{min(r[k]['runs_seconds']):.1f}-{max(r[k]['runs_seconds']):.1f} s",
          fmt.rate(r[k]["images_per_s"]), f"{r[k]['cpu_s']:.1f}", str(r[k]["shards"]), fmt.mib(r[k]["peak_rss_self_mb"])]
         for k, label in MATERIALIZE_ROWS.items() if k in r],
    )
    ratios = d["ratios"]
    line = (f"`materialize` against the loop: {fmt.times(ratios['materialize_vs_serial'])}; against the pool: "
            f"{fmt.times(ratios['materialize_vs_pool'])} (target {fmt.times(d['targets']['materialize_vs_pool'])}). "
            + (f"Ray's shards byte-identical to the native runner's: "
               f"{'yes' if r['ray']['same_shards_as_native'] else 'no'}." if "ray" in r else
               "The Ray row was not run (`--ray`); tests/engine/test_cache_ray.py checks its shards byte for byte."))
    plan = fmt.table(
        ["planning", "table rows", "median", "runs (min-max)", "driver peak RSS"],
        [[label, fmt.count(r[k]["rows"]), fmt.secs(r[k]["seconds"]),
          f"{min(r[k]['runs_seconds']):.1f}-{max(r[k]['runs_seconds']):.1f} s", fmt.mib(r[k]["peak_rss_self_mb"])]
         for k, label in PLAN_ROWS.items() if k in r],
    )
    return "\n\n".join([build, fmt.para(line), plan, fmt.source("materialize")])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.row:
        t0 = time.perf_counter()
        r = ROWS[args.row](Path(args.data), Path(args.dest))
        emit({**r, "seconds_in_process": time.perf_counter() - t0})
        return 0
    write_result(args.out, run(args), ("rows", "ratios"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
