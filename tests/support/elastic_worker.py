"""Worker code for the elastic exactness test (tests/trainer/test_elastic_step.py): one segment of an elastic run
on spawned gloo ranks, through the real Trainer at the size the ranks form, stopped right after a commit."""

from __future__ import annotations

import torch

SAMPLES = 96  # one epoch: 8 global batches of 12
# the run every layout shares: parallel.num_workers = [2, 3], a global batch of 12, 3 micro-batches at 3 workers
# (4 samples each: 2, 1, 1, uneven) and so 3 of 2 at 2 workers; float64; commits every 3 steps, written before
# the step returns (async off) so that a segment can stop right after one
BASE = ["data.source=synthetic", "data.size=8", f"data.synthetic_samples={SAMPLES}", "data.global_batch_size=12",
        "data.micro_batches=3", "model.width=8", "model.depth=2", "model.groups=4", "run.precision=fp64",
        "run.max_steps=8", "run.eval_every=0", "run.log_every=1", "run.report=false", "run.save_model=false",
        "run.health_check=false", "checkpoint.every=3", "checkpoint.async_save=false", "optim.warmup_steps=2",
        "parallel.threads_per_worker=1"]


class Stop(Exception):
    """Raised after the commit of the step a segment ends at."""


def pending_correction(trainer) -> dict[str, list] | None:
    """Error feedback's correction still to be applied, per parameter: ``f / D * sum over ranks of R_q[p]``
    (parallel/residuals.py), all-reduced; what a resharded restore must keep. None without error feedback."""
    import torch.distributed as dist
    from dutycycle.trainer.parallel import residuals
    from dutycycle.trainer.parallel.fsdp_api import predivide_factor

    hs = residuals.holders(trainer.strategy)
    if not hs:
        return None
    d = trainer.dims.dp_size
    out = {}
    for h in hs:
        f = predivide_factor(h.unit)
        for i, s in enumerate(h.slots):
            r = torch.zeros(s.shape, dtype=torch.float64) if h.residual is None else \
                residuals.to_param(h.param_residual(i), s.shape, s.shard_dim).double()
            total = r * (f / d)
            dist.all_reduce(total)
            out[s.fqn] = total.reshape(-1).tolist()
    return out


def segment(rank: int, world: int, run_dir: str, extra: list[str], stop: int, nodes: list[str]) -> dict:
    """Train the run in ``run_dir`` at ``world`` ranks (resuming from its newest commit) until the commit of step
    ``stop`` (0: to the end). Returns this rank's loss and sample ids per step, where it resumed, the
    micro-batches it ran, and error feedback's pending correction after the restore and at the stop."""
    from dutycycle.trainer.config import load_config, resolve_for_world
    from dutycycle.trainer.step.loop import WorkerContext
    from dutycycle.trainer.step.trainer import Trainer

    torch.set_num_threads(1)
    cfg = resolve_for_world(load_config(None, [*BASE, f"run.dir={run_dir}", *extra]), world)
    losses, ids, corrections = {}, {}, {}

    class Segment(Trainer):
        def train_step(self, batch, index=-1):
            loss = super().train_step(batch, index)
            losses[self.step], ids[self.step] = float(loss), [int(i) for i in batch["sample_id"]]
            c = pending_correction(self)  # error feedback: the 2-norm of what is not applied yet, after the step
            if c is not None:
                corrections[self.step] = sum(v * v for vs in c.values() for v in vs) ** 0.5
            return loss

        def _after_step(self):
            super()._after_step()
            if self.step == stop:
                raise Stop

    # every rank's node given (all on one unless ``nodes`` says): observing it would import ray in each rank
    ctx = WorkerContext(rank=rank, world_size=world, run_dir=run_dir, node_labels=list(nodes) or ["n0"] * world)
    trainer = Segment(cfg, ctx)
    restored = pending_correction(trainer)
    with trainer:
        try:
            trainer.train()
        except Stop:
            pass
    return {"losses": losses, "ids": ids, "resumed_at": trainer.first_step, "micro_batches": cfg.data.micro_batches,
            "partitions": trainer.train_src.loader.config.partitions, "replicate": trainer.dims.replicate,
            "restored": restored, "stopped": pending_correction(trainer), "corrections": corrections}
