"""Failures as the fourth wait: the model (checked by hand and against a brute-force search), the verdict that
names it, and the experiment that measures a save's stall and a restart's cost on a real short run."""

from __future__ import annotations

import pytest
from dutycycle.trainer.config import load_config
from dutycycle.trainer.diagnose import decide, diagnose
from dutycycle.trainer.diagnose import failures as fm


def test_the_default_rate_is_the_llama3_report_s():
    # 419 interruptions in 54 days on 16,384 GPUs
    assert fm.LLAMA3_RATE_PER_WORKER_HOUR == pytest.approx(1.973e-5, rel=1e-3)
    assert fm.mtbf_s(16384, fm.LLAMA3_RATE_PER_WORKER_HOUR) / 3600 == pytest.approx(54 * 24 / 419)


def test_ettr_by_hand_and_daly_s_interval_is_the_best_one():
    # M = 10,000 s, C = 2 s, R = 100 s, a commit every 200 s: 1 - 2/200 - (100 + 100)/10000 = 0.97
    assert fm.ettr(200, 2, 100, 10_000) == pytest.approx(0.97)
    best = fm.daly_interval_s(2, 10_000)
    assert best == pytest.approx(200, rel=0.01)  # Young: sqrt(2 * 2 * 10000) = 200, Daly a hair off
    # no interval on a fine grid beats it by more than the grid's resolution (first-order model)
    grid = [best * f / 100 for f in range(20, 500)]
    assert max(fm.ettr(t, 2, 100, 10_000) for t in grid) <= fm.ettr(best, 2, 100, 10_000) + 1e-6
    assert fm.daly_interval_s(5, float("inf")) == float("inf")


def test_assess_counts_lost_work_and_recommends_steps():
    costs = fm.FailureCosts(save_s=2.0, restart_s=100.0, step_s=1.0, rate_per_worker_hour=0.36)  # M = 10,000 s
    a = fm.assess(costs, workers=1, every_steps=1000)
    assert a["mtbf_s"] == pytest.approx(10_000)
    assert a["lost_s_per_failure"] == pytest.approx(500 + 100)
    assert a["lost_s_per_hour"] == pytest.approx(0.36 * 600)
    assert a["ettr"] == pytest.approx(1 - 2 / 1000 - 600 / 10_000)
    assert a["recommended_every"] in (199, 200) and a["ettr_recommended"] > a["ettr"]  # Daly: 199.3 s
    assert a["failure_share"] == pytest.approx(0.06)
    # without checkpoints a failure loses the run so far (a whole MTBF on average is counted)
    assert fm.assess(costs, 1, 0)["ettr"] < a["ettr"]
    # what it would take to reach a target the best interval misses
    far = fm.FailureCosts(save_s=30.0, restart_s=300.0, step_s=1.0)
    text = fm.to_reach(0.97, far, 16384)
    assert "short of 97%" in text and "saves would have to stall at most" in text


def _fails(share, every=100, best=20):
    return {"failure_share": share, "workers": 16384, "mtbf_s": 11_000.0, "lost_s_per_failure": 400.0,
            "ettr": 1 - share, "configured_every": every, "recommended_every": best, "ettr_recommended": 0.98}


def test_the_verdict_names_failures_when_they_are_the_largest_wait():
    e2e = {"configured": "cache", "cache": {"data_wait_share": 0.05, "comm_share": 0.05, "checkpoint_share": 0.0,
                                            "samples_per_s": 100.0, "step_s": 0.1}}
    v = decide({"end_to_end": e2e, "failures": _fails(0.3)})
    assert v.kind == "failure-bound" and "at 16,384 workers" in v.headline
    assert "checkpoint.every = 20" in v.fix and "98.0%" in v.fix
    assert decide({"end_to_end": e2e, "failures": _fails(0.01)}).kind == "compute-bound"


def test_the_failures_experiment_measures_a_save_and_a_restart(tmp_path):
    cfg = load_config(None, ["data.source=synthetic", "data.size=8", "data.synthetic_samples=128",
                             "data.global_batch_size=16", "data.eval_batch_size=16", "model.width=8",
                             "optim.warmup_steps=1", "run.log_every=0", f"run.dir={tmp_path / 'run'}",
                             "checkpoint.every=4"])
    out = diagnose(cfg, out=str(tmp_path / "d"), budget_s=120, only=["failures"], scale=16384,
                   say=lambda _: None)
    f = out["findings"]["failures"]
    assert "error" not in f, f
    m = f["measured"]
    assert m["save_s"] > 0 and m["restore_s"] > 0 and m["launch_s"] >= 0
    assert m["restart_s"] == pytest.approx(m["launch_s"] + m["restore_s"])
    assert f["workers"] == 16384 and 0 < f["ettr"] <= 1 and f["recommended_every"] >= 1
    assert out["projection"]["workers"] == 16384 and out["projection"]["shares"] == out["verdict"]["shares"]
    assert "one worker" in out["projection"]["models"]["communication"]  # nothing exchanged to scale
    assert "failures" in out["verdict"]["shares"]
