"""What each ZeRO stage means here, as plain functions: the torch settings, the bytes held, the bytes sent.

ZeRO (arXiv 1910.02054) partitions model state across the W data-parallel ranks: stage 1 the optimizer state,
stage 2 also the gradients, stage 3 also the parameters. dutycycle maps the stages onto PyTorch's own
machinery:

- stage 0 is ``DistributedDataParallel``: bucketed all-reduce launched during backward, ``no_sync()`` on all
  micro-batches but the last, so the step's one gradient exchange overlaps the last backward.
- stages 1-3 are FSDP2 (``fully_shard``) applied per block, then to the root. FSDP2 always keeps parameters
  sharded between optimizer steps (keeping them unsharded across a step would train on stale weights), so the
  stages differ in what is unsharded *during* the step:
  stage 3 reshards after forward and gathers again in backward; stage 2 keeps parameters unsharded from forward
  to the end of backward; stage 1 keeps them (and the full gradients) unsharded across the whole accumulation
  window. Stage 1 has no exact FSDP2 equivalent: ZeRO-1 keeps parameters replicated between steps, FSDP2 does
  not; what it holds is measured and reported beside the ZeRO formula.

Stage 2 reduce-scatters every micro-batch's gradients into their owners' shards, as DeepSpeed's stage 2 does
(FSDP2 accumulates each reduced shard into the sharded gradient): a rank never holds more than 1/W of the
gradients, at any number of micro-batches, for M times the gradient traffic. That is what stage 2 is for: kept
unsharded across the window, its gradients would be stage 1's, and stage 1 holds less.
The other stages exchange gradients once per optimizer step, at the accumulation boundary, by default
(synchronizing inside the accumulation window multiplies gradient traffic by the micro-batch count, enough to make
a cluster slower than one GPU). With ``reduce_every_micro_step`` stages 0 and 3 reduce after every micro-batch
too (DeepSpeed's style): less memory (no full gradients kept), M times the gradient traffic.

The root unit (the parameters in no block) is never resharded after forward, as torchtitan sets it: backward
needs its parameters first, so resharding them would only gather them again (an all-gather per micro-batch for
nothing). It is resharded after backward with the blocks. (A model without blocks is one unit, which reshards as
its stage says.)

Hybrid sharding (``replicate`` = R > 1, FSDP2's HSDP): the W ranks form R replica groups of S = W / R ranks, each
group on one node (``hybrid_groups``). The stage applies inside each group, on the mesh's ``shard`` dimension:
parameters are gathered and gradients reduce-scattered among the S ranks of the node; then each rank all-reduces
its gradient shard (1/S of the gradients) with the R ranks holding the same shard on the other nodes (the
``replicate`` dimension). Per step a rank sends 2G(R-1)/(RS) bytes across nodes instead of flat stage 3's
G(W-1)/W for the reduce-scatter plus 2P(W-1)/W for the gathers, almost all of which crosses nodes when W is
large; the price is memory: state divided by S instead of W.
"""

from __future__ import annotations

from dataclasses import dataclass

from dutycycle.engine.errors import ConfigError


@dataclass(frozen=True)
class ShardingPlan:
    """The resolved torch settings for one run (pure data, derived from the parallel config)."""

    zero_stage: int
    world_size: int
    micro_batches: int
    reduce_every_micro_step: bool  # resolved: the config's key at stages 0 and 3, always at 2, never at 1
    offload: bool
    fsdp: bool  # FSDP2 (stages 1-3) or DDP / a plain module (stage 0)
    reshard_after_forward: bool | int  # FSDP2 only
    keep_unsharded_across_micro_batches: bool  # stage 1: reshard after backward only at the last micro-batch
    replicate: int = 1  # hybrid sharding: replica groups (FSDP2 stages only); 1 = flat
    optimizer_on_disk: bool = False  # offload = "nvme": the optimizer state in files (nvme.py), not host memory
    tensor: int = 1  # tensor parallelism: ranks per tensor-parallel group (FSDP2 stages only); 1 = off

    @property
    def shard_size(self) -> int:
        """Ranks one parameter is sharded over by ZeRO: the world, one replica group under hybrid sharding, the
        data-parallel ranks (world / tensor) under tensor parallelism."""
        return self.world_size // (self.replicate * self.tensor)

    def syncs_gradients(self, micro: int) -> bool:
        """Whether micro-batch ``micro`` (0-based) of the step exchanges gradients."""
        return self.reduce_every_micro_step or micro == self.micro_batches - 1

    def reshards_after_backward(self, micro: int) -> bool:
        """Stage 1 keeps parameters unsharded until the last micro-batch; then they must be resharded, or the
        next step would compute with the unsharded copy the optimizer never updated (stale weights). hpZ keeps
        its secondary shard instead (``keeps_secondary``)."""
        if self.keeps_secondary(micro):
            return False
        return not self.keep_unsharded_across_micro_batches or micro == self.micro_batches - 1

    def keeps_secondary(self, micro: int) -> bool:
        """hpZ: after the backward of every micro-batch but the last, reshard to the node-sized secondary shard
        rather than fully, so the next micro-batch's forward gathers inside the node: one cross-node gather per
        step instead of one per micro-batch. The weights cannot change inside a step, so the secondary shard is
        still current; after the last micro-batch the parameters are resharded fully for the optimizer step."""
        return type(self.reshard_after_forward) is int and micro < self.micro_batches - 1


