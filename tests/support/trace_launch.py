"""A run over a real cache SIGKILLed at 3 ranks and resumed at 2, for the trace test (tests/trainer/test_trace.py).

    python -m tests.support.trace_launch ROOT CACHE

One process imports torch and dutycycle once, then runs two launches of the product's torchrun entry under
torchrun's elastic agent with forked ranks (as tests/support/kill_launch.py does), in ROOT/run:

- attempt 1 at 3 ranks: global batch 12 in 2 micro-batches per rank, a commit every 5 steps, every sample's loss
  recorded (``run.record_sample_loss``); rank 1 SIGKILLs itself in the backward of step 8 (the step's first
  micro-batch), after steps 6 and 7 were trained and their per-sample rows written: the agent, with no restarts
  left, ends the launch;
- attempt 2, ``--resume`` at 2 ranks: continues from the commit of step 5 (mid-epoch), trains steps 6 to 10 again
  at the other size, and finishes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from . import ckpt_models as cm

STEPS, EVERY, KILL_STEP, MICRO = 10, 5, 8, 2


def overrides(run_dir: str, cache: str) -> list[str]:
    return [f"data.cache={cache}", "data.global_batch_size=12", f"data.micro_batches={MICRO}",
            "model.name=tests.support.ckpt_models:risky_cnn", "model.width=8", f"run.max_steps={STEPS}",
            "run.eval_every=0", f"run.dir={run_dir}", "run.log_every=1", f"checkpoint.every={EVERY}",
            "checkpoint.async_save=false", "run.report=false", "run.save_model=false", "run.health_check=false", "run.record_sample_loss=true",
            "parallel.threads_per_worker=1", "optim.warmup_steps=2"]


def rank_main(config: str, sets: list[str], flags: list[str], kill: bool) -> None:
    from dutycycle.trainer.launch import torchrun

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the driver
    if kill and int(os.environ["RANK"]) == 1:
        cm.FAULTS["kill_at"] = (KILL_STEP - 1) * MICRO + 1  # the first micro-batch's forward of step KILL_STEP
    code = torchrun.main([config, *flags, *[x for s in sets for x in ("--set", s)]])
    if code:
        raise SystemExit(code)


def launch(root: str, world: int, sets: list[str], flags: list[str], kill: bool) -> bool:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world, rdzv_backend="c10d",
                       rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1, start_method="fork")
    try:
        elastic_launch(cfg, rank_main)(os.path.join(root, "empty.toml"), sets, flags, kill)
    except ChildFailedError:
        return False
    return True


def main() -> int:
    import torch
    from dutycycle.trainer.launch import torchrun  # noqa: F401 - imported once here, not in every forked rank

    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    root, cache = sys.argv[1], sys.argv[2]
    open(os.path.join(root, "empty.toml"), "w").close()
    sets = overrides(os.path.join(root, "run"), cache)
    assert not launch(root, 3, sets, [], kill=True), "attempt 1 should have lost rank 1"
    assert launch(root, 2, sets, ["--resume"], kill=False), "the resume at 2 ranks failed"
    return 0


if __name__ == "__main__":
    sys.exit(main())
