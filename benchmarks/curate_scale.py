"""Curation at scale: exact + near dedupe and save of one generated metadata table at growing sizes, each size in a
fresh process, with the driver's peak memory and the wall time per size and how both grow.

    python benchmarks/curate_scale.py                      # 100k, 300k and 1M rows (the lead's run)
    python benchmarks/curate_scale.py --sizes 20000,100000  # while others share the machine
    python benchmarks/curate_scale.py --quick               # the smoke test: two tiny sizes

Every size is a prefix of the same generated table (row i is a pure function of the seed and i): 3% exact copies
(an earlier row's content id and hash), 3% near copies (an earlier row's perceptual hash with 1 to 3 bits flipped,
a new content id), 1% unreadable rows, ten labels, and otherwise uniform 64-bit hashes. A row process opens the
table, runs ``dedupe(exact=True, near=True, max_distance=4)`` and ``save``s the result as a new table, on Daft's
native runner unless ``--runner ray``; before that, on its own, ``resplit`` + ``sample(fraction=0.5)`` + ``save``
(the other curation steps that must not gather the table). On the native runner the driver runs every partition itself, so its peak
is the whole query's; on the Ray runner the workers' memory is reported apart.

Baselines in the same run: the smallest size (the time and memory ratios per row say how each grows; linear
growth keeps the time ratio near 1), and a row that reads the largest table into the driver with pyarrow, which
is what a save that collects its view pays before any dedupe work. The near-dedupe recall against exhaustive
comparison on a sample comes from the dedupe module's ``near_recall`` where it exists. ``EXTRA_SECTIONS`` is
the hook for sections measured by other benchmarks (the ingest of many tiny files: ``ingest_section``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as `python benchmarks/curate_scale.py`: the siblings import as `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import docs_format as fmt  # noqa: E402
from benchmarks._common import PeakRSS, default_out, emit, machine, run_row, write_result  # noqa: E402

SIZES = (100_000, 300_000, 1_000_000)
QUICK_SIZES = (1_000, 2_000)
MAX_DISTANCE = 4  # the dedupe default
DRIVER_TARGET_MIB = 2048  # the target: exact + near dedupe + save of 1M rows within 2 GiB of driver memory
EXACT_PER_MILLE, NEAR_PER_MILLE, ERROR_PER_MILLE = 30, 30, 10
LABELS = [f"class_{k}" for k in range(10)]
ROW_TIMEOUT_S = 3_600


# ------------------------------------------------------------------------------------------------ the table


def _mix(i, salt: int):
    """splitmix64 of ``i`` (a uint64 array) and ``salt``: the generator's randomness as a pure function of the
    row index, so every size is a prefix of the largest table."""
    import numpy as np

    with np.errstate(over="ignore"):
        z = i + np.uint64((0x9E3779B97F4A7C15 * (salt + 1)) % (1 << 64))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def generate(n: int, seed: int = 0):
    """The first ``n`` rows of the generated table (an Arrow table of the table schema) and what was planted."""
    import numpy as np
    import pyarrow as pa
    from dutycycle.engine.table import format as tf

    i = np.arange(n, dtype=np.uint64)
    s = seed * 1_000_003
    kind = _mix(i, s + 1) % np.uint64(1000)
    offset = np.uint64(1) + _mix(i, s + 2) % np.uint64(1000)
    has_src = i >= offset
    exact = has_src & (kind < EXACT_PER_MILLE)
    near = has_src & (kind >= EXACT_PER_MILLE) & (kind < EXACT_PER_MILLE + NEAR_PER_MILLE)
    src = np.where(has_src, i - np.minimum(offset, i), i).astype(np.int64)
    n_flips = np.uint64(1) + _mix(i, s + 20) % np.uint64(3)
    flips = np.zeros(n, dtype=np.uint64)
    for k in range(3):  # 1 to 3 bit flips: within the dedupe distance of the source
        bit = np.uint64(1) << (_mix(i, s + 10 + k) % np.uint64(64))
        flips ^= np.where(np.uint64(k) < n_flips, bit, np.uint64(0))
    flips = np.where(flips == 0, np.uint64(1), flips)  # two flips of one bit cancel: keep the copy near, not equal
    own_error = (_mix(i, s + 3) % np.uint64(1000)) < ERROR_PER_MILLE
    # a copy takes what its source has (which may itself be a copy): resolve the chains, earlier rows first
    ident = np.arange(n, dtype=np.int64)  # whose content id a row carries
    phash = _mix(i, s + 4)
    error = own_error.copy()
    for _ in range(64):
        new_ident = np.where(exact, ident[src], ident)
        new_hash = np.where(exact, phash[src], np.where(near, phash[src] ^ flips, _mix(i, s + 4)))
        new_error = np.where(exact, error[src], own_error)
        if (new_ident == ident).all() and (new_hash == phash).all() and (new_error == error).all():
            break
        ident, phash, error = new_ident, new_hash, new_error
    id_hi, id_lo = _mix(ident.astype(np.uint64), s + 5), _mix(ident.astype(np.uint64), s + 6)
    label = (_mix(i, s + 7) % np.uint64(len(LABELS))).astype(np.int64)
    side = (32 + _mix(i, s + 8) % np.uint64(993)).astype(np.int32)
    labels = np.asarray(LABELS, dtype=object)[label]
    cols = {
        "sample_id": pa.array([f"{a:016x}{b:016x}" for a, b in zip(id_hi.tolist(), id_lo.tolist(), strict=True)]),
        "uri": pa.array([f"/data/{lab}/img_{k:08d}.jpg" for k, lab in enumerate(labels.tolist())]),
        "size_bytes": pa.array((1000 + _mix(i, s + 9) % np.uint64(50_000)).astype(np.int64)),
        "modified": pa.array(["1700000000000000000"] * n),
        "format": pa.array(np.where(error, None, "JPEG").tolist(), pa.string()),
        "width": pa.array(side, mask=error),
        "height": pa.array(side, mask=error),
        "mode": pa.array(np.where(error, None, "RGB").tolist(), pa.string()),
        "channels": pa.array(np.full(n, 3, np.int32), mask=error),
        "orientation": pa.array(np.ones(n, np.int32), mask=error),
        "label": pa.array(labels.tolist(), pa.string()),
        "split": pa.array(np.asarray(["train", "val", "test"], dtype=object)[
            (_mix(i, s + 11) % np.uint64(3)).astype(np.int64)].tolist(), pa.string()),
        "phash": pa.array(phash.view(np.int64), mask=error),
        "error": pa.array(np.where(error, "corrupt: cut short", None).tolist(), pa.string()),
        "uri_bytes": pa.nulls(n, pa.binary()),  # every generated name is text
    }
    planted = {"rows": n, "exact_copies": int(exact.sum()), "near_copies": int(near.sum()),
               "unreadable": int(error.sum())}
    return pa.table(cols, schema=tf.SCHEMA), planted


def write_table(uri: str, n: int, seed: int) -> dict[str, int]:
    from dutycycle.engine.table.commit import write_version

    rows, planted = generate(n, seed)
    write_version(uri, rows, classes=LABELS, source="benchmarks/curate_scale.py", options={"seed": seed})
    return planted


# ---------------------------------------------------------------------------------------------- row processes


def _dedupe_and_save(table: str, dest: str, runner: str, max_distance: int, warm: bool = True) -> None:
    """One size: open, dedupe (exact and near), save; emits the figures. A tiny table goes through the same steps
    first (unless ``--quick``), so Daft's start-up (its first query, the UDF machinery) is not counted against the
    smallest size."""
    t0 = time.perf_counter()
    with PeakRSS() as peak:
        from dutycycle.engine.table import format as tf
        from dutycycle.engine.table.table import open_table

        if warm:
            folder = tempfile.mkdtemp(prefix="warm-", dir=os.path.dirname(dest))
            write_table(os.path.join(folder, "t"), 300, seed=1)
            open_table(os.path.join(folder, "t"), runner=runner).dedupe(max_distance=max_distance).save(
                os.path.join(folder, "s"))
            shutil.rmtree(folder)
        t0 = time.perf_counter()
        t = open_table(table, runner=runner)
        t_open = time.perf_counter()
        # the other curation steps at this size, on their own first: resplit, a stratified half, save
        with PeakRSS() as own:
            t1 = time.perf_counter()
            half = t.resplit("0.8,0.1,0.1", seed=0).sample(fraction=0.5, seed=0).save(dest + "-half")
            other = {"seconds": round(time.perf_counter() - t1, 3), "kept": half.manifest.num_rows}
        other["peak_rss_mb"] = own.result()["peak_rss_mb"]  # sampled: the process's peak during these steps
        shutil.rmtree(dest + "-half")
        t_start = time.perf_counter()
        view = t.dedupe(exact=True, near=True, max_distance=max_distance)  # plans (and may run a first query)
        t_dedupe = time.perf_counter()
        saved = view.save(dest)  # runs the exact dedupe and writes
        t_save = time.perf_counter()
    m = tf.read_manifest(dest)
    emit({
        "rows": t.manifest.num_rows,
        "kept": m.num_rows,
        "files_written": len(m.files),
        "seconds": {"open": round(t_open - t0, 3), "dedupe": round(t_dedupe - t_start, 3),
                    "save": round(t_save - t_dedupe, 3), "dedupe_and_save": round(t_save - t_start, 3)},
        "saved_version": saved.manifest.version,
        "resplit_sample_save": other,
        **peak.result(),
    })


def _collect(table: str) -> None:
    """The baseline: the whole table read into the driver as Arrow, as a save that collects its view would."""
    t0 = time.perf_counter()
    with PeakRSS() as peak:
        from dutycycle.engine.table.table import read_arrow

        rows = read_arrow(table)
    emit({"rows": rows.num_rows, "arrow_mb": round(rows.nbytes / 1024**2, 1),
          "seconds": round(time.perf_counter() - t0, 3), **peak.result()})


def _find_near_recall() -> Callable | None:
    """The dedupe module's ``near_recall(df, max_distance, sample=, seed=)``, wherever that slice put it."""
    import importlib

    for module in ("dutycycle.engine.table.dedupe", "dutycycle.engine.table.curate"):
        try:
            fn = getattr(importlib.import_module(module), "near_recall", None)
        except ImportError:
            continue
        if fn is not None:
            return fn
    return None


