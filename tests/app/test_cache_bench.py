"""benchmarks/cache.py and benchmarks/cache_formats.py run end to end at a tiny size; no timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ..support import REPO

# left out of `./run.sh test` (CI): a benchmark's smoke run; `./run.sh test-all` runs it
pytestmark = pytest.mark.long

BENCH = REPO / "benchmarks"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cache_benchmark_quick(tmp_path):
    out = tmp_path / "cache.json"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "DAFT_ANALYTICS_ENABLED": "0"}
    proc = subprocess.run(
        [sys.executable, str(BENCH / "cache.py"), "--n", "300", "--min-seconds", "0.2", "--out", str(out),
         "--workdir", str(tmp_path / "data")],
        capture_output=True, text=True, env=env, timeout=380,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for name, row in result["rows"].items():
        assert "error" not in row, f"{name}: {row['error']}"
    assert set(result["samples_per_s"]) == {"torch-jpeg", "cache", "ram"}
    assert all(v > 0 for v in result["samples_per_s"].values())
    assert set(result["ratios"]) == {"cache_vs_ram", "cache_vs_torch_jpeg", "met"}
    assert result["rows"]["materialize"]["images"] == 300 and result["rows"]["reuse"]["reused"]
    formats = {r["format"] for r in result["rows"]["formats"]["rows"]}
    assert formats == {"arrow", "arrow-lz4", "parquet", "parquet-zstd"}
