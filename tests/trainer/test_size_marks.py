"""A run whose size changed shows it: the workers it trained at over time and each change marked on the loss
curve (report.png), the path of sizes and each change on its page (report.html). The run is real and changes
size twice the way a user changes it by hand: 1 worker here, resumed at 2 on the session's Ray cluster, resumed
at 1 here again. An elastic resize on Ray Train reads the same attempt rows plus its ``resize`` row."""

from __future__ import annotations

import pytest
from dutycycle.engine.synth import synthesize_cache
from dutycycle.trainer.config import load_config
from dutycycle.trainer.launch.train import train
from dutycycle.trainer.step import sizes as S
from dutycycle.trainer.step.metrics import read_metrics, read_summary
from dutycycle.trainer.step.report import CHANGE, draw

from ..support.pages import raw_values

pytestmark = pytest.mark.ray


def _cfg(cache, run_dir, *extra):
    return load_config(None, [f"data.cache={cache}", "data.global_batch_size=16", "data.eval_batch_size=32",
                              "model.width=8", "optim.warmup_steps=1", "run.log_every=0", "run.eval_every=0",
                              "run.eval_max_batches=1", "checkpoint.every=2", "checkpoint.async_save=false",
                              f"run.dir={run_dir}", *extra])


@pytest.mark.long
def test_a_run_resumed_at_other_sizes_shows_its_workers_over_time(ray_cluster, tmp_path):
    cache = synthesize_cache(str(tmp_path / "cache"), n_train=128, n_val=32, size=16, seed=5)
    run = tmp_path / "run"
    train(_cfg(cache, run, "run.max_steps=4"), local=True, quiet=True)
    train(_cfg(cache, run, "run.max_steps=8", "parallel.num_workers=2"), quiet=True, resume=True)
    last = train(_cfg(cache, run, "run.max_steps=12"), local=True, quiet=True, resume=True)
    assert last["steps"] == 12

    rows = read_metrics(str(run))
    runs = S.attempts(rows)
    assert [(a["world_size"], a["step"], a["last_step"]) for a in runs] == [(1, 0, 4), (2, 4, 8), (1, 8, 12)]
    assert all(a["started"] <= a["loop_started"] <= a["end"] for a in runs)
    assert runs[0]["end"] < runs[1]["loop_started"] and runs[1]["end"] < runs[2]["loop_started"]
    # each launch's driver wrote a resize row for the change before its attempt (launch/account.py): read once
    changes = S.changes(rows)
    assert [(c["step"], c["from"], c["to"], c["kind"], c["source"]) for c in changes] == [
        (4, 1, 2, "grow", "resize"), (8, 2, 1, "shrink", "resize")]
    assert all(c["total_s"] > 0 and c["steps_redone"] == 0 for c in changes)  # resumed from the final commits
    assert S.path(rows) == [1, 2, 1]

    # report.png: the loss panel marks both changes where training continued at the new size, labelled with
    # the sizes; a panel of workers over time; the path in the title (and the PNG's text)
    fig = draw(rows, read_summary(str(run)))
    ax_loss, ax_size = fig.axes[0], fig.axes[1]
    marks = {kind: [ln.get_xdata()[0] for ln in ax_loss.lines if ln.get_color() == color]
             for kind, color in CHANGE.items()}
    assert marks == {"grow": [4], "shrink": [8]}
    assert {t.get_text() for t in ax_loss.texts} == {"1\u21922", "2\u21921"}
    assert ax_size.get_title() == "workers over time (2 size changes)"
    line = ax_size.lines[0]
    assert sorted(set(line.get_ydata())) == [0, 1, 2]  # 1, then 2, then 1; 0 while no group trains
    assert len(fig.axes) == 4
    from PIL import Image

    with Image.open(run / "report.png") as png:
        title, width = png.text["Title"], png.size[0]
    grow, shrink = (f"{c['kind']} at step {c['step']} in {c['total_s']:.1f} s" for c in changes)
    assert f"workers 1 \u2192 2 \u2192 1: {grow}, {shrink}" in title
    assert width == 1900  # four panels

    page = (run / "report.html").read_text()
    assert "1 \u2192 2 \u2192 1, " in page  # the workers row
    assert "<h3>Workers over time: 1 \u2192 2 \u2192 1</h3>" in page
    assert "<li>step 4: 1 \u2192 2 workers (grow), " in page and "<li>step 8: 2 \u2192 1 workers (shrink), " in page
    assert not raw_values(page), raw_values(page)


def test_a_resize_row_names_its_change_and_its_parts():
    """The driver's ``resize`` row (launch/account.py) beside the attempts' sizes: the change is read from it
    once, with its parts, not again from the attempts; a change no row explains is read from the attempts."""
    from dutycycle.trainer.launch.runpage import change_text

    seconds = {"detect": 2.5, "decide": 0.25, "worker_start": 4.0, "setup": 1.0, "restore": 1.0, "first_step": 0.5,
               "other": 0.01}
    rows = [
        {"event": "attempt", "step": 0, "world_size": 3, "started": 100.0, "loop_started": 101.0},
        {"step": 1, "loss": 1.0, "time": 102.0}, {"step": 2, "loss": 0.9, "time": 103.0},
        {"event": "resume", "step": 2, "time": 120.0, "restore_s": 1.0, "down_s": 12.0},
        {"event": "resize", "step": 2, "from": 3, "to": 2, "kind": "shrink", "seconds": seconds, "total_s": 9.26,
         "steps_redone": 3, "time": 119.0},
        {"event": "attempt", "step": 2, "world_size": 2, "started": 115.0, "loop_started": 119.0},
        {"step": 3, "loss": 0.8, "time": 122.0},
        {"event": "attempt", "step": 3, "world_size": 3, "started": 200.0, "loop_started": 204.0},
        {"step": 4, "loss": 0.7, "time": 205.0},
    ]
    shrink, grow = S.changes(rows)
    assert shrink == {"step": 2, "from": 3, "to": 2, "kind": "shrink", "source": "resize", "seconds": seconds,
                      "total_s": 9.26, "steps_redone": 3}
    assert grow == {"step": 3, "from": 2, "to": 3, "kind": "grow", "source": "attempts", "seconds": None,
                    "total_s": None, "steps_redone": None}
    assert change_text(shrink) == ("step 2: 3 \u2192 2 workers (shrink), 9.3 s from the last step at 3 to the first "
                                   "at 2: detect 2.5 s, decide 0.2 s, worker start 4.0 s, setup 1.0 s, restore 1.0 s, "
                                   "first step 0.5 s; 3 steps trained again")
    runs = S.attempts(rows)
    # the first attempt trained until its last row (120 - 1 - 12 = 107), after its kept step-2 row at 103
    assert [a["end"] for a in runs] == [107.0, 122.0, 205.0]
    assert S.path(rows) == [3, 2, 3] and S.path_text([3, 2, 3]) == "3 \u2192 2 \u2192 3"