def _recall(table: str, runner: str, max_distance: int, sample: int, seed: int) -> None:
    from dutycycle.engine.table.table import open_table

    fn = _find_near_recall()
    if fn is None:
        emit({"recall": None, "note": "no near_recall function in this checkout"})
        return
    t0 = time.perf_counter()
    out = fn(open_table(table, runner=runner).df, max_distance, sample=sample, seed=seed)
    # {"recall", "pairs", "found", "sample", "by_distance", "search"}, or a bare share
    emit({**(out if isinstance(out, dict) else {"recall": out}), "seconds": round(time.perf_counter() - t0, 3)})


# --------------------------------------------------------------------------------------------- other sections


def ingest_section(args) -> dict[str, Any] | None:
    """Ingest of many tiny files, measured by ``benchmarks/ingest_scale.py``'s ``run(n)`` (its own rows and
    figures); None where that benchmark is not in this checkout."""
    try:
        from benchmarks import ingest_scale
    except ImportError:
        return None
    return ingest_scale.run(args.ingest_files)


# name -> function(args) -> a section of the result (None: left out); the lead's hook for more sections
EXTRA_SECTIONS: dict[str, Callable[[Any], dict[str, Any] | None]] = {"ingest": ingest_section}


# ---------------------------------------------------------------------------------------------------- the run


