"""Training configuration: a tree of dataclasses, loaded from TOML, overridden with ``--set a.b=value``.

Everything is validated here, in the driver, before any worker starts: an unknown key or a bad value raises
``ConfigError`` naming the dotted key. Each section checks its own values (``check``); ``validate`` adds the few
checks that need two sections. The data section holds the training loader's ``LoaderConfig``, whose fields are
keys of ``[data]`` itself (``[data.augment]`` is its ``AugmentConfig``, ``[data.read]`` the cache reader's
``ReadConfig``), and derives the training and validation configs from it in one method. The parallel section, the
longest, is in config_parallel.py (imported from here as ``ParallelSection``).

Types are strict where a value has one: a TOML (or JSON) value of the wrong type is refused with the key, the type
found and the type expected (``configtree.coerce``); a ``--set`` value is text and is parsed as its key's type.
``load_config`` reads a TOML file, a run's own ``config.json`` (each launch saves the resolved tree as
``RUN_DIR/attempts/<k>/config.json``, the finished attempt's also as ``RUN_DIR/config.json``) or a run directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any

from dutycycle.engine import formats, io
from dutycycle.engine.errors import ConfigError
from dutycycle.loader.config import MODES, AugmentConfig, LoaderConfig

from .config_batch import check_batch, check_layouts, micro_batches_at, with_partitions
from .config_checkpoint import CheckpointSection
from .config_parallel import ParallelSection
from .config_ray import RaySection
from .config_tracking import TrackingSection
from .configtree import (
    as_tree,
    build,
    flat,
    not_negative,
    one_of,
    parse_overrides,
    parse_value,
    positive,
    renamed,
    set_dotted,
)
from .parallel.dims import ParallelDims
from .step.optim import OPTIMIZERS, check_optimizer

# -------------------------------------------------------------------------------------------- sections

# LoaderConfig fields that no config key sets, and why. Every other field comes from the data section (or
# run.seed); a test checks that each one is reachable from a key, so a new loader option cannot be forgotten.
LOADER_SET_BY_TRAINER = {
    "shuffle": "training batches are shuffled; validation reads every sample once in cache order (for_eval)",
    "pin_memory": "on CUDA the loader pins each batch in its prefetch thread (step/data.py); off on CPU",
    "device": "on CUDA the loader's prefetch thread copies each batch there on a side stream while the step "
              "before it trains (step/data.py); on CPU batches stay where they are",
}


def _training_loader() -> LoaderConfig:
    # partitions 0: sized for parallel.num_workers when the config is loaded (config_batch.with_partitions)
    return LoaderConfig(global_batch_size=128, prefetch=2, partitions=0)


# LoaderConfig fields that are no keys of the data section: the loader's mode is data.loader_mode, its seed
# run.seed, and the rest (LOADER_SET_BY_TRAINER) the trainer sets.
LOADER_HIDDEN = ("mode", "seed", *LOADER_SET_BY_TRAINER)


@dataclass
class DataSection:
    # Where batches come from: "cache" (a materialized cache), "raw" (decode the metadata table per step) or
    # "synthetic" (in-memory shapes drawn with numpy; for tests and smoke runs, no files).
    source: str = "cache"
    cache: str = ""  # cache URI when source = "cache"
    table: str = ""  # metadata table URI when source = "raw"
    size: int = 32  # sample side for source = "raw" / "synthetic"
    # gradient accumulation: micro-batches per optimizer step on each rank at the largest size (parallel.
    # num_workers' max); a smaller size runs as many more as keep each micro-batch within that size's samples
    # (config_batch.py: B = 12, [2, 3], 2 -> 2 micro-batches of 2 at 3 workers, 3 of 2 at 2); uneven ones allowed
    micro_batches: int = 1
    eval_batch_size: int = 256  # per rank
    loader_mode: str = "auto"  # the loader's execution mode inside a worker (see launch.py for why)
    synthetic_samples: int = 512  # source = "synthetic": training samples (val gets a quarter)
    slow_ms: float = 0.0  # add this much sleep per batch (to show what a slow loader costs)
    # The training loader's own config (dutycycle.loader.config.LoaderConfig), its fields keys of this table:
    # global_batch_size (samples per optimizer step, over all ranks and micro-batches; 128 here), prefetch (2
    # here), drop_last, augmentation ([data.augment]: crop_padding, flip, normalize, mean, std), normalize_on
    # (where the normalization runs: "auto" = on the device after a uint8 copy on CUDA, on the host on CPU;
    # "host"; "device"; the values are the same bits either way), how shards are
    # reached ([data.read]), the shuffle's block and window, partitions (canonical partitions of the training
    # plan; docs: the data path; 0, the default: loader.plan.default_partitions of every size parallel.num_workers
    # allows, e.g. 6 for [2, 3], 1 for one worker or synthetic data, resolved when the config is loaded and
    # recorded in the run's config.json), Ray task retries, raw-path decode threads, the in-RAM share of "memory"
    # mode.
    loader: LoaderConfig = flat(_training_loader, hidden=LOADER_HIDDEN)

    def __getattr__(self, name: str) -> Any:
        # data.global_batch_size, data.augment, ...: the keys this table takes from the loader's config
        if name in _LOADER_KEYS and "loader" in self.__dict__:
            return getattr(self.__dict__["loader"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def loader_configs(self, seed: int, world_size: int) -> tuple[LoaderConfig, LoaderConfig]:
        """The loader configs for training and for validation (every sample once across ``world_size`` ranks,
        in cache order, no random augmentation, the same normalization)."""
        train = dataclasses.replace(self.loader, seed=seed, mode=self.loader_mode)
        a = train.augment
        val = dataclasses.replace(train, global_batch_size=self.eval_batch_size * world_size, drop_last=False,
                                  shuffle=False, partitions=1, augment=AugmentConfig.eval(a.normalize, a.mean, a.std))
        return train, val

    def check(self, where: str) -> None:
        one_of(f"{where}.source", self.source, ("cache", "raw", "synthetic"))
        one_of(f"{where}.loader_mode", self.loader_mode, MODES)
        positive(where, self, "micro_batches", "eval_batch_size", "size")  # global_batch_size: the LoaderConfig's
        not_negative(where, self, "slow_ms")
        if self.source == "cache" and not self.cache:
            raise ConfigError(f"{where}.cache is empty; set it to a materialized cache URI (dutycycle materialize ...)")
        if self.source == "raw" and not self.table:
            raise ConfigError(f"{where}.table is empty; set it to a metadata table URI for {where}.source = 'raw'")
        try:  # the loader's own checks (prefetch, block_size, memory_fraction, ...), named by their keys here
            self.loader_configs(seed=0, world_size=1)
        except ConfigError as e:
            raise renamed(e, LoaderConfig, where) from None


_LOADER_KEYS = frozenset(f.name for f in dataclasses.fields(LoaderConfig)) - set(LOADER_HIDDEN)


# The models step/models.py builds by name (it imports torch; a config is checked without it).
BUILT_IN_MODELS = ("cnn", "vit")


@dataclass
class ModelSection:
    # A registered name ("cnn", "vit") or a plug-in "package.module:factory" returning an nn.Module.
    name: str = "cnn"
    width: int = 32  # cnn: channels of the first block; vit: embedding dimension
    depth: int = 3  # cnn: conv blocks; vit: transformer blocks
    heads: int = 4  # vit only
    patch: int = 4  # vit only
    groups: int = 8  # GroupNorm groups (world-size-invariant normalization)
    # BatchNorm layers of the model (a plug-in's: the built-in models use GroupNorm) take their training batch
    # statistics over the whole data-parallel group's micro-batch instead of each rank's own: converted before
    # DDP / FSDP2 wrap the model (torch's SyncBatchNorm on CUDA, trainer/parallel/batchnorm.py's on CPU), so N
    # ranks of B samples train as one process on N x B. Off, such a model warns once when data-parallel.
    sync_batchnorm: bool = False

    def check(self, where: str) -> None:
        positive(where, self, "width", "depth")
        if ":" in self.name:
            module, _, attr = self.name.partition(":")
            if not module or not attr:
                raise ConfigError(f"{where}.name = {self.name!r} must be a registered name or 'package.module:factory'")
        elif self.name not in BUILT_IN_MODELS:
            raise ConfigError(f"{where}.name = {self.name!r} is not registered ({', '.join(sorted(BUILT_IN_MODELS))}); "
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
    # torch's fused kernel (adamw, adam, sgd: one launch per step, not one per tensor) where it is supported:
    # parameters on CUDA, floating point (step/optim.py: fused_choice); otherwise, or false, torch's default
    # (foreach on CUDA, a per-tensor loop on CPU). The summary's "optimizer" says which ran, and why.
    fused: bool = True

    def check(self, where: str) -> None:
        one_of(f"{where}.name", self.name, tuple(OPTIMIZERS))
        one_of(f"{where}.schedule", self.schedule, ("cosine", "constant"))
        not_negative(where, self, "lr", "weight_decay", "grad_clip", "warmup_steps")


@dataclass
class RunSection:
    dir: str = "runs/train"  # run directory (any fsspec URI): config, metrics.jsonl, summary.json, report.png
    name: str = "dutycycle"
    seed: int = 0
    epochs: float = 1.0  # may be fractional; max_steps wins when > 0
    max_steps: int = 0
    eval_every: int = 50  # optimizer steps between validation passes (and always at the end); 0 = end only
    eval_max_batches: int = 0  # cap validation batches per pass; 0 = the whole split
    # the driver's progress line every N steps (a bar on a terminal; launch/progress.py); 0 = none shown.
    # metrics.jsonl records every step either way
    log_every: int = 10
    # "auto" (bf16 on GPU, fp32 on CPU), "fp32", "bf16", or "fp64" (model and inputs in float64: parity checks)
    precision: str = "auto"
    save_model: bool = True  # write the consolidated weights as RUN_DIR/model.safetensors at the end
    report: bool = True  # write report.png at the end
    # before training, every worker runs a small matmul and a timed collective round trip (trainer/checkpoint/
    # health.py); a worker that fails or exceeds health_timeout_s is named in the error
    health_check: bool = True
    health_timeout_s: float = 30.0
    # write each sample's loss at every step into RUN_DIR/sample_loss/ (Parquet: row id, step, epoch, rank,
    # micro-batch, loss; trainer/trace/losses.py), for `dutycycle trace` and a notebook's highest-loss samples.
    # Off by default: a second, detached cross-entropy per micro-batch, and per log interval a gather to rank 0
    # and a Parquet part (the cost per step is in benchmarks/results/trace.json)
    record_sample_loss: bool = False

    def check(self, where: str) -> None:
        one_of(f"{where}.precision", self.precision, ("auto", "fp32", "bf16", "fp64"))
        not_negative(where, self, "epochs", "max_steps", "eval_every")
        if self.epochs == 0 and self.max_steps == 0:
            raise ConfigError(f"{where}.epochs and {where}.max_steps are both 0; set one of them, "
                              f"e.g. --set {where}.epochs=3")
        positive(where, self, "health_timeout_s")


@dataclass
class TrainConfig:
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    optim: OptimSection = field(default_factory=OptimSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    ray: RaySection = field(default_factory=RaySection)
    run: RunSection = field(default_factory=RunSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)  # MLflow (config_tracking.py)

    def to_dict(self) -> dict[str, Any]:
        return as_tree(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


# Keys that cannot be field names: ``async`` is a Python keyword.
ALIASES = {"checkpoint.async": "checkpoint.async_save"}

def packaged_config(name: str) -> str:
    """The text of a config shipped with the package (``configs/NAME``), e.g. ``packaged_config("demo.toml")``."""
    from importlib import resources

    return resources.files("dutycycle.configs").joinpath(name).read_text()


def _read_config_text(path: str) -> str:
    """A config file; ``configs/NAME.toml`` not found on disk is the copy installed with the package, so the
    documented ``dutycycle train configs/demo.toml`` works from any directory."""
    try:
        if io.protocol(path) != "file":
            return io.read_capped(path, MAX_CONFIG_BYTES).decode("utf-8")
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
                          "(the configs installed with dutycycle: demo.toml, vit.toml), a run's config.json or "
                          "a run directory") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path!r} is not UTF-8 text; pass a TOML file, a run's config.json or a "
                          "run directory") from None


# ------------------------------------------------------------------------------------------- a run's config

# A run directory's own config files (the layout is trainer/launch/rundir.py's): RUN_DIR/config.json is the
# config of the newest attempt that finished (the one model.safetensors and summary.json belong to);
# RUN_DIR/attempts/<k>/config.json is the config each launch k started with.
CONFIG_FILE = "config.json"
ATTEMPTS = "attempts"
MAX_CONFIG_BYTES = 1 << 20  # a config is a few kilobytes; a larger file is no config


def attempt_numbers(run_dir: str) -> list[int]:
    """The numbers of the attempt folders in ``run_dir`` (``attempts/1``, ``attempts/2``, ...), ascending."""
    fs, path = io.filesystem(io.join(run_dir, ATTEMPTS))
    try:
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(path, detail=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(n) for n in names if n.isdigit() and not n.startswith("0"))


def newest_attempt_file(run_dir: str, name: str) -> str | None:
    """``RUN_DIR/attempts/<k>/<name>`` of the newest attempt that has one (``RUN_DIR/<name>`` in a run made
    before attempt folders existed); None when there is none."""
    for k in reversed(attempt_numbers(run_dir)):
        uri = io.join(run_dir, ATTEMPTS, str(k), name)
        if io.exists(uri):
            return uri
    uri = io.join(run_dir, name)
    return uri if io.exists(uri) else None


def run_config_uri(run_dir: str) -> str | None:
    """The config a run directory continues with: its newest attempt's ``config.json``, else (a run made before
    attempt folders existed) ``RUN_DIR/config.json``; None when it holds neither."""
    return newest_attempt_file(run_dir, CONFIG_FILE)


def _is_dir(path: str) -> bool:
    fs, p = io.filesystem(path)
    try:
        return fs.isdir(p)
    except OSError:
        return False


def read_config_tree(path: str) -> dict[str, Any]:
    """The nested dict of a config file: TOML, or JSON (a run's ``config.json``: its ``format`` stamp is checked
    and dropped), or a run directory (the config it continues with: ``run_config_uri``)."""
    if _is_dir(path):
        uri = run_config_uri(path)
        if uri is None:
            raise ConfigError(f"{path!r} is a directory without a run's config (no {CONFIG_FILE}, no "
                              f"{ATTEMPTS}/<k>/{CONFIG_FILE}); pass a TOML config or a run directory")
        path = uri
    text = _read_config_text(path)
    if path.endswith(".json"):
        try:
            tree = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {path!r} is not valid JSON: {e}") from e
        if isinstance(tree, dict) and formats.KEY in tree:  # a run's own config.json carries the stamp
            formats.check(tree, f"config file {path!r}")
            tree = {k: v for k, v in tree.items() if k != formats.KEY}
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {path!r} holds a JSON {type(tree).__name__}, not an object of sections")
        return tree
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from e


def load_config(path: str | None = None, overrides: list[str] | None = None, base: dict | None = None) -> TrainConfig:
    """Load a config (or start from ``base``/defaults), apply ``--set`` overrides, validate. ``path``: a TOML
    file, a run's ``config.json`` (``RUN_DIR/config.json``, ``RUN_DIR/attempts/<k>/config.json``) or a run
    directory (its newest attempt's config: what ``--resume`` continues). A value of the wrong type is refused
    (``configtree.coerce``); an override is text, parsed as its key's type."""
    tree: dict[str, Any] = read_config_tree(path) if path else dict(base or {})
    tree = elastic_form(tree)
    for k, v in parse_overrides(overrides):
        if k == "parallel.num_workers" and v.strip().startswith("["):  # --set parallel.num_workers=[2,3]
            tree = elastic_form({**tree, "parallel": {**tree.get("parallel", {}),
                                                       "num_workers": parse_value(k, v, "a TOML array", f"{k}=[2, 3]")}})
            continue
        set_dotted(TrainConfig, tree, k, v, ALIASES)
    cfg = with_partitions(build(TrainConfig, tree, "", ALIASES))
    validate(cfg)
    return cfg


def elastic_form(tree: dict[str, Any]) -> dict[str, Any]:
    """``parallel.num_workers = [min, max]`` as the two keys it means (``min_workers``, ``num_workers``); a tree
    without it is returned as it is."""
    par = tree.get("parallel")
    if not isinstance(par, dict) or not isinstance(par.get("num_workers"), (list, tuple)):
        return tree
    pair = par["num_workers"]
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair):
        raise ConfigError(f"parallel.num_workers = {list(pair)!r} must be an integer or [min, max] (two integers, "
                          "e.g. [2, 4]: elastic training between 2 and 4 workers)")
    if "min_workers" in par:
        raise ConfigError("parallel.num_workers = [min, max] and parallel.min_workers both set the fewest workers; "
                          "keep one")
    return {**tree, "parallel": {**par, "num_workers": pair[1], "min_workers": pair[0]}}


