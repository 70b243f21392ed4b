"""Training configuration: a tree of dataclasses, loaded from TOML, overridden with ``--set a.b=value``.

Everything is validated here, in the driver, before any worker starts: an unknown key or a bad value raises
``ConfigError`` naming the dotted key. The resolved tree is printed and saved as ``RUN_DIR/config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from dutycycle.engine.errors import ConfigError


@dataclass
class AugmentSection:
    crop_padding: int = 0  # random crop after zero padding by this many pixels (0 = off)
    flip: bool = False  # random horizontal flip
    normalize: bool = True  # uint8 -> float in [0, 1]


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
    augment: AugmentSection = field(default_factory=AugmentSection)


@dataclass
class ModelSection:
    # A registered name ("cnn", "vit") or a plug-in "package.module:factory" returning an nn.Module.
    name: str = "cnn"
    width: int = 32  # cnn: channels of the first block; vit: embedding dimension
    depth: int = 3  # cnn: conv blocks; vit: transformer blocks
    heads: int = 4  # vit only
    patch: int = 4  # vit only
    groups: int = 8  # GroupNorm groups (world-size-invariant normalization)


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


@dataclass
class ParallelSection:
    num_workers: int = 1
    use_gpu: str = "auto"  # "auto" (GPU when the cluster has one), "true" or "false"
    # ZeRO stage (trainer/parallel/plan.py): 0 = DDP; 1-3 = FSDP2 sharding optimizer state (1), + gradients (2),
    # + parameters (3)
    zero_stage: int = 0
    offload: str = "none"  # "optimizer": sharded parameters, gradients and optimizer state live in host memory
    # exchange gradients after every micro-batch (DeepSpeed style: less memory, M x the gradient traffic) instead
    # of once at the accumulation boundary
    reduce_every_micro_step: bool = False
    find_unused_parameters: bool = False  # parameters that get no gradient in some step (DDP's flag)
    node_size: int = 0  # ranks per node (consecutive ranks); 0 = all on one node. Byte accounting, hpZ, two-hop qgZ
    # ZeRO++ (stages 1-3; trainer/parallel/quant.py): int8 parameter all-gathers (qwZ), int8/int4 gradient
    # exchange by all-to-all summed in fp32 (qgZ), the backward all-gather kept inside the node (hpZ, stage 3)
    quant_weights: str = "none"  # "none" or "int8"
    quant_grads: str = "none"  # "none", "int8" or "int4"
    quant_block: int = 256  # elements per quantization block (one fp32 scale each)
    hierarchical: bool = True  # qgZ in two hops (inside the node, then across) when node_size splits the ranks
    error_feedback: bool = False  # keep each rank's gradient quantization error and send it with the next step
    hpz: bool = False  # stage 3: reshard to a node-sized group after forward (parallel.node_size)
    bucket_mb: float = 25.0  # DDP gradient bucket size (stage 0)
    cpus_per_worker: float = 1.0  # Ray CPU reservation per training worker
    threads_per_worker: int = 0  # torch intra-op threads; 0 = cores / workers on this node


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


@dataclass
class CheckpointSection:
    """Checkpoints (trainer/checkpoint/): model, optimizer, loader position, RNG and step, committed by a manifest
    with checksums written last."""

    every: int = 0  # optimizer steps between saves (and one at the last step); 0 = no checkpoints
    dir: str = ""  # any fsspec URI; "" = RUN_DIR/checkpoints
    keep: int = 2  # committed checkpoints kept (at least 2: the newest may be the one being replaced)
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


CHOICES = {
    "data.source": ("cache", "raw", "synthetic"),
    "data.loader_mode": ("auto", "sync", "thread", "ray", "memory"),
    "optim.name": ("adamw", "adam", "sgd", "rmsprop", "adagrad", "adamax", "nadam", "radam", "adafactor"),
    "optim.schedule": ("cosine", "constant"),
    "parallel.use_gpu": ("auto", "true", "false"),
    "parallel.offload": ("none", "optimizer"),
    "parallel.quant_weights": ("none", "int8"),
    "parallel.quant_grads": ("none", "int8", "int4"),
    "ray.placement_strategy": ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"),
    "ray.log_level": ("DEBUG", "INFO", "WARNING", "ERROR"),
    "run.precision": ("auto", "fp32", "bf16", "fp64"),
    "checkpoint.on_nonfinite": ("skip", "rollback", "stop"),
}


# Keys that cannot be field names: ``async`` is a Python keyword.
ALIASES = {"checkpoint.async": "checkpoint.async_save"}

# ----------------------------------------------------------------------------------------------- building


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert ``value`` (from TOML or a ``--set`` string) to the field type ``tp`` or raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        raise AssertionError(f"unsupported union type for {key}")
    if origin is dict:
        if isinstance(value, str):
            value = _parse_mapping(key, value)
        if not isinstance(value, dict):
            raise ConfigError(f"{key} = {value!r} must be a table of strings, e.g. {key}={{zone=\"a\"}}")
        return {str(k): str(v) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{key} = {value!r} is not a boolean; use true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r} is not an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{key} = {value!r} is not an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} = {value!r} is not a number")
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key} = {value!r} must be a string")
        if isinstance(value, bool):
            return "true" if value else "false"
        return str(value)
    raise AssertionError(f"unsupported field type {tp} for {key}")


def _parse_mapping(key: str, text: str) -> dict:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{key} = {text!r} is not a TOML inline table; write e.g. {key}={{zone=\"a\"}}") from e


def _build(cls, data: dict[str, Any], prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix} must be a table, got {data!r}")
    data = {ALIASES.get(f"{prefix}.{k}", f"{prefix}.{k}").rsplit(".", 1)[-1]: v for k, v in data.items()}
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(f"unknown config key {key!r}; valid keys here: {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, key)
        else:
            kwargs[name] = _coerce(key, value, tp)
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], dotted: str, raw: str) -> None:
    """Apply one ``a.b=value`` override to a nested dict, coercing the value to the field's type."""
    dotted = ALIASES.get(dotted, dotted)
    parts = dotted.split(".")
    cls: Any = TrainConfig
    node = tree
    for i, part in enumerate(parts):
        key = ".".join(parts[: i + 1])
        names = {f.name for f in dataclasses.fields(cls)}
        if part not in names:
            raise ConfigError(f"unknown config key {key!r}; valid keys here: {', '.join(sorted(names))}")
        tp = _hints(cls)[part]
        last = i == len(parts) - 1
        if dataclasses.is_dataclass(tp):
            if last:
                raise ConfigError(f"{key} is a section; set one of its keys, e.g. {key}.{dataclasses.fields(tp)[0].name}=...")
            node = node.setdefault(part, {})
            cls = tp
        else:
            if not last:
                raise ConfigError(f"unknown config key {dotted!r}: {key} is not a section")
            node[part] = _coerce(dotted, raw, tp)