@dataclass(frozen=True)
class Quantization:
    """ZeRO++ wire formats (bits: 32 = unquantized, 8 = int8, 4 = int4; quant.py) and their options."""

    weights_bits: int = 32  # parameter all-gathers (qwZ)
    grads_bits: int = 32  # gradient reduce-scatters (qgZ)
    block: int = 256
    two_hop: bool = False  # qgZ inside the node first, then across nodes
    error_feedback: bool = False
    # gradients exchanged by dutycycle's all-to-all (summed in fp32 on arrival) rather than the backend's
    # reduce-scatter: always when quantized; in fp32 when asked (parallel.reduce_scatter = "all_to_all"), the
    # algorithm of qgZ without its quantization (gloo's reduce-scatter is an all-reduce underneath: twice the bytes)
    grads_all_to_all: bool = False


BITS = {"none": 32, "int8": 8, "int4": 4}


def make_quantization(parallel, world) -> Quantization:
    """The wire formats the parallel config section asks for (``quant_weights``, ``quant_grads``,
    ``quant_block``, ``hierarchical``, ``error_feedback``, ``reduce_scatter``) on ``world`` (a ``cluster.world.World``). Two hops
    only pay when there is more than one node and more than one rank per node."""
    grads = BITS[parallel.quant_grads]
    a2a = parallel.grads_all_to_all
    two_hop = parallel.hierarchical and a2a and world.num_nodes > 1 and world.node_size > 1
    return Quantization(weights_bits=BITS[parallel.quant_weights], grads_bits=grads, block=parallel.quant_block,
                        two_hop=two_hop, error_feedback=parallel.error_feedback and grads < 32,
                        grads_all_to_all=a2a)


def make_plan(zero_stage: int, world_size: int, micro_batches: int = 1, reduce_every_micro_step: bool = False,
              offload: bool = False, reshard_group: int = 0, replicate: int = 1,
              optimizer_on_disk: bool = False, tensor: int = 1) -> ShardingPlan:
    """``reshard_group`` > 0 (stage 3 only): reshard to groups of that many ranks after forward (hpZ).
    ``replicate`` > 1 (stages 1-3): hybrid sharding over that many replica groups (resolved: never 0 here).
    ``tensor`` > 1 (stages 1-3): tensor parallelism in groups of that many ranks; ZeRO over the rest."""
    assert zero_stage in (0, 1, 2, 3), zero_stage
    assert replicate >= 1 and world_size % replicate == 0 and (replicate == 1 or zero_stage >= 1), replicate
    assert tensor >= 1 and world_size % tensor == 0 and (tensor == 1 or (zero_stage >= 1 and replicate == 1)), tensor
    reshard: bool | int = zero_stage == 3
    if zero_stage == 3 and reshard_group and reshard_group < world_size:
        reshard = reshard_group
    return ShardingPlan(
        zero_stage=zero_stage, world_size=world_size, micro_batches=micro_batches,
        # stage 1 is defined by holding full gradients across the window: it always reduces at the boundary;
        # stage 2 by holding 1/W of them: it always reduces every micro-batch (module doc)
        reduce_every_micro_step=(reduce_every_micro_step and zero_stage != 1) or zero_stage == 2,
        offload=offload, fsdp=zero_stage >= 1, reshard_after_forward=reshard,
        keep_unsharded_across_micro_batches=zero_stage == 1, replicate=replicate,
        optimizer_on_disk=optimizer_on_disk and zero_stage >= 1, tensor=tensor,
    )


