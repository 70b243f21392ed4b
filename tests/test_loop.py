"""The step loop: accumulation equals one big step, gradients sync once per optimizer step, the schedule, the
stop on a non-finite loss, and a local run's outputs (metrics.jsonl, summary.json, report.png)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from dutycycle.trainer.config import load_config
from dutycycle.trainer.data import draw_shapes
from dutycycle.trainer.loop import StepHooks, TrainingDiverged, lr_at, make_optimizer, optimizer_step
from dutycycle.trainer.models import build_model
from dutycycle.trainer.sync import Checkpointer, NoSync, ParamGather
from dutycycle.trainer.timing import StepTimer

from .harness import run_distributed


def small_cfg(tmp_path, *extra):
    return load_config(None, ['data.source=synthetic', "data.size=16", "data.global_batch_size=32",
                              "data.synthetic_samples=256", "model.width=8", "run.max_steps=12",
                              "run.eval_every=6", f"run.dir={tmp_path / 'run'}", "run.log_every=0", *extra])


def batch(n=32, size=16, seed=0):
    images, labels = draw_shapes(n, size, seed)
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255, torch.from_numpy(labels)


def one_step(cfg, x, y, micro_batches, steps=1):
    torch.manual_seed(0)
    model = build_model(cfg.model, 3, 4, 16)
    opt = make_optimizer(model, cfg.optim)
    hooks = StepHooks(grad_sync=NoSync(), param_gather=ParamGather(), checkpointer=Checkpointer())
    for _ in range(steps):
        optimizer_step(model, opt, x, y, micro_batches=micro_batches, hooks=hooks, timer=StepTimer(),
                       autocast=__import__("contextlib").nullcontext, grad_clip=1.0, lr=0.01)
    return model, hooks


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_accumulated_step_equals_one_step_on_concatenated_batch(tmp_path, optim):
    cfg = small_cfg(tmp_path, f"optim.name={optim}")
    x, y = batch()
    big, hooks_big = one_step(cfg, x, y, micro_batches=1, steps=3)
    acc, hooks_acc = one_step(cfg, x, y, micro_batches=4, steps=3)
    # fp32 tolerance: the same sum in a different order (4 partial sums of 8 vs one sum of 32) differs in the
    # last bits; Adam divides by sqrt(v) and can grow that to ~2e-6 here. 1e-5 is 1/1000 of one lr-sized step.
    for (name, a), b in zip(big.state_dict().items(), acc.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    # the gradient sync point ran once per optimizer step, never per micro-batch
    assert hooks_big.grad_sync.stats.calls == 3 and hooks_acc.grad_sync.stats.calls == 3
    # and the steps really moved the weights (a test of two unchanged models would prove nothing)
    torch.manual_seed(0)
    init = build_model(cfg.model, 3, 4, 16)
    assert not torch.equal(init.head.weight, big.head.weight)


def _sync_counting_worker(rank, world_size):
    return {m: _count_sync(rank, world_size, m) for m in (1, 4)}


def _count_sync(rank, world_size, micro_batches):
    import torch.distributed as dist
    from dutycycle.trainer.sync import AllReduceSync

    cfg = load_config(None, ["data.source=synthetic", "model.width=8", "parallel.num_workers=2",
                             f"data.micro_batches={micro_batches}", "data.global_batch_size=32"])
    torch.manual_seed(0)
    model = build_model(cfg.model, 3, 4, 16)
    opt = make_optimizer(model, cfg.optim)
    sync = AllReduceSync(world_size, bucket_mb=0.002)  # small buckets: several collectives per sync
    calls = []
    original = dist.all_reduce

    def counting_all_reduce(t, *a, **k):
        calls.append(t.numel())
        return original(t, *a, **k)

    dist.all_reduce = counting_all_reduce
    hooks = StepHooks(grad_sync=sync, param_gather=ParamGather(), checkpointer=Checkpointer())
    x, y = batch(32, 16, seed=1)
    mine = slice(rank * 16, (rank + 1) * 16)
    for _ in range(2):
        optimizer_step(model, opt, x[mine], y[mine], micro_batches=micro_batches, hooks=hooks, timer=StepTimer(),
                       autocast=__import__("contextlib").nullcontext, grad_clip=0.0, lr=0.01)
    dist.all_reduce = original
    n_params = sum(p.numel() for p in model.parameters())
    return {"calls": sync.stats.calls, "collectives": sync.stats.collectives, "bytes": sync.stats.bytes,
            "all_reduce_elems": sum(calls), "n_params": n_params}


def test_gradients_are_exchanged_once_per_optimizer_step():
    """Real gloo, 2 ranks, 2 optimizer steps: the bytes all-reduced per optimizer step are one copy of the
    gradients in fp32, whether the step has 1 or 4 micro-batches."""
    results = run_distributed(_sync_counting_worker, 2)
    for r in [res[m] for res in results for m in ("1", "4")]:
        assert r["calls"] == 2
        assert r["bytes"] == 2 * 4 * r["n_params"]
        assert r["all_reduce_elems"] == 2 * r["n_params"]
        assert r["collectives"] > 2  # bucketed


def test_lr_schedule_warmup_then_cosine(tmp_path):
    cfg = small_cfg(tmp_path, "optim.lr=0.1", "optim.warmup_steps=10", "optim.min_lr_ratio=0.1")
    lrs = [lr_at(s, 110, cfg.optim) for s in range(110)]
    assert lrs[0] == pytest.approx(0.01) and lrs[9] == pytest.approx(0.1)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10], strict=False))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert lrs[-1] == pytest.approx(0.01, rel=0.01)
    assert lrs[60] == pytest.approx(0.1 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))))


class NaNAfter(torch.nn.Module):
    """A plug-in model whose output becomes NaN from its 4th forward pass on."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        out = self.lin(x.mean(dim=(2, 3)))
        return out * float("nan") if self.calls > 3 else out


