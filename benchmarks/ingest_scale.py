"""Ingest at scale: the driver's memory per file while ingesting many tiny files, the listing streamed.

    python benchmarks/ingest_scale.py                # 1,000,000 files (the issue's target: < 0.2 KiB per file)
    python benchmarks/ingest_scale.py --quick        # 20,000 files, for the smoke test
    python -c "from benchmarks.ingest_scale import run; print(run(100_000))"   # what curate_scale.py calls

The files are tiny PNGs (4x4, 64 distinct contents, about 80 bytes each) in class folders of
``--per-folder`` files, as a labelled collection is laid out. Each row ingests in a fresh process with the
product's defaults (native runner, perceptual hash on, ``batch_files`` 10,000): imports, Daft's start-up and a
16-file warm-up ingest happen first, then the kernel's peak resident set is reset (``/proc/self/clear_refs``)
and the ingest runs. ``driver_growth_bytes`` is the peak during the ingest minus the resident set before it,
``bytes_per_file`` that over the files. The ingest rows then change one file in a hundred and measure a
re-ingest the same way (``reingest``: the diff against the committed rows, the probes, and the copy-on-write of
every data file that lost a row).

Rows:
- ``ingest``: ``n`` files;
- ``ingest_tenth``: ``n / 10`` files, the baseline: memory that does not grow with the files gives
  ``growth_ratio`` (ingest's growth over the tenth's) near 1, while per-file holding would give 10;
- ``listing_held``: the whole listing of the ``n`` files held as one Arrow table (``scan.list_source``), what a
  driver holding its listing needs at the least (main before the streamed listing held it as Python lists too,
  about 2.2 KiB per file); for scale.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as `python benchmarks/ingest_scale.py`: the siblings import as `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import default_out, emit, machine, main_for, run_row  # noqa: E402

TARGET_BYTES_PER_FILE = 0.2 * 1024  # the target at 1M files
TEMPLATES = 64  # distinct file contents (so the content ids and splits vary)
REINGEST_EVERY = 100  # the re-ingest changes one file in this many


def _blobs() -> list[bytes]:
    from PIL import Image

    blobs = []
    for k in range(TEMPLATES):
        buf = io.BytesIO()
        Image.new("RGB", (4, 4), (k * 4, 255 - k * 4, (k * 37) % 256)).save(buf, "PNG")
        blobs.append(buf.getvalue())
    return blobs


def make_files(root: str, n: int, per_folder: int = 1000) -> None:
    """``n`` tiny PNGs under ``root/c00000/...``, ``per_folder`` to a folder."""
    blobs = _blobs()
    for i in range(n):
        folder = os.path.join(root, f"c{i // per_folder:05d}")
        if i % per_folder == 0:
            os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{i:08d}.png"), "wb") as f:
            f.write(blobs[i % TEMPLATES])


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    """Reset the kernel's peak resident set of this process to its current one (Linux 4.0+)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def row(kind: str, src: str, work: str, n: int) -> dict:
    """One row, in this (fresh) process: see the module docstring."""
    from dutycycle.engine.table import scan
    from dutycycle.engine.table.catalog import ingest

    warm = os.path.join(work, f"warm-{kind}")
    make_files(warm, 16)
    ingest(warm, os.path.join(work, f"warm-{kind}-table"), progress_every=0)
    reset = _reset_peak()
    before = _status("VmHWM") if reset else _status("VmRSS")  # (the peak just reset: the level the ingest starts from)
    t0 = time.perf_counter()
    table = os.path.join(work, f"table-{kind}")
    if kind == "listing_held":
        held = scan.list_source(src)
        rows, extra = held.num_rows, {"arrow_bytes": held.nbytes}
    else:
        s = ingest(src, table, progress_every=0)
        rows, extra = s["rows"], {"errors": s["errors"]}
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    growth = max(0, peak - before)
    out = {"files": n, "rows": rows, "seconds": round(seconds, 2), "files_per_s": round(n / seconds, 1),
           "driver_rss_before_mib": round(before / 2**20, 1), "driver_peak_mib": round(peak / 2**20, 1),
           "driver_growth_bytes": growth, "bytes_per_file": round(growth / n, 1), "peak_reset": reset, **extra}
    if kind != "listing_held":  # then a re-ingest with 1% of the files changed: diff, probe, copy-on-write
        changed = _change_every(src, REINGEST_EVERY)
        _reset_peak()
        before = _status("VmHWM")
        t0 = time.perf_counter()
        s = ingest(src, table, progress_every=0)
        seconds = time.perf_counter() - t0
        growth = max(0, _status("VmHWM") - before)
        assert s["modified"] == changed, (s["modified"], changed)
        out["reingest"] = {"modified": s["modified"], "seconds": round(seconds, 2), "driver_growth_bytes": growth,
                           "bytes_per_file": round(growth / n, 1)}
    return out


