"""The run's parallel degrees, resolved and validated once: ``ParallelDims``, the one thing to ask about layout.

Built from the ``[parallel]`` config section and the observed placement (a ``cluster.world.World``, as
``cluster.topology.observe`` gathers it), like torchtitan's ``ParallelDims``::

    dims = ParallelDims.build(cfg.parallel, world)        # observed: the groups checked on the placement
    dims = ParallelDims.from_config(cfg.parallel, world_size=8, node_size=4)   # before launch (no world)

Fields (degrees; frozen):

- ``world_size``: ranks in the run; ``node_size``: ranks per node (0: uneven, or one node when built from config);
- ``zero_stage``: 0 (DDP) to 3 (FSDP2; plan.py);
- ``tensor``: ranks per tensor-parallel group (1: off); ``replicate``: hybrid sharding's replica groups,
  resolved (``parallel.replicate = 0``, one group per node, is the number of nodes here; 1: flat);
- ``offload``: ``"none"``, ``"optimizer"`` (host memory) or ``"nvme"`` (the optimizer state in files);
- ``world``: the observed placement (None when built from config alone).

Questions:

- ``tp_enabled`` (tensor > 1), ``hybrid_enabled`` (replicate > 1), ``fsdp_enabled`` (zero_stage >= 1),
  ``offload_enabled`` (offload != "none"), ``nvme`` (offload == "nvme");
- ``dp_size``: data-parallel ranks (world / tensor: what the loader splits the global batch by);
  ``shard_size``: ranks one parameter is sharded over by ZeRO (world / (replicate * tensor));
- ``data_ranks(rank)``: ``(data-parallel rank, dp_size)`` of a rank (a tensor-parallel group's ranks share one);
- ``shard_groups()``: hybrid sharding's groups on the placement (None when flat); ``tensor_groups()``: tensor
  parallelism's (None when off);
- ``flat_overrides(section)`` (a function): the overrides that turn replica and tensor groups off, for a variant
  that quantizes or runs one worker;
- ``build_mesh(device)``: the DeviceMesh these degrees need (a collective: every rank builds it): 2-D
  ``(data, tensor)`` with tensor parallelism, 2-D ``(replicate, shard)`` under hybrid sharding, 1-D otherwise.

Errors (``ConfigError``, naming the key and the fix) are raised once, by ``from_config`` (the degrees against each
other: also what ``ParallelSection.check`` runs at config load) and ``build`` (the groups against the placement,
and ``cluster.topology.check_layout``'s hpZ and two-hop checks).
"""

from __future__ import annotations

from dataclasses import dataclass

from dutycycle.engine.errors import ConfigError
from dutycycle.trainer.cluster.topology import check_layout
from dutycycle.trainer.cluster.world import World
from dutycycle.trainer.configtree import positive

from .plan import replica_groups, tensor_groups

OFFLOADS = ("none", "optimizer", "nvme")