def parse_overrides(items: list[str] | None) -> list[tuple[str, str]]:
    out = []
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} must look like key=value, e.g. --set optim.lr=0.01")
        k, v = item.split("=", 1)
        out.append((k.strip(), v.strip()))
    return out


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
        _set_dotted(tree, k, v)
    cfg = _build(TrainConfig, tree, "")
    validate(cfg)
    return cfg


def from_dict(tree: dict[str, Any]) -> TrainConfig:
    cfg = _build(TrainConfig, tree, "")
    validate(cfg)
    return cfg


def validate(cfg: TrainConfig) -> None:
    """Value checks that need more than a type; every message names the dotted key."""
    tree = cfg.to_dict()
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        if tree[section][name] not in allowed:
            raise ConfigError(f"{key} = {tree[section][name]!r} is not one of {', '.join(allowed)}")
    positive = {
        "data.global_batch_size": cfg.data.global_batch_size,
        "data.micro_batches": cfg.data.micro_batches,
        "data.eval_batch_size": cfg.data.eval_batch_size,
        "data.size": cfg.data.size,
        "parallel.num_workers": cfg.parallel.num_workers,
        "model.width": cfg.model.width,
        "model.depth": cfg.model.depth,
    }
    for key, v in positive.items():
        if v <= 0:
            raise ConfigError(f"{key} = {v} must be positive")
    for key, v in {
        "optim.lr": cfg.optim.lr,
        "optim.weight_decay": cfg.optim.weight_decay,
        "optim.grad_clip": cfg.optim.grad_clip,
        "optim.warmup_steps": cfg.optim.warmup_steps,
        "run.epochs": cfg.run.epochs,
        "run.max_steps": cfg.run.max_steps,
        "run.eval_every": cfg.run.eval_every,
        "data.slow_ms": cfg.data.slow_ms,
        "parallel.cpus_per_worker": cfg.parallel.cpus_per_worker,
        "ray.max_failures": cfg.ray.max_failures,
        "checkpoint.every": cfg.checkpoint.every,
        "checkpoint.max_rollbacks": cfg.checkpoint.max_rollbacks,
    }.items():
        if v < 0:
            raise ConfigError(f"{key} = {v} must not be negative")
    if cfg.run.epochs == 0 and cfg.run.max_steps == 0:
        raise ConfigError("run.epochs and run.max_steps are both 0; set one of them, e.g. --set run.epochs=3")
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
    _validate_parallel(cfg)
    _validate_checkpoint(cfg)
    if cfg.data.source == "cache" and not cfg.data.cache:
        raise ConfigError("data.cache is empty; set it to a materialized cache URI (dutycycle materialize ...)")
    if cfg.data.source == "raw" and not cfg.data.table:
        raise ConfigError("data.table is empty; set it to a metadata table URI for data.source = 'raw'")
    if ":" in cfg.model.name:
        module, _, attr = cfg.model.name.partition(":")
        if not module or not attr:
            raise ConfigError(f"model.name = {cfg.model.name!r} must be a registered name or 'package.module:factory'")
    else:
        from dutycycle.trainer.step.models import MODELS

        if cfg.model.name not in MODELS:
            raise ConfigError(
                f"model.name = {cfg.model.name!r} is not registered ({', '.join(sorted(MODELS))}); "
                "or give a plug-in 'package.module:factory'"
            )
    if cfg.model.name == "vit":
        if cfg.model.width % cfg.model.heads:
            raise ConfigError(f"model.width = {cfg.model.width} must be divisible by model.heads = {cfg.model.heads}")
    if cfg.model.name == "cnn" and cfg.model.width % cfg.model.groups:
        raise ConfigError(f"model.width = {cfg.model.width} must be divisible by model.groups = {cfg.model.groups}")


