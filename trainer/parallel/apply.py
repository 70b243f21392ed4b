"""Apply data parallelism to a model: DDP for ZeRO stage 0, FSDP2 per block for stages 1-3.

``parallelize`` is the one function to read: it builds the plan (plan.py), wraps the model the way torchtitan's
``parallelize`` does (each block bottom-up, then the root, in a fixed order), installs the counting collectives
(comm.py) and returns a ``Strategy``: the object the step loop talks to.

The step loop calls, per optimizer step::

    for i, micro-batch in enumerate(...):
        with strategy.micro_step(i):          # DDP no_sync / FSDP2 gradient-sync and reshard switches
            loss = strategy.model(x); loss.backward()
    strategy.clip_grad_norm_(max_norm)        # exact across shards
    optimizer.step()
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from dutycycle.engine.errors import ConfigError
from dutycycle.trainer.cluster.world import World
from torch import nn

from .activation import checkpoint_blocks
from .batchnorm import (
    BatchNormWarning,
    batchnorm_layers,
    convert_batchnorm,
    data_parallel_group,
    unsynced_warning,
)
from .comm import (
    CommMeter,
    CountingAllGather,
    CountingReduceScatter,
    QuantAllGather,
    QuantReduceScatter,
    counting_allreduce_hook,
    counting_hsdp_hook,
)
from .dims import ParallelDims
from .fsdp_api import fsdp_modules, reshard_to_secondary, set_unshard_async
from .plan import Quantization, ShardingPlan, make_plan, make_quantization
from .qcollectives import make_hierarchy
from .tensor import apply_tensor_parallel
from .traffic import Topology


class ShardingWarning(UserWarning):
    """A model could not be sharded the way it was asked (no blocks, shared parameters)."""


# --------------------------------------------------------------------------------------------- strategies


@dataclass
class Strategy:
    """What the loop needs from data parallelism. ``model`` is what forward is called on (a DDP wrapper, the
    FSDP2 root, or the plain module); ``module`` is the user's module (``model`` itself for FSDP2)."""

    model: nn.Module
    module: nn.Module
    plan: ShardingPlan
    meter: CommMeter
    name: str = "local"
    compute_dtype: torch.dtype = torch.float32  # what inputs are cast to before forward
    units: list[str] = field(default_factory=list)  # module names sharded as their own FSDP2 unit
    quant: Quantization = field(default_factory=Quantization)
    # tensor parallelism (tensor.py): this rank's place in its group (0 when off: every rank is its own group);
    # the parameters one rank of a group holds before ZeRO shards them (None when off: all of them)
    tensor_rank: int = 0
    tensor_numel: int | None = None
    tensor_traffic: object = None  # tensor.TensorTraffic of the first step, once it ran
    sequence_parallel: bool = False
    dims: ParallelDims | None = None  # the degrees it was built for (dims.py)
    # elements of the root unit's parameters as this rank holds them before ZeRO shards them (root_parameters;
    # stage 3 keeps them unsharded from forward to the end of backward: plan.expected_held's ``root_numel``)
    root_numel: int = 0
    synced_batchnorm: list[str] = field(default_factory=list)  # BatchNorm layers synchronized (batchnorm.py)

    @contextlib.contextmanager
    def micro_step(self, micro: int):
        yield

    def after_eval(self) -> None:
        """Called after a validation pass (FSDP2 stages 1-2 would otherwise keep parameters unsharded)."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(self.module.parameters(), max_norm)


class DDPStrategy(Strategy):
    """Stage 0: ``DistributedDataParallel``; ``no_sync()`` on all micro-batches but the last (unless
    ``reduce_every_micro_step``), so the one all-reduce per step overlaps the last backward."""

    @contextlib.contextmanager
    def micro_step(self, micro: int):
        sync = self.plan.syncs_gradients(micro)
        self.meter.last_ready = None
        try:
            with contextlib.nullcontext() if sync else self.model.no_sync():
                yield
        except RuntimeError as e:
            if "find_unused_parameters" in str(e):  # DDP names its own keyword; name the config key instead

                raise ConfigError("a parameter got no gradient in a step, and DDP (parallel.zero_stage = 0) needs to "
                                  "know: set parallel.find_unused_parameters = true") from e
            raise
        if sync and self.meter.last_ready is not None:
            # exposed communication: from the last bucket's hand-over (compute done) to backward's return
            self.meter.add_blocked(time.perf_counter() - self.meter.last_ready)


class FSDPStrategy(Strategy):
    """Stages 1-3: FSDP2. Per micro-batch: gradient sync only where the plan says; stage 1 keeps parameters
    unsharded across micro-batches and reshards after the last backward (the stale-weights trap otherwise)."""

    @contextlib.contextmanager
    def micro_step(self, micro: int):
        root = self.model
        root.set_requires_gradient_sync(self.plan.syncs_gradients(micro))
        root.set_reshard_after_backward(self.plan.reshards_after_backward(micro))
        yield
        if self.plan.keeps_secondary(micro):  # hpZ: down to the secondary shard, not further (plan.py)

            reshard_to_secondary(root)

    def after_eval(self) -> None:
        for m in fsdp_modules(self.model):
            m.reshard()


# --------------------------------------------------------------------------------------------- clipping


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Clip by the global 2-norm over all gradients, exact across shards (``total_norm``); the scaling runs per
    mesh (DTensor's foreach ops take one mesh at a time)."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    total = total_norm([p.grad for p in params])
    for group in _by_mesh(params, lambda p: p.grad):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global 2-norm of ``grads``: FSDP2 gradients are DTensors whose norm is a partial value per rank, and
    ``full_tensor()`` combines them (as torchtitan does). Under tensor parallelism the gradients live on two
    meshes (the blocks' on (data, tensor), the replicated layers' on data alone), whose norms DTensor cannot
    stack: each mesh's norm is combined on its own, in one order on every rank (each is a collective)."""
    norms = []
    for group in _by_mesh(grads, lambda g: g):
        n = torch.nn.utils.get_total_norm(group, 2.0)
        norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), 2.0)


