"""The trainer's artifacts carry ``"format": 1`` (``engine.formats``): a checkpoint manifest, a run's
``metrics.jsonl`` rows and its ``summary.json`` of another format, or of none, are refused naming the file and
the version found."""

from __future__ import annotations

import json
import os

import pytest
from dutycycle.engine import sealed
from dutycycle.engine.errors import FormatError
from dutycycle.trainer.checkpoint import manifest as mf
from dutycycle.trainer.step.metrics import MetricsWriter, read_metrics, read_summary

FOUND = [(2, "has format 2"), (None, "has no `format` field")]


def _set(d: dict, found) -> dict:
    d = dict(d)
    if found is None:
        d.pop("format")
    else:
        d["format"] = found
    return d


@pytest.mark.parametrize("found, said", FOUND)
def test_a_checkpoint_manifest_of_another_format_is_refused(tmp_path, found, said):
    step = str(tmp_path / mf.step_name(3))
    os.makedirs(step)
    mf.write_manifest(step, mf.Manifest(step=3, world_size=1, files={}))
    assert mf.read_manifest(step).format == 1
    path = os.path.join(step, mf.MANIFEST)
    d = json.loads(open(path).read())
    assert d["format"] == 1
    open(path, "w").write(json.dumps(sealed.seal(_set(d, found))))
    with pytest.raises(FormatError, match=f"{mf.MANIFEST} {said}; this dutycycle reads format 1 only"):
        mf.read_manifest(step)


@pytest.mark.parametrize("found, said", FOUND)
def test_run_metrics_of_another_format_are_refused_naming_the_row(tmp_path, found, said):
    writer = MetricsWriter(str(tmp_path))
    writer.log({"step": 1, "loss": 2.0})
    writer.log({"step": 2, "loss": 1.5})
    writer.close()
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1, 2] and all(r["format"] == 1 for r in rows)
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(_set(rows[1], found)) + "\n")
    with pytest.raises(FormatError, match=rf"metrics.jsonl' \(row 2\) {said}"):
        read_metrics(str(tmp_path))


@pytest.mark.parametrize("found, said", FOUND)
def test_a_run_summary_of_another_format_is_refused(tmp_path, found, said):
    (tmp_path / "summary.json").write_text(json.dumps({"format": 1, "steps": 4}))
    assert read_summary(str(tmp_path))["steps"] == 4
    (tmp_path / "summary.json").write_text(json.dumps(_set({"format": 1, "steps": 4}, found)))
    with pytest.raises(FormatError, match=f"summary.json' {said}"):
        read_summary(str(tmp_path))


@pytest.mark.parametrize("found, said", FOUND)
def test_a_ray_train_pointer_of_another_format_is_refused(tmp_path, found, said):
    from dutycycle.trainer.checkpoint import checkpoint_uri
    from dutycycle.trainer.checkpoint.raytrain import POINTER
    from ray.train import Checkpoint

    commit = tmp_path / "checkpoints" / mf.step_name(8)
    commit.mkdir(parents=True)
    (commit / mf.MANIFEST).write_text("{}")
    pointer = tmp_path / "pointer"
    pointer.mkdir()
    record = {"format": 1, "uri": str(commit), "step": 8}
    (pointer / POINTER).write_text(json.dumps(record))
    assert checkpoint_uri(Checkpoint.from_directory(str(pointer))) == {"uri": str(commit), "step": 8}
    (pointer / POINTER).write_text(json.dumps(_set(record, found)))
    with pytest.raises(FormatError, match=f"{POINTER} {said}"):
        checkpoint_uri(Checkpoint.from_directory(str(pointer)))


def test_a_health_record_of_another_format_names_the_file_in_the_chaos_report(tmp_path):
    """The failure injector reads the workers' PIDs from health.json: one of another format is not trusted."""
    import torch
    from dutycycle.trainer.app.chaos import KillOneWorker
    from dutycycle.trainer.cluster import health

    health.preflight(0, 1, torch.device("cpu"), 30.0, str(tmp_path))
    record = json.loads((tmp_path / "health.json").read_text())
    assert record["format"] == 1 and record["workers"][0]["pid"] == os.getpid()
    (tmp_path / "health.json").write_text(json.dumps(_set(record, 2)))
    writer = MetricsWriter(str(tmp_path))
    writer.log({"step": 5, "loss": 1.0})
    writer.close()
    ckpt = tmp_path / "checkpoints"
    mf.write_manifest(str(ckpt / mf.step_name(4)), mf.Manifest(step=4, world_size=1, files={}))
    chaos = KillOneWorker(str(tmp_path), str(ckpt), 1, timeout_s=10, since=0.0)  # its rows predate it here
    chaos.run()
    assert "health.json has format 2" in chaos.report.error
