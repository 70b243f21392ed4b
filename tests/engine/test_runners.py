"""The same ingest, curation and inspect checks on Daft's native runner and on Ray.

Daft fixes its runner per process, so each runner runs in its own subprocess (the Ray one starts a local
Ray cluster through ``daft.set_runner_ray()``); results are compared with an in-process native run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from dutycycle.engine.errors import ConfigError
from dutycycle.engine.runner import resolve
from dutycycle.engine.synth import synthesize
from dutycycle.engine.table.catalog import ingest
from dutycycle.engine.table.table import open_table, read_arrow

SCRIPT = r"""
import json, sys
import daft
from dutycycle.trainer.app.cli import main
from dutycycle.engine import open_table
from dutycycle.engine.table.table import read_arrow

src, table, s3src, s3table, html, out = sys.argv[1:]
rc = main(["ingest", src, table, "--progress-every", "0", "--json"])
t = open_table(table)
res = {
    "rc": rc,
    "runner": daft.get_or_infer_runner_type(),
    "rows": read_arrow(table).sort_by("uri").to_pylist(),
    "stats": t.stats(),
    "stars": sorted(t.where("label = 'star'").to_arrow().column("uri").to_pylist()),
    "dedupe": sorted(t.dedupe().to_arrow().column("uri").to_pylist()),
    "sample": sorted(t.sample(n=10, seed=0).to_arrow().column("uri").to_pylist()),
    "resplit": sorted((r["uri"], r["split"]) for r in t.resplit("0.5,0.25,0.25").to_arrow().to_pylist()),
    "inspect_rc": main(["inspect", table, "--where", "label = 'circle'", "--limit", "5", "--html", html]),
}
t.resplit("0.5,0.25,0.25").save(table + "-saved")  # on Ray, Daft's writer runs in the workers
res["saved"] = sorted((r["uri"], r["split"]) for r in read_arrow(table + "-saved").to_pylist())
if s3src != "-":
    main(["ingest", s3src, s3table, "--progress-every", "0"])
    res["s3_rows"] = open_table(s3table).count()
json.dump(res, open(out, "w"))
"""


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("runners")
    synthesize(str(root / "src"), 40, seed=8, broken_fraction=0.1)
    expected_table = str(root / "expected")
    ingest(str(root / "src"), expected_table, progress_every=0)
    t = open_table(expected_table)
    expected = {
        "rows": read_arrow(expected_table).sort_by("uri").to_pylist(),
        "stats": t.stats(),
        "stars": sorted(t.where("label = 'star'").to_arrow().column("uri").to_pylist()),
        "dedupe": sorted(t.dedupe().to_arrow().column("uri").to_pylist()),
        "sample": sorted(t.sample(n=10, seed=0).to_arrow().column("uri").to_pylist()),
        "resplit": sorted((r["uri"], r["split"]) for r in t.resplit("0.5,0.25,0.25").to_arrow().to_pylist()),
    }
    return root, expected


@pytest.mark.parametrize("runner", ["native", pytest.param("ray", marks=[pytest.mark.slow, pytest.mark.ray])])
def test_same_results_on_both_runners(source, runner, tmp_path, s3):
    root, expected = source
    s3src = f"{s3}/src"
    synthesize(s3src, 6, seed=1)
    env = {**os.environ, "DAFT_RUNNER": runner, "RAY_USAGE_STATS_ENABLED": "0", "DAFT_ANALYTICS_ENABLED": "0"}
    out = tmp_path / "result.json"
    html = tmp_path / "sheet.html"
    args = [str(root / "src"), str(tmp_path / "table"), s3src, f"{s3}/table", str(html), str(out)]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], env=env, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["runner"] == runner and res["rc"] == 0 and res["inspect_rc"] == 0
    for key in ("rows", "stats", "stars", "dedupe", "sample"):
        assert res[key] == json.loads(json.dumps(expected[key])), key
    assert [tuple(x) for x in res["resplit"]] == expected["resplit"] == [tuple(x) for x in res["saved"]]
    assert res["s3_rows"] == 6
    assert html.read_text().count("data:image/jpeg;base64,") >= 3


def test_runner_choice_precedence(monkeypatch):
    monkeypatch.delenv("DAFT_RUNNER", raising=False)
    assert resolve(None) == "native"
    monkeypatch.setenv("DAFT_RUNNER", "ray")
    assert resolve(None) == "ray" and resolve("native") == "native"
    monkeypatch.setenv("DAFT_RUNNER", "spark")
    with pytest.raises(ConfigError, match="DAFT_RUNNER 'spark'"):
        resolve(None)
    with pytest.raises(ConfigError, match="--runner 'dask'"):
        resolve("dask")


def test_ray_address_needs_ray_runner():
    from dutycycle.engine.runner import configure

    with pytest.raises(ConfigError, match="--runner ray"):
        configure("native", "ray://127.0.0.1:10001")