def _by_mesh(items: list, tensor_of) -> list[list]:
    """``items`` grouped by the device mesh of ``tensor_of(item)`` (one group for plain tensors), groups in an
    order every rank agrees on: by the mesh's dimension names, then by first appearance in ``items`` (the same
    parameter order on every rank); never by the member ranks, which differ from rank to rank."""
    groups: dict = {}
    for item in items:
        mesh = getattr(tensor_of(item), "device_mesh", None)
        key = () if mesh is None else (mesh.mesh_dim_names, tuple(mesh.mesh.flatten().tolist()))
        groups.setdefault(key, []).append(item)
    return [groups[k] for k in sorted(groups, key=lambda k: repr(k[0]) if k else "")]  # stable: ties keep order


# -------------------------------------------------------------------------------------------- sharding units


def shard_units(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """The blocks to shard as their own FSDP2 units, in forward order, and warnings.

    A model exposes its blocks as ``model.blocks`` (an ``nn.Sequential`` or ``nn.ModuleList``), as the models in
    models.py do. A block sharing a parameter with anything outside it (tied weights) stays in the root unit: FSDP2
    manages each parameter in exactly one unit, and a tied parameter used outside its unit's forward would be
    used while sharded."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (nn.Sequential, nn.ModuleList)) or len(blocks) == 0:
        return [], [f"{type(model).__name__} has no `blocks` (nn.Sequential/ModuleList): it is sharded as one "
                    "unit, so a whole-model all-gather happens at once (expose blocks to shard per block)"]
    warns = []
    owners: dict[int, set[str]] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(name)
    units = []
    for i, block in enumerate(blocks):
        prefix = f"blocks.{i}"
        inside = {id(p) for p in block.parameters()}
        shared = any(any(not (o == prefix or o.startswith(prefix + ".")) for o in owners[pid]) for pid in inside)
        if shared:
            warns.append(f"{prefix} shares a parameter with another part of the model (tied weights): "
                         "it stays in the root unit")
            continue
        units.append((prefix, block))
    return units, warns


# ------------------------------------------------------------------------------------------------ parallelize


def parallelize(model: nn.Module, parallel, world: World, *, device: torch.device, precision: str = "fp32",
                micro_batches: int = 1, sync_batchnorm: bool = False) -> Strategy:
    """Wrap ``model`` (already on ``device``, identical on every rank) for data-parallel training.

    ``parallel`` is the config's parallel section (``trainer.config.ParallelSection``): the ZeRO stage, offload,
    the DDP bucket size and unused-parameter flag, the ZeRO++ options (quantized collectives, hpZ), activation
    checkpointing per block (activation.py).
    ``world`` is this rank, the world size and which ranks share a node; the node layout feeds the
    intra/inter-node split of the byte counts, hpZ's secondary shard and two-hop qgZ. The rest is the run's:
    ``precision`` is the resolved compute precision: ``"fp32"``, ``"fp64"`` (the model is float64 already) or
    ``"bf16"`` (stage 0: the loop autocasts; stages 1-3: FSDP2 keeps fp32 sharded master weights, gathers bf16
    parameters and reduces gradients in fp32); ``micro_batches`` per optimizer step (``data.micro_batches``);
    ``sync_batchnorm`` (``model.sync_batchnorm``): BatchNorm statistics over the data-parallel group
    (batchnorm.py), converted before any wrapping; off, a model with BatchNorm on several data-parallel ranks
    gets one warning (rank 0)."""
    p, world_size = parallel, world.size
    topology = Topology(world.node_ids)  # as the ranks reported it (cluster/topology.py)
    meter = CommMeter(world.rank, topology, host_timing=device.type == "cpu")
    # the degrees on the observed placement (hybrid sharding's groups, replicate = 0 resolved per node); the
    # layout checks ran where the run built its own (the Trainer), so they are not repeated here
    dims = ParallelDims.build(p, world, validate=False)
    plan = make_plan(dims.zero_stage, world_size, micro_batches, p.reduce_every_micro_step, dims.offload_enabled,
                     reshard_group=world.node_size if p.hpz else 0, replicate=dims.replicate,
                     optimizer_on_disk=dims.nvme, tensor=dims.tensor)
    quant = make_quantization(p, world)
    compute_dtype = torch.float64 if precision == "fp64" else torch.float32
    tp_mesh = tensor_rank = tensor_numel = None
    if dims.tp_enabled:
        ensure_process_group(device)
        tp_mesh = dims.build_mesh(device)
    # before anything wraps the model, so that a tensor-parallel plan, DDP and FSDP2 all see the synced layers
    model, synced = _batchnorm(model, dims, world.rank, device, tp_mesh, meter, sync_batchnorm)
    if dims.tp_enabled:  # first, as torchtitan orders it: tensor parallelism, activation checkpointing, FSDP2
        tensor_numel = apply_tensor_parallel(model, tp_mesh["tensor"], p.sequence_parallel)
        tensor_rank = tp_mesh["tensor"].get_local_rank()
    if p.activation_checkpointing:
        # first: DDP and fully_shard then wrap the checkpointed blocks (FSDP2 shards each wrapper as the unit)
        checkpoint_blocks(model)

    if not plan.fsdp:
        if world_size == 1:
            return Strategy(model=model, module=model, plan=plan, meter=meter, compute_dtype=compute_dtype,
                            dims=dims, synced_batchnorm=synced)
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=p.bucket_mb,
                  gradient_as_bucket_view=True, find_unused_parameters=p.find_unused_parameters)
        ddp.register_comm_hook(None, counting_allreduce_hook(meter))
        return DDPStrategy(model=ddp, module=model, plan=plan, meter=meter, name="ddp",
                           compute_dtype=compute_dtype, dims=dims, synced_batchnorm=synced)

    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    ensure_process_group(device)
    mesh = tp_mesh["data"] if tp_mesh is not None else dims.build_mesh(device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" \
        else MixedPrecisionPolicy()
    # pinned host memory needs an accelerator (it raises on a CPU-only machine)
    off = CPUOffloadPolicy(pin_memory=device.type == "cuda") if plan.offload else OffloadPolicy()
    units, warns = shard_units(model)
    for w in warns:
        warnings.warn(w, ShardingWarning, stacklevel=2)
    kwargs = dict(mesh=mesh, mp_policy=mp, offload_policy=off)
    for _, block in units:  # bottom-up: each block its own unit, then the root takes what is left
        fully_shard(block, reshard_after_forward=plan.reshard_after_forward, **kwargs)
    root = root_parameters(model)
    # the root is never resharded after forward (as torchtitan sets it): backward needs its parameters first, so
    # resharding them would only gather them again; it reshards after backward with the blocks (plan.py). A model
    # without blocks is one unit, which reshards as the stage says (or stage 3 would hold all its parameters)
    fully_shard(model, reshard_after_forward=False if units else plan.reshard_after_forward, **kwargs)
    hierarchy = None
    if quant.two_hop:
        # collective: every rank creates every node group, in one order
        hierarchy = make_hierarchy(topology, device=device)
    gather = QuantAllGather(meter, quant.weights_bits, quant.block, hpz=p.hpz) if quant.weights_bits < 32 \
        else CountingAllGather(meter, hpz=p.hpz)
    if p.overlap:
        _prefetch(model, [block for _, block in units], device)
    for m in fsdp_modules(model):  # the setters are per module, not recursive
        m.set_custom_all_gather(gather)
        m.set_custom_reduce_scatter(
            QuantReduceScatter(meter, quant.grads_bits, quant.block, hierarchy, quant.error_feedback, unit=m,
                               root=model)
            if quant.grads_all_to_all else CountingReduceScatter(meter))
        # error feedback: every parameter's shard in every reduce-scatter (a zero gradient when unused), so each
        # residual is sent with its own parameter at every step, whatever find_unused_parameters says
        if p.find_unused_parameters or quant.error_feedback:
            m.set_reduce_scatter_unused_params(True, recurse=False)
        if dims.hybrid_enabled:
            m.set_all_reduce_hook(counting_hsdp_hook(meter, mesh.get_group("replicate")))
    return FSDPStrategy(model=model, module=model, plan=plan, meter=meter, name="fsdp2",
                        compute_dtype=compute_dtype, units=[n for n, _ in units], quant=quant,
                        tensor_rank=tensor_rank or 0, tensor_numel=tensor_numel,
                        sequence_parallel=dims.tp_enabled and p.sequence_parallel, dims=dims,
                        synced_batchnorm=synced, root_numel=sum(_local_numel(q) for q in root))


def _batchnorm(model: nn.Module, dims: ParallelDims, rank: int, device: torch.device, tp_mesh, meter: CommMeter,
               sync: bool) -> tuple[nn.Module, list[str]]:
    """BatchNorm under data parallelism (batchnorm.py): the model with its BatchNorm layers synchronized over the
    data-parallel group and their names, when asked and there is more than one data-parallel rank; otherwise the
    model as it is, with one warning on rank 0 when its BatchNorm layers would normalize per rank."""
    layers = batchnorm_layers(model)
    if not layers or dims.dp_size == 1:
        return model, []
    if not sync:
        per_rank = batchnorm_layers(model, per_rank=True)
        if per_rank and rank == 0:
            warnings.warn(unsynced_warning(model, per_rank, dims.dp_size), BatchNormWarning, stacklevel=3)
        return model, []
    group = data_parallel_group(dims, tp_mesh)
    return convert_batchnorm(model, device=device, group=group, meter=meter), layers


def _prefetch(model: nn.Module, blocks: list[nn.Module], device: torch.device) -> None:
    """Explicit prefetch, as torchtitan sets it: in forward each block issues the next block's all-gather once its
    own is copied out, in backward the previous block's; the root (the first unit forward runs) prefetches the
    first block. On a GPU, FSDP2 issues every unshard on its own all-gather streams, so the transfer overlaps the
    block's compute already; on CPU there are no streams and every unshard would block where it is issued, so
    there the unshards ask for ``async_op=True`` (fsdp_api.set_unshard_async) and FSDP2 waits for the prefetched
    gather when its block starts. Forcing async_op on a GPU would replace those streams with the process
    group's, so it is applied on CPU only (``unshard_async_wanted``)."""

    if blocks:
        model.set_modules_to_forward_prefetch([blocks[0]])
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])
    if unshard_async_wanted(device):
        set_unshard_async(model)


def unshard_async_wanted(device: torch.device) -> bool:
    """Whether FSDP2's unshards should ask the all-gather for ``async_op=True``: only without an accelerator
    (CPU, gloo), where FSDP2 has no all-gather stream to overlap on (``_prefetch``)."""
    return device.type == "cpu"


def root_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters ``parallelize`` leaves to the root FSDP2 unit, which is not resharded after forward: those
    in no block of ``shard_units`` (the stem, the head, tied weights), each once. None for a model without
    blocks: its one unit reshards after forward as the stage says."""
    units = shard_units(model)[0]
    inside = {id(q) for _, block in units for q in block.parameters()}
    return [q for q in model.parameters() if id(q) not in inside] if units else []


def _local_numel(t: torch.Tensor) -> int:
    """A tensor-parallel DTensor's elements on this rank; a plain tensor's elements."""
    return t.to_local().numel() if hasattr(t, "to_local") else t.numel()


def ensure_process_group(device: torch.device) -> None:
    """FSDP2 needs a process group even for one rank: make a one-process group in memory (no ports) when the
    run has none (local mode)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
