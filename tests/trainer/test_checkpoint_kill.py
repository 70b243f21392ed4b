"""Saves SIGKILLed at random moments across snapshot, write, commit and retention (tests/support/ckpt_killer.py), on a
local disk and on the S3-compatible server; and a training run checkpointing to ``s3://`` that crashes and
resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ..support import REPO
from ..support import ckpt_models as cm
from ..support import ckpt_worker as cw


def kill_points(root: str, kills: int, seed: int, phases: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "tests.support.ckpt_killer", root, "--kills", str(kills), "--seed", str(seed)]
    if phases:
        cmd += ["--phases", phases]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = next((x for x in proc.stdout.splitlines() if x.startswith("KILLER ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(line.removeprefix("KILLER "))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_save_killed_anywhere_leaves_the_newest_commit_loadable(tmp_path):
    out = kill_points(str(tmp_path / "ckpt"), kills=24, seed=0)
    assert out["failures"] == [], out["failures"]
    res = out["results"]
    assert len(res) == 24 and all(r["signal"] == 9 for r in res)
    # every phase was hit, in both save modes, and kills landed on both sides of the commit
    assert {(r["phase"], r["async"]) for r in res} == {(p, a) for p in ("snapshot", "write", "commit", "retention")
                                                      for a in (False, True)}
    assert any(r["after"] == r["killed_in"][0] for r in res)  # killed after the manifest: that save counts
    assert any(r["after"] == r["killed_in"][0] - 1 for r in res)  # killed before it: the previous one does
    # the hand-made directory newer than everything was never taken for a checkpoint
    assert (tmp_path / "ckpt" / "step-99999999").is_dir()
    assert all(r["after"] < 99999999 for r in res)


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_s3_save_killed_during_upload_and_a_run_that_resumes_from_s3(s3, tmp_path):
    out = kill_points(f"{s3}/kills", kills=8, seed=1, phases="write,commit")
    assert out["failures"] == [], out["failures"]
    assert {r["phase"] for r in out["results"]} == {"write", "commit"}
    assert any(r["after"] == r["killed_in"][0] - 1 for r in out["results"])  # a torn upload was passed over
    # training that checkpoints to the bucket, crashes after its commit of step 8 and resumes from it
    a = cw.train(cw.small_cfg(tmp_path / "a"))
    ckpt = f"{s3}/run-b/checkpoints"
    cm.FAULTS["crash_at"] = 11
    try:
        with pytest.raises(cm.InjectedCrash):
            cw.train(cw.small_cfg(tmp_path / "b", f"checkpoint.dir={ckpt}"))
    finally:
        cm.reset()
    b = cw.train(cw.small_cfg(tmp_path / "b", f"checkpoint.dir={ckpt}"))
    assert b["checkpoint"]["resumed"]["uri"] == f"{ckpt}/step-00000008"
    assert b["checkpoint"]["committed"] == [12, 14]
    assert b["weights_sha256"] == a["weights_sha256"]
