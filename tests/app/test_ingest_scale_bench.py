"""benchmarks/ingest_scale.py end to end at a tiny size (each row in a fresh process, as in the full run); no
memory figure is asserted, only that each is measured and consistent."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ..support import REPO

# left out of `./run.sh test` (CI): a benchmark's smoke run; `./run.sh test-all` runs it
pytestmark = pytest.mark.long


@pytest.mark.timeout(300)
def test_ingest_scale_rows_measure_the_driver_per_file(tmp_path):
    out = tmp_path / "ingest_scale.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ingest_scale.py"), "--n", "130",
                           "--per-folder", "50", "--workdir", str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    d = json.loads(out.read_text())
    rows = d["rows"]
    for kind, n in (("ingest", 130), ("ingest_tenth", 13), ("listing_held", 130)):
        got = rows[kind]
        assert "error" not in got and got["rows"] == n, (kind, got)
        assert got["bytes_per_file"] == round(got["driver_growth_bytes"] / n, 1) and got["files_per_s"] > 0
        assert got["driver_peak_mib"] > 0 and got["driver_rss_before_mib"] > 0 and got["peak_reset"]
    assert rows["ingest"]["errors"] == {}  # every tiny file is a readable image
    assert rows["ingest"]["reingest"]["modified"] == 2  # files 0 and 100 changed, each a modified row
    assert rows["listing_held"]["arrow_bytes"] > 130 * len(str(tmp_path))  # the URIs alone
    assert d["bytes_per_file"] == rows["ingest"]["bytes_per_file"] and d["growth_ratio_vs_tenth"] is not None