def from_dict(tree: dict[str, Any]) -> TrainConfig:
    cfg = with_partitions(build(TrainConfig, elastic_form(tree), "", ALIASES))
    validate(cfg)
    return cfg


def resolve_for_world(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """The config one worker trains with at the world size it actually runs at (Ray Train's or torchrun's):
    a fixed-size config at ``world_size`` (``parallel.num_workers``; ``min_workers`` 0) whose
    ``data.micro_batches`` is what that size runs (config_batch.py: the micro-batch never grows past the largest
    size's). The global batch, the plan (``data.partitions`` resolved from the whole range first) and everything
    else are the run's. A size outside ``parallel.num_workers`` is refused."""
    cfg = with_partitions(cfg)
    par = cfg.parallel
    if world_size not in par.sizes:
        raise ConfigError(f"{world_size} workers is outside parallel.num_workers = "
                          f"{[par.min_workers, par.num_workers] if par.elastic else par.num_workers}; a run trains at "
                          f"{par.sizes.start}..{par.sizes.stop - 1} workers")
    if world_size == par.num_workers and not par.elastic:
        return cfg
    data = dataclasses.replace(cfg.data, micro_batches=micro_batches_at(cfg, world_size))
    out = dataclasses.replace(cfg, data=data, parallel=dataclasses.replace(par, num_workers=world_size,
                                                                           min_workers=0))
    validate(out)
    return out


def validate(cfg: TrainConfig) -> None:
    """Value checks that need more than a type; every message names the dotted key. Each section checks its
    own values (its ``check``); what follows needs two sections at once."""
    for f in dataclasses.fields(cfg):
        getattr(cfg, f.name).check(f.name)
    check_layouts(cfg)  # every size of an elastic run forms the parallel layout
    check_batch(cfg)  # the global batch splits at every size; micro-batches at the largest (config_batch.py)
    check_optimizer(cfg.optim.name, cfg.parallel.zero_stage)
    _check_tensor_model(cfg)
    c = cfg.checkpoint
    where = c.dir or cfg.run.dir
    if c.every and where.startswith("memory://") and cfg.parallel.num_workers > 1:
        # each worker process has its own memory:// store: ranks would not see each other's files
        key = "checkpoint.dir" if c.dir else "run.dir"
        raise ConfigError(f"{key} = {where!r} keeps checkpoints in one process's memory, which the other "
                          f"{cfg.parallel.num_workers - 1} worker(s) cannot see; use a local path or s3://")


def _check_tensor_model(cfg: TrainConfig) -> None:
    """Tensor parallelism needs a model that says how to split its layers, in whole heads, and groups inside a
    node: refused here, before any worker starts, for the built-in models (a plug-in's plan is checked when it is
    applied, trainer/parallel/tensor.py)."""
    dims, m = ParallelDims.from_config(cfg.parallel, validate=False), cfg.model
    if not dims.tp_enabled:
        return
    t = dims.tensor
    if m.name == "cnn":
        raise ConfigError(f"parallel.tensor = {t} needs a model with a tensor-parallel plan, and model.name = 'cnn' "
                          "has none: use model.name = 'vit', or parallel.tensor = 1")
    if m.name == "vit" and m.heads % t:
        raise ConfigError(f"parallel.tensor = {t} must divide model.heads = {m.heads}: each rank takes whole heads")
    if dims.node_size and dims.node_size % t:
        raise ConfigError(f"parallel.tensor = {t} must divide parallel.node_size = {dims.node_size}: a "
                          "tensor-parallel group sits on one node")


def use_gpu(cfg: TrainConfig, gpus_available: float) -> bool:
    if cfg.parallel.use_gpu == "auto":
        return gpus_available >= 1
    return cfg.parallel.use_gpu == "true"
