"""The driver of a Ray run: rank 0's progress rows reach it live through the mailbox actor (shown once, whatever
the number of workers, and recorded in MLflow), a Ray instance the process already runs is reused and the start-up
is accounted. `dutycycle train` as a user types it (no Ray noise, one line for the config, progress) is checked
in tests/app/test_user_path.py, on the user's own data and model."""

from __future__ import annotations

import gc
import json

import pytest
from dutycycle.engine.synth import synthesize_cache
from dutycycle.trainer.config import load_config
from dutycycle.trainer.launch.account import STARTUP
from dutycycle.trainer.launch.progress import mailbox
from dutycycle.trainer.launch.train import train

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return synthesize_cache(str(tmp_path_factory.mktemp("cache") / "shapes"), n_train=256, n_val=64, size=16, seed=3)


def _steps(run_dir) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_rank_0_progress_reaches_the_driver_through_ray_and_into_mlflow(ray_cluster, cache, tmp_path, capsys):
    from mlflow import MlflowClient

    run_dir = tmp_path / "run"
    cfg = load_config(None, [f"data.cache={cache}", "data.global_batch_size=32", "data.eval_batch_size=64",
                             "model.width=8", "run.max_steps=4", "run.eval_every=2", "run.log_every=1",
                             "run.report=false", "parallel.num_workers=2", f"run.dir={run_dir}", "run.name=ray-progress",
                             f"tracking.mlflow_uri={tmp_path / 'mlruns'}"])
    summary = train(cfg, quiet=True)
    out = capsys.readouterr().out
    lines = out.splitlines()
    # rank 0's rows, shown by the driver once each (two workers, one voice), evaluations included
    assert "ray-progress: 4 steps on 2 workers, global batch 32" in lines
    for step in range(1, 5):
        assert sum(ln.startswith(f"step {step}/4 (") for ln in lines) == 1, out
    assert sum("val accuracy" in ln for ln in lines) == 2 and "[rank 0]" not in out
    # the same rows, as metrics of the MLflow run: every step's loss as metrics.jsonl has it
    client = MlflowClient(tracking_uri=summary["tracking"]["uri"])
    history = client.get_metric_history(summary["tracking"]["run_id"], "loss")
    assert [(m.step, m.value) for m in history] == sorted(_steps(run_dir).items())
    tags = client.get_run(summary["tracking"]["run_id"]).data.tags
    assert tags["dutycycle.launcher"] == "ray" and tags["dutycycle.world_size"] == "2"
    assert tags["dutycycle.cache_fingerprint"] == summary["data"]["fingerprint"]
    # the session's Ray was this process's already: reused, no start of its own; every second under a name
    startup = summary["startup"]
    assert startup["ray_reused"] is True and startup["seconds"]["ray_start"] < 1.0
    assert set(startup["seconds"]) == set(STARTUP)
    assert sum(startup["seconds"].values()) == pytest.approx(startup["launch_to_first_step_s"], rel=1e-9)
    assert startup["seconds"]["worker_start"] > 0 and startup["seconds"]["first_step"] > 0
    assert startup["launch_to_first_step_s"] < summary["launch"]["wall_s"]
    # the mailbox outlives the run for the next one of this process (Ray destroys an actor nobody holds)
    gc.collect()
    assert ray_cluster.get(mailbox().take.remote("no-such-run"), timeout=60) == ([], 0)

