"""The job's time account from launch to exit (launch/account.py): it closes, each boundary lands in its phase,
a failure's cost is what the job did not keep, and a real local run leaves next to nothing as "other"."""

from __future__ import annotations

import json

import pytest
from dutycycle.trainer.launch.account import JOB_ACCOUNT, job_time
from dutycycle.trainer.step.timing import ACCOUNT


def _summary(loop: dict, *, started: float, loop_started: float, loop_s: float, setup: dict, results_s=0.5,
             redone_s=0.0) -> dict:
    seconds = dict.fromkeys(ACCOUNT, 0.0) | loop
    return {"time_breakdown": {"seconds": seconds},
            "attempt": {"started": started, "setup": setup, "loop_started": loop_started, "loop_s": loop_s,
                        "results_s": results_s},
            "job": {"redone_s": redone_s}}


def test_one_attempt_closes_and_each_boundary_lands_in_its_phase():
    setup = {"worker_init": 1.0, "health_check": 2.0, "data_open": 0.5, "model_build": 1.5}
    # launch 100, fit 104, worker entered 110 (+1 s of its own imports), loop 115.25..125.25, results 0.5,
    # account closed at 128
    loop = {"forward_backward": 6.0, "optimizer": 1.0, "comm": 2.0, "restore": 0.5, "other": 0.5}
    s = _summary(loop, started=110.0, loop_started=115.25, loop_s=10.0, setup=setup)
    a = job_time(s, [], launched=100.0, fit_called=104.0, closed=128.0)
    sec = a["seconds"]
    assert set(sec) == set(JOB_ACCOUNT)
    assert sum(sec.values()) == pytest.approx(a["wall_s"]) == pytest.approx(28.0)
    assert sec["ray_start"] == 4.0 and sec["worker_start"] == 6.0 + 1.0
    assert (sec["health_check"], sec["data_open"], sec["model_build"]) == (2.0, 0.5, 1.5)
    assert sec["results"] == 0.5 and sec["teardown"] == pytest.approx(128.0 - 125.25 - 0.5)
    assert sec["failures"] == 0.0 and a["attempts"] == 1
    # the loop's own "other" (0.5) plus the setup's gap (115.25 - 110 - 5 = 0.25)
    assert sec["other"] == pytest.approx(0.75)
    assert a["per_step_s"] == pytest.approx(9.0) and a["goodput"] == pytest.approx(7.0 / 28.0)


def test_a_failure_costs_what_the_job_did_not_keep():
    setup = {"worker_init": 0.0, "health_check": 1.0, "data_open": 1.0, "model_build": 1.0}
    first = {"step": 0, "event": "attempt", "started": 10.0, "setup": setup, "loop_started": 13.0, "time": 13.1}
    # the first attempt trained 4 steps of 1 s (kept: the commit at step 4), then 2 more, then died
    kept = [{"step": i, "loss": 1.0, "step_s": 1.0, "forward_backward": 0.75, "optimizer": 0.25,
             "time": 13.0 + i} for i in range(1, 5)]
    second = {"step": 4, "event": "attempt", "started": 30.0, "setup": setup, "loop_started": 33.0, "time": 33.1}
    later = [{"step": i, "loss": 1.0, "step_s": 1.0, "forward_backward": 0.75, "optimizer": 0.25,
              "time": 33.0 + i - 4} for i in range(5, 9)]
    loop = {"forward_backward": 3.0, "optimizer": 1.0, "restore": 0.5, "other": 0.0}
    s = _summary(loop, started=30.0, loop_started=33.0, loop_s=4.5, setup=setup, results_s=0.0, redone_s=2.0)
    a = job_time(s, [first, *kept, second, *later], launched=0.0, fit_called=2.0, closed=40.0)
    sec = a["seconds"]
    assert a["attempts"] == 2
    assert sec["forward_backward"] == pytest.approx(3.0 + 4 * 0.75)  # the kept steps of both attempts
    # from the first loop's start (13) to the last one's (33), less the 4 kept seconds
    assert sec["failures"] == pytest.approx(16.0)
    assert a["failures"] == {"redone_s": 2.0, "restart_s": pytest.approx(14.0)}
    assert (sec["health_check"], sec["model_build"]) == (1.0, 1.0)  # set up once; the second time is a failure's
    assert sum(sec.values()) == pytest.approx(40.0)


