"""benchmarks/curate_scale.py runs end to end at two tiny sizes: every size's dedupe + save row, the growth
against the smallest, the collect baseline and the recall row; no timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ..support import REPO

# left out of `./run.sh test` (CI): a benchmark's smoke run; `./run.sh test-all` runs it
pytestmark = pytest.mark.long

BENCH = REPO / "benchmarks" / "curate_scale.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_curate_scale_benchmark_quick(tmp_path):
    out = tmp_path / "curate_scale.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--skip", "ingest", "--out", str(out)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    d = json.loads(out.read_text())
    assert len(d["sizes"]) == 2 and set(d["growth"]) == {str(n) for n in d["sizes"]}
    for n in d["sizes"]:
        row, planted = d["rows"][str(n)], d["rows"][str(n)]["planted"]
        assert "error" not in row and row["rows"] == n and row["peak_rss_self_mb"] > 0
        # every exact copy goes; near copies go unless their source is unreadable (no hash to be near to)
        assert n - planted["exact_copies"] - planted["near_copies"] <= row["kept"] < n - planted["exact_copies"]
        assert row["resplit_sample_save"]["kept"] == round(n / 2)  # a stratified half: allocate rounds the total
    assert d["collect_baseline"]["rows"] == d["sizes"][-1]
    recall = d["near_recall"]["recall"]  # None only where this checkout has no near_recall
    assert recall is None or 0 < recall <= 1, d["near_recall"]
