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
    "dutycycle-auto", "dutycycle-thread", "dutycycle-memory", "dutycycle-ray", "ram-gather", "torch-jpeg",
    "ray-parquet", "ray-images", "daft-parquet", "webdataset",
}
RATIOS = {"vs_ram_gather", "vs_torch_jpeg", "vs_ray_parquet", "vs_ray_images", "vs_daft", "vs_webdataset"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_loader_benchmark_quick(tmp_path):
    pytest.importorskip("webdataset", reason="the `bench` extra is not installed")
    out = tmp_path / "loader.json"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "DAFT_ANALYTICS_ENABLED": "0"}
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--n", "300", "--min-seconds", "0", "--out", str(out),
         "--workdir", str(tmp_path / "data")],
        capture_output=True, text=True, env=env, timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == ROWS
    for name, r in rows.items():
        assert "error" not in r, f"{name}: {r['error']}"
        assert r["samples_per_s"] > 0 and r["time_to_first_batch_s"] > 0 and r["peak_rss_mb"] > 0, (name, r)
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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero_benchmark_quick(tmp_path):
    """benchmarks/zero.py runs its rows through torchrun at a tiny size; bytes are exact, so they are checked."""
    out = tmp_path / "zero.json"
    proc = subprocess.run([sys.executable, str(BENCH.parent / "zero.py"), "--quick", "--worlds", "2", "--rows",
                           "allreduce-manual", "stage0-ddp", "stage3", "--out", str(out)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert set(rows) == {"allreduce-manual", "stage0-ddp", "stage3"}
    for r in rows.values():
        assert r["samples_per_s"] > 0 and r["bytes_sent_per_step"], r
    # the baseline and DDP send the same all-reduce; stage 3 sends 1.5x (up to FSDP2's row padding)
    assert rows["allreduce-manual"]["bytes_sent_per_step"] == rows["stage0-ddp"]["bytes_sent_per_step"]
    assert 1.5 <= data["ratios"]["stage3_bytes_sent_vs_stage0_2ranks"] < 1.6
    assert 1.0 <= data["ratios"]["stage3_optimizer_bytes_vs_stage0_over_N_2ranks"] < 1.05
    assert "| 2 | stage3 |" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checkpoint_benchmark_quick(tmp_path):
    """benchmarks/checkpoint.py runs its rows through torchrun at a tiny size: synchronous and asynchronous saves
    are measured, and a job killed after its first commit comes back resumed. Timings are not asserted."""
    out = tmp_path / "checkpoint.json"
    proc = subprocess.run([sys.executable, str(BENCH.parent / "checkpoint.py"), "--quick", "--rows", "sync", "async",
                           "recovery", "--out", str(out)], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert set(rows) == {"sync", "async", "recovery"}
    for name in ("sync", "async"):
        r = rows[name]
        assert r["saves"] == 3 and r["stall_s_per_save"] > 0 and r["write_mb_per_s"] > 0 and r["bytes_per_save"] > 0
    assert data["ratios"]["async_stall_vs_sync"] > 0
    rec = rows["recovery"]
    assert rec["resumed_from_step"] >= 3 and rec["steps"] == 8 and rec["recovery_s"] > 0
    assert "| async |" in proc.stdout