@dataclass(frozen=True)
class ParallelDims:
    world_size: int = 1
    zero_stage: int = 0
    tensor: int = 1
    replicate: int = 1
    offload: str = "none"
    node_size: int = 0
    world: World | None = None

    def __post_init__(self):
        assert self.world_size % (self.tensor * self.replicate) == 0, (self.world_size, self.tensor, self.replicate)
        assert self.offload in OFFLOADS, self.offload

    # ---------------------------------------------------------------------------------------- building

    @classmethod
    def from_config(cls, parallel, *, world_size: int | None = None, node_size: int | None = None,
                    where: str = "parallel", validate: bool = True) -> ParallelDims:
        """The degrees a ``[parallel]`` section asks for on ``world_size`` ranks (default ``num_workers``) of
        ``node_size`` per node (default ``node_size``; 0: one node). ``validate``: refuse degrees that contradict
        each other, naming the keys (``where`` prefixes them)."""
        n = parallel.num_workers if world_size is None else world_size
        per_node = parallel.node_size if node_size is None else node_size
        if validate:
            check_degrees(parallel, where, n)
        replicate = parallel.replicate if parallel.zero_stage else 1
        if replicate == 0:  # one replica group per node
            replicate = n // per_node if per_node else 1
        return cls(world_size=n, zero_stage=parallel.zero_stage, tensor=parallel.tensor, replicate=replicate,
                   offload=parallel.offload, node_size=per_node)

    @classmethod
    def build(cls, parallel, world: World, *, validate: bool = True) -> ParallelDims:
        """The degrees on the observed placement: hybrid sharding's groups (replicate = 0 resolved per node) and
        tensor parallelism's, each refused when a group would span nodes. ``validate``: also the layout checks of
        ``cluster.topology.check_layout`` (hpZ, two-hop quantized gradients)."""
        if validate:
            check_layout(world, parallel)
        replicate = 1
        if parallel.replicate != 1 and parallel.zero_stage > 0:
            replicate = len(replica_groups(world, parallel.replicate))  # one group on one node: flat
        if parallel.tensor > 1:
            tensor_groups(world, parallel.tensor)
        return cls(world_size=world.size, zero_stage=parallel.zero_stage, tensor=parallel.tensor,
                   replicate=replicate, offload=parallel.offload, node_size=world.node_size, world=world)

    # -------------------------------------------------------------------------------------- questions

    @property
    def tp_enabled(self) -> bool:
        return self.tensor > 1

    @property
    def hybrid_enabled(self) -> bool:
        return self.replicate > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.zero_stage >= 1

    @property
    def offload_enabled(self) -> bool:
        return self.offload != "none"

    @property
    def nvme(self) -> bool:
        return self.offload == "nvme"

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tensor

    @property
    def shard_size(self) -> int:
        return self.world_size // (self.replicate * self.tensor)

    def _placement(self) -> World:
        return self.world if self.world is not None else World(0, self.world_size, node_size=self.node_size)

    def data_ranks(self, rank: int | None = None) -> tuple[int, int]:
        """``(rank, size)`` among the data-parallel ranks (``rank``: the observed world's own by default)."""
        if rank is None:
            rank = self._placement().rank
        if not self.tp_enabled:
            return rank, self.world_size
        groups = self.tensor_groups()
        return next(i for i, g in enumerate(groups) if rank in g), len(groups)

    def shard_groups(self) -> list[list[int]] | None:
        return replica_groups(self._placement(), self.replicate) if self.hybrid_enabled else None

    def tensor_groups(self) -> list[list[int]] | None:
        return tensor_groups(self._placement(), self.tensor) if self.tp_enabled else None

    def build_mesh(self, device):
        """The DeviceMesh of these degrees (see the module docstring). Collective."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if self.tp_enabled:
            return DeviceMesh(device.type, torch.tensor(self.tensor_groups()), mesh_dim_names=("data", "tensor"))
        if self.hybrid_enabled:
            return DeviceMesh(device.type, torch.tensor(self.shard_groups()), mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(device.type, (self.world_size,))


# ------------------------------------------------------------------------------------------- validation


def flat_overrides(parallel) -> list[str]:
    """The ``--set`` overrides that make a ``[parallel]`` section flat data parallelism (no replica groups, no
    tensor groups): what a variant adds that quantizes its collectives or runs one worker, since neither
    combines with them (``check_degrees``). Empty when the section is flat already."""
    out = []
    if parallel.replicate != 1:
        out.append("parallel.replicate=1")
    if parallel.tensor != 1:
        out.append("parallel.tensor=1")
    return out


def check_degrees(p, where: str, world_size: int) -> None:
    """The degrees against each other and the world size, each refusal naming the keys and the fix."""
    if p.offload == "nvme" and "://" in p.offload_dir:
        raise ConfigError(f"{where}.offload_dir = {p.offload_dir!r} is remote: offloaded optimizer state is "
                          "rewritten every step and must be on each node's local disk (an NVMe mount); set a "
                          "local path")
    if p.offload != "none" and p.zero_stage == 0:
        raise ConfigError(f"{where}.offload = {p.offload!r} needs sharded optimizer state; "
                          f"set {where}.zero_stage = 1, 2 or 3")
    _check_hybrid(p, where, world_size)
    _check_tensor(p, where, world_size)


def _check_hybrid(p, where: str, n: int) -> None:
    if p.replicate < 0:
        raise ConfigError(f"{where}.replicate = {p.replicate} must be >= 0 (1 = flat sharding, 0 = one "
                          "replica group per node)")
    if p.replicate == 1:
        return
    if p.zero_stage == 0:
        raise ConfigError(f"{where}.replicate = {p.replicate} shards inside each replica group, and "
                          f"{where}.zero_stage = 0 shards nothing (DDP replicates on every rank): set "
                          f"{where}.zero_stage = 1, 2 or 3, or {where}.replicate = 1")
    if p.replicate and n % p.replicate:
        raise ConfigError(f"{where}.replicate = {p.replicate} must divide {where}.num_workers = "
                          f"{n}: every replica group holds the same number of ranks")
    if p.replicate and n // p.replicate < 2:
        raise ConfigError(f"{where}.replicate = {p.replicate} leaves one rank per replica group of "
                          f"{where}.num_workers = {n}: nothing is sharded (that is DDP, "
                          f"{where}.zero_stage = 0); use fewer groups")
    # ZeRO++ is the other answer to slow inter-node links: quantize what crosses them. Hybrid sharding keeps
    # the gathers inside the node in fp32 instead; the two are not combined here (FSDP2 issues HSDP's
    # all-reduce itself, with no seam for a quantized one)
    for key, value, off in (("quant_weights", p.quant_weights, "none"), ("quant_grads", p.quant_grads, "none"),
                            ("reduce_scatter", p.reduce_scatter, "auto"), ("hpz", p.hpz, False)):
        if value != off and not (key == "reduce_scatter" and value == "native"):
            raise ConfigError(f"{where}.replicate = {p.replicate} (hybrid sharding) does not combine with "
                              f"{where}.{key} = {value!r}: hybrid keeps parameter gathers inside the node in "
                              f"fp32, ZeRO++ quantizes what crosses nodes; choose one ({where}.replicate = 1, "
                              f"or {where}.{key} = {off!r})")


def _check_tensor(p, where: str, n: int) -> None:
    positive(where, p, "tensor")
    if p.tensor == 1:
        return
    if n % p.tensor:
        raise ConfigError(f"{where}.tensor = {p.tensor} must divide {where}.num_workers = {n}: "
                          "every tensor-parallel group holds the same number of ranks")
    if p.zero_stage == 0:
        raise ConfigError(f"{where}.tensor = {p.tensor} composes with FSDP2 over the data-parallel ranks; "
                          f"{where}.zero_stage = 0 is DDP: set {where}.zero_stage = 1, 2 or 3")
    # one 2-D mesh (data, tensor): hybrid sharding would make it 3-D, and ZeRO++'s collectives and the offloads
    # handle plain (1-D) shards only; each combination is refused by name rather than run half-checked
    for key, value, off in (("replicate", p.replicate, 1), ("offload", p.offload, "none"),
                            ("quant_weights", p.quant_weights, "none"), ("quant_grads", p.quant_grads, "none"),
                            ("reduce_scatter", p.reduce_scatter, "auto"), ("hpz", p.hpz, False)):
        if value != off and not (key == "reduce_scatter" and value == "native"):
            raise ConfigError(f"{where}.tensor = {p.tensor} (tensor parallelism) does not combine with "
                              f"{where}.{key} = {value!r} here; set {where}.{key} = {off!r} or {where}.tensor = 1")