def hybrid_groups(nodes: list[list[int]], replicate: int) -> list[list[int]]:
    """Hybrid sharding's shard groups, one per replica group: each node's ranks (``nodes``, as observed) cut in
    order into groups of W / ``replicate``. Row i of FSDP2's 2-D mesh is group i (its ``shard`` dimension); column
    j pairs the j-th rank of every group, the ranks holding the same shard (its ``replicate`` dimension). The
    caller has checked that every node's ranks divide into whole groups (cluster/topology.py)."""
    world = sum(len(ranks) for ranks in nodes)
    size = world // replicate
    groups = [sorted(ranks)[i:i + size] for ranks in nodes for i in range(0, len(ranks), size)]
    assert len(groups) == replicate and all(len(g) == size for g in groups), (nodes, replicate)
    return groups


def replica_groups(world, replicate: int) -> list[list[int]]:
    """Hybrid sharding's shard groups (``hybrid_groups``) on the observed placement (``world``, a
    ``cluster.world.World``), ``replicate`` resolved (0: one group per node). Refused, naming the placement, when a group would span nodes (its gathers would cross
    the slow links hybrid sharding exists to avoid) or hold a single rank (nothing to shard: that is DDP)."""

    r = replicate or world.num_nodes
    size = world.size // r if world.size % r == 0 else 0
    if size < 2 or any(len(ranks) % size for ranks in world.nodes):
        why = (f"{world.size} workers do not split into {r} groups of at least 2" if size < 2 else
               f"groups of {size} ranks would span nodes")
        raise ConfigError(f"parallel.replicate = {replicate} (hybrid sharding: {r} replica groups) cannot run on this "
                          f"placement ({world.placement()}): {why}; every node's workers must divide into whole "
                          "groups of at least 2 ranks. Set parallel.replicate = 0 (one group per node), 1 (flat "
                          "sharding), or place the workers evenly (ray.placement_strategy, parallel.num_workers)")
    return hybrid_groups(world.nodes, r)


