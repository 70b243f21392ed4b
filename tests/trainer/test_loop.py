"""The step loop: accumulation equals one big step, the schedule, the stop on a non-finite loss, and a local
run's outputs (metrics.jsonl, summary.json, report.png, model.safetensors). Gradient exchange per stage is
tested on real ranks in test_zero.py."""

from __future__ import annotations

import json
import math
import os
import time

import pytest
import torch
from dutycycle.trainer.cluster.world import World
from dutycycle.trainer.config import ParallelSection, load_config
from dutycycle.trainer.parallel.apply import parallelize
from dutycycle.trainer.step.data import draw_shapes
from dutycycle.trainer.step.loop import TrainingDiverged, lr_at, optimizer_step
from dutycycle.trainer.step.models import build_model
from dutycycle.trainer.step.optim import make_optimizer
from dutycycle.trainer.step.timing import StepTimer


def small_cfg(tmp_path, *extra):
    return load_config(None, ['data.source=synthetic', "data.size=16", "data.global_batch_size=32",
                              "data.synthetic_samples=256", "model.width=8", "run.max_steps=12",
                              "run.eval_every=6", f"run.dir={tmp_path / 'run'}", "run.log_every=0", *extra])


def batch(n=32, size=16, seed=0):
    images, labels = draw_shapes(n, size, seed)
    return torch.from_numpy(images).permute(0, 3, 1, 2).double() / 255, torch.from_numpy(labels)


def one_step(cfg, x, y, micro_batches, steps=1):
    torch.manual_seed(0)
    model = build_model(cfg.model, 3, 4, 16).double()
    strategy = parallelize(model, ParallelSection(), World(), device=torch.device("cpu"), precision="fp64",
                           micro_batches=micro_batches)
    opt = make_optimizer(model.parameters(), cfg.optim)
    for _ in range(steps):
        optimizer_step(strategy, opt, x, y, micro_batches=micro_batches, timer=StepTimer(),
                       autocast=__import__("contextlib").nullcontext, grad_clip=1.0, lr=0.01)
    return model


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_accumulated_step_equals_one_step_on_concatenated_batch(tmp_path, optim):
    cfg = small_cfg(tmp_path, f"optim.name={optim}")
    x, y = batch()
    big = one_step(cfg, x, y, micro_batches=1, steps=3)
    acc = one_step(cfg, x, y, micro_batches=4, steps=3)
    # float64: 4 partial sums of 8 vs one sum of 32 differ by ~1e-16 relative; AdamW's division by sqrt(v) can
    # amplify that where a gradient is tiny, but not by 10^6 in 3 steps (fp32 here made 1e-5 fail: 2.4e-4)
    for (name, a), b in zip(big.state_dict().items(), acc.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=name)
    # and the steps really moved the weights (a test of two unchanged models would prove nothing)
    torch.manual_seed(0)
    init = build_model(cfg.model, 3, 4, 16).double()
    assert (init.head.weight - big.head.weight).abs().max() > 1e-4


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
    from dutycycle.trainer.launch.train import train

    cfg = small_cfg(tmp_path, "model.name=tests.trainer.test_loop:nan_model", "run.log_every=2")
    with pytest.raises(TrainingDiverged, match=r"loss became nan at step 4"):
        train(cfg, local=True, quiet=True)
    # losses are read once per logging interval (2 steps here), and the run stops at the first read after it
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]