def test_the_first_steps_extra_time_is_warm_up_not_a_step_cost():
    setup = {"health_check": 0.0, "data_open": 0.0, "model_build": 0.0}
    attempt = {"step": 0, "event": "attempt", "started": 10.0, "setup": setup, "loop_started": 10.0, "time": 10.0}
    rows = [attempt] + [{"step": i, "loss": 1.0, "step_s": 1.0 if i > 1 else 1.4, "forward_backward": 0.5,
                         "optimizer": 0.1 if i > 1 else 0.5, "time": 10.0 + i} for i in range(1, 6)]
    loop = {"forward_backward": 2.5, "optimizer": 0.9, "other": 2.0}
    s = _summary(loop, started=10.0, loop_started=10.0, loop_s=5.4, setup=setup, results_s=0.0)
    a = job_time(s, rows, launched=10.0, fit_called=None, closed=15.4)
    assert a["seconds"]["warmup"] == pytest.approx(0.4)  # step 1's optimizer beyond the median step's
    assert a["seconds"]["optimizer"] == pytest.approx(0.5) and a["seconds"]["forward_backward"] == 2.5
    assert sum(a["seconds"].values()) == pytest.approx(5.4)


def test_a_local_run_accounts_for_every_second(tmp_path):
    """A real run in this process: the summary's account closes, and "other" is a residue of under 5%.

    The residue is the untimed Python of the loop (metric rows written, the loop's own bookkeeping): about
    5-10 ms in all here. The tiny model's whole loop is 0.1-0.4 s, so on a busy machine that residue alone
    came to 5.7% of it once; 60 ms of injected link time per step (counted as exposed communication, a
    fixed 0.36 s) makes the run long enough that "other" stays a residue even if the machine slows the
    untimed part threefold (30 ms of about 0.6 s: 5% is then still a margin, not a coin toss)."""
    from dutycycle.trainer.launch.train import train

    from .test_loop import small_cfg

    cfg = small_cfg(tmp_path, "run.max_steps=6", "run.eval_every=3", "checkpoint.every=3", "run.report=true",
                    "parallel.inject_comm_ms=60")
    s = train(cfg, local=True, quiet=True)
    a = s["launch"]
    assert sum(a["seconds"].values()) == pytest.approx(a["wall_s"], rel=1e-9)
    assert a["seconds"]["model_build"] > 0 and a["seconds"]["final_save"] > 0 and a["seconds"]["eval"] > 0
    assert a["seconds"]["comm"] >= 6 * 0.060 and a["seconds"]["results"] > 0  # the memory probe is a result
    assert a["fractions"]["other"] < 0.05, a["seconds"]
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["launch"] == a and on_disk["report_draw_s"] > 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("event") == "attempt"] == [0]


def test_a_resumed_launch_counts_its_own_steps_only():
    """A run directory resumed by a second launch holds the first launch's attempt and steps: the second launch's
    account covers its own wall time and its own steps (counting the first launch's made goodput exceed 1)."""
    setup = {"worker_init": 0.5, "health_check": 0.25, "data_open": 0.25, "model_build": 0.5}
    earlier = {"event": "attempt", "step": 0, "started": 10.0, "loop_started": 12.0, "setup": setup, "time": 12.0}
    old_steps = [{"step": s, "loss": 1.0, "time": 12.0 + s, "step_s": 1.0, "forward_backward": 0.9} for s in range(1, 9)]
    mine = {"event": "attempt", "step": 8, "started": 103.0, "loop_started": 105.0, "setup": setup, "time": 105.0,
            "loop_s": 4.0, "results_s": 0.0}
    new_steps = [{"step": s, "loss": 1.0, "time": 105.0 + s - 8, "step_s": 1.0, "forward_backward": 0.9}
                 for s in range(9, 13)]
    s = {"attempt": mine, "time_breakdown": {"seconds": {"forward_backward": 3.6, "other": 0.4}}}
    a = job_time(s, [earlier, *old_steps, mine, *new_steps], launched=100.0, fit_called=101.0, closed=110.0)
    assert a["attempts"] == 1 and a["wall_s"] == 10.0
    assert a["seconds"]["failures"] == 0.0  # the earlier launch is not a failure inside this one
    assert 0 < a["goodput"] <= 1
