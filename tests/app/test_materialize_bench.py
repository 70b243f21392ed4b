"""benchmarks/materialize.py runs end to end at a tiny size and reports every row; no timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ..support import REPO

# left out of `./run.sh test` (CI): a benchmark's smoke run; `./run.sh test-all` runs it
pytestmark = pytest.mark.long

BENCH = REPO / "benchmarks" / "materialize.py"


@pytest.mark.slow
def test_materialize_benchmark_quick(tmp_path):
    out = tmp_path / "materialize.json"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "DAFT_ANALYTICS_ENABLED": "0"}
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--n", "40", "--repeat", "1", "--plan-rows", "3000", "--plan-rows-large", "6000", "--out", str(out),
         "--workdir", str(tmp_path / "data")],
        capture_output=True, text=True, env=env, timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert set(rows) == {"materialize", "serial", "pool", "plan_daft", "plan_lists", "plan_daft_large"}
    for name, r in rows.items():
        assert "error" not in r, f"{name}: {r['error']}"
        assert r["seconds"] > 0 and r["peak_rss_self_mb"] > 0, (name, r)
    assert rows["materialize"]["images"] == rows["serial"]["images"] == 40
    assert rows["plan_daft"]["fingerprint"] == rows["plan_lists"]["fingerprint"]  # the two plans agree
    assert rows["plan_daft"]["selected"] == rows["plan_lists"]["selected"] < 3000  # errors, duplicates left out
    assert result["ratios"]["materialize_vs_serial"] > 0
    assert rows["plan_daft_large"]["rows"] == 6000 and result["ratios"]["plan_rows_large_over_small"] == 2
