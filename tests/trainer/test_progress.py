"""The driver's progress: the stream and its listeners, the display's lines, bar and ETA, the mailbox between rank 0
and the driver, and the start-up account. No processes: rows are written here with the clock they carry."""

from __future__ import annotations

import io
import threading
import time
import warnings

import pytest
from dutycycle.trainer.launch.account import STARTUP, format_startup, startup_time
from dutycycle.trainer.launch.progress import LINE_S, Mailbox, ProgressDisplay, ProgressStream, Rate


def _run(display, t0: float = 1000.0, total: int = 100, step_s: float = 0.1, log_every: int = 10, evals=(50,)):
    """Rows as rank 0 sends them for ``total`` steps of ``step_s`` seconds (a flush every ``log_every`` steps,
    ticks between), with an evaluation at each step in ``evals``."""
    rows = [{"event": "start", "step": 0, "epoch": 0, "total": total, "world_size": 2, "global_batch": 64,
             "resumed": False, "time": t0}]
    for step in range(1, total + 1):
        t = t0 + step * step_s
        if step == 1 or step % log_every == 0:
            rows.append({"event": "step", "step": step, "epoch": 0, "loss": 2.0 / step, "lr": 1e-3, "samples": 64 * step,
                         "step_s": step_s, "time": t, "samples_per_s": 64 / step_s})
        elif step % 5 == 0:
            rows.append({"event": "tick", "step": step, "epoch": 0, "time": t})
        if step in evals:
            rows.append({"event": "eval", "step": step, "val_accuracy": 0.5, "val_loss": 1.25, "eval_s": 0.3,
                         "time": t})
    rows.append({"event": "end", "step": total, "time": t0 + total * step_s})
    for row in rows:
        display(row)
    display.close()
    return rows


def test_plain_lines_every_log_every_steps_with_loss_rate_and_eta():
    out = io.StringIO()
    _run(ProgressDisplay(10, out=out, bar=False, label="demo"))
    lines = out.getvalue().splitlines()
    assert lines[0] == "demo: 100 steps on 2 workers, global batch 64"
    steps = [ln for ln in lines if ln.startswith("step ") and "val" not in ln]
    assert [ln.split()[1] for ln in steps] == ["1/100"] + [f"{s}/100" for s in range(10, 101, 10)]
    # 10 steps per second (rank 0's clock): at step 40, 60 steps remain: 6 s
    assert "step 40/100 (40%)  loss 0.0500  640 samples/s  eta 0:06" in lines
    assert lines[-1] == "step 100/100 (100%)  loss 0.0200  640 samples/s  done"
    assert "step 50/100: val accuracy 0.500, val loss 1.2500 (0.3 s)" in lines
    assert len(lines) == len(set(lines))  # no line twice


def test_a_slow_run_prints_at_least_every_few_seconds_and_log_every_zero_only_by_time():
    out = io.StringIO()
    _run(ProgressDisplay(0, out=out, bar=False), total=20, step_s=LINE_S / 4, log_every=100, evals=())
    steps = [ln for ln in out.getvalue().splitlines() if ln.startswith("step ")]
    # ticks every 5 steps (1.25 x LINE_S apart): a line at each, and the end
    assert [ln.split()[1] for ln in steps] == ["5/20", "10/20", "15/20", "20/20"]


def test_a_resumed_attempt_and_a_restart_are_named():
    out = io.StringIO()
    d = ProgressDisplay(10, out=out, bar=False, label="r")
    d({"event": "start", "step": 40, "total": 100, "world_size": 1, "global_batch": 8, "resumed": True, "time": 0.0})
    d({"event": "step", "step": 50, "loss": 0.5, "time": 1.0})
    d({"event": "start", "step": 40, "total": 100, "world_size": 1, "global_batch": 8, "resumed": True, "time": 5.0})
    d({"event": "start", "step": 0, "total": 100, "world_size": 1, "global_batch": 8, "resumed": False, "time": 9.0})
    d({"event": "step", "step": 1, "loss": 0.9, "time": 9.5})
    lines = out.getvalue().splitlines()
    assert lines[0] == "r: resumed at step 40/100 (1 worker, global batch 8)"
    assert lines[1].startswith("step 50/100 (50%)  loss 0.5000") and "eta 0:05" in lines[1]
    assert lines[2] == "r: attempt 2: resumed at step 40/100 (1 worker, global batch 8)"
    assert lines[3] == "r: attempt 3: started again at step 0 (1 worker, global batch 8)"
    assert lines[4].startswith("step 1/100 (1%)  loss 0.9000")  # a restart's lines are not held back


def test_the_bar_shows_step_total_loss_and_rate():
    out = io.StringIO()
    _run(ProgressDisplay(10, out=out, bar=True, label="demo"))
    text = out.getvalue()
    assert "demo: 100 steps on 2 workers" in text
    assert "100/100" in text and "loss 0.0200" in text and "640 samples/s" in text
    assert "step 50/100: val accuracy 0.500" in text


