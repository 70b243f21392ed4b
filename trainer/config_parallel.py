"""The ``[parallel]`` config section: data parallelism and its ZeRO stage, offload, hybrid sharding, ZeRO++ and
the fault injection the diagnosis uses; each key checked here, naming it (trainer/config.py holds the others)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dutycycle.engine.errors import ConfigError

from .configtree import not_negative, one_of, positive
from .parallel.dims import ParallelDims


@dataclass
class ParallelSection:
    # training workers (ranks). Elastic training: ``num_workers = [min, max]`` in TOML (or ``--set
    # parallel.num_workers=[2,3]``) sets ``num_workers`` to max and ``min_workers`` to min: Ray Train runs at up to
    # max workers and keeps training on as few as min when nodes are lost, growing back when they return; each
    # size trains on the same global batches (data.global_batch_size is samples per optimizer step at any size)
    num_workers: int = 1
    # the fewest workers an elastic run continues on; 0 = not elastic (a fixed size, num_workers). Written as the
    # first element of num_workers = [min, max]
    min_workers: int = 0
    # "auto" (GPU when the cluster has one), "true" or "false"; TOML's true and false are accepted as those words
    use_gpu: Literal["auto", "true", "false"] = "auto"
    # ZeRO stage (trainer/parallel/plan.py): 0 = DDP; 1-3 = FSDP2 sharding optimizer state (1), + gradients (2),
    # + parameters (3)
    zero_stage: int = 0
    # what leaves device memory (stages 1-3): "optimizer" = sharded parameters, gradients and optimizer state live
    # in host memory (FSDP2's CPUOffloadPolicy); "nvme" = the same, with the optimizer state in files on local disk
    # under offload_dir (trainer/parallel/nvme.py). Both serve fitting a model, not speed.
    offload: str = "none"
    offload_dir: str = ""  # "nvme": a local directory (an NVMe mount); "" = the system's temporary directory
    # stages 0 and 3: exchange gradients after every micro-batch (DeepSpeed style: less memory, M x the gradient
    # traffic) instead of once at the accumulation boundary. Stage 2 always does (it holds 1/W of the gradients:
    # trainer/parallel/plan.py); stage 1 never does (refused)
    reduce_every_micro_step: bool = False
    find_unused_parameters: bool = False  # parameters that get no gradient in some step (DDP's flag)
    # ranks per node for the byte accounting, hpZ and two-hop qgZ: 0 = as observed (every rank reports its node:
    # trainer/cluster/topology.py); a positive value asserts that many consecutive ranks per node (checked)
    node_size: int = 0
    # ZeRO++ (stages 1-3; trainer/parallel/quant.py): int8 parameter all-gathers (qwZ), int8/int4 gradient
    # exchange by all-to-all summed in fp32 (qgZ), the backward all-gather kept inside the node (hpZ, stage 3)
    quant_weights: str = "none"  # "none" or "int8"
    quant_grads: str = "none"  # "none", "int8" or "int4"
    quant_block: int = 256  # elements per quantization block (one fp32 scale each)
    hierarchical: bool = True  # qgZ in two hops (inside the node, then across) when node_size splits the ranks
    # how gradients are reduce-scattered (stages 1-3): "auto" = dutycycle's all-to-all summed in fp32 when
    # quantized (qgZ), the backend's reduce_scatter otherwise; "all_to_all" = the same all-to-all in fp32 (on gloo,
    # whose reduce-scatter is an all-reduce underneath, it moves half the bytes); "native" = the backend's
    reduce_scatter: str = "auto"
    error_feedback: bool = False  # keep each rank's gradient quantization error and send it with the next step
    hpz: bool = False  # stage 3: reshard to a node-sized group after forward (parallel.node_size)
    # hybrid sharding (FSDP2's HSDP on a 2-D mesh; trainer/parallel/plan.py): this many replica groups, zero_stage
    # sharding inside each group of num_workers / replicate ranks, one gradient all-reduce between the groups per
    # step. Each group must sit on one node (checked on the observed placement): parameter gathers and the
    # reduce-scatter stay on local links, only the all-reduce of the sharded gradient crosses nodes. 1 = flat
    # (shard over all workers); 0 = one group per node, as observed. Serves speed (traffic), not memory: each
    # rank holds 1/(num_workers / replicate) of the state, more than flat sharding's 1/num_workers.
    replicate: int = 1
    # tensor parallelism (torch.distributed.tensor.parallel on the model's own plan, e.g. TinyViT's: attention and
    # MLP split Megatron-style; trainer/parallel/tensor.py): this many ranks of one node compute each layer
    # together on the same batch, and zero_stage shards over the num_workers / tensor data-parallel ranks (FSDP2
    # on the data dimension of a 2-D mesh). Serves fitting (each rank holds 1/tensor of the blocks' weights and
    # activations) at the price of activation traffic on every layer: keep it inside a node. 1 = off
    tensor: int = 1
    # with tensor > 1: the residual stream between sub-layers split along the tokens (the norms run on 1/tensor of
    # them; each all-reduce becomes a reduce-scatter and an all-gather); false: replicated, all-reduced
    sequence_parallel: bool = True
    # stages 1-3: each unit prefetches the next unit's all-gather (forward) and the previous one's (backward),
    # so the transfer overlaps compute (trainer/parallel/comm.py; on CPU asked for asynchronously, on a GPU on
    # FSDP2's own streams); false: FSDP2's defaults (on CPU every all-gather then blocks where it is issued)
    overlap: bool = True
    bucket_mb: float = 25.0  # DDP gradient bucket size (stage 0)
    # recompute each block of model.blocks in backward instead of keeping its activations (any stage;
    # trainer/parallel/activation.py): activation memory of ~one block instead of all, for one more forward
    activation_checkpointing: bool = False
    cpus_per_worker: float = 1.0  # Ray CPU reservation per training worker
    threads_per_worker: int = 0  # torch intra-op threads; 0 = cores / workers on this node
    # fault injection (to test the diagnosis, as data.slow_ms does for the loader): every optimizer step's gradient
    # exchange waits this much longer, as on a slower link; counted as exposed communication, at any world size
    inject_comm_ms: float = 0.0
    # the parity check (trainer/parallel/check.py): every this many optimizer steps, the gradient the sharded,
    # quantized path applied to a sample of parameters (the largest of each sharded unit) is compared with a
    # plain float64 all-reduce of every rank's gradient, within a bound derived from the path's quantization and
    # rounding; beyond it the run stops (ParityCheckFailed). Each check is a metrics row (error, bound, seconds,
    # the step's collectives with their bytes and wire dtypes). 0 = off: nothing installed, nothing computed
    check_every: int = 0

    @property
    def elastic(self) -> bool:
        """The run may train at several sizes: min_workers < num_workers."""
        return 0 < self.min_workers < self.num_workers

    @property
    def sizes(self) -> range:
        """Every world size the run may train at, smallest first (one size when not elastic)."""
        return range(self.min_workers if self.elastic else self.num_workers, self.num_workers + 1)

    @property
    def grads_all_to_all(self) -> bool:
        """Gradients go by dutycycle's all-to-all (quantized, or asked for in fp32) rather than the backend's
        reduce-scatter: what plan.make_quantization wires and cluster/topology.py checks the layout for."""
        return self.quant_grads != "none" or self.reduce_scatter == "all_to_all"

    def check(self, where: str) -> None:
        one_of(f"{where}.use_gpu", self.use_gpu, ("auto", "true", "false"))
        one_of(f"{where}.offload", self.offload, ("none", "optimizer", "nvme"))
        one_of(f"{where}.quant_weights", self.quant_weights, ("none", "int8"))
        one_of(f"{where}.quant_grads", self.quant_grads, ("none", "int8", "int4"))
        one_of(f"{where}.reduce_scatter", self.reduce_scatter, ("auto", "all_to_all", "native"))
        if self.reduce_scatter == "native" and self.quant_grads != "none":
            raise ConfigError(f"{where}.reduce_scatter = 'native' cannot carry quantized gradients ({where}.quant_grads "
                              f"= {self.quant_grads!r} is exchanged by all-to-all); use \"auto\" or quant_grads = "
                              "\"none\"")
        positive(where, self, "num_workers")
        if not 0 <= self.min_workers <= self.num_workers:
            raise ConfigError(f"{where}.num_workers = [{self.min_workers}, {self.num_workers}] must be [min, max] with "
                              "1 <= min <= max (an integer: a fixed size)")
        not_negative(where, self, "cpus_per_worker", "inject_comm_ms", "check_every")
        one_of(f"{where}.zero_stage", self.zero_stage, (0, 1, 2, 3))
        if self.reduce_every_micro_step and self.zero_stage == 1:
            raise ConfigError(f"{where}.reduce_every_micro_step = true contradicts {where}.zero_stage = 1, which holds "
                              "full gradients across the accumulation window; use zero_stage = 2 or 3 for that")
        if self.node_size < 0 or (self.node_size and self.num_workers % self.node_size):
            raise ConfigError(f"{where}.node_size = {self.node_size} must divide {where}.num_workers = "
                              f"{self.num_workers} (or be 0: all workers on one node)")
        positive(where, self, "bucket_mb")
        for key, value in (("quant_weights", self.quant_weights), ("quant_grads", self.quant_grads)):
            if value != "none" and self.zero_stage == 0:
                raise ConfigError(f"{where}.{key} = {value!r} quantizes FSDP2's collectives; set {where}.zero_stage "
                                  "= 1, 2 or 3 (stage 0 is DDP's all-reduce)")
        if self.error_feedback and self.quant_grads == "none":
            raise ConfigError(f"{where}.error_feedback = true needs quantized gradients: set {where}.quant_grads = "
                              "'int8' or 'int4'")
        if self.quant_block < 2 or self.quant_block % 2:
            raise ConfigError(f"{where}.quant_block = {self.quant_block} must be an even number >= 2 (int4 packs two "
                              "values per byte); 256 is the default")
        # offload, hybrid sharding and tensor parallelism: the degrees against each other (parallel/dims.py)
        ParallelDims.from_config(self, where=where)
        if self.hpz:
            if self.zero_stage != 3:
                raise ConfigError(f"{where}.hpz = true needs {where}.zero_stage = 3 (got {self.zero_stage}): only "
                                  "stage 3 gathers parameters again in backward")
            if self.node_size and not 1 < self.node_size < self.num_workers:  # 0: checked on the observed layout
                raise ConfigError(f"{where}.hpz = true needs {where}.node_size between 2 and {where}.num_workers - 1 "
                                  f"(got node_size = {self.node_size}, num_workers = {self.num_workers}): the "
                                  "secondary shard lives on the ranks of one node")
