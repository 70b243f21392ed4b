"""MLflow tracking, read back from a real local store with ``MlflowClient``: the config as params, every step's
metrics as they arrived, the report, summary and model as artifacts, the data's and the code's tags, one MLflow run
across a resumed attempt, an evaluation's files; and the driver's progress for the same runs. Also the pieces:
where a store lives, the flattened params, the git revision, and the error when MLflow is missing."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
from dutycycle.engine.cache.write import write_cache
from dutycycle.engine.errors import ConfigError
from dutycycle.engine.synth import CLASSES, draw_shapes
from dutycycle.trainer.config import load_config
from dutycycle.trainer.launch.tracking import (
    INSTALL_HINT,
    RECORD,
    code_revision,
    flat_params,
    log_run_files,
    resolve_store,
)
from dutycycle.trainer.launch.train import train

mlflow = pytest.importorskip("mlflow", reason="the `tracking` extra is not installed")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A committed cache that names its table and the table's version, as materialize writes them."""
    images, labels = draw_shapes(320, 16, seed=5)
    uri = str(tmp_path_factory.mktemp("cache") / "c")
    ids = [hashlib.sha256(f"t-{i}".encode()).hexdigest()[:16] for i in range(len(labels))]
    write_cache(uri, ids, labels, ["train"] * 256 + ["val"] * 64, images, classes=list(CLASSES),
                spec={"size": 16}, source="/data/shapes-table", options={"table_version": 7},
                fingerprint="f1ngerpr1nt0007")
    return uri


