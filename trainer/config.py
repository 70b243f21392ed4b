"""Training configuration: a tree of dataclasses, loaded from TOML, overridden with ``--set a.b=value``.

Everything is validated here, in the driver, before any worker starts: an unknown key or a bad value raises
``ConfigError`` naming the dotted key. Each section checks its own values (``check``); ``validate`` adds the few
checks that need two sections. The data section holds the loader's own config objects (``[data.augment]`` is the
loader's ``AugmentConfig``, ``[data.read]`` the cache reader's ``ReadConfig``) and derives its ``LoaderConfig``s
in one method. The resolved tree is printed and saved as ``RUN_DIR/config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any

from dutycycle.engine.cache.shards import ReadConfig
from dutycycle.engine.errors import ConfigError
from dutycycle.loader.config import MODES, AugmentConfig, LoaderConfig

from .configtree import build, parse_overrides, renamed, set_dotted

# ------------------------------------------------------------------------------------------ value checks


def _one_of(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} = {value!r} is not one of {', '.join(map(str, allowed))}")


def _positive(where: str, section: Any, *names: str) -> None:
    for name in names:
        v = getattr(section, name)
        if v <= 0:
            raise ConfigError(f"{where}.{name} = {v} must be positive")


def _not_negative(where: str, section: Any, *names: str) -> None:
    for name in names:
        v = getattr(section, name)
        if v < 0:
            raise ConfigError(f"{where}.{name} = {v} must not be negative")


# -------------------------------------------------------------------------------------------- sections

# LoaderConfig fields that no config key sets, and why. Every other field comes from the data section (or
# run.seed); a test checks that each one is reachable from a key, so a new loader option cannot be forgotten.
LOADER_SET_BY_TRAINER = {
    "shuffle": "training batches are shuffled; validation reads every sample once in cache order (for_eval)",
    "pin_memory": "batches stay on the host: the step loop copies them to its device and times the copy (h2d)",
    "device": "batches stay on the host: the step loop copies them to its device and times the copy (h2d)",
}


@dataclass
class DataSection:
    # Where batches come from: "cache" (a materialized cache), "raw" (decode the metadata table per step) or
    # "synthetic" (in-memory shapes drawn with numpy; for tests and smoke runs, no files).
    source: str = "cache"
    cache: str = ""  # cache URI when source = "cache"
    table: str = ""  # metadata table URI when source = "raw"
    size: int = 32  # sample side for source = "raw" / "synthetic"
    global_batch_size: int = 128  # samples per optimizer step, over all ranks and micro-batches
    micro_batches: int = 1  # gradient accumulation: micro-batches per optimizer step on each rank
    eval_batch_size: int = 256  # per rank
    loader_mode: str = "auto"  # the loader's execution mode inside a worker (see launch.py for why)
    prefetch: int = 2
    drop_last: bool = True
    synthetic_samples: int = 512  # source = "synthetic": training samples (val gets a quarter)
    slow_ms: float = 0.0  # add this much sleep per batch (to show what a slow loader costs)
    # The loader's own options, with the loader's defaults (dutycycle.loader.config.LoaderConfig): augmentation
    # ([data.augment]: crop_padding, flip, normalize, mean, std), how shards are reached ([data.read]), the
    # shuffle's block and window, Ray task retries, raw-path decode threads, the in-RAM share of "memory" mode.
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    read: ReadConfig = field(default_factory=ReadConfig)
    block_size: int = LoaderConfig.block_size
    window: int = LoaderConfig.window
    partitions: int = LoaderConfig.partitions  # canonical partitions of the training plan (docs: the data path)
    ray_max_retries: int = LoaderConfig.ray_max_retries
    raw_threads: int = LoaderConfig.raw_threads
    memory_fraction: float = LoaderConfig.memory_fraction

    def loader_configs(self, seed: int, world_size: int) -> tuple[LoaderConfig, LoaderConfig]:
        """The loader configs for training and for validation (every sample once across ``world_size`` ranks,
        in cache order, no random augmentation, the same normalization)."""
        shared = dict(seed=seed, mode=self.loader_mode, prefetch=self.prefetch, read=self.read,
                      block_size=self.block_size, window=self.window, ray_max_retries=self.ray_max_retries,
                      raw_threads=self.raw_threads, memory_fraction=self.memory_fraction)
        a = self.augment
        train = LoaderConfig(global_batch_size=self.global_batch_size, drop_last=self.drop_last, augment=a,
                             partitions=self.partitions, **shared)
        val = LoaderConfig.for_eval(global_batch_size=self.eval_batch_size * world_size,
                                    augment=AugmentConfig.eval(a.normalize, a.mean, a.std), **shared)
        return train, val

    def check(self, where: str) -> None:
        _one_of(f"{where}.source", self.source, ("cache", "raw", "synthetic"))
        _one_of(f"{where}.loader_mode", self.loader_mode, MODES)
        _positive(where, self, "global_batch_size", "micro_batches", "eval_batch_size", "size")
        _not_negative(where, self, "slow_ms")
        if self.source == "cache" and not self.cache:
            raise ConfigError(f"{where}.cache is empty; set it to a materialized cache URI (dutycycle materialize ...)")
        if self.source == "raw" and not self.table:
            raise ConfigError(f"{where}.table is empty; set it to a metadata table URI for {where}.source = 'raw'")
        try:  # the loader's own checks (prefetch, block_size, memory_fraction, ...), named by their keys here
            self.loader_configs(seed=0, world_size=1)
        except ConfigError as e:
            raise renamed(e, LoaderConfig, where) from None


@dataclass
class ModelSection:
    # A registered name ("cnn", "vit") or a plug-in "package.module:factory" returning an nn.Module.
    name: str = "cnn"
    width: int = 32  # cnn: channels of the first block; vit: embedding dimension
    depth: int = 3  # cnn: conv blocks; vit: transformer blocks
    heads: int = 4  # vit only
    patch: int = 4  # vit only
    groups: int = 8  # GroupNorm groups (world-size-invariant normalization)

    def check(self, where: str) -> None:
        _positive(where, self, "width", "depth")
        if ":" in self.name:
            module, _, attr = self.name.partition(":")
            if not module or not attr:
                raise ConfigError(f"{where}.name = {self.name!r} must be a registered name or 'package.module:factory'")
        else:
            from dutycycle.trainer.step.models import MODELS

            if self.name not in MODELS:
                raise ConfigError(f"{where}.name = {self.name!r} is not registered ({', '.join(sorted(MODELS))}); "
                                  "or give a plug-in 'package.module:factory'")
        if self.name == "vit" and self.width % self.heads:
            raise ConfigError(f"{where}.width = {self.width} must be divisible by {where}.heads = {self.heads}")
        if self.name == "cnn" and self.width % self.groups:
            raise ConfigError(f"{where}.width = {self.width} must be divisible by {where}.groups = {self.groups}")


@dataclass
class OptimSection:
    name: str = "adamw"  # adamw, adam, sgd, rmsprop, adagrad, adamax, nadam, radam, adafactor (trainer/optim.py)
    lr: float = 3e-3
    weight_decay: float = 0.05
    momentum: float = 0.9  # sgd only
    beta1: float = 0.9
    beta2: float = 0.999
    warmup_steps: int = 20
    schedule: str = "cosine"  # "cosine" or "constant" after warmup
    min_lr_ratio: float = 0.05  # cosine floor as a fraction of lr
    grad_clip: float = 1.0  # max global gradient norm; 0 = off

    def check(self, where: str) -> None:
        from dutycycle.trainer.step.optim import OPTIMIZERS

        _one_of(f"{where}.name", self.name, tuple(OPTIMIZERS))
        _one_of(f"{where}.schedule", self.schedule, ("cosine", "constant"))
        _not_negative(where, self, "lr", "weight_decay", "grad_clip", "warmup_steps")


@dataclass
class ParallelSection:
    num_workers: int = 1
    use_gpu: str = "auto"  # "auto" (GPU when the cluster has one), "true" or "false"
    # ZeRO stage (trainer/parallel/plan.py): 0 = DDP; 1-3 = FSDP2 sharding optimizer state (1), + gradients (2),
    # + parameters (3)
    zero_stage: int = 0
    # what leaves device memory (stages 1-3): "optimizer" = sharded parameters, gradients and optimizer state live
    # in host memory (FSDP2's CPUOffloadPolicy); "nvme" = the same, with the optimizer state in files on local disk
    # under offload_dir (trainer/parallel/nvme.py). Both serve fitting a model, not speed.
    offload: str = "none"
    offload_dir: str = ""  # "nvme": a local directory (an NVMe mount); "" = the system's temporary directory
    # exchange gradients after every micro-batch (DeepSpeed style: less memory, M x the gradient traffic) instead
    # of once at the accumulation boundary
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
    # stages 1-3: each unit prefetches the next unit's all-gather (forward) and the previous one's (backward),
    # asynchronously, so the transfer overlaps compute (trainer/parallel/comm.py); false: FSDP2's defaults (on
    # CPU every all-gather then blocks where it is issued)
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

    @property
    def grads_all_to_all(self) -> bool:
        """Gradients go by dutycycle's all-to-all (quantized, or asked for in fp32) rather than the backend's
        reduce-scatter: what plan.make_quantization wires and cluster/topology.py checks the layout for."""
        return self.quant_grads != "none" or self.reduce_scatter == "all_to_all"

    def check(self, where: str) -> None:
        _one_of(f"{where}.use_gpu", self.use_gpu, ("auto", "true", "false"))
        _one_of(f"{where}.offload", self.offload, ("none", "optimizer", "nvme"))
        if self.offload == "nvme" and "://" in self.offload_dir:
            raise ConfigError(f"{where}.offload_dir = {self.offload_dir!r} is remote: offloaded optimizer state is "
                              "rewritten every step and must be on each node's local disk (an NVMe mount); set a "
                              "local path")
        _one_of(f"{where}.quant_weights", self.quant_weights, ("none", "int8"))
        _one_of(f"{where}.quant_grads", self.quant_grads, ("none", "int8", "int4"))
        _one_of(f"{where}.reduce_scatter", self.reduce_scatter, ("auto", "all_to_all", "native"))
        if self.reduce_scatter == "native" and self.quant_grads != "none":
            raise ConfigError(f"{where}.reduce_scatter = 'native' cannot carry quantized gradients ({where}.quant_grads "
                              f"= {self.quant_grads!r} is exchanged by all-to-all); use \"auto\" or quant_grads = "
                              "\"none\"")
        _positive(where, self, "num_workers")
        _not_negative(where, self, "cpus_per_worker", "inject_comm_ms")
        _one_of(f"{where}.zero_stage", self.zero_stage, (0, 1, 2, 3))
        if self.offload != "none" and self.zero_stage == 0:
            raise ConfigError(f"{where}.offload = {self.offload!r} needs sharded optimizer state; "
                              f"set {where}.zero_stage = 1, 2 or 3")
        if self.reduce_every_micro_step and self.zero_stage == 1:
            raise ConfigError(f"{where}.reduce_every_micro_step = true contradicts {where}.zero_stage = 1, which holds "
                              "full gradients across the accumulation window; use zero_stage = 2 or 3 for that")
        if self.node_size < 0 or (self.node_size and self.num_workers % self.node_size):
            raise ConfigError(f"{where}.node_size = {self.node_size} must divide {where}.num_workers = "
                              f"{self.num_workers} (or be 0: all workers on one node)")
        _positive(where, self, "bucket_mb")
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
        self._check_hybrid(where)
        if self.hpz:
            if self.zero_stage != 3:
                raise ConfigError(f"{where}.hpz = true needs {where}.zero_stage = 3 (got {self.zero_stage}): only "
                                  "stage 3 gathers parameters again in backward")
            if self.node_size and not 1 < self.node_size < self.num_workers:  # 0: checked on the observed layout
                raise ConfigError(f"{where}.hpz = true needs {where}.node_size between 2 and {where}.num_workers - 1 "
                                  f"(got node_size = {self.node_size}, num_workers = {self.num_workers}): the "
                                  "secondary shard lives on the ranks of one node")

    def _check_hybrid(self, where: str) -> None:
        if self.replicate < 0:
            raise ConfigError(f"{where}.replicate = {self.replicate} must be >= 0 (1 = flat sharding, 0 = one "
                              "replica group per node)")
        if self.replicate == 1:
            return
        if self.zero_stage == 0:
            raise ConfigError(f"{where}.replicate = {self.replicate} shards inside each replica group, and "
                              f"{where}.zero_stage = 0 shards nothing (DDP replicates on every rank): set "
                              f"{where}.zero_stage = 1, 2 or 3, or {where}.replicate = 1")
        if self.replicate and self.num_workers % self.replicate:
            raise ConfigError(f"{where}.replicate = {self.replicate} must divide {where}.num_workers = "
                              f"{self.num_workers}: every replica group holds the same number of ranks")
        if self.replicate and self.num_workers // self.replicate < 2:
            raise ConfigError(f"{where}.replicate = {self.replicate} leaves one rank per replica group of "
                              f"{where}.num_workers = {self.num_workers}: nothing is sharded (that is DDP, "
                              f"{where}.zero_stage = 0); use fewer groups")
        # ZeRO++ is the other answer to slow inter-node links: quantize what crosses them. Hybrid sharding keeps
        # the gathers inside the node in fp32 instead; the two are not combined here (FSDP2 issues HSDP's
        # all-reduce itself, with no seam for a quantized one)
        for key, value, off in (("quant_weights", self.quant_weights, "none"), ("quant_grads", self.quant_grads, "none"),
                                ("reduce_scatter", self.reduce_scatter, "auto"), ("hpz", self.hpz, False)):
            if value != off and not (key == "reduce_scatter" and value == "native"):
                raise ConfigError(f"{where}.replicate = {self.replicate} (hybrid sharding) does not combine with "
                                  f"{where}.{key} = {value!r}: hybrid keeps parameter gathers inside the node in "
                                  f"fp32, ZeRO++ quantizes what crosses nodes; choose one ({where}.replicate = 1, "
                                  f"or {where}.{key} = {off!r})")


@dataclass
class RaySection:
    address: str = ""  # "" starts (or joins) a local cluster; "auto" or ray://... joins an existing one
    storage_path: str = ""  # Ray Train run storage (absolute path or fsspec URI); "" = RUN_DIR/ray
    placement_strategy: str = "PACK"  # PACK, STRICT_PACK, SPREAD, STRICT_SPREAD
    label_selector: dict[str, str] = field(default_factory=dict)  # e.g. {"zone" = "us-east-1a"}
    accelerator_type: str = ""
    log_level: str = "WARNING"  # Ray Train's own console lines (INFO: resources, every rank's reports, ...)
    # Ray Train restarts the whole worker group this many times after a worker dies; the restarted workers resume
    # from the last committed checkpoint (checkpoint.resume = "auto"). 0 = a failed worker fails the run.
    max_failures: int = 0
    # how long a worker group may wait for its placement (all workers' resources at once) before the run fails
    # with a named reason; Ray Train's own default retries such a group forever. Raise it on an autoscaling
    # cluster, where nodes take minutes to join.
    start_timeout_s: float = 120.0
    # how often Ray Train's controller polls the workers. Each ray.train.report (a commit's pointer, an
    # evaluation's metrics, the final results) is taken from a worker at one poll, so at Ray's default (2 s) a
    # run's reports queue up and its end waits about 2 s per report still queued (14 s of a 16-step demo). One
    # status call per worker per interval: raise it for runs of hundreds of workers.
    health_check_interval_s: float = 0.5

    def check(self, where: str) -> None:
        _one_of(f"{where}.placement_strategy", self.placement_strategy,
                ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"))
        _one_of(f"{where}.log_level", self.log_level, ("DEBUG", "INFO", "WARNING", "ERROR"))
        _not_negative(where, self, "max_failures")
        _positive(where, self, "start_timeout_s")
        _positive(where, self, "health_check_interval_s")


@dataclass
class CheckpointSection:
    """Checkpoints (trainer/checkpoint/): model, optimizer, loader position, RNG and step, committed by a manifest
    with checksums written last."""

    every: int = 0  # optimizer steps between saves (and one at the last step); 0 = no checkpoints
    # any fsspec URI; "" = RAY_STORAGE/RUN_NAME/checkpoints when ray.storage_path is set (Ray Train's shared
    # storage), else RUN_DIR/checkpoints
    dir: str = ""
    # Ranks on several nodes each write their own files, and rank 0's manifest names them all: a local path is
    # refused then (each node would hold a part), unless it is a file system every node mounts (NFS, a mounted
    # bucket) and this says so. Object stores (s3://, gs://, ...) need nothing.
    shared_fs: bool = False
    keep: int = 2  # committed checkpoints kept (at least 2: the newest may be the one being replaced)
    # failures per worker-hour that `dutycycle diagnose` models lost work and the best interval with; default: the
    # Llama 3 report's 419 interruptions in 54 days on 16,384 GPUs (trainer/diagnose/failures.py)
    failures_per_worker_hour: float = 419 / (54 * 24 * 16384)
    # true: the step blocks only for the snapshot into host memory, the write streams in the background (at most
    # one save in flight; a save due while the previous one still writes waits for it, counted as stall).
    # false: the step blocks for the whole write and commit. The key "checkpoint.async" is accepted too.
    async_save: bool = True
    # "auto": continue from the newest checkpoint under checkpoint.dir whose manifest verifies (falling back to
    # older ones, loudly); "none": start fresh; or the URI of one step directory (it must verify)
    resume: str = "auto"
    # a non-finite loss (or gradient norm) at step s: "skip" = roll back to the last commit before s and leave
    # out the global batch of step s; "rollback" = roll back and train the same batches again (a transient
    # fault; the same step failing twice stops); "stop" = stop with the step and the batch's sample ids
    on_nonfinite: str = "skip"
    max_rollbacks: int = 3  # rollbacks in one run before a non-finite loss stops it
    # A resumed loader position is refused when the saved plan inputs (split, seed, window, block size, cache
    # fingerprint, ...) differ from this run's: the position would index another sequence of batches. true
    # loads the position anyway and continues this run's own plan from there (a different sample order).
    force_loader_state: bool = False

    def check(self, where: str) -> None:
        _one_of(f"{where}.on_nonfinite", self.on_nonfinite, ("skip", "rollback", "stop"))
        _not_negative(where, self, "every", "max_rollbacks", "failures_per_worker_hour")
        if self.keep < 2:
            raise ConfigError(f"{where}.keep = {self.keep} must be at least 2: a save replaces the oldest commit "
                              "only after it has committed itself, and a rollback may need the commit before the "
                              "newest")
        if self.resume == "":
            raise ConfigError(f'{where}.resume is empty; use "auto", "none" or the URI of a checkpoint step directory')


@dataclass
class RunSection:
    dir: str = "runs/train"  # run directory (any fsspec URI): config, metrics.jsonl, summary.json, report.png
    name: str = "dutycycle"
    seed: int = 0
    epochs: float = 1.0  # may be fractional; max_steps wins when > 0
    max_steps: int = 0
    eval_every: int = 50  # optimizer steps between validation passes (and always at the end); 0 = end only
    eval_max_batches: int = 0  # cap validation batches per pass; 0 = the whole split
    log_every: int = 10  # print every N steps (metrics.jsonl records every step)
    # "auto" (bf16 on GPU, fp32 on CPU), "fp32", "bf16", or "fp64" (model and inputs in float64: parity checks)
    precision: str = "auto"
    save_model: bool = True  # write the consolidated weights as RUN_DIR/model.safetensors at the end
    report: bool = True  # write report.png at the end
    # before training, every worker runs a small matmul and a timed collective round trip (trainer/checkpoint/
    # health.py); a worker that fails or exceeds health_timeout_s is named in the error
    health_check: bool = True
    health_timeout_s: float = 30.0

    def check(self, where: str) -> None:
        _one_of(f"{where}.precision", self.precision, ("auto", "fp32", "bf16", "fp64"))
        _not_negative(where, self, "epochs", "max_steps", "eval_every")
        if self.epochs == 0 and self.max_steps == 0:
            raise ConfigError(f"{where}.epochs and {where}.max_steps are both 0; set one of them, "
                              f"e.g. --set {where}.epochs=3")
        _positive(where, self, "health_timeout_s")


@dataclass
class TrainConfig:
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    optim: OptimSection = field(default_factory=OptimSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    ray: RaySection = field(default_factory=RaySection)
    run: RunSection = field(default_factory=RunSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


# Keys that cannot be field names: ``async`` is a Python keyword.
ALIASES = {"checkpoint.async": "checkpoint.async_save"}

def packaged_config(name: str) -> str:
    """The text of a config shipped with the package (``configs/NAME``), e.g. ``packaged_config("demo.toml")``."""
    from importlib import resources

    return resources.files("dutycycle.configs").joinpath(name).read_text()


def _read_config_text(path: str) -> str:
    """A config file from disk; ``configs/NAME.toml`` not found on disk is the copy installed with the package,
    so the documented ``dutycycle train configs/demo.toml`` works from any directory."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        head, name = os.path.split(os.path.normpath(path))
        if os.path.basename(head) == "configs" and name.endswith(".toml"):
            try:
                return packaged_config(name)
            except FileNotFoundError:
                pass
        raise ConfigError(f"config file {path!r} does not exist; pass a TOML file such as configs/demo.toml "
                          "(the configs installed with dutycycle: demo.toml, vit.toml)") from None


