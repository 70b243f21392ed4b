"""benchmarks/ingest_scale.py's rows run at a tiny size in this process (the full run starts a fresh process per
row: the lead's curation scale benchmark calls ``run(n)``); no memory figure is asserted, only that it is
measured and consistent."""

from __future__ import annotations

import os

from benchmarks.ingest_scale import make_files, row


def test_ingest_scale_rows_measure_the_driver_per_file(tmp_path):
    src = tmp_path / "src"
    make_files(str(src), 130, per_folder=50)
    assert sorted(os.listdir(src)) == ["c00000", "c00001", "c00002"]
    got = row("ingest", str(src), str(tmp_path), 130)
    assert got["rows"] == 130 and got["errors"] == {}  # every tiny file is a readable image
    assert got["bytes_per_file"] == round(got["driver_growth_bytes"] / 130, 1) and got["files_per_s"] > 0
    assert got["driver_peak_mib"] > 0 and got["driver_rss_before_mib"] > 0 and got["peak_reset"]
    assert got["reingest"]["modified"] == 2  # files 0 and 100 changed, each a modified row
    held = row("listing_held", str(src), str(tmp_path), 130)
    assert held["rows"] == 130 and held["arrow_bytes"] > 130 * len(str(src))  # the URIs alone