def _git_repo(path, dirty: bool) -> str:
    def git(*args):
        return subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True, text=True).stdout

    path.mkdir()
    git("init", "-q")
    (path / "model.py").write_text("x = 1\n")
    git("add", "model.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    if dirty:
        (path / "model.py").write_text("x = 2\n")
    return git("rev-parse", "HEAD").strip()


def _cfg(cache, run_dir, store, *extra):
    return load_config(None, [f"data.cache={cache}", "data.global_batch_size=32", "data.eval_batch_size=64",
                              "model.width=8", "run.eval_every=2", "run.log_every=1", "run.report=false",
                              "checkpoint.every=2", f"run.dir={run_dir}", "run.name=digits",
                              f"tracking.mlflow_uri={store}", 'tracking.tags={team = "vision"}', *extra])


def _losses(run_dir) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_a_tracked_run_and_its_resume_are_one_mlflow_run(cache, tmp_path, monkeypatch, capsys):
    from mlflow import MlflowClient

    commit = _git_repo(tmp_path / "project", dirty=True)
    monkeypatch.chdir(tmp_path / "project")  # the working directory's repository is the code's revision
    run_dir, store = tmp_path / "run", tmp_path / "project" / "mlruns"  # relative: to the working directory
    first = train(_cfg(cache, run_dir, "mlruns", "run.max_steps=4"), local=True)
    out = capsys.readouterr().out
    record = json.loads((run_dir / RECORD).read_text())
    client = MlflowClient(tracking_uri=record["tracking_uri"])
    assert record["tracking_uri"] == f"sqlite:///{store}/mlflow.db" and (store / "mlflow.db").exists()
    run = client.get_run(record["run_id"])
    assert first["tracking"]["run_id"] == run.info.run_id and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "digits"  # run.name by default
    assert run.info.run_name == "run"  # the run directory's name
    p = run.data.params
    assert p["data.global_batch_size"] == "32" and p["model.width"] == "8" and p["run.max_steps"] == "4"
    assert p["data.augment.flip"] == "false" and p["tracking.tags"] == '{"team": "vision"}'
    t = run.data.tags
    assert t["dutycycle.table"] == "/data/shapes-table" and t["dutycycle.table_version"] == "7"
    assert t["dutycycle.cache_fingerprint"] == "f1ngerpr1nt0007" and t["dutycycle.cache"] == cache
    assert t["mlflow.source.git.commit"] == commit and t["dutycycle.git_dirty"] == "true"
    assert t["dutycycle.version"] and t["dutycycle.launcher"] == "local" and t["team"] == "vision"
    # every step's loss as the run logged it, in order; the evaluations at their steps
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == sorted(_losses(run_dir).items())
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_accuracy")] == [2, 4]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "lr")] == [1, 2, 3, 4]
    assert client.get_metric_history(run.info.run_id, "samples_per_s")[-1].value > 0
    assert run.data.metrics["final_loss"] == first["final_loss"]
    assert run.data.metrics["launch_to_first_step_s"] == first["startup"]["launch_to_first_step_s"]
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "config.json", "metrics.jsonl", "model"} <= names
    assert [a.path for a in client.list_artifacts(run.info.run_id, "model")] == ["model/model.safetensors"]
    logged = json.loads(open(client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path))).read())
    assert logged["steps"] == 4 and logged["tracking"]["run_id"] == run.info.run_id
    # the driver showed the progress; rank 0 printed none of its own
    assert "digits: 4 steps on 1 worker, global batch 32" in out
    assert "step 1/4 (25%)" in out and "step 4/4 (100%)" in out and "step 2/4: val accuracy" in out
    assert "[rank 0]" not in out and "resolved config" not in out
    assert f"config: {run_dir}/attempts/1/config.json (resolved; run directory {run_dir}, attempt 1)" in out

    # a second train into the same directory, --resume, continues from its commit at step 4: the same MLflow run goes on
    second = train(_cfg(cache, run_dir, "mlruns", "run.max_steps=6"), local=True, resume=True)
    out = capsys.readouterr().out
    assert json.loads((run_dir / RECORD).read_text())["run_id"] == run.info.run_id
    run = client.get_run(run.info.run_id)
    assert second["tracking"]["run_id"] == run.info.run_id and run.info.status == "FINISHED"
    assert run.data.tags["dutycycle.attempts"] == "2"
    assert run.data.tags["dutycycle.changed.run.max_steps"] == "4 -> 6" and run.data.params["run.max_steps"] == "4"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == sorted(_losses(run_dir).items())  # steps 1..6, each once
    assert [m.step for m in history] == [1, 2, 3, 4, 5, 6]
    assert "digits: resumed at step 4/6" in out and "step 6/6 (100%)" in out
    assert len(client.search_runs([run.info.experiment_id])) == 1

    # the evaluate command's files join the run, and a figure of its with them
    (run_dir / "evaluation").mkdir()
    (run_dir / "evaluation" / "test.json").write_text('{"accuracy": 0.5}')
    (run_dir / "evaluation" / "confusion.png").write_bytes(b"\x89PNG\r\n")
    files = [str(run_dir / "evaluation" / n) for n in ("test.json", "confusion.png")]
    assert log_run_files(str(run_dir), files, metrics={"test_accuracy": 0.5}, step=6) == run.info.run_id
    assert {a.path for a in client.list_artifacts(run.info.run_id, "evaluation")} == {
        "evaluation/test.json", "evaluation/confusion.png"}
    assert client.get_run(run.info.run_id).data.metrics["test_accuracy"] == 0.5
    assert log_run_files(str(tmp_path), files) is None  # an untracked directory


def test_a_run_from_step_0_is_a_new_mlflow_run_and_a_failed_launch_leaves_none(cache, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)  # nothing is written where the command runs: artifacts go beside the database

    store = str(tmp_path / "db" / "t.db")
    first = train(_cfg(cache, tmp_path / "a", f"sqlite:///{store}", "run.max_steps=2", "checkpoint.every=0",
                       "run.log_every=0"), local=True)
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    # the same directory replaced (nothing to resume from): training starts at step 0, a new run
    again = train(_cfg(cache, tmp_path / "a", f"sqlite:///{store}", "run.max_steps=2", "checkpoint.every=0",
                       "run.log_every=0"), local=True, overwrite=True)
    assert again["tracking"]["run_id"] != first["tracking"]["run_id"]
    exp = client.get_experiment_by_name("digits").experiment_id
    assert len(client.search_runs([exp])) == 2
    # a launch that fails before its loop (the cache is gone) creates no run and writes no record
    with pytest.raises(Exception):  # noqa: B017, PT011 - the loader's own error; which one is not the point
        train(_cfg(cache + "-missing", tmp_path / "b", f"sqlite:///{store}", "run.max_steps=2"), local=True)
    assert not (tmp_path / "b" / RECORD).exists() and len(client.search_runs([exp])) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "db"]  # checked before anything was written
    assert (tmp_path / "db" / "artifacts").is_dir()