def test_the_rate_looks_at_the_last_minute():
    r = Rate(window_s=60)
    for i in range(400):  # 1 step/s for 100 s, then 4 steps/s for 75 s
        r.add(float(i) if i <= 100 else 100 + (i - 100) / 4, i)
    assert r.steps_per_s() == pytest.approx(4.0, rel=0.02)
    assert r.eta(400, 600) == pytest.approx(50.0, rel=0.02)
    r.add(174.0, 399)  # a step not beyond the last is no new point
    assert r.points[-1] == (174.75, 399)
    assert Rate().eta(0, 10) is None


def test_the_stream_delivers_in_order_and_drops_a_broken_listener():
    seen, other = [], []

    def broken(row):
        if row["i"] == 3:
            raise RuntimeError("store down")
        other.append(row["i"])

    stream = ProgressStream([seen.append, broken])
    writers = [threading.Thread(target=lambda k=k: [stream.put([{"i": (k + 1) * 100 + j}]) for j in range(50)])
               for k in range(4)]
    stream.put([{"i": i} for i in range(5)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for w in writers:
            w.start()
        for w in writers:
            w.join()
        stream.close()
    assert [r["i"] for r in seen[:5]] == [0, 1, 2, 3, 4] and len(seen) == 205
    for k in range(4):  # each writer's rows in its order
        mine = [r["i"] for r in seen if r["i"] // 100 == k + 1]
        assert mine == sorted(mine) and len(mine) == 50
    assert other == [0, 1, 2]  # off after it failed; the other listener kept going
    assert any("store down" in str(w.message) for w in caught)


def test_a_slow_listener_holds_back_no_other():
    gate, fast, slow_seen = threading.Event(), [], []

    def slow(row):  # an MLflow store still opening
        gate.wait(30)
        slow_seen.append(row["i"])

    stream = ProgressStream([slow, fast.append])
    stream.put([{"i": i} for i in range(3)])
    deadline = time.monotonic() + 30
    while len(fast) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r["i"] for r in fast] == [0, 1, 2] and slow_seen == []
    gate.set()
    stream.close()
    assert slow_seen == [0, 1, 2]


def test_the_mailbox_keeps_runs_apart_and_counts_what_it_drops():
    box = Mailbox(limit=5)
    box.put("a", [{"step": i} for i in range(3)])
    box.put("b", [{"step": 9}])
    box.put("a", [{"step": i} for i in range(3, 8)])
    rows, dropped = box.take("a")
    assert [r["step"] for r in rows] == [3, 4, 5, 6, 7] and dropped == 3
    assert box.take("a") == ([], 3)
    assert box.take("b") == ([{"step": 9}], 0)
    box.forget("a")
    assert box.take("a") == ([], 0)


def test_startup_splits_launch_to_first_step_at_its_boundaries():
    launched = 100.0
    attempt = {"event": "attempt", "step": 0, "started": 104.0, "loop_started": 106.5,
               "setup": {"worker_init": 0.5, "health_check": 0.25, "data_open": 0.5, "model_build": 0.75}}
    rows = [attempt, {"step": 1, "loss": 2.0, "step_s": 0.25, "time": 107.0},
            {"step": 2, "loss": 1.9, "step_s": 0.1, "time": 107.1}]
    s = startup_time({"attempt": attempt}, rows, launched=launched, fit_called=102.5, ray_ready=101.5,
                     ray_reused=False)
    assert s["launch_to_first_step_s"] == pytest.approx(7.0)
    sec = s["seconds"]
    assert set(sec) == set(STARTUP)
    assert sec["ray_start"] == pytest.approx(1.5) and sec["trainer_start"] == pytest.approx(1.0)
    assert sec["worker_start"] == pytest.approx(1.5 + 0.5)
    assert sec["first_step"] == pytest.approx(0.25) and sec["loop_start"] == pytest.approx(0.25)
    assert sum(sec.values()) == pytest.approx(7.0)  # every second under a name; "other" the gaps
    assert sec["other"] == pytest.approx(7.0 - 1.5 - 1.0 - 2.0 - 1.5 - 0.5)
    assert "7.0 s from launch to the first step" in format_startup(s)
    # in process (--local): no Ray, no fit; the worker starts at launch
    local = startup_time({"attempt": attempt}, rows, launched=launched, fit_called=None)
    assert local["seconds"]["ray_start"] == 0 and local["seconds"]["worker_start"] == pytest.approx(4.5)
    assert startup_time({"attempt": attempt}, [attempt], launched=launched, fit_called=None) is None
    # a later launch resuming the run directory: its own attempt and first step, not the first launch's
    again = {**attempt, "step": 2, "started": 204.0, "loop_started": 206.5}
    later = startup_time({"attempt": again}, [*rows, again, {"step": 3, "loss": 1.8, "step_s": 0.25, "time": 207.0}],
                         launched=200.0, fit_called=None)
    assert later["launch_to_first_step_s"] == pytest.approx(7.0)
