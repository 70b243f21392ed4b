"""Training on a real local Ray cluster with Ray Train's TorchTrainer (gloo), and what the time accounting
shows when the loader is slow versus reading the cache; and the driver of a Ray run: rank 0's progress rows reach
it live through the mailbox actor (shown once, whatever the number of workers, and recorded in MLflow), a Ray
instance the process already runs is reused and the start-up is accounted. `dutycycle train` as a user types it
(no Ray noise, one line for the config, progress) is checked in tests/app/test_user_path.py, on the user's own data
and model."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from dutycycle.engine.synth import synthesize_cache
from dutycycle.trainer.config import load_config
from dutycycle.trainer.launch.account import STARTUP
from dutycycle.trainer.launch.progress import mailbox
from dutycycle.trainer.launch.train import train
from dutycycle.trainer.serve.load import load_model

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("cache") / "shapes")
    return synthesize_cache(uri, n_train=384, n_val=64, size=24, seed=3)


def cfg_for(cache, run_dir, *extra):
    return load_config(None, [f"data.cache={cache}", "data.global_batch_size=32", "data.eval_batch_size=64",
                              "model.width=8", "optim.lr=0.003", "optim.warmup_steps=4", "run.log_every=0",
                              "run.eval_every=6", f"run.dir={run_dir}", "run.report=false", *extra])


# one plan for both: the default partition count follows the worker count (a plan input)
COMMON = ["run.max_steps=24", "run.precision=fp64", "optim.grad_clip=0.5", "data.partitions=2"]
# what the driver test reads of the same run; none of it changes a number the parity test compares
DRIVER = ["run.log_every=1", "run.name=ray-progress"]


@pytest.fixture(scope="module")
def stage3_ray(ray_cluster, cache, tmp_path_factory):
    """The 2-worker ZeRO-3 run on Ray Train that the parity test and the driver test below both read (one launch:
    each costs a worker group's start), tracked in MLflow: (run directory, summary, what the driver printed while it
    ran)."""
    root = tmp_path_factory.mktemp("stage3-ray")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the driver's progress lines
        summary = train(cfg_for(cache, root / "run", "parallel.num_workers=2", "parallel.zero_stage=3", *COMMON,
                                *DRIVER, f"tracking.mlflow_uri={root / 'mlruns'}"), quiet=True)
    return root / "run", summary, printed.getvalue()


@pytest.mark.slow
def test_two_workers_on_ray_train_at_stage3_match_the_local_launch(stage3_ray, cache, tmp_path):
    """ZeRO-3 (FSDP2) under Ray Train's TorchTrainer, unchanged, reaches the same loss and weights as one local
    process over the same global batches (float64: differences are reordered sums, ~1e-16)."""
    from safetensors.torch import load_file

    run, summary, _ = stage3_ray
    local = train(cfg_for(cache, tmp_path / "local", *COMMON), local=True, quiet=True)
    assert summary["world_size"] == 2 and summary["launcher"] == "ray"
    assert summary["steps"] == 24 and summary["samples"] == 24 * 32
    assert summary["parallel"]["strategy"] == "fsdp2" and summary["parallel"]["zero_stage"] == 3
    assert summary["final_loss"] == pytest.approx(local["final_loss"], rel=1e-10)
    assert summary["val_loss"] == pytest.approx(local["val_loss"], rel=1e-10)
    a, b = load_file(run / "model.safetensors"), load_file(tmp_path / "local" / "model.safetensors")
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-10
    # rank 0 wrote the gathered weights with their metadata: they load alone, as trained (float64)
    model = load_model(str(run))
    assert model.metadata.weights["sha256"] == summary["weights_sha256"] and model.input_dtype == torch.float64
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 24
    assert sum(losses[-4:]) < 0.93 * sum(losses[:4])  # the loss falls (means of 4 steps: batches are noisy)
    traffic = summary["parallel"]["traffic"]["per_kind"]
    assert traffic["all_gather"]["calls"] > 0 and traffic["reduce_scatter"]["calls"] > 0
    assert summary["comm_fraction"] > 0  # two ranks do exchange parameters and gradients
    assert sorted(w["rank"] for w in summary["workers"]) == [0, 1]
    assert all(r["data_wait_max"] >= r["data_wait"] for r in rows if "loss" in r)
    # Ray Train kept its own run record under the run directory (storage_path)
    assert (run / "ray").is_dir()


@pytest.mark.slow
def test_rank_0_progress_reaches_the_driver_through_ray_and_into_mlflow(ray_cluster, stage3_ray):
    import gc

    from mlflow import MlflowClient

    run_dir, summary, out = stage3_ray
    lines = out.splitlines()
    # rank 0's rows, shown by the driver once each (two workers, one voice), evaluations included
    assert "ray-progress: 24 steps on 2 workers, global batch 32" in lines
    for step in range(1, 25):
        assert sum(ln.startswith(f"step {step}/24 (") for ln in lines) == 1, out
    assert sum("val accuracy" in ln for ln in lines) == 24 // 6 and "[rank 0]" not in out
    # the same rows, as metrics of the MLflow run: every step's loss as metrics.jsonl has it
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    client = MlflowClient(tracking_uri=summary["tracking"]["uri"])
    history = client.get_metric_history(summary["tracking"]["run_id"], "loss")
    assert [(m.step, m.value) for m in history] == sorted((r["step"], r["loss"]) for r in rows if "loss" in r)
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


@pytest.mark.slow
def test_local_mode_equals_one_worker_ray_run_bit_for_bit_and_its_results_reach_the_driver_through_storage(
        ray_cluster, cache, tmp_path):
    """A one-worker Ray run equals the local launch bit for bit; and its worker writes the run directory where the
    driver cannot see it (``memory://`` is private to each process, like a local disk on another node): the
    summary and result files still reach the driver, through Ray Train's result checkpoint in
    ``ray.storage_path``, so the figures compared come from there. (One launch for both: a launch of its own
    costs a worker group's start.)"""
    import uuid

    import fsspec

    run_dir = f"memory://dc-{uuid.uuid4().hex[:8]}/run"
    local = train(cfg_for(cache, tmp_path / "local", "run.max_steps=8"), local=True, quiet=True)
    ray_run = train(cfg_for(cache, run_dir, "run.max_steps=8", "run.report=true",
                            f"ray.storage_path={tmp_path / 'ray'}"), quiet=True)
    assert ray_run["launcher"] == "ray" and ray_run["world_size"] == local["world_size"] == 1
    assert ray_run["weights_sha256"] == local["weights_sha256"]
    assert ray_run["final_loss"] == local["final_loss"]
    assert ray_run["val_accuracy"] == local["val_accuracy"]
    fs = fsspec.filesystem("memory")  # this (driver) process's memory: filled from Ray's storage
    base = run_dir.removeprefix("memory://")
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(base, detail=False)}
    assert {"summary.json", "metrics.jsonl", "report.png", "config.json"} <= names, names
    # the launch's own files, in its attempt folder: health.json came back from rank 0 the same way
    attempt = {p.rsplit("/", 1)[-1] for p in fs.ls(base + "/attempts/1", detail=False)}
    assert {"config.json", "health.json", "attempt.json"} <= attempt, attempt
    assert [w["rank"] for w in json.loads(fs.cat(base + "/attempts/1/health.json"))["workers"]] == [0]
    rows = [json.loads(x) for x in fs.cat(base + "/metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 9))
    assert fs.cat(base + "/report.png")[:4] == b"\x89PNG"
    assert ray_run["ray_storage"].startswith(str(tmp_path / "ray"))


@pytest.mark.slow
def test_data_wait_is_large_from_a_slow_loader_and_small_from_the_cache(cache, tmp_path):
    """A loader slowed by 250 ms per batch dominates the step time of a tiny model; reading the cache with the
    loader's prefetching does not. (Ratios of two runs of the same model, not absolute times.)"""
    short = ["run.max_steps=8", "run.eval_every=0", "run.eval_max_batches=1"]
    fast = train(cfg_for(cache, tmp_path / "fast", *short), local=True, quiet=True)
    slow = train(cfg_for(cache, tmp_path / "slow", *short, "data.slow_ms=250"), local=True, quiet=True)
    assert slow["time_breakdown"]["seconds"]["data_wait"] >= 8 * 0.25
    assert slow["data_wait_fraction"] > 0.5
    assert fast["data_wait_fraction"] < slow["data_wait_fraction"] / 3
    assert slow["goodput"] < fast["goodput"]


@pytest.mark.slow
def test_torchrun_entry_trains_two_ranks(cache, tmp_path):
    """The torchrun-compatible entry: two gloo ranks started by torch.distributed.run."""
    import os
    import subprocess
    import sys

    from dutycycle.trainer.cluster.local import free_port

    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[data]\ncache = "{cache}"\nglobal_batch_size = 32\n[model]\nwidth = 8\n'
                   f'[run]\ndir = "{tmp_path / "run"}"\nmax_steps = 4\neval_every = 0\nlog_every = 0\n'
                   "report = false\n")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "dutycycle.trainer.launch.torchrun", str(cfg)],
        capture_output=True, text=True, timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["launcher"] == "torchrun" and summary["steps"] == 4
    assert summary["parallel"]["strategy"] == "ddp"
    assert summary["parallel"]["traffic"]["per_kind"]["all_reduce"]["calls"] >= 4
