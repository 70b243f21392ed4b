"""Error feedback's residuals through stop-and-resume and rollback, at 2 real ranks (stage 3, int4 qgZ): the
workers behind tests/trainer/test_error_feedback.py."""

from __future__ import annotations

import json
import shutil

from . import ckpt_models as cm
from .ckpt_worker import small_cfg, train

EF = ["parallel.zero_stage=3", "parallel.quant_grads=int4", "parallel.error_feedback=true", "checkpoint.every=2"]


def losses(run_dir: str) -> dict[int, float]:
    with open(f"{run_dir}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def ef_runs(rank: int, world: int, root: str) -> dict:
    """An uninterrupted run; a run crashing at step 11 resumed (from the commit of step 10) with its residuals,
    and the same crashed run resumed with the saved residuals ignored (the control that shows they matter); a
    run whose 6th forward is NaN once, rolled back to step 4."""
    from dutycycle.trainer.parallel import residuals

    extra = [f"parallel.num_workers={world}", *EF]
    a = train(small_cfg(f"{root}/a", *extra), rank, world)
    cm.FAULTS["crash_at"] = 11
    try:
        train(small_cfg(f"{root}/b", *extra), rank, world)
        raise AssertionError("the injected crash did not happen")
    except cm.InjectedCrash:
        pass
    cm.reset()
    if rank == 0:
        shutil.copytree(f"{root}/b", f"{root}/control")
    from dutycycle.trainer.cluster.world import broadcast

    broadcast(None, world)  # the copy exists before rank 1 resumes from it
    b = train(small_cfg(f"{root}/b", *extra), rank, world)
    real = residuals.load_targets
    residuals.load_targets = lambda *args, **kwargs: ({}, "")  # the control: saved residuals never read
    try:
        control = train(small_cfg(f"{root}/control", *extra), rank, world)
    finally:
        residuals.load_targets = real
    cm.FAULTS["nan_at"] = 6
    c = train(small_cfg(f"{root}/c", *extra, "checkpoint.on_nonfinite=rollback"), rank, world)
    cm.reset()
    out = {name: {"weights": s["weights_sha256"], "resumed": s["checkpoint"]["resumed"],
                  "nonfinite": s["checkpoint"]["nonfinite"], "memory": s["memory"]}
           for name, s in (("a", a), ("b", b), ("control", control), ("c", c))}
    if rank == 0:
        for name in out:
            out[name]["losses"] = losses(f"{root}/{name}")
    return out
