"""Worker code for the peer-memory tests: spawned gloo ranks (tests/support/harness.py) that join the test
session's Ray cluster, where the run's memory stores live (trainer/checkpoint/peer.py)."""

from __future__ import annotations

import json
import os

from dutycycle.trainer.step.models import SmallCNN

from . import ckpt_models as cm
from . import ckpt_worker as cw


class CrashingCNN(SmallCNN):
    """The built-in CNN with ckpt_models' injected crash and nothing random in its forward (ckpt_models' CNN has
    a dropout, whose masks depend on how the batch is split over ranks: no run at another size could match it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forwards = 0

    def forward(self, x):
        cm._count_forward(self)
        return super().forward(x)


def crashing_cnn(cfg, in_channels, num_classes, image_size):
    return CrashingCNN(in_channels, num_classes, width=cfg.width, depth=cfg.depth, groups=cfg.groups)


def overrides(run_dir: str, world: int, *extra: str) -> list[str]:
    """``ckpt_worker.small_cfg`` in float64 (losses compared across world sizes), peer memory every 2 steps,
    storage every 4."""
    return ["run.precision=fp64", "checkpoint.memory_every=2", "checkpoint.every=4", f"parallel.num_workers={world}",
            "parallel.zero_stage=3", "run.max_steps=12", "model.name=tests.support.peer_worker:crashing_cnn", *extra]


def train(rank: int, world: int, address: str, run_dir: str, crash_at: int | None, extra: list[str]) -> dict:
    """One rank of a run under Ray (this process joins the cluster at ``address``), crashing at forward
    ``crash_at`` (None: to the end)."""
    import ray

    ray.init(address=address, log_to_driver=False, configure_logging=False)
    try:
        cm.FAULTS["crash_at"] = crash_at
        try:
            out = cw.train(cw.small_cfg(run_dir, *overrides(run_dir, world, *extra)), rank, world)
        except cm.InjectedCrash:
            return {"crashed": True}
        finally:
            cm.reset()
        return {"crashed": False, "resumed": out["checkpoint"]["resumed"], "memory": out["checkpoint"]["memory"],
                "steps": out["steps"]}
    finally:
        ray.shutdown()


def losses(run_dir: str) -> dict[int, float]:
    """Each step's global loss, from the run's metrics rows."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}
