"""Ranks SIGKILLed under torchrun's elastic agent and restarted the way the product restarts (``--max-restarts``).

    python -m tests.support.kill_launch ROOT

One process imports torch and dutycycle once, then runs, per layout (``LAYOUTS``), two launches through
``torch.distributed.launcher.elastic_launch`` (what the ``torchrun`` command runs) with forked ranks (a fork starts in
milliseconds; a fresh Python with torch takes seconds on a busy 2-core machine): the uninterrupted reference
(ROOT/LAYOUT/ref), and the run with faults (ROOT/LAYOUT/run, ``--max-restarts 2``). Each rank runs the product's
torchrun entry (``dutycycle.trainer.launch.torchrun.main``) on ``ckpt_worker.small_cfg``'s settings (float64, the CNN
with dropout, asynchronous saves every 2 steps, 8 steps), with one fault per attempt (``KILLS``, by torchrun's
``TORCHELASTIC_RESTART_COUNT``):

- attempt 0: rank 1 SIGKILLed during the backward of step 5 (its peers inside the step's collectives; the save of
  step 4 may still be in flight on the background threads): mid-step;
- attempt 1: rank 1 SIGKILLed in the asynchronous save of step 6 once its shard is written (its part of DCP's
  write is done: every rank's file is there) and before the commit's gather: a save half written, no manifest;
- attempt 2 resumes from the newest commit and finishes.

Before anything else, rank 0 of every attempt records what the checkpoint root holds (each ``step-*`` directory's
files) in ``RUN_DIR/kill-evidence/attempt-K.json``: what the restarted attempt found; a rank about to SIGKILL
itself leaves ``killed-K`` there (the agent logs only the first failure it notices, often the peer's).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys

from . import ckpt_models as cm
from . import ckpt_worker as cw

# (ranks, overrides): hybrid sharding needs 2 ranks per replica group to shard anything (the config refuses
# replicate = world size: that is DDP), so its run has 2 groups of 2
LAYOUTS = {"stage3": (2, ["parallel.zero_stage=3"]),
           "hybrid": (4, ["parallel.zero_stage=3", "parallel.replicate=2"])}
EXTRA = ["run.precision=fp64", "run.max_steps=8", "checkpoint.every=2", "checkpoint.async_save=true"]
KILLS = {0: (1, "step", 5), 1: (1, "save", 6)}  # attempt: (rank, where, the step's forward / the saved step)


def _die(where: str) -> None:
    """SIGKILL this process, leaving a note first (the agent logs only the failures it notices first)."""
    attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
    with open(os.path.join(os.environ["DUTYCYCLE_TEST_RUN_DIR"], "kill-evidence", f"killed-{attempt}"), "w") as f:
        json.dump({"rank": int(rank), "where": where, "pid": os.getpid()}, f)
    os.kill(os.getpid(), signal.SIGKILL)


def _record(run_dir: str, attempt: int) -> None:
    root = os.path.join(run_dir, "checkpoints")
    found = {d: sorted(os.listdir(os.path.join(root, d))) for d in sorted(os.listdir(root))
             if d.startswith("step-")} if os.path.isdir(root) else {}
    os.makedirs(os.path.join(run_dir, "kill-evidence"), exist_ok=True)
    with open(os.path.join(run_dir, "kill-evidence", f"attempt-{attempt}.json"), "w") as f:
        json.dump(found, f)


def _arm(where: str, at: int) -> None:
    if where == "step":
        cm.FAULTS["kill_at"] = at  # the at-th training forward of this attempt (attempt 0: step at)
        cm.FAULTS["on_kill"] = lambda: _die("step")
        return
    from dutycycle.trainer.checkpoint import saver

    real, name = saver.write_state, f"step-{at:08d}"

    def write_state(state, uri, *args, **kwargs):
        files = real(state, uri, *args, **kwargs)
        if uri.rstrip("/").endswith(name):
            _die("save")
        return files

    saver.write_state = write_state


def rank_main(config: str, run_dir: str, sets: list[str], kills: dict) -> None:
    """One rank of one attempt (forked by the agent, which set RANK, WORLD_SIZE, TORCHELASTIC_RESTART_COUNT...)."""
    from dutycycle.trainer.launch import torchrun

    # die with the driver (a test's timeout kills it): a rank left behind would wait in gloo for good
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    os.environ["DUTYCYCLE_TEST_RUN_DIR"] = run_dir
    if rank == 0:
        _record(run_dir, attempt)
    if attempt in kills and kills[attempt][0] == rank:
        _arm(*kills[attempt][1:])
    code = torchrun.main([config, *[x for s in sets for x in ("--set", s)]])
    if code:
        raise SystemExit(code)


def launch(root: str, layout: str, name: str, kills: dict) -> None:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    world, extra = LAYOUTS[layout]
    run_dir = os.path.join(root, layout, name)
    config = os.path.join(root, "empty.toml")
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world, rdzv_backend="c10d",
                       rdzv_endpoint="localhost:0", max_restarts=len(kills), monitor_interval=0.1,
                       start_method="fork")
    elastic_launch(cfg, rank_main)(config, run_dir, cw.small_overrides(run_dir, *extra, *EXTRA), kills)


def main() -> int:
    import torch
    from dutycycle.trainer.launch import torchrun  # noqa: F401 - imported once here, not in every forked rank

    torch.set_num_threads(1)  # no OpenMP pool in the parent: ranks are forked
    os.environ["OMP_NUM_THREADS"] = "1"
    root = sys.argv[1]
    os.makedirs(root, exist_ok=True)
    open(os.path.join(root, "empty.toml"), "w").close()
    for layout in LAYOUTS:
        launch(root, layout, "ref", {})
        launch(root, layout, "run", KILLS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