def test_tracking_without_mlflow_is_refused_before_anything_starts(cache, tmp_path, monkeypatch):
    import dutycycle.trainer.launch.train as launch_train

    monkeypatch.setitem(sys.modules, "mlflow", None)  # what an environment without the extra looks like
    # the session's Ray may be up already, so "Ray still as it was" would hold by construction: any start fails
    monkeypatch.setattr(launch_train, "init_ray", lambda *a, **k: pytest.fail("Ray was started for it"))
    for local in (True, False):
        with pytest.raises(ConfigError, match=r"pip install 'dutycycle\[tracking\]'") as err:
            train(_cfg(cache, tmp_path / "r", "mlruns", "run.max_steps=2"), local=local)
        assert "tracking.mlflow_uri = 'mlruns'" in str(err.value) and INSTALL_HINT in str(err.value)
    assert not (tmp_path / "r").exists()  # nothing written


def test_stores_params_and_revisions(tmp_path):
    assert resolve_store("mlruns", "/w") == ("sqlite:////w/mlruns/mlflow.db", "/w/mlruns/artifacts")
    assert resolve_store("/abs/m", "/w") == ("sqlite:////abs/m/mlflow.db", "/abs/m/artifacts")
    assert resolve_store("file:///abs/m", "/w")[0] == "sqlite:////abs/m/mlflow.db"
    assert resolve_store("sqlite:///x.db", "/w") == ("sqlite:////w/x.db", "/w/artifacts")
    assert resolve_store("sqlite:////abs/x.db", "/w") == ("sqlite:////abs/x.db", "/abs/artifacts")
    assert resolve_store("http://mlflow:5000", "/w") == ("http://mlflow:5000", None)
    assert resolve_store("databricks", "/w") == ("databricks", None)
    params = flat_params({"data": {"cache": "c", "augment": {"flip": True, "mean": [0.5]}, "size": 32},
                          "ray": {"label_selector": {"zone": "a"}, "address": ""}, "tracking": {"tags": {}}})
    assert params == {"data.cache": "c", "data.augment.flip": "true", "data.augment.mean": "[0.5]",
                      "data.size": "32", "ray.label_selector": '{"zone": "a"}', "ray.address": "",
                      "tracking.tags": "{}"}
    clean = _git_repo(tmp_path / "clean", dirty=False)
    assert code_revision(str(tmp_path / "clean")) == {"commit": clean, "dirty": False,
                                                      "root": str(tmp_path / "clean")}
    (tmp_path / "clean" / "untracked.txt").write_text("not code")  # untracked files do not make it dirty
    assert code_revision(str(tmp_path / "clean"))["dirty"] is False
    assert code_revision(str(tmp_path)) is None  # no repository here
    with pytest.raises(ConfigError, match="sqlite:///"):
        load_config(None, ["data.cache=x", "tracking.mlflow_uri=sqlite://x.db"])
    with pytest.raises(ConfigError, match="tag key"):
        load_config(None, ["data.cache=x", "tracking.mlflow_uri=m", 'tracking.tags={"a:b" = "c"}'])


def test_files_of_a_run_on_an_object_store_are_logged_as_artifacts(tmp_path):
    """A run directory that is not a local folder (here ``memory://``) has its files copied to a local one for
    MLflow, streamed (the weights can be large); its bytes arrive unchanged."""
    from dutycycle.engine import io
    from dutycycle.trainer.launch.tracking import log_files
    from mlflow import MlflowClient

    folder = f"memory://tracked-{tmp_path.name}"
    payload = bytes(range(256)) * 4096
    io.write_bytes_atomic(io.join(folder, "model.safetensors"), payload)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    run = client.create_run(client.create_experiment("e", artifact_location=str(tmp_path / "art")))
    log_files(client, run.info.run_id, folder, ["model.safetensors"], None)
    got = client.download_artifacts(run.info.run_id, "model.safetensors", str(tmp_path / "back"))
    with open(got, "rb") as f:
        assert f.read() == payload
