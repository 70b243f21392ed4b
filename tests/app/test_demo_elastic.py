"""`dutycycle demo --small --elastic` as a user runs it: a local Ray cluster of three 1-CPU nodes (and a 0-CPU head),
an elastic run at [2, 3] workers that loses a node mid-run, continues on 2, gets the node back and grows to 3; the
pages show the sizes over time. A subprocess: the demo starts its own multi-node cluster, and the session's Ray
belongs to this process. Exactness across the resizes is the launch tests' (float64, per-step losses); this test
proves the demo does what it says and shows it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from dutycycle.trainer.step import sizes as S
from dutycycle.trainer.step.metrics import read_metrics

from ..support.pages import raw_values, unresolved

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.long]


def test_demo_elastic_loses_a_node_trains_on_fewer_workers_and_grows_back(tmp_path):
    out = tmp_path / "demo"
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", DAFT_ANALYTICS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)  # the demo's own cluster, joined by its address
    proc = subprocess.run([sys.executable, "-m", "dutycycle.trainer", "demo", "--small", "--elastic", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    text = proc.stdout
    for said in ("cluster: a local Ray cluster of 3 nodes", "train: elastic, 2 to 3 workers", "removed (its raylet",
                 "training at 2 workers from step", "a node added back at step", "training at 3 workers again",
                 "workers: 3 \u2192 2 \u2192 3", "everything together:"):
        assert said in text, f"{said!r} missing from the demo output:\n{text}"
    demo = json.loads((out / "demo.json").read_text())
    el = demo["elastic"]
    assert el["error"] is None, el
    assert el["sizes"] == [3, 2, 3] and (el["shrunk_to"], el["grown_to"]) == (2, 3)
    # in order: the node lost after a commit and the step it waited for, the node back after the smaller group
    # trained, the larger group after that. (The step the smaller group continued from may be past the newest
    # step logged when the node was lost: rank 0 writes its step rows every run.log_every steps, so the run can
    # be a few steps and a commit ahead of its rows.)
    assert el["removed_at_step"] >= 20 and el["shrunk_at_step"] >= 4
    run = out / "run"
    rows = read_metrics(str(run))
    # the smaller group restored the newest whole state: a commit (checkpoint.every = 4) or the survivors' peer
    # memory (checkpoint.memory_every = 5 by default in an elastic run), whichever was newer
    restored = [r for r in rows if r.get("event") == "resume" and r["step"] == el["shrunk_at_step"]]
    assert restored and restored[0]["source"] in ("storage", "memory"), restored
    assert el["shrunk_at_step"] % (4 if restored[0]["source"] == "storage" else 5) == 0, restored
    assert el["added_at_step"] >= el["shrunk_at_step"] + 10 and el["grown_at_step"] >= el["shrunk_at_step"]
    assert 0 < el["removed_at_s"] < el["first_step_smaller_s"] < el["added_at_s"] < el["first_step_larger_s"]
    assert el["loss_to_step_s"] > 0 and el["add_to_step_s"] > 0

    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 160 and summary["world_size"] == 3
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == list(range(1, 161))  # the lost node's steps trained again, none twice, none skipped
    assert [a["world_size"] for a in S.attempts(rows)][-1] == 3 and S.path(rows) == [3, 2, 3]
    changes = S.changes(rows)
    assert [(c["from"], c["to"], c["kind"]) for c in changes] == [(3, 2, "shrink"), (2, 3, "grow")]
    assert [c["step"] for c in changes] == [el["shrunk_at_step"], el["grown_at_step"]]
    assert changes == el["resizes"]

    from PIL import Image

    with Image.open(run / "report.png") as png:
        assert "workers 3 \u2192 2 \u2192 3: shrink at step" in png.text["Title"]
    page = (run / "report.html").read_text()
    assert "<h3>Workers over time: 3 \u2192 2 \u2192 3</h3>" in page and "(elastic, 2 to 3)" in page
    demo_page = (out / "demo.html").read_text()
    assert "<h2>Elastic training</h2>" in demo_page and "Each change of size" in demo_page
    assert "Diagnosis" not in demo_page and "Failure and recovery" not in demo_page
    for html_page, folder in ((demo_page, out), (page, run)):
        assert not raw_values(html_page), raw_values(html_page)
        assert not unresolved(html_page, folder), unresolved(html_page, folder)
