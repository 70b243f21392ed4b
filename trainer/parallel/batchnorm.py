"""BatchNorm under data parallelism (``model.sync_batchnorm``): batch statistics over the data-parallel group.

A BatchNorm layer in training mode normalizes with the statistics of the batch it sees. Under data parallelism
each rank sees its own slice of the global batch, so each normalizes with different statistics and the result
depends on how many ranks split the batch. ``model.sync_batchnorm = true`` converts every BatchNorm of the model
(``nn.BatchNorm1d/2d/3d``, the lazy ones once initialized, and any subclass, built-in or a plug-in's) before it
is wrapped (DDP / FSDP2), so that each layer's statistics are taken over the whole data-parallel group's
micro-batch: N ranks of B samples train as one process on N x B samples does.

- On CUDA: torch's own ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``.
- Elsewhere (CPU, gloo): ``CollectiveBatchNorm`` below, because torch's ``SyncBatchNorm`` raises on CPU tensors
  once a process group exists. Each rank computes its slice's per-channel count, mean and centred sum of squares
  (in float32, float64 for float64 inputs: the compute dtype, never bf16), the group all-gathers them in one
  collective and every rank combines them in rank order (Chan's parallel variance: stable where the sum of
  squares minus the squared sum would cancel), so every rank holds bit-identical statistics and running
  estimates. The gather is an autograd Function whose backward all-reduces the statistics' gradients, so each
  rank's inputs get the gradient of every rank's loss through the shared statistics, as torch's SyncBatchNorm
  computes it. Running statistics follow ``nn.BatchNorm``: momentum (or the cumulative average when
  ``momentum`` is None), the unbiased variance of the global batch for the running variance,
  ``num_batches_tracked`` counted once per forward. Eval mode, and a group of one rank, run ``nn.BatchNorm``'s
  own forward. The layer is an ``nn.modules.batchnorm._BatchNorm`` (as torch's SyncBatchNorm is), so its
  parameters and buffers keep BatchNorm's names: ``model.safetensors`` and checkpoints load into the plain model.

The group is the data-parallel one (``data_parallel_group``): every rank under DDP, FSDP2 and hybrid sharding
(all of them read different samples); under tensor parallelism the ranks of this rank's column of the
(data, tensor) mesh, since a tensor-parallel group's ranks share one batch.

Micro-batches: with ``data.micro_batches = M`` each forward is one micro-batch, so a layer's statistics are taken
over micro-batch i of every rank together (global batch / M samples), and the running statistics are updated M
times per optimizer step, as one process running the same M forwards would.

Activation checkpointing runs a block's forward again in backward; ``activation.py`` holds BatchNorm's running
statistics still during that recomputation, so they are updated once per micro-batch either way.

Without ``sync_batchnorm``, a model with BatchNorm on more than one data-parallel rank gets one warning
(``BatchNormWarning``, rank 0, naming the key): each rank normalizes with its own micro-batch's statistics.
Under DDP the running statistics are rank 0's (DDP broadcasts buffers before each forward); under FSDP2 each
rank keeps its own and a checkpoint holds one rank's.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from dutycycle.engine.errors import ConfigError
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from .fsdp_api import BatchNormBase


class BatchNormWarning(UserWarning):
    """A model normalizes with per-rank batch statistics under data parallelism (``model.sync_batchnorm`` off)."""


def batchnorm_layers(model: nn.Module, *, per_rank: bool = False) -> list[str]:
    """Names of the model's BatchNorm layers (any ``BatchNormBase``: 1d/2d/3d, lazy, SyncBatchNorm, subclasses);
    ``per_rank``: only those that normalize with this rank's batch alone (not synchronized already)."""
    synced = (nn.SyncBatchNorm, CollectiveBatchNorm) if per_rank else ()
    return [name or type(model).__name__ for name, m in model.named_modules()
            if isinstance(m, BatchNormBase) and not isinstance(m, synced)]