def _change_every(root: str, every: int) -> int:
    """Rewrite every ``every``-th file (in name order) with other content; how many."""
    changed = 0
    for folder in sorted(os.listdir(root)):
        for name in sorted(os.listdir(os.path.join(root, folder))):
            i = int(name.split(".")[0])
            if i % every == 0:
                with open(os.path.join(root, folder, name), "wb") as f:
                    f.write(_blobs()[(i + 1) % TEMPLATES] + b"\0")  # other bytes, one longer: surely modified
                changed += 1
    return changed


def run(n: int, workdir: str | None = None, per_folder: int = 1000, timeout: float = 7200) -> dict:
    """Ingest ``n`` tiny files (and ``n / 10``, the baseline) in fresh processes; the result dict (see the
    module docstring). ``workdir``: where the files go (a temporary folder, removed after, by default)."""
    work = tempfile.mkdtemp(prefix="dc-bench-ingest-scale-", dir=workdir)
    try:
        tenth = max(1, n // 10)
        src, src_tenth = os.path.join(work, "src"), os.path.join(work, "src-tenth")
        t0 = time.perf_counter()
        make_files(src, n, per_folder)
        make_files(src_tenth, tenth, per_folder)
        made = time.perf_counter() - t0
        rows = {}
        for kind, where, count in (("ingest", src, n), ("ingest_tenth", src_tenth, tenth),
                                   ("listing_held", src, n)):
            got, wall = run_row([os.path.abspath(__file__), "--row", kind, "--src", where, "--work", work,
                                 "--n", str(count)], timeout)
            rows[kind] = {**got, "wall_s": wall}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    main_row, base = rows["ingest"], rows["ingest_tenth"]
    ok = "error" not in main_row and "error" not in base
    growth_ratio = round(main_row["driver_growth_bytes"] / max(1, base["driver_growth_bytes"]), 2) if ok else None
    return {
        "benchmark": "ingest_scale",
        "machine": machine(),
        "files": n,
        "per_folder": per_folder,
        "make_files_s": round(made, 1),
        "rows": rows,
        "bytes_per_file": main_row.get("bytes_per_file"),
        "target_bytes_per_file": TARGET_BYTES_PER_FILE,
        "meets_target": ok and main_row["bytes_per_file"] < TARGET_BYTES_PER_FILE,
        "growth_ratio_vs_tenth": growth_ratio,
        "note": "driver peak resident set during an ingest of n tiny files over the files, in a fresh process "
        "after warm-up; the same at n/10 as the baseline (a ratio near 1: memory does not grow with the files)",
    }


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="tiny files to ingest")
    parser.add_argument("--quick", action="store_true", help="20,000 files: the smoke test's size")
    parser.add_argument("--per-folder", type=int, default=1000, help="files per class folder")
    parser.add_argument("--workdir", default=None, help="where to write the files (default: the temp folder)")
    parser.add_argument("--out", default=default_out("ingest_scale"))
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)  # (a row's own process)
    parser.add_argument("--src", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.row:
        emit(row(args.row, args.src, args.work, args.n))
        return 0
    return main_for(lambda _argv: args, lambda a: run(20_000 if a.quick else a.n, a.workdir, a.per_folder), argv)


if __name__ == "__main__":
    sys.exit(main())