def load_config(path: str | None = None, overrides: list[str] | None = None, base: dict | None = None) -> TrainConfig:
    """Load a TOML file (or start from ``base``/defaults), apply ``--set`` overrides, validate."""
    tree: dict[str, Any] = dict(base or {})
    if path:
        try:
            tree = tomllib.loads(_read_config_text(path))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from e
    for k, v in parse_overrides(overrides):
        set_dotted(TrainConfig, tree, k, v, ALIASES)
    cfg = build(TrainConfig, tree, "", ALIASES)
    validate(cfg)
    return cfg


def from_dict(tree: dict[str, Any]) -> TrainConfig:
    cfg = build(TrainConfig, tree, "", ALIASES)
    validate(cfg)
    return cfg


def validate(cfg: TrainConfig) -> None:
    """Value checks that need more than a type; every message names the dotted key. Each section checks its
    own values (its ``check``); what follows needs two sections at once."""
    from dutycycle.trainer.step.optim import check_optimizer

    for f in dataclasses.fields(cfg):
        getattr(cfg, f.name).check(f.name)
    per_step = cfg.parallel.num_workers * cfg.data.micro_batches
    if cfg.data.global_batch_size % per_step:
        raise ConfigError(
            f"data.global_batch_size = {cfg.data.global_batch_size} does not split evenly over "
            f"parallel.num_workers x data.micro_batches = {per_step}; choose a multiple of {per_step}"
        )
    if not cfg.data.drop_last and per_step > 1:
        # A short last batch splits unevenly over ranks and micro-batches, and the gradient sync averages equal
        # shares: the step would no longer be the mean over the global batch (or a rank could get no sample).
        raise ConfigError(
            f"data.drop_last = false needs parallel.num_workers x data.micro_batches = 1 (got {per_step}); "
            "keep data.drop_last = true for distributed or accumulated training"
        )
    check_optimizer(cfg.optim.name, cfg.parallel.zero_stage)
    c = cfg.checkpoint
    where = c.dir or cfg.run.dir
    if c.every and where.startswith("memory://") and cfg.parallel.num_workers > 1:
        # each worker process has its own memory:// store: ranks would not see each other's files
        key = "checkpoint.dir" if c.dir else "run.dir"
        raise ConfigError(f"{key} = {where!r} keeps checkpoints in one process's memory, which the other "
                          f"{cfg.parallel.num_workers - 1} worker(s) cannot see; use a local path or s3://")


def use_gpu(cfg: TrainConfig, gpus_available: float) -> bool:
    if cfg.parallel.use_gpu == "auto":
        return gpus_available >= 1
    return cfg.parallel.use_gpu == "true"


def describe(cfg: TrainConfig) -> str:
    """The resolved config as TOML-ish text, for printing before a run starts."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            lines.append(f"{k} = {json.dumps(v)}")
    return "\n".join(lines)