def unsynced_warning(model: nn.Module, layers: list[str], dp_size: int) -> str:
    """The one-line warning for a model with BatchNorm ``layers`` trained on ``dp_size`` data-parallel ranks
    without ``model.sync_batchnorm``."""
    shown = ", ".join(layers[:3]) + (f", ... ({len(layers)} in all)" if len(layers) > 3 else "")
    return (f"{type(model).__name__} has BatchNorm layers ({shown}) and model.sync_batchnorm = false: each of the "
            f"{dp_size} data-parallel ranks normalizes with its own micro-batch's statistics, so training depends "
            "on the world size; set model.sync_batchnorm = true to take them over the whole batch")


def data_parallel_group(dims, mesh=None):
    """The process group a BatchNorm synchronizes over: this rank's column of the (data, tensor) ``mesh`` under
    tensor parallelism (the ranks reading different samples), else every rank (None: the default group; under
    hybrid sharding the replica and shard dimensions both split the batch)."""
    if dims.tp_enabled:
        assert mesh is not None and mesh.mesh_dim_names == ("data", "tensor"), mesh
        return mesh["data"].get_group()
    return None


def convert_batchnorm(model: nn.Module, *, device: torch.device, group=None, meter=None) -> nn.Module:
    """Every BatchNorm of ``model`` made synchronized over ``group`` (None: every rank), sharing the layer's own
    parameters and buffers: torch's ``SyncBatchNorm`` on CUDA, ``CollectiveBatchNorm`` elsewhere (``meter``, a
    ``comm.CommMeter``, counts its collectives). Converts in place and returns the model (a new module only when
    ``model`` itself is a BatchNorm, as torch's converter does)."""
    for name, m in model.named_modules():
        if isinstance(m, BatchNormBase) and isinstance(m, LazyModuleMixin) and m.has_uninitialized_params():
            raise ConfigError(f"model.sync_batchnorm = true: {name or type(m).__name__} is a lazy BatchNorm whose "
                              "size is not known before its first forward; give it num_features (nn.BatchNorm2d) "
                              "or run one forward in the model factory")
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
    return _convert(model, group, meter)


def _convert(module: nn.Module, group, meter) -> nn.Module:
    out = module
    # torch's SyncBatchNorm too: it raises on CPU tensors once a process group exists
    if isinstance(module, BatchNormBase) and not isinstance(module, CollectiveBatchNorm):
        out = CollectiveBatchNorm.like(module, group=group, meter=meter)
    for name, child in module.named_children():
        out.add_module(name, _convert(child, group, meter))
    return out


# ------------------------------------------------------------------------------------------------ the layer


class CollectiveBatchNorm(BatchNormBase):
    """BatchNorm whose training-mode statistics are taken over a process group (module docstring). Made from a
    BatchNorm by ``CollectiveBatchNorm.like(bn, group=...)``; keeps the original's input-rank check (1d: 2-D or
    3-D input, 2d: 4-D, 3d: 5-D)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, *, group=None, meter=None, input_ranks: tuple[int, ...] = (),
                 bias: bool = True, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias)
        self.group, self.meter, self.input_ranks = group, meter, input_ranks

    @classmethod
    def like(cls, bn: BatchNormBase, *, group=None, meter=None) -> CollectiveBatchNorm:
        """A CollectiveBatchNorm holding ``bn``'s own parameters and buffers (the same tensors) and settings."""
        out = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, group=group, meter=meter,
                  input_ranks=_input_ranks(bn), bias=bn.bias is not None, device="meta")
        if bn.affine:
            out.weight = bn.weight
            if bn.bias is not None:
                out.bias = bn.bias
        out.running_mean, out.running_var = bn.running_mean, bn.running_var
        out.num_batches_tracked = bn.num_batches_tracked
        out.training = bn.training
        if hasattr(bn, "qconfig"):
            out.qconfig = bn.qconfig
        return out

    def _check_input_dim(self, input: torch.Tensor) -> None:
        ranks = self.input_ranks or tuple(range(2, 9))
        if input.dim() not in ranks:
            raise ValueError(f"expected {' or '.join(f'{r}D' for r in ranks)} input (got {input.dim()}D input)")

    def _group_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self._group_size() == 1:
            return super().forward(input)  # running statistics (eval), or one rank: nn.BatchNorm's forward
        self._check_input_dim(input)
        factor = 0.0
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        acc = torch.float64 if input.dtype == torch.float64 else torch.float32
        x = input.to(acc)
        c = x.shape[1]
        dims = [0, *range(2, x.dim())]
        shape = [1, c] + [1] * (x.dim() - 2)
        n = x.numel() // c if c else 0
        mean = x.sum(dims) / max(n, 1)  # a rank with no samples contributes zeros, weighted by its count 0
        # a second pass adds back what the first sum rounded away (channels far from zero lose digits there)
        mean = mean + (x - mean.view(shape)).sum(dims) / max(n, 1)
        m2 = ((x - mean.view(shape)) ** 2).sum(dims)
        stats = torch.cat([mean, m2, mean.new_full((1,), float(n))])
        gathered = _GatherStats.apply(stats, self.group, self.meter)  # [ranks, 2c + 1], differentiable
        mean, var, total = combine(gathered, c)
        if total <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got {int(total)} over the "
                             f"data-parallel group (input size {list(input.shape)} on this rank)")
        if self.track_running_stats:
            with torch.no_grad():  # as nn.BatchNorm: momentum * batch + (1 - momentum) * running, unbiased var
                unbiased = var * (total / (total - 1))
                self.running_mean.copy_(factor * mean + (1 - factor) * self.running_mean)
                self.running_var.copy_(factor * unbiased + (1 - factor) * self.running_var)
        y = (x - mean.view(shape)) * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            y = y * self.weight.to(acc).view(shape)
        if self.bias is not None:
            y = y + self.bias.to(acc).view(shape)
        return y.to(input.dtype)


