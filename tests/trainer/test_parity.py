"""End to end through the ``Trainer`` (data plan, micro-batches, clipping, schedule, evaluation, summary):
1 worker and 2 workers trained on the same global batches end with the same weights, at ZeRO stage 0 (DDP) and
stage 3 (FSDP2), in float64. Tolerance as in test_zero.py: measured differences are ~1e-16."""

from __future__ import annotations

import pytest

from ..support.harness import run_distributed


def _train(rank, world_size, stage, micro_batches):
    import torch
    from dutycycle.trainer.config import load_config
    from dutycycle.trainer.parallel.state import full_state_dict
    from dutycycle.trainer.step.loop import WorkerContext
    from dutycycle.trainer.step.models import build_model
    from dutycycle.trainer.step.trainer import Trainer

    cfg = load_config(None, ["data.source=synthetic", "data.size=16", "data.global_batch_size=32",
                             "data.synthetic_samples=128", "model.width=8", "run.max_steps=6", "run.eval_every=3",
                             "run.log_every=0", "optim.lr=0.01", "optim.warmup_steps=2", "run.precision=fp64",
                             "optim.grad_clip=0.5", f"parallel.num_workers={world_size}",
                             f"parallel.zero_stage={stage}", f"data.micro_batches={micro_batches}"])
    torch.set_num_threads(1)
    ctx = WorkerContext(rank=rank, world_size=world_size)
    with Trainer(cfg, ctx) as trainer:
        summary = trainer.train()
    full = full_state_dict(ctx.state["strategy"])
    params = torch.cat([v.reshape(-1) for _, v in sorted(full.items())]) if full else None
    torch.manual_seed(cfg.run.seed)  # the initialization the Trainer started from
    init = build_model(cfg.model, 3, 4, 16).double().state_dict()
    init = torch.cat([v.reshape(-1) for _, v in sorted(init.items())])
    return {"params": params.tolist() if params is not None else None, "loss": summary["final_loss"],
            "moved": float((params - init).abs().max()) if params is not None else None,
            "val_accuracy": summary["val_accuracy"], "val_loss": summary["val_loss"],
            "traffic": summary["parallel"]["traffic"]["bytes"], "steps": summary["steps"]}


def _both_stages(rank, world_size, micro_batches):
    return {stage: _train(rank, world_size, stage, micro_batches) for stage in (0, 3)}


@pytest.fixture(scope="module")
def runs():
    one = run_distributed(_both_stages, 1, 1)[0]
    two = run_distributed(_both_stages, 2, 2)  # and with gradient accumulation on top
    return one, two


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_one_and_two_workers_reach_the_same_weights(runs, stage):
    import torch

    one, two = runs[0][str(stage)], [r[str(stage)] for r in runs[1]]
    a, b = torch.tensor(one["params"]), torch.tensor(two[0]["params"])
    torch.testing.assert_close(b, a, rtol=0, atol=1e-10)
    assert two[0]["loss"] == pytest.approx(one["loss"], rel=1e-12)
    assert two[0]["val_loss"] == pytest.approx(one["val_loss"], rel=1e-12)
    assert two[0]["val_accuracy"] == two[1]["val_accuracy"] == one["val_accuracy"]
    assert two[0]["steps"] == 6 and two[0]["traffic"] > 0 and one["traffic"] == 0
    assert one["moved"] > 1e-3  # training moved the weights: parity of untouched models would prove nothing