def tensor_groups(world, tensor: int) -> list[list[int]]:
    """Tensor parallelism's groups on the observed placement (``world``, a ``cluster.world.World``): each node's
    ranks cut in order into groups of ``tensor``, as ``hybrid_groups`` cuts them. Row i of the 2-D (data, tensor)
    mesh is group i; its ranks compute every layer together on one batch (data-parallel rank i). Refused, naming
    the placement, when a group would span nodes: tensor parallelism exchanges activations in every layer."""

    if any(len(ranks) % tensor for ranks in world.nodes):
        raise ConfigError(f"parallel.tensor = {tensor} cannot run on this placement ({world.placement()}): a "
                          "tensor-parallel group must sit on one node (it exchanges activations in every layer), "
                          f"so every node's workers must divide into groups of {tensor}. Place the workers evenly "
                          "(ray.placement_strategy, parallel.num_workers) or lower parallel.tensor")
    return hybrid_groups(world.nodes, world.size // tensor)


# ------------------------------------------------------------------------------------------------- memory


def zero_formula(stage: int, numel: int, world: int, param_bytes: int, grad_bytes: int, optim_bytes: int) -> dict:
    """Bytes per rank that the ZeRO paper assigns to each stage: parameters, gradients, optimizer state."""
    p, g, o = numel * param_bytes, numel * grad_bytes, numel * optim_bytes
    if stage >= 1:
        o /= world
    if stage >= 2:
        g /= world
    if stage >= 3:
        p /= world
    return {"params": p, "grads": g, "optimizer": o}


def expected_held(plan: ShardingPlan, numel: int, master_bytes: int, compute_bytes: int, grad_bytes: int,
                  optim_bytes: int, residual_bytes: int = 0, root_numel: int = 0) -> dict:
    """Peak bytes one rank holds at the step's phase boundaries (after each forward, after each backward, after
    the optimizer step) under dutycycle's mapping: what memory.py measures. Padding excluded (FSDP2 pads each
    parameter's first dimension to a multiple of W).

    ``master_bytes`` is the parameter dtype the optimizer updates, ``compute_bytes`` the dtype forward runs in
    (2 with bf16 mixed precision), ``grad_bytes`` the reduction dtype. ``optimizer_file``: the optimizer state
    kept in files under offload = "nvme" (then not in ``optimizer``). ``residual_bytes``: 4 with ZeRO++ error
    feedback, whose residual is an fp32 copy of every unit's *unsharded* gradient on every rank (more than the
    sharded model state at stage 3); 0 without. ``root_numel``: the elements of the root unit's parameters (those
    in no block: apply.root_parameters), which stay unsharded from forward to the end of backward at stage 3 too
    (module doc); 0 counts them as sharded.
    """
    residuals = numel * residual_bytes
    w = plan.shard_size
    if not plan.fsdp:
        return {"params": numel * master_bytes, "grads": numel * grad_bytes, "optimizer": numel * optim_bytes,
                "residuals": residuals, "optimizer_file": 0}
    shard = numel / w
    params = shard * master_bytes
    if plan.reshard_after_forward is False:  # stages 1-2: the unsharded compute copy beside the shard
        params += numel * compute_bytes
    else:  # stage 3: the root unit's unsharded copy after forward, and under hpZ the blocks' secondary shard
        params += root_numel * compute_bytes
        if plan.reshard_after_forward is not True:
            params += (numel - root_numel) * compute_bytes / plan.reshard_after_forward
    # without a per-micro-batch reduce-scatter, unsharded gradients accumulate across the window
    accumulates = plan.micro_batches > 1 and not plan.reduce_every_micro_step
    grads = numel * grad_bytes if accumulates else shard * grad_bytes
    optimizer = shard * optim_bytes
    # offload = "nvme": the state is in files between steps (during one, a chunk at a time: nvme.CHUNK_BYTES)
    on_disk = optimizer if plan.optimizer_on_disk else 0
    return {"params": params, "grads": grads, "optimizer": optimizer - on_disk, "residuals": residuals,
            "optimizer_file": on_disk}


# ------------------------------------------------------------------------------------------------ traffic


def expected_traffic(plan: ShardingPlan, param_bytes_total: int, grad_bytes_total: int,
                     root_param_bytes: float = 0) -> dict:
    """Logical bytes one rank sends per optimizer step (traffic.py's accounting), by collective kind, unquantized
    (quantized collectives send their packed bytes: quant.packed_nbytes). ``param_bytes_total``: all parameters
    in the dtype the all-gathers move (FSDP2's ``param_dtype``: bf16 under mixed precision, 2 bytes each);
    ``grad_bytes_total``: all gradients in the dtype they are reduced in (``reduce_dtype``: fp32 there).
    Under hybrid sharding the gathers and the reduce-scatter run over the S ranks of a replica group and
    ``all_reduce`` is the exchange of each rank's 1/S gradient shard among the R groups. ``root_param_bytes``:
    of ``param_bytes_total``, the root unit's (apply.root_parameters), which stage 3 gathers once per micro-batch
    (never resharded after forward) and hpZ once per step (kept unsharded across micro-batches)."""
    w, m, r = plan.shard_size, plan.micro_batches, plan.replicate
    if plan.world_size == 1:
        return {}
    per = (w - 1) / w
    syncs = m if plan.reduce_every_micro_step else 1
    if not plan.fsdp:
        return {"all_reduce": 2 * grad_bytes_total * per * syncs}
    out = {"reduce_scatter": syncs * grad_bytes_total * per}
    if r > 1:
        out["all_reduce"] = syncs * 2 * grad_bytes_total / w * (r - 1) / r
    if plan.zero_stage == 1:
        out["all_gather"] = param_bytes_total * per
    elif plan.zero_stage == 2:
        out["all_gather"] = m * param_bytes_total * per
    elif plan.reshard_after_forward is True:  # blocks in forward and again in backward, the root in forward
        out["all_gather"] = m * (2 * param_bytes_total - root_param_bytes) * per
    else:  # hpZ: the first forward gathers over all ranks; the blocks' backwards, and their forwards of later
        # micro-batches (the secondary shard is kept between them), over the node's ranks
        group = plan.reshard_after_forward
        out["all_gather"] = param_bytes_total * per
        out["all_gather_hpz"] = (2 * m - 1) * (param_bytes_total - root_param_bytes) * (group - 1) / group
    return out


def inter_node_bytes(plan: ShardingPlan, traffic: dict, node_size: int) -> float:
    """Of ``traffic`` (``expected_traffic``'s bytes by kind), the bytes one rank sends across nodes when the world
    runs ``node_size`` consecutive ranks per node and hybrid sharding's groups each sit inside one node. A flat
    collective sends equal bytes to every peer, (W - n) of whose W - 1 live elsewhere; hybrid's gathers and
    reduce-scatter stay inside and its all-reduce reaches the other groups, (R - n/S) of R - 1 elsewhere."""
    w, n = plan.world_size, node_size or plan.world_size
    if w == 1 or n >= w:
        return 0.0
    if plan.replicate == 1:
        return sum(v for k, v in traffic.items() if k != "all_gather_hpz") * (w - n) / (w - 1)
    r, per_node = plan.replicate, max(1, n // plan.shard_size)
    return traffic.get("all_reduce", 0.0) * (r - per_node) / (r - 1)