def _validate_parallel(cfg: TrainConfig) -> None:
    from dutycycle.trainer.step.optim import check_optimizer

    p = cfg.parallel
    if p.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero_stage = {p.zero_stage} is not one of 0, 1, 2, 3")
    if p.offload != "none" and p.zero_stage == 0:
        raise ConfigError(f"parallel.offload = {p.offload!r} needs sharded optimizer state; "
                          "set parallel.zero_stage = 1, 2 or 3")
    if p.reduce_every_micro_step and p.zero_stage == 1:
        raise ConfigError("parallel.reduce_every_micro_step = true contradicts parallel.zero_stage = 1, which holds "
                          "full gradients across the accumulation window; use zero_stage = 2 or 3 for that")
    if p.node_size < 0 or (p.node_size and p.num_workers % p.node_size):
        raise ConfigError(f"parallel.node_size = {p.node_size} must divide parallel.num_workers = "
                          f"{p.num_workers} (or be 0: all workers on one node)")
    if p.bucket_mb <= 0:
        raise ConfigError(f"parallel.bucket_mb = {p.bucket_mb} must be positive")
    for key, value in (("quant_weights", p.quant_weights), ("quant_grads", p.quant_grads)):
        if value != "none" and p.zero_stage == 0:
            raise ConfigError(f"parallel.{key} = {value!r} quantizes FSDP2's collectives; set parallel.zero_stage "
                              "= 1, 2 or 3 (stage 0 is DDP's all-reduce)")
    if p.error_feedback and p.quant_grads == "none":
        raise ConfigError("parallel.error_feedback = true needs quantized gradients: set parallel.quant_grads = "
                          "'int8' or 'int4'")
    if p.quant_block < 2 or p.quant_block % 2:
        raise ConfigError(f"parallel.quant_block = {p.quant_block} must be an even number >= 2 (int4 packs two "
                          "values per byte); 256 is the default")
    if p.hpz:
        if p.zero_stage != 3:
            raise ConfigError(f"parallel.hpz = true needs parallel.zero_stage = 3 (got {p.zero_stage}): only stage "
                              "3 gathers parameters again in backward")
        if not 1 < p.node_size < p.num_workers:
            raise ConfigError(f"parallel.hpz = true needs parallel.node_size between 2 and parallel.num_workers - 1 "
                              f"(got node_size = {p.node_size}, num_workers = {p.num_workers}): the secondary "
                              "shard lives on the ranks of one node")
    check_optimizer(cfg.optim.name, p.zero_stage)


def _validate_checkpoint(cfg: TrainConfig) -> None:
    c = cfg.checkpoint
    if c.keep < 2:
        raise ConfigError(f"checkpoint.keep = {c.keep} must be at least 2: a save replaces the oldest commit only "
                          "after it has committed itself, and a rollback may need the commit before the newest")
    if c.resume == "":
        raise ConfigError('checkpoint.resume is empty; use "auto", "none" or the URI of a checkpoint step directory')
    where = c.dir or cfg.run.dir
    if c.every and where.startswith("memory://") and cfg.parallel.num_workers > 1:
        # each worker process has its own memory:// store: ranks would not see each other's files
        key = "checkpoint.dir" if c.dir else "run.dir"
        raise ConfigError(f"{key} = {where!r} keeps checkpoints in one process's memory, which the other "
                          f"{cfg.parallel.num_workers - 1} worker(s) cannot see; use a local path or s3://")
    if cfg.run.health_timeout_s <= 0:
        raise ConfigError(f"run.health_timeout_s = {cfg.run.health_timeout_s} must be positive")


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
