"""Worker code for the checkpoint tests that run on spawned gloo ranks (tests/support/harness.py: run_distributed)."""

from __future__ import annotations

import hashlib

import torch

# ------------------------------------------------------------------------------ resume through the Trainer


def small_cfg(run_dir: str, *extra: str):
    from dutycycle.trainer.config import load_config

    return load_config(None, small_overrides(run_dir, *extra))


def small_overrides(run_dir: str, *extra: str) -> list[str]:
    """``small_cfg``'s ``--set`` overrides (for a launcher started as a command)."""
    return ["data.source=synthetic", "data.size=16", "data.global_batch_size=32", "data.synthetic_samples=192",
            "model.name=tests.support.ckpt_models:risky_cnn", "model.width=8", "run.max_steps=14",
            "run.eval_every=0", f"run.dir={run_dir}", "run.log_every=1", "checkpoint.every=4", "run.report=false",
            "optim.warmup_steps=2", "parallel.threads_per_worker=1", *extra]


def train(cfg, rank: int = 0, world: int = 1) -> dict:
    from dutycycle.trainer.step.loop import WorkerContext
    from dutycycle.trainer.step.trainer import Trainer

    torch.set_num_threads(1)
    with Trainer(cfg, WorkerContext(rank=rank, world_size=world, run_dir=cfg.run.dir)) as trainer:
        return trainer.train()


def resume_runs(rank: int, world: int, root: str, stages: list[int], more: tuple = ()) -> dict:
    """Per ZeRO stage: an uninterrupted run; a run that crashes at step 11 (after the commit at step 8, with the
    save of step 12 never reached); the same run started again, which resumes from step 8. Returns the final
    weight digests and the resume records."""
    from . import ckpt_models as cm

    out = {}
    for stage in stages:
        extra = [f"parallel.num_workers={world}", f"parallel.zero_stage={stage}", *more]
        a = train(small_cfg(f"{root}/s{stage}/a", *extra), rank, world)
        cm.FAULTS["crash_at"] = 11
        try:
            train(small_cfg(f"{root}/s{stage}/b", *extra), rank, world)
            crashed = False
        except cm.InjectedCrash:
            crashed = True
        cm.reset()
        b = train(small_cfg(f"{root}/s{stage}/b", *extra), rank, world)
        out[str(stage)] = {"a": a["weights_sha256"], "b": b["weights_sha256"], "crashed": crashed,
                           "resumed": b["checkpoint"]["resumed"], "strategy": b["parallel"]["strategy"],
                           "loss_a": a["final_loss"], "loss_b": b["final_loss"],
                           "offload_files": b["parallel"].get("offload_files"),
                           "snapshot_file_bytes": b["checkpoint"]["snapshot_file_bytes_per_save"]}
    return out


def train_at(rank: int, world: int, run_dir: str, extra: list[str]) -> dict:
    """``small_cfg`` at ``world`` ranks (run_distributed): where it resumed and the final weights."""
    out = train(small_cfg(run_dir, f"parallel.num_workers={world}", *extra), rank, world)
    return {"resumed": out["checkpoint"]["resumed"], "weights_sha256": out["weights_sha256"]}


def _killed_rank_entry(rank: int, world: int, port: int, run_dir: str, extra: list[str], step: int) -> None:
    import datetime
    import os
    import signal
    import time

    import torch.distributed as dist
    from dutycycle.trainer.step.steplog import StepLog

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    if rank == 1:
        real = StepLog.flush

        def flush(self):
            if any(p.step == step for p in self.pending):
                # give rank 0's saver time to commit, should anything have started a save of this step already
                manifest = os.path.join(run_dir, "checkpoints", f"step-{step:08d}", "manifest.json")
                deadline = time.monotonic() + 3.0
                while not os.path.exists(manifest) and time.monotonic() < deadline:
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)
            real(self)

        StepLog.flush = flush
    try:
        train(small_cfg(run_dir, f"parallel.num_workers={world}", *extra), rank, world)
    except BaseException:  # noqa: BLE001 - rank 0 loses its peer: expected, and reported by the exit code
        os._exit(1)
    os._exit(0)


def run_with_rank_1_killed(run_dir: str, extra: list[str], step: int, timeout: float = 120.0) -> list:
    """A 2-rank run whose rank 1 SIGKILLs itself at the flush that would write step ``step``'s metrics row.
    Returns the ranks' exit codes."""
    from .harness import spawn_ranks

    procs, _ = spawn_ranks(_killed_rank_entry, 2, run_dir, extra, step, timeout=timeout)
    return [p.exitcode for p in procs]