def combine(gathered: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Per-channel mean and biased variance of the union of the ranks' slices, and its sample count, from the
    rows ``[mean (c), centred sum of squares (c), count]`` of each rank (Chan et al.'s pairwise formula, summed
    in rank order: the same bits on every rank)."""
    means, m2s, counts = gathered[:, :c], gathered[:, c:2 * c], gathered[:, 2 * c:].detach()  # counts: constants
    total = counts.sum()
    # the ranks' means as offsets from the first rank's with samples: the weighted sum then runs over small
    # differences, not over values of the channel's magnitude
    base = means[int(torch.nonzero(counts[:, 0])[0])] if bool(total) else means[0]
    mean = base + (counts * (means - base)).sum(0) / total
    m2 = (m2s + counts * (means - mean) ** 2).sum(0)
    return mean, m2 / total, float(total)


class _GatherStats(torch.autograd.Function):
    """All-gather of each rank's statistics row, differentiable: backward all-reduces (sums) the gradient of the
    gathered rows, whose row r is then rank r's gradient from every rank's loss. Both directions are counted in
    ``meter`` (kind ``batchnorm``) and timed as exposed communication (they block the step)."""

    @staticmethod
    def forward(ctx, stats: torch.Tensor, group, meter):
        ctx.group, ctx.meter = group, meter
        out = stats.new_empty(dist.get_world_size(group) * stats.numel())  # gloo wants a flat 1-D output
        with _counted(meter, "batchnorm", out, group):
            dist.all_gather_single(out, stats.contiguous(), group=group)
        return out.view(-1, stats.numel())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        with _counted(ctx.meter, "batchnorm", grad, ctx.group, factor=2):
            dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None, None


@contextlib.contextmanager
def _counted(meter, kind: str, full: torch.Tensor, group, factor: int = 1):
    if meter is None:
        yield
        return
    meter.count_tensor(kind, full, group, factor=factor)
    with meter.blocking():
        yield


def _input_ranks(bn: BatchNormBase) -> tuple[int, ...]:
    """The input ranks ``bn`` accepts (its own ``_check_input_dim``); () when its class says nothing we know."""
    for kinds, ranks in (((nn.BatchNorm1d, nn.LazyBatchNorm1d), (2, 3)), ((nn.BatchNorm2d, nn.LazyBatchNorm2d), (4,)),
                         ((nn.BatchNorm3d, nn.LazyBatchNorm3d), (5,))):
        if isinstance(bn, kinds):
            return ranks
    return ()
