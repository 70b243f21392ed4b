"""The loader benchmark runs end to end at a tiny size and reports every row; no timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "loader.py"
ROWS = {
    "dutycycle-auto", "dutycycle-thread", "dutycycle-memory", "dutycycle-ray", "dutycycle-s3-range",
    "dutycycle-s3-disk", "ram-bound", "interleaved", "torch-jpeg", "ray-parquet", "ray-images", "daft-parquet",
    "webdataset",
}  # mds and litdata run in a venv the benchmark makes (a 2-minute install): not in the test suite
RATIOS = {"vs_ram-bound", "vs_torch-jpeg", "vs_ray-images", "vs_ray-parquet", "vs_daft-parquet", "vs_webdataset"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_loader_benchmark_quick(tmp_path):
    pytest.importorskip("webdataset", reason="the `bench` extra is not installed")
    out = tmp_path / "loader.json"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "DAFT_ANALYTICS_ENABLED": "0"}
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--no-peers-venv", "--n", "300", "--min-seconds", "0",
         "--out", str(out), "--workdir", str(tmp_path / "data")],
        capture_output=True, text=True, env=env, timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == ROWS
    for name, r in rows.items():
        assert "error" not in r, f"{name}: {r['error']}"
        if name == "interleaved":
            assert all(v > 0 for v in r["samples_per_s"].values()) and r["ratio"] > 0
            continue
        assert r["samples_per_s"] > 0 and r["time_to_first_batch_s"] > 0 and r["peak_rss_mb"] > 0, (name, r)
        assert 0 < r["peak_private_mb"] <= r["peak_rss_mb"]
    assert rows["dutycycle-auto"]["execution"] == "auto: memory-mapped shards, caller thread"
    assert 0 < rows["dutycycle-s3-range"]["bytes_fetched"]
    ratios = {r["name"]: r for r in result["ratios"]}
    assert set(ratios) == RATIOS and all(r["value"] > 0 for r in ratios.values())
    # the README table comes from stdout
    assert "| dutycycle-thread |" in proc.stdout and "| webdataset |" in proc.stdout


def test_ingest_benchmark_quick(tmp_path):
    """benchmarks/ingest.py runs end to end at a tiny size and reports both rates and their ratio."""
    out = tmp_path / "ingest.json"
    proc = subprocess.run([sys.executable, str(BENCH.parent / "ingest.py"), "--n", "60", "--photos", "4",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    shapes = data["datasets"]["shapes_48_256px"]
    assert shapes["images"] == 60
    assert shapes["images_per_s"]["ingest_no_phash"] > 0 and shapes["images_per_s"]["pil_decode_1proc"] > 0
    assert shapes["ratios"]["ingest_no_phash_vs_pil_decode_1proc"] > 0