def nan_model(cfg, in_channels, num_classes, image_size):
    return NaNAfter()


def test_non_finite_loss_stops_with_step_and_loss(tmp_path):
    from dutycycle.trainer.launch import train

    cfg = small_cfg(tmp_path, "model.name=tests.test_loop:nan_model")
    with pytest.raises(TrainingDiverged, match=r"loss became nan at step 4"):
        train(cfg, local=True, quiet=True)


def test_local_run_learns_and_writes_outputs(tmp_path):
    from dutycycle.trainer.launch import train

    cfg = small_cfg(tmp_path, "run.max_steps=24", "optim.lr=0.01", "optim.warmup_steps=2")
    summary = train(cfg, local=True, quiet=True)
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "val_accuracy" in r]
    assert [r["step"] for r in steps] == list(range(1, 25))
    assert [r["step"] for r in evals] == [6, 12, 18, 24]
    assert summary["steps"] == 24 and summary["samples"] == 24 * 32 and summary["world_size"] == 1
    assert summary["final_loss"] < summary["first_loss"]
    assert 0.0 <= summary["val_accuracy"] <= 1.0 and all(r["val_samples"] > 0 for r in evals)
    fr = summary["time_breakdown"]["fractions"]
    assert sum(fr.values()) == pytest.approx(1.0, abs=1e-6)
    assert summary["goodput"] == pytest.approx(fr["forward_backward"] + fr["optimizer"])
    assert summary["mfu"] is None  # CPU: no peak to compare against
    assert json.loads((run / "config.json").read_text())["run"]["max_steps"] == 24
    assert (run / "summary.json").exists()
    png = (run / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_run_directory_on_object_storage(s3):
    """Run storage is any fsspec location: config, metrics, summary and report land in the S3 bucket."""
    import s3fs
    from dutycycle.trainer.launch import train

    run_dir = f"{s3}/runs/r1"
    cfg = load_config(None, ["data.source=synthetic", "data.size=16", "data.global_batch_size=32",
                             "data.synthetic_samples=128", "model.width=8", "run.max_steps=4", "run.eval_every=2",
                             f"run.dir={run_dir}", "run.log_every=0"])
    summary = train(cfg, local=True, quiet=True)
    assert summary["steps"] == 4
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]})
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(run_dir.removeprefix("s3://"))}
    assert {"config.json", "metrics.jsonl", "summary.json", "report.png"} <= names, names
    rows = [json.loads(x) for x in fs.cat(run_dir.removeprefix("s3://") + "/metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert all(r["val_samples"] > 0 for r in rows if "val_accuracy" in r)