# ----------------------------------------------------------------------------------------------- resharding


class _Position:
    """The smallest batch source a checkpoint restores: a position and nothing to iterate."""

    def __init__(self):
        self.state = {"epoch": 0, "batch_index": 0}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state, force=False):
        self.state = dict(state)

    def position(self):
        return self.state["epoch"], self.state["batch_index"]

    def set_epoch(self, epoch):
        self.state = {"epoch": epoch, "batch_index": 0}

    def __len__(self):
        return 100


def _full_state(strategy, optimizer) -> dict[str, torch.Tensor]:
    """Model and optimizer state as full tensors, by name (rank 0; {} elsewhere): comparable across world
    sizes and stages."""
    from dutycycle.trainer.parallel.state import full_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model = full_state_dict(strategy)
    options = None if strategy.name == "local" else StateDictOptions(full_state_dict=True, cpu_offload=True)
    osd = get_optimizer_state_dict(strategy.module, optimizer, options=options)  # keyed by parameter name
    optim = {f"{n}.{k}": v for n, st in osd.get("state", {}).items() for k, v in st.items()}
    return {**{f"model.{k}": v for k, v in model.items()}, **{f"optim.{k}": v for k, v in optim.items()}}


def model_only(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's tensors of ``_full_state``, by parameter name (what a commit's weights load as for inference)."""
    return {k.removeprefix("model."): v for k, v in full.items() if k.startswith("model.")}


def _digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(torch.as_tensor(state[k]).detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _checkpointer(root: str, rank: int, world: int, stage: int, resume: str, *extra: str):
    from dutycycle.trainer.checkpoint.checkpointer import Checkpointer
    from dutycycle.trainer.config import load_config
    from dutycycle.trainer.step.loop import WorkerContext

    cfg = load_config(None, ["data.source=synthetic", f"parallel.num_workers={world}",
                             f"parallel.zero_stage={stage}", "checkpoint.every=1", f"checkpoint.dir={root}",
                             "checkpoint.async_save=false", f"checkpoint.resume={resume}", *extra])
    return Checkpointer(cfg, WorkerContext(rank=rank, world_size=world), total_steps=100)


def _fresh(rank: int, world: int, stage: int, **parallel):
    """The ZeRO tests' awkward model (tied weight, frozen and sometimes-unused layers, odd shapes) at ``stage``
    (and further ``parallel`` config keys), untrained, with an AdamW optimizer."""
    import warnings

    from dutycycle.trainer.cluster.world import World
    from dutycycle.trainer.config import OptimSection, ParallelSection
    from dutycycle.trainer.parallel.apply import parallelize
    from dutycycle.trainer.step.optim import make_optimizer

    from .zero_worker import Quirky

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        strategy = parallelize(Quirky().double(), ParallelSection(zero_stage=stage, find_unused_parameters=stage == 0,
                                                                **parallel),
                               World(rank, world), device=torch.device("cpu"), precision="fp64")
    optimizer = make_optimizer(strategy.module.parameters(), OptimSection(lr=0.02, weight_decay=0.1))
    return strategy, optimizer


def _one_more_step(strategy, optimizer, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Train one more step on a fixed global batch and return the full model state."""
    import contextlib

    from dutycycle.trainer.parallel.state import full_state_dict
    from dutycycle.trainer.step.loop import optimizer_step
    from dutycycle.trainer.step.timing import StepTimer

    from .zero_worker import GLOBAL_BATCH

    g = torch.Generator().manual_seed(99)
    x = torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)
    per = GLOBAL_BATCH // world
    strategy.module.use_sometimes = True
    optimizer_step(strategy, optimizer, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per],
                   micro_batches=1, timer=StepTimer(), autocast=contextlib.nullcontext, grad_clip=0.05, lr=0.02)
    return {k: v.clone() for k, v in full_state_dict(strategy).items()}


