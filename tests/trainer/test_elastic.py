"""Elastic launch without a cluster: what Ray Train is asked for at ``parallel.num_workers = [min, max]``, the
layouts refused at launch, the resize rows the account builds from attempt rows and the controller's events,
and a lost node named as one. The elastic run itself is tests/trainer/test_elastic_ray.py."""

from __future__ import annotations

import json

import pytest
from dutycycle.engine.errors import ConfigError
from dutycycle.trainer.config import load_config
from dutycycle.trainer.launch import train as T
from dutycycle.trainer.launch.account import add_resize_rows, job_time, resizes
from dutycycle.trainer.launch.fits import check_fits, check_sizes


def cfg(*extra: str):
    return load_config(None, ["data.source=synthetic", "data.global_batch_size=12", *extra])


def test_ray_train_is_asked_for_the_range_with_a_fast_start_and_resize_check():
    c = cfg("parallel.num_workers=[2,3]", "ray.max_failures=1")
    sc = T.scaling_config(c, gpu=False)
    assert (sc.min_workers, sc.max_workers) == (2, 3) and sc.elastic_resize_monitor_interval_s == 5.0
    env = T.ray_train_env(c)
    assert env["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "5.0"  # ray.elastic_start_timeout_s
    assert T.max_failures(c) == 2  # the user's one, plus one lost worker the range allows
    fixed = cfg("parallel.num_workers=3", "ray.max_failures=1")
    assert T.scaling_config(fixed, gpu=False).num_workers == 3 and T.max_failures(fixed) == 1
    assert T.ray_train_env(fixed)["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "120.0"


def test_an_elastic_run_needs_room_for_min_and_a_layout_at_every_size():
    one_cpu = [{"CPU": 1.0}, {"CPU": 1.0}]
    check_fits(cfg("parallel.num_workers=[2,4]"), one_cpu, {"CPU": 1.0})  # starts at 2, grows when nodes come
    with pytest.raises(ConfigError, match=r"num_workers = \[3, 4\] \(at least 3\) workers .* room for 2"):
        check_fits(cfg("parallel.num_workers=[3,4]"), one_cpu, {"CPU": 1.0})
    # tensor parallel 2 forms at 2 and 4 workers, not at 3: refused when the config is loaded, before any launch
    tp = ["parallel.num_workers=[2,4]", "parallel.zero_stage=3", "parallel.tensor=2", "model.name=vit"]
    with pytest.raises(ConfigError, match=r"cannot train at 1 of its sizes \(3\); at 3 workers: parallel.tensor = 2 "
                                          r"must divide .* Train at a fixed size \(2 or 4 works\)"):
        cfg(*tp)
    check_sizes(cfg("parallel.num_workers=[4,4]", *tp[1:]))  # not elastic: the config's own check holds
    with pytest.raises(ConfigError, match=r"cannot train at 2 of its sizes \(2, 3\); at 2 workers: "
                                          r"parallel.replicate = 2 leaves one rank .* Train at a fixed size \(4 works\)"):
        cfg("parallel.num_workers=[2,4]", "parallel.zero_stage=3", "parallel.replicate=2")
    cfg("parallel.num_workers=[2,4]", "parallel.zero_stage=3", "parallel.replicate=0")  # one group per node
    with pytest.raises(ConfigError, match=r"cannot train at 1 of its sizes \(5\).* Raise the minimum: "
                                          r"parallel.num_workers = \[6, 6\]|Train at a fixed size"):
        cfg("parallel.num_workers=[4,6]", *tp[1:])


def test_tensor_groups_larger_than_a_node_are_refused_at_launch():
    with pytest.raises(ConfigError, match=r"parallel.num_workers = \[4, 8\] cannot train at 3 of its sizes "
                                          r"\(5, 6, 7\).* Train at a fixed size \(4 or 8 works\)"):
        cfg("parallel.num_workers=[4,8]", "parallel.zero_stage=3", "parallel.tensor=4", "model.name=vit",
            "data.global_batch_size=24")
    c = cfg("parallel.num_workers=4", "parallel.zero_stage=3", "parallel.tensor=2", "model.name=vit")
    check_sizes(c, [{"CPU": 2.0}] * 2, {"CPU": 1.0})
    with pytest.raises(ConfigError, match=r"parallel.tensor = 2 needs 2 workers on one node .* largest node holds 1"):
        check_sizes(c, [{"CPU": 1.0}] * 4, {"CPU": 1.0})


def _attempt(step, world, started, loop_started, **setup):
    return {"event": "attempt", "step": step, "world_size": world, "started": started, "loop_started": loop_started,
            "setup": {"worker_init": 0.5, "health_check": 0.25, "data_open": 0.25, "model_build": 0.5, **setup},
            "loop_s": 1.0, "results_s": 0.0, "time": loop_started}


def _step(step, t):
    return {"step": step, "loss": 1.0, "time": t, "step_s": 0.5, "forward_backward": 0.25}


def test_each_size_change_is_a_resize_row_split_at_measured_boundaries(tmp_path):
    # 3 workers train steps 1-6, a node dies after step 6 (its last row at t=106), Ray Train's controller sees
    # the dead worker at 107, tries 3 workers once on a stale view, schedules 2 at 113; the new group's rank 0
    # enters the train function at 119 (set up by 121, 0.5 s of it unaccounted), restores step 4 (2 steps redone) and trains step 5 at 124
    rows = [_attempt(0, 3, 90.0, 100.0), *[_step(s, 100.0 + s) for s in range(1, 5)],
            {"event": "resume", "step": 4, "time": 122.5, "restore_s": 0.5, "down_s": 121.0 - 106.0,
             "redone_s": 1.0, "steps_redone": 2},
            _attempt(4, 2, 119.0, 121.0), _step(5, 124.0), _step(6, 125.0)]
    controller = [{"time": 107.0, "state": "RESTARTING", "from": "RUNNING", "error": "WorkerGroupError"},
                  {"time": 107.1, "state": "SCHEDULING", "from": "RESTARTING", "num_workers": 3},
                  {"time": 112.0, "state": "RESCHEDULING", "from": "SCHEDULING"},
                  {"time": 113.0, "state": "SCHEDULING", "from": "RESCHEDULING", "num_workers": 2},
                  {"time": 119.0, "state": "RUNNING", "from": "SCHEDULING"}]
    nodes = [{"time": 108.0, "node_id": "n3", "alive": False, "cpus": 1.0, "gpus": 0.0}]
    (r,) = resizes(rows, controller, nodes)
    assert (r["from"], r["to"], r["step"], r["kind"], r["stale_starts"]) == (3, 2, 4, "shrink", 1)
    sec = r["seconds"]
    assert sec["detect"] == pytest.approx(1.0) and sec["decide"] == pytest.approx(6.0)
    assert sec["worker_start"] == pytest.approx(119.5 - 113.0) and sec["setup"] == pytest.approx(1.0)
    assert sec["other"] == pytest.approx(0.5)
    assert sec["restore"] == 0.5 and sec["first_step"] == pytest.approx(124.0 - 121.0 - 0.5)
    assert r["total_s"] == pytest.approx(124.0 - 106.0) == pytest.approx(sum(sec.values()))
    assert (r["redone_s"], r["steps_redone"], r["node_seen_s"]) == (1.0, 2, 2.0)
    # written into the metrics before the attempt it led to, once however often the account closes
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    out = add_resize_rows(str(tmp_path), rows, controller, nodes)
    again = add_resize_rows(str(tmp_path), out, controller, nodes)
    written = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert again == out and len(written) == len(rows) + 1
    kinds = [x.get("event") for x in written if x.get("event")]
    assert kinds == ["attempt", "resume", "resize", "attempt"]
    summary = {"attempt": rows[-3], "time_breakdown": {"seconds": {}}, "job": {"redone_s": 1.0}}
    launch = job_time(summary, written, launched=80.0, fit_called=85.0, closed=130.0)
    assert launch["world_sizes"] == [3, 2] and launch["resize_s"] == pytest.approx(18.0)
    assert launch["resizes"][0]["seconds"] == sec
    # a restart at the same size is a failure, not a resize
    same = [_attempt(0, 3, 90.0, 100.0), _attempt(4, 3, 120.0, 121.0)]
    assert resizes(same, controller, nodes) == []


def test_a_lost_node_is_named_as_one_not_as_placement():
    lost = [{"time": 1.0e9, "node_id": "abcdef0123456789", "alive": False, "cpus": 1.0, "gpus": 0.0}]
    err = T._lost_node_error(RuntimeError("ControllerError"), cfg("parallel.num_workers=3", "ray.max_failures=1"), lost)
    assert "1 node(s) of the Ray cluster were lost" in str(err) and "abcdef012345 (1 CPU)" in str(err)
    assert "ray.max_failures = 1 restarts were spent" in str(err) and "parallel.num_workers = [min, max]" in str(err)
    assert T._lost_node_error(RuntimeError("x"), cfg("parallel.num_workers=3"), []) is None
