"""torchrun-compatible entry: ``torchrun --nproc-per-node 2 -m dutycycle.trainer.launch.torchrun CONFIG [--set k=v]``.

Reads RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE (and MASTER_ADDR / MASTER_PORT) from the environment as
torchrun sets them, initializes the process group (nccl on GPU, gloo on CPU) and runs the same step loop.
Rank 0 checks the data, the model and the run directory (``--resume``, ``--overwrite``, ``--force`` as for
``dutycycle train``), saves the config in its attempt folder, writes metrics and the summary, and draws the
report; it is the driver too: it shows the progress (progress.py) and records the run in MLflow when
``tracking.mlflow_uri`` is set. A launch refused there exits 2 on rank 0; the other ranks then stop at the
process group's timeout. A restart by torchrun (``--max-restarts``; ``TORCHELASTIC_RESTART_COUNT`` > 0) is the
same launch: it continues in its attempt folder and resumes from the newest commit, as a restarted Ray Train
group does. A launch whose last try fails before training removes its attempt folder (rundir.py).
"""

from __future__ import annotations

import argparse
import os
import sys

from dutycycle.engine.errors import ConfigError, DutycycleError
from dutycycle.trainer.cluster.world import broadcast
from dutycycle.trainer.config import from_dict, load_config, resolve_for_world, use_gpu
from dutycycle.trainer.configtree import add_overrides
from dutycycle.trainer.step.loop import WorkerContext, set_threads
from dutycycle.trainer.step.trainer import Trainer

from .rundir import rejoin
from .train import end_tracking, finish_run, open_tracking, prepare_run, progress_stream, resolve_run_dir


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="python -m dutycycle.trainer.launch.torchrun")
    parser.add_argument("config")
    add_overrides(parser)
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--resume", action="store_true", help="continue the run in run.dir (see dutycycle train)")
    how.add_argument("--overwrite", action="store_true", help="replace the run in run.dir")
    parser.add_argument("--force", action="store_true", help="with --resume: accept changes to its data")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    last_try = restarts >= int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    attempt, tracker = None, None
    try:
        try:
            elastic = load_config(args.config, args.overrides).parallel.elastic
        except ConfigError:
            elastic = False  # a fixed size that may form only at torchrun's size: checked there, below
        # a fixed size is torchrun's (--nnodes x --nproc-per-node), as it always was; an elastic range is the
        # config's (torchrun --nnodes MIN:MAX), and this size must be in it
        cfg = load_config(args.config, args.overrides + ([] if elastic else [f"parallel.num_workers={world}"]))
        gpu = use_gpu(cfg, torch.cuda.device_count())
        if rank == 0 and restarts:
            resolve_run_dir(cfg)
            attempt = rejoin(cfg)
            # the launch's own config as its first try resolved it (a --resume kept the run's plan inputs)
            cfg = load_config(attempt.config_uri())
        elif rank == 0:
            attempt = prepare_run(cfg, resume=args.resume, overwrite=args.overwrite, force=args.force)
        else:
            resolve_run_dir(cfg)
        device = torch.device("cuda", local_rank) if gpu else torch.device("cpu")
        if gpu:
            torch.cuda.set_device(device)
        if world > 1:
            init_group("nccl" if gpu else "gloo", restarts)
            # rank 0's config, as its run-directory checks left it: a resume takes the run's own plan inputs
            # (data.partitions at its default keeps the run's count: config_batch.keep_run_partitions), which the
            # other ranks, which do not read the run directory, would otherwise size for this world
            cfg = from_dict(broadcast(cfg.to_dict(), world))
        set_threads(cfg, local_world)
        tracker = open_tracking(cfg, "torchrun") if rank == 0 else None
        stream = progress_stream(cfg, tracker) if rank == 0 else None
        ctx = WorkerContext(rank=rank, world_size=world, device=device, run_dir=cfg.run.dir,
                            attempt_dir=attempt.dir if attempt else "", info={"launcher": "torchrun"},
                            progress=stream.put if stream else None)
        try:
            # an elastic run (torchrun --nnodes MIN:MAX, parallel.num_workers = [min, max]) at the size torchrun
            # formed: the same global batches, more micro-batches on fewer workers
            with Trainer(resolve_for_world(cfg, world), ctx) as trainer:
                trainer.train()
        finally:
            if stream is not None:
                stream.close()
        if world > 1:
            # only after success (torchtitan does the same): a rank that failed may leave peers inside a
            # collective, where a barrier would hang. Every rank reaches the barrier before any tears its groups
            # down, so none exits while a peer still has collectives in flight (SIGABRT in gloo at exit).
            dist.barrier()
            dist.destroy_process_group()
        if rank == 0:
            summary = finish_run(cfg, tracker=tracker, attempt=attempt)
            print(f"val accuracy {summary['val_accuracy']}, report {summary.get('report')}")
    except BaseException as e:
        if tracker is not None:
            end_tracking(tracker, None, "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        if not isinstance(e, DutycycleError):
            raise
        if attempt is not None and last_try:
            attempt.discard_if_untrained()
        print(f"dutycycle torchrun: error: {e}", file=sys.stderr)
        return 2
    return 0


def init_group(backend: str, restarts: int) -> None:
    """The default process group, its keys under this attempt's own prefix in the rendezvous store.

    torchrun's agent keeps one TCPStore across its restarts (static and c10d rendezvous alike), and every
    process group leaves its ranks' addresses there under the same keys each attempt. A restarted rank that reads
    a key before its peer has rewritten it connects to the dead attempt's process: gloo's ``connectFullMesh``
    fails with "Connection refused" (seen here on the checkpoint saver's group, in every restart). Groups made
    later (``new_group``) take their keys under the default group's store, so the prefix covers them too."""
    import torch.distributed as dist

    store, rank, world = next(dist.rendezvous("env://"))
    dist.init_process_group(backend, store=dist.PrefixStore(f"dutycycle/attempt-{restarts}", store), rank=rank,
                            world_size=world)


if __name__ == "__main__":
    sys.exit(main())