def _row(argv: list[str]) -> dict[str, Any]:
    result, wall = run_row([str(Path(__file__).resolve()), *argv], timeout=ROW_TIMEOUT_S)
    return {**result, "row_wall_s": wall}


def run(args) -> dict[str, Any]:
    sizes = sorted(args.sizes)
    work = tempfile.mkdtemp(prefix="dc-bench-curate-scale-", dir=args.work)
    rows: dict[str, Any] = {}
    try:
        planted = {}
        for n in sizes:
            planted[n] = write_table(os.path.join(work, f"t{n}"), n, args.seed)
        for n in sizes:
            row = _row(["--row", "dedupe-save", "--table", os.path.join(work, f"t{n}"), "--dest",
                        os.path.join(work, f"saved{n}"), "--runner", args.runner,
                        "--max-distance", str(args.max_distance), *(["--quick"] if args.quick else [])])
            rows[str(n)] = {**row, "planted": planted[n]}
            shutil.rmtree(os.path.join(work, f"saved{n}"), ignore_errors=True)
        largest = os.path.join(work, f"t{sizes[-1]}")
        baseline = _row(["--row", "collect", "--table", largest])
        recall = _row(["--row", "recall", "--table", largest, "--runner", args.runner, "--max-distance",
                       str(args.max_distance), "--recall-sample", str(args.recall_sample), "--seed", str(args.seed)])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result: dict[str, Any] = {
        "benchmark": "curate_scale",
        "machine": machine(),
        "runner": args.runner,
        "max_distance": args.max_distance,
        "sizes": sizes,
        "rows": rows,
        "growth": _growth(rows, sizes),
        "collect_baseline": baseline,
        "near_recall": recall,
        "driver_target_mib": DRIVER_TARGET_MIB,
        "note": "each size a prefix of one generated table, in a fresh process: exact + near dedupe "
        f"(max_distance {args.max_distance}) and save; driver = the row's own process",
    }
    for name, section in EXTRA_SECTIONS.items():
        if name not in args.skip:
            got = section(args)
            if got is not None:
                result[name] = got
    return result