def reshard_save(rank: int, world: int, root: str) -> dict:
    """At every stage: train 4 steps, save as step 4 under root/stage{s}, and record the full state and the
    weights after one more step (the reference for a resharded continuation)."""
    from .zero_worker import train

    out = {}
    for stage in range(4):
        strategy, optimizer, _, _ = train(rank, world, stage=stage, find_unused=stage == 0)
        ck = _checkpointer(f"{root}/stage{stage}", rank, world, stage, "none")
        ck.maybe_save(4, strategy, optimizer, _Position().state_dict())
        ck.finalize()
        full = _full_state(strategy, optimizer)  # a collective; live tensors, so digest them before stepping on
        digest = _digest(full) if rank == 0 else None
        after = _one_more_step(strategy, optimizer, rank, world)
        out[stage] = {"digest": digest, "after": {k: v.tolist() for k, v in after.items()} if rank == 0 else None}
    return out


def reshard_load(rank: int, world: int, sources: list[str], dst: str | None) -> dict:
    """For each source and every stage: load source/stage{s} at this world size into a fresh model; record the
    full state's digest and the weights after one more step; save it again under ``dst`` (for the way back)."""
    out = {}
    for src in sources:
        for stage in range(4):
            strategy, optimizer = _fresh(rank, world, stage)
            ck = _checkpointer(f"{src}/stage{stage}", rank, world, stage, "auto")
            restored = ck.restore(strategy, optimizer, _Position())
            ck.close()
            full = _full_state(strategy, optimizer)
            digest = _digest(full) if rank == 0 else None
            if dst:
                again = _checkpointer(f"{dst}/stage{stage}", rank, world, stage, "none")
                again.maybe_save(4, strategy, optimizer, _Position().state_dict())
                again.finalize()
            after = _one_more_step(strategy, optimizer, rank, world)
            out[f"{src}/{stage}"] = {"step": restored.step if restored else None, "digest": digest,
                                     "after": {k: v.tolist() for k, v in after.items()} if rank == 0 else None}
    return out


# ------------------------------------------------------------------------------------------- health check


def health_with_bad_worker(rank: int, world: int, run_dir: str) -> dict:
    """Rank 1's device returns wrong products (stood in for by ``FaultyMatmul``); both ranks must refuse to
    train, naming rank 1."""
    from contextlib import nullcontext

    from dutycycle.trainer.cluster import health

    from .faulty import FaultyMatmul

    cfg = small_cfg(run_dir, f"parallel.num_workers={world}", "model.name=cnn")
    try:
        with FaultyMatmul(lambda c: c + 1e-2) if rank == 1 else nullcontext():
            train(cfg, rank, world)
    except health.HealthCheckError as e:
        return {"error": str(e)}
    return {"error": None}


def hybrid_round_trip(rank: int, world: int, root: str) -> dict:
    """Hybrid sharding (2 replica groups) to flat stage 3 and back through DCP, at ``world`` ranks: train 4 steps
    hybrid and save; load into flat stage 3 and save again; load that into hybrid. Records each load's full-state
    digest and the weights after one more step (as reshard_save / reshard_load do)."""
    from .zero_worker import train

    strategy, optimizer, _, _ = train(rank, world, stage=3, replicate=2)
    ck = _checkpointer(f"{root}/hybrid", rank, world, 3, "none", "parallel.replicate=2")
    ck.maybe_save(4, strategy, optimizer, _Position().state_dict())
    ck.finalize()
    full = _full_state(strategy, optimizer)
    out = {"saved": {"digest": _digest(full) if rank == 0 else None, "shard_size": strategy.plan.shard_size,
                     "model_digest": _digest(model_only(full)) if rank == 0 else None}}
    after = _one_more_step(strategy, optimizer, rank, world)
    out["saved"]["after"] = {k: v.tolist() for k, v in after.items()} if rank == 0 else None
    for name, src, dst, replicate in (("hybrid to flat", "hybrid", "flat", 1), ("flat back to hybrid", "flat", None, 2)):
        strategy, optimizer = _fresh(rank, world, 3, replicate=replicate)
        ck = _checkpointer(f"{root}/{src}", rank, world, 3, "auto", f"parallel.replicate={replicate}")
        restored = ck.restore(strategy, optimizer, _Position())
        ck.close()
        full = _full_state(strategy, optimizer)
        digest = _digest(full) if rank == 0 else None
        if dst:
            again = _checkpointer(f"{root}/{dst}", rank, world, 3, "none", f"parallel.replicate={replicate}")
            again.maybe_save(4, strategy, optimizer, _Position().state_dict())
            again.finalize()
        after = _one_more_step(strategy, optimizer, rank, world)
        out[name] = {"step": restored.step if restored else None, "digest": digest,
                     "shard_size": strategy.plan.shard_size,
                     "after": {k: v.tolist() for k, v in after.items()} if rank == 0 else None}
    return out
