"""What runs where the training runs: a Ray Train worker (``ray_worker``) or this process (``in_process``).

This module imports the step loop and with it torch.distributed's FSDP and DTensor (a second or more): the
driver of a Ray run does without them, so launch/train.py loads this module only inside a worker or for
``--local``.
"""

from __future__ import annotations

import time

from dutycycle.trainer.checkpoint.raytrain import latest_reported, report_commit
from dutycycle.trainer.cluster.topology import node_label
from dutycycle.trainer.config import from_dict, resolve_for_world, use_gpu
from dutycycle.trainer.step.loop import WorkerContext, set_threads
from dutycycle.trainer.step.trainer import Trainer

from .progress import RaySink
from .results import quiet_ray_logs, report_results


def ray_worker(payload: dict, started: float) -> None:
    """One Ray Train worker's run (every rank). Ray Train has already set up the process group (gloo or nccl);
    ``started``: the wall clock when the worker entered the train function (launch/account.py)."""
    import ray
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    quiet_ray_logs()  # also when Ray was started by someone else, without dutycycle's setup hook
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    # the run's config at the size Ray Train started this group with (an elastic run's may be any of
    # parallel.num_workers = [min, max]): the same global batches, more micro-batches on fewer workers
    cfg = resolve_for_world(from_dict(payload["config"]), world)
    set_threads(cfg, ctx.get_local_world_size())
    device = ray.train.torch.get_device() if payload["use_gpu"] else torch.device("cpu")
    rt = ray.get_runtime_context()

    me = {"rank": rank, "node_id": rt.get_node_id(), "node": node_label(), "labels": dict(rt.get_node_labels() or {})}
    where = [None] * world
    if world > 1:
        dist.all_gather_object(where, me)
    else:
        where = [me]
    # Ray's own labels (ray.io/...) are noise in a summary; keep the user's
    for w in where:
        w["labels"] = {k: v for k, v in w["labels"].items() if not k.startswith("ray.io/")}

    # a restarted group resumes from the newest verified commit by itself (checkpoint.resume = "auto"); Ray
    # Train's own record of the last reported one is kept for the summary
    info = {"workers": where, "launcher": "ray", "ray_checkpoint": latest_reported()}
    last_commit: dict = {}

    def on_commit(step: int, uri: str) -> None:
        last_commit.update(step=step, uri=uri)
        report_commit(step, uri)

    def report(metrics: dict) -> None:  # an evaluation's metrics: the barrier only, the hand-over in the background
        ray.train.report(metrics, checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)

    # rank 0's rows go to the driver's mailbox; submitted, never awaited (launch/progress.py)
    sink = RaySink(payload["progress"]["mailbox"], payload["progress"]["token"]) if rank == 0 else None
    ctx = WorkerContext(rank=rank, world_size=world, device=device, report=report, run_dir=payload["run_dir"],
                        attempt_dir=payload["attempt_dir"], info=info, on_commit=on_commit,
                        node_labels=[w["node"] for w in where], started=started, progress=sink)
    try:
        with Trainer(cfg, ctx) as trainer:
            summary = trainer.train()
    finally:
        if sink is not None:
            sink.close()
    report_results(cfg, payload["run_dir"], summary, rank, last_commit or None, attempt_dir=payload["attempt_dir"])


def in_process(cfg, progress=None, attempt_dir: str = "") -> None:
    """One worker in this process, no Ray and no process group (``--local``); ``progress``: the driver's sink;
    ``attempt_dir``: this launch's folder in the run directory ("" = the run directory)."""
    import torch

    gpu = use_gpu(cfg, torch.cuda.device_count())
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    set_threads(cfg, 1)
    with Trainer(cfg, WorkerContext(rank=0, world_size=1, device=device, run_dir=cfg.run.dir,
                                    attempt_dir=attempt_dir, started=time.time(), progress=progress)) as trainer:
        trainer.train()