class _InfGrad(torch.autograd.Function):
    """Identity forward (the loss stays finite); the gradient flowing back through it becomes infinite."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * math.inf


class InfGradAt(NaNAfter):
    """A plug-in model whose 4th forward pass gives a finite loss but an infinite gradient."""

    def forward(self, x):
        self.calls += 1
        out = self.lin(x.mean(dim=(2, 3)))
        return _InfGrad.apply(out) if self.calls == 4 else out


def inf_grad_model(cfg, in_channels, num_classes, image_size):
    return InfGradAt()


def test_infinite_gradient_without_clipping_is_caught_at_its_own_step(tmp_path):
    """optim.grad_clip = 0 computes no clipping norm; an infinite gradient at a finite loss (step 4, global batch
    3) must still be caught at step 4, not at step 5, whose loss it turns NaN (blaming, and skipping, batch 4)."""
    from dutycycle.trainer.launch.train import train

    cfg = small_cfg(tmp_path, "model.name=tests.trainer.test_loop:inf_grad_model", "run.log_every=2",
                    "optim.grad_clip=0")
    with pytest.raises(TrainingDiverged, match=r"gradient norm became (inf|nan) at step 4 ") as err:
        train(cfg, local=True, quiet=True)
    assert (err.value.step, err.value.epoch, err.value.batch) == (4, 0, 3)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(math.isfinite(r["grad_norm"]) for r in steps)


def test_local_run_learns_and_writes_outputs(tmp_path):
    from dutycycle.trainer.launch.train import train

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
    # every second under a name: the per-step phases and the one-time ones (restore, each epoch's loader start,
    # the final save), "other" only the rest
    from dutycycle.trainer.step.timing import ACCOUNT

    assert set(fr) == set(ACCOUNT) and summary["time_breakdown"]["seconds"]["loader_start"] > 0
    assert summary["goodput"] == pytest.approx(fr["forward_backward"] + fr["optimizer"])
    assert summary["mfu"] is None  # CPU: no peak to compare against
    assert json.loads((run / "config.json").read_text())["run"]["max_steps"] == 24
    assert (run / "summary.json").exists()
    png = (run / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert all(r["grad_norm"] > 0 for r in steps)  # clipping on (optim.grad_clip = 1): the pre-clip norm is logged
    assert summary["parallel"]["zero_stage"] == 0 and summary["parallel"]["strategy"] == "local"
    assert summary["memory"]["held_per_rank"][0]["optimizer"] > 0
    # the consolidated weights load into a plain module with no code execution (safetensors)
    from safetensors.torch import load_file

    plain = build_model(cfg.model, 3, 4, 16)
    plain.load_state_dict(load_file(run / "model.safetensors"))
    from dutycycle.trainer.step.summary import weights_digest

    assert weights_digest(plain.state_dict()) == summary["weights_sha256"]


def test_run_directory_on_object_storage(s3):
    """Run storage is any fsspec location: config, metrics, summary and report land in the S3 bucket."""
    import s3fs
    from dutycycle.trainer.launch.train import train

    run_dir = f"{s3}/runs/r1"
    cfg = load_config(None, ["data.source=synthetic", "data.size=16", "data.global_batch_size=32",
                             "data.synthetic_samples=128", "model.width=8", "run.max_steps=4", "run.eval_every=2",
                             f"run.dir={run_dir}", "run.log_every=0"])
    summary = train(cfg, local=True, quiet=True)
    assert summary["steps"] == 4
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]})
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(run_dir.removeprefix("s3://"))}
    assert {"config.json", "metrics.jsonl", "summary.json", "report.png", "model.safetensors"} <= names, names
    rows = [json.loads(x) for x in fs.cat(run_dir.removeprefix("s3://") + "/metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert all(r["val_samples"] > 0 for r in rows if "val_accuracy" in r)


def test_the_job_account_adds_every_attempt():
    from dutycycle.trainer.step.metrics import job_account

    t0 = time.time() - 200.0  # the first attempt started 200 s ago (its first step began at t0 + 100)
    rows = [{"step": 1, "loss": 1.0, "step_s": 1.0, "forward_backward": 0.5, "optimizer": 0.1, "time": t0 + 101.0},
            {"step": 4, "event": "resume", "steps_redone": 2, "redone_s": 2.0, "down_s": 10.0,
             "kept_useful_s": 2.4, "time": t0 + 130.0},
            {"step": 6, "event": "resume", "steps_redone": 1, "redone_s": 1.0, "down_s": 5.0,
             "kept_useful_s": 3.6, "time": t0 + 160.0},
            {"step": 7, "loss": 1.0, "step_s": 1.0, "forward_backward": 0.5, "optimizer": 0.1, "time": t0 + 170.0}]
    job = job_account(rows, wall_s=20.0, useful_s=12.0)
    assert job["attempts"] == 3 and job["steps_redone"] == 3
    assert job["failures_s"] == 18.0
    assert job["wall_s"] == pytest.approx(100.0, abs=5.0)  # from the first step's start to now
    assert job["goodput"] == pytest.approx((12.0 + 3.6) / job["wall_s"])
    one = job_account([rows[0]], wall_s=20.0, useful_s=12.0)
    assert one["attempts"] == 1 and one["failures_s"] == 0 and one["goodput"] == pytest.approx(0.6)