def _growth(rows: dict[str, Any], sizes: list[int]) -> dict[str, Any]:
    """Per row, each size against the smallest: time and driver memory per row (1.0: linear growth)."""
    first = rows[str(sizes[0])]
    if "error" in first:
        return {}
    out = {}
    for n in sizes:
        r = rows[str(n)]
        if "error" in r:
            continue
        t = r["seconds"]["dedupe_and_save"] / n / (first["seconds"]["dedupe_and_save"] / sizes[0])
        other = r["resplit_sample_save"]["seconds"] / n / (first["resplit_sample_save"]["seconds"] / sizes[0])
        out[str(n)] = {
            "rows_vs_smallest": round(n / sizes[0], 2),
            "seconds_per_row_ratio": round(t, 2),
            "resplit_sample_save_seconds_per_row_ratio": round(other, 2),
            "driver_mb_ratio": round(r["peak_rss_self_mb"] / first["peak_rss_self_mb"], 2),
            # what each row past the smallest size added to the driver's peak: the slope to extrapolate with
            "driver_kib_per_added_row": round((r["peak_rss_self_mb"] - first["peak_rss_self_mb"]) * 1024
                                              / (n - sizes[0]), 3) if n > sizes[0] else None,
            "within_driver_target": r["peak_rss_self_mb"] <= DRIVER_TARGET_MIB,
        }
    return out


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=list(SIZES),
                   help="comma-separated row counts (each a prefix of the largest), e.g. 100000,300000,1000000")
    p.add_argument("--quick", action="store_true", help=f"the smoke test: sizes {QUICK_SIZES}, a small ingest")
    p.add_argument("--runner", default="native", choices=["native", "ray"], help="Daft's runner for the rows")
    p.add_argument("--max-distance", type=int, default=MAX_DISTANCE)
    p.add_argument("--recall-sample", type=int, default=2_000, help="rows near_recall compares exhaustively")
    p.add_argument("--ingest-files", type=int, default=1_000_000, help="tiny files for the ingest section")
    p.add_argument("--skip", action="append", default=[], help="leave out a section (e.g. ingest)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="folder for the generated tables (default: the temp folder)")
    p.add_argument("--out", default=default_out("curate_scale"))
    # a row process (internal)
    p.add_argument("--row", choices=["dedupe-save", "collect", "recall"], help=argparse.SUPPRESS)
    p.add_argument("--table", help=argparse.SUPPRESS)
    p.add_argument("--dest", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.recall_sample, args.ingest_files = list(QUICK_SIZES), 200, 2_000
    if len(args.sizes) < 1 or min(args.sizes) < 1:
        p.error(f"--sizes {args.sizes} must name at least one positive row count")
    return args


def main(argv: list[str] | None = None) -> int:
    import json

    args = parse_args(argv)
    if args.row == "dedupe-save":
        _dedupe_and_save(args.table, args.dest, args.runner, args.max_distance, warm=not args.quick)
    elif args.row == "collect":
        _collect(args.table)
    elif args.row == "recall":
        _recall(args.table, args.runner, args.max_distance, args.recall_sample, args.seed)
    else:
        result = run(args)
        write_result(args.out, result)
        print(json.dumps({k: result[k] for k in ("rows", "growth", "near_recall") if k in result}, indent=2))
    return 0


# -- the docs' block (benchmarks/render_docs.py writes it between a page's render markers) ----------------------------


def render(d: dict) -> str:
    headers = ["rows", "kept", "dedupe()", "save() (the query runs and writes)", "total", "time per row vs "
               f"{fmt.count(d['sizes'][0])}", "driver peak", "driver KiB per row added",
               "resplit + sample half + save", "its peak"]
    out = []
    for n in d["sizes"]:
        r, g = d["rows"][str(n)], d["growth"].get(str(n), {})
        if "error" in r:
            out.append([fmt.count(n), r["error"], "-", "-", "-", "-", "-", "-", "-", "-"])
            continue
        s = r["seconds"]
        added = g.get("driver_kib_per_added_row")
        out.append([fmt.count(n), fmt.count(r["kept"]), fmt.secs(s["dedupe"]), fmt.secs(s["save"]),
                    fmt.secs(s["dedupe_and_save"]), fmt.times(g.get("seconds_per_row_ratio")) if g else "-",
                    fmt.mib(r["peak_rss_self_mb"]), f"{added:.2f}" if added is not None else "-",
                    fmt.secs(r["resplit_sample_save"]["seconds"]), fmt.mib(r["resplit_sample_save"]["peak_rss_mb"])])
    base = d["collect_baseline"]
    rec = d["near_recall"]
    recall = rec.get("recall")
    lines = [f"Runner: {d['runner']}, max_distance {d['max_distance']}. {fmt.sentence(d['note'])}"]
    if "error" not in base:
        lines.append(f"Baseline: reading the {fmt.count(base['rows'])}-row table into the driver with pyarrow (what a "
                     f"save that collects its view pays first) peaks at {fmt.mib(base['peak_rss_self_mb'])}.")
    if recall is not None:
        found = f" ({fmt.count(rec['found'])} of {fmt.count(rec['pairs'])} pairs within the distance, " \
            f"{fmt.count(rec['sample'])} hashes compared with every other)" if "pairs" in rec else ""
        lines.append(f"Near-dedupe recall against exhaustive comparison on the largest table: {recall:.3f}{found}.")
    else:
        lines.append("Near-dedupe recall: not measured in this run.")
    ing = d.get("ingest")
    if ing and "error" not in ing["rows"]["ingest"]:
        r, tenth = ing["rows"]["ingest"], ing["rows"]["ingest_tenth"]
        lines.append(f"Ingest of {fmt.count(ing['files'])} tiny files (`benchmarks/ingest_scale.py`, the listing "
                     f"streamed): the driver grew by {fmt.mib(r['driver_growth_bytes'] / 2**20)}, "
                     f"{r['bytes_per_file']:.1f} bytes per file against a target of {ing['target_bytes_per_file']:.1f} "
                     f"({fmt.count(tenth['files'])} files: {fmt.mib(tenth['driver_growth_bytes'] / 2**20)}, so "
                     f"{ing['growth_ratio_vs_tenth']:.2f}x for ten times the files), at "
                     f"{fmt.count(round(r['files_per_s']))} files/s; re-ingesting with "
                     f"{fmt.count(r['reingest']['modified'])} files changed grew it by "
                     f"{fmt.mib(r['reingest']['driver_growth_bytes'] / 2**20)}.")
    return "\n\n".join([fmt.table(headers, out), fmt.para(" ".join(lines)), fmt.source("curate_scale")])


if __name__ == "__main__":
    sys.exit(main())
