"""The three places where data parallelism touches model state, each an explicit, replaceable object.

- ``GradSync.sync(model)`` runs once per optimizer step, at the gradient-accumulation boundary, and leaves
  every rank with the gradient of the *global* mean loss. The baseline is ``AllReduceSync``: the DDP
  equivalent (flat buckets, all_reduce SUM, divide by world size: gloo has no AVG). ZeRO-2/3 replace it with
  reduce-scatter into shards; qgZ replaces the collective with a quantized all-to-all.
- ``ParamGather.gather(model)`` runs before each forward: a no-op while every rank holds full parameters;
  ZeRO-3 / qwZ / hpZ all-gather parameter shards here.
- ``Checkpointer.maybe_save(step, ...)`` runs after each optimizer step; the time it blocks the loop is the
  "checkpoint" phase. The baseline saves nothing; asynchronous two-phase checkpoints plug in here.

Each object counts the bytes it sends so benchmarks compare modes on traffic, not on gloo timings.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SyncStats:
    calls: int = 0  # sync() invocations (= optimizer steps)
    collectives: int = 0  # collective ops issued
    bytes: int = 0  # payload bytes handed to collectives by this rank


class GradSync:
    """Interface: make ``p.grad`` on every rank equal the gradient of the global mean loss."""

    def __init__(self):
        self.stats = SyncStats()

    def sync(self, model) -> None:
        raise NotImplementedError


class NoSync(GradSync):
    """World size 1: nothing to exchange (still counted, so tests see one call per optimizer step)."""

    def sync(self, model) -> None:
        self.stats.calls += 1


class AllReduceSync(GradSync):
    """DDP-equivalent gradient all-reduce: gradients are copied into flat buckets of about ``bucket_mb``,
    all-reduced with SUM, divided by the world size and copied back.

    Each rank's loss is the mean over its own slice of the global batch, and slices are equal, so the mean of
    the per-rank gradients is the gradient of the global mean loss.
    """

    def __init__(self, world_size: int, bucket_mb: float = 25.0):
        super().__init__()
        self.world_size = world_size
        self.bucket_bytes = max(1, int(bucket_mb * 1024 * 1024))

    def _buckets(self, params):
        bucket, size = [], 0
        for p in params:
            nbytes = p.grad.numel() * p.grad.element_size()
            if bucket and (size + nbytes > self.bucket_bytes or p.grad.dtype != bucket[0].grad.dtype):
                yield bucket
                bucket, size = [], 0
            bucket.append(p)
            size += nbytes
        if bucket:
            yield bucket

    def sync(self, model) -> None:
        import torch
        import torch.distributed as dist

        self.stats.calls += 1
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # a parameter unused this step still takes part, so buckets line up across ranks
                p.grad = torch.zeros_like(p)
        for bucket in self._buckets(params):
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat.div_(self.world_size)
            self.stats.collectives += 1
            self.stats.bytes += flat.numel() * flat.element_size()
            offset = 0
            for p in bucket:
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n


def make_grad_sync(name: str, world_size: int, bucket_mb: float) -> GradSync:
    if world_size == 1:
        return NoSync()
    if name == "allreduce":
        return AllReduceSync(world_size, bucket_mb)
    raise AssertionError(f"unknown grad sync {name!r} (config validation should have caught it)")


class ParamGather:
    """Interface point before the forward pass: full parameters are already local in the baseline."""

    def __init__(self):
        self.stats = SyncStats()

    def gather(self, model) -> None:
        return None


class Checkpointer:
    """Interface point after each optimizer step. The baseline keeps no checkpoints; ``maybe_save`` returns
    whether it saved, and the loop charges the time it blocked to the "checkpoint" phase."""

    def maybe_save(self, step: int, model, optimizer, loader_state: dict | None) -> bool:
        return False

    def finalize(self) -> None:
        """Wait for any save still in flight (asynchronous checkpointers)."""
        return None
