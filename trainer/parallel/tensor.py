"""Tensor parallelism (``parallel.tensor``): the model's layers split across the ranks of a group inside a node,
composed with FSDP2 over the data-parallel ranks on a 2-D (data, tensor) mesh, as torchtitan composes them.

Each tensor-parallel group is T ranks of one node (plan.tensor_groups, from the observed placement); the groups
are the mesh's rows, and row i is data-parallel rank i: its T ranks read the same batch (ParallelDims.data_ranks) and
compute each layer together. The split is the model's own (``model.tensor_parallel_plan(T, sequence_parallel)``,
``torch.distributed.tensor.parallel`` styles by module name; TinyViT's is Megatron's), applied before activation
checkpointing and FSDP2, which then shards the tensor-parallel DTensors further over the data dimension.

Activation traffic, per micro-batch, per rank, for a model of L blocks whose activation is A bytes (batch x tokens
x width; tokens padded up to a multiple of T, as DTensor pads an uneven split): with sequence parallelism each
block gathers its two sub-layer inputs and reduce-scatters their outputs in forward, and the reverse in
backward, plus one gather out of the blocks and one in backward into them:
``all_gather = (4L + 2) A (T-1)/T``, ``reduce_scatter = 4L A (T-1)/T``, and the norms' weight and bias gradients
all-reduced once per gradient exchange (``2 x 4 d x bytes x (T-1)/T`` per block: FSDP2 reduces them with
the rest, so an accumulation window reduces them once). Without it, four all-reduces of A per block
(``4L x 2A (T-1)/T``). ``expected_traffic`` gives these; ``TensorTraffic`` measures them (DTensor's functional
collectives, on the first step) for the run's summary. With activation checkpointing the forward's exchanges run
again in backward (the recompute): measured, not in the formula.
"""

from __future__ import annotations

import math

import torch
from dutycycle.engine.errors import ConfigError

from .fsdp_api import TorchDispatchMode, functional_collectives, group_size


def apply_tensor_parallel(model: torch.nn.Module, mesh, sequence_parallel: bool) -> int:
    """Split ``model`` over the 1-D tensor ``mesh`` by its own plan; returns the parameter elements this rank
    holds afterwards (what ZeRO then shards over the data ranks). A model without a plan is refused by name."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan_fn = getattr(model, "tensor_parallel_plan", None)
    if plan_fn is None:
        raise ConfigError(f"parallel.tensor = {mesh.size()} needs a model that says how to split its layers "
                          f"({type(model).__name__} has no tensor_parallel_plan(tensor, sequence_parallel)); use "
                          "model.name = 'vit', or parallel.tensor = 1")
    parallelize_module(model, mesh, plan_fn(mesh.size(), sequence_parallel))
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())


def tensor_share(model: torch.nn.Module, tensor: int, sequence_parallel: bool = True) -> int | None:
    """The parameter elements one rank of a ``tensor``-rank group holds under the model's plan, from the plan
    alone (no process group: the diagnosis sizes layouts with it): column-wise layers hold 1/T of their weight
    and bias, row-wise ones 1/T of their weight and all of their bias, the rest everything. None when the model
    has no plan or the plan refuses ``tensor``. What ``apply_tensor_parallel`` returns, for a divisible model."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan_fn = getattr(model, "tensor_parallel_plan", None)
    if plan_fn is None:
        return None
    try:
        plan = plan_fn(tensor, sequence_parallel)
    except ConfigError:
        return None
    total = sum(p.numel() for p in model.parameters())
    for name, style in plan.items():
        if isinstance(style, (ColwiseParallel, RowwiseParallel)):
            layer = model.get_submodule(name)
            split = layer.weight.numel() + (layer.bias.numel() if isinstance(style, ColwiseParallel) and
                                            layer.bias is not None else 0)
            total -= split - split // tensor
    return total


def expected_traffic(*, blocks: int, batch: int, tokens: int, width: int, tensor: int, elem_bytes: int,
                     syncs: int, sequence_parallel: bool) -> dict:
    """Activation bytes one rank sends per optimizer step (module doc), ``batch`` the rank's batch (all its
    micro-batches together), ``syncs`` gradient exchanges per step (1, or the micro-batches when reduced after
    each)."""
    if tensor == 1:
        return {}
    per = (tensor - 1) / tensor
    padded = math.ceil(tokens / tensor) * tensor if sequence_parallel else tokens
    act = batch * padded * width * elem_bytes  # all micro-batches: each moves its share, same total
    if not sequence_parallel:
        return {"tp_all_reduce": blocks * 4 * 2 * act * per}
    return {"tp_all_gather": (4 * blocks + 2) * act * per, "tp_reduce_scatter": 4 * blocks * act * per,
            "tp_all_reduce": syncs * blocks * 2 * 4 * width * elem_bytes * per}


def expected_for(model: torch.nn.Module, plan, global_batch: int, elem_bytes: int,
                 sequence_parallel: bool) -> dict | None:
    """``expected_traffic`` for ``model`` under ``plan`` (plan.ShardingPlan) when it is a transformer whose shape
    the formula reads (``blocks``, tokens and width from its position table ``pos``): {} without tensor
    parallelism, None for a model the formula does not know."""
    if plan.tensor == 1:
        return {}
    pos = getattr(model, "pos", None)
    if pos is None or not hasattr(model, "blocks"):
        return None
    return expected_traffic(blocks=len(model.blocks), batch=global_batch // plan.shard_size, tokens=pos.shape[1],
                            width=pos.shape[2], tensor=plan.tensor, elem_bytes=elem_bytes,
                            syncs=plan.micro_batches if plan.reduce_every_micro_step else 1,
                            sequence_parallel=sequence_parallel)


class TensorTraffic(TorchDispatchMode):
    """Counts the functional collectives DTensor issues (tensor parallelism's activation exchanges, and the
    norms' gradient all-reduces) while active, in traffic.py's convention: logical bytes this rank sends."""

    def __init__(self):
        super().__init__()
        self.kinds = functional_collectives()
        self.bytes: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.dtypes: dict[str, set[str]] = {}  # per kind, the dtypes it sent (as traffic.Traffic.dtypes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = self.kinds.get(func)
        if kind is not None:
            t = args[0]
            n = group_size(args[-1])
            nbytes = t.numel() * t.element_size()
            sent = {"tp_all_gather": nbytes * (n - 1), "tp_reduce_scatter": nbytes * (n - 1) / n,
                    "tp_all_reduce": 2 * nbytes * (n - 1) / n}[kind]
            self.bytes[kind] = self.bytes.get(kind, 0.0) + sent
            self.calls[kind] = self.calls.get(kind, 0) + 1
            self.dtypes.setdefault(kind, set()).add(str(t.dtype).removeprefix("torch."))
        return func(*args, **(kwargs or {}))

    def wire(self) -> dict[str, dict]:
        """Per kind: ``{"dtypes": sorted names, "bytes", "calls"}``, a fresh copy (as ``Traffic.wire``)."""
        return {k: {"dtypes": sorted(self.dtypes.get(k, ())), "bytes": self.bytes[k], "calls": self.calls[k]}
                for k in sorted(self.calls)}
