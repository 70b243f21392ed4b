"""What each experiment of ``dutycycle diagnose`` finds, as one dataclass per experiment: the schema its result
has when it comes back from the experiment's process as JSON.

``to_dict`` writes a finding as the dict that ``diagnosis.json``, the verdict, the remedies and the report read;
``from_dict`` reads one back and names any key that is missing or not in the schema. A field with a default is
optional: absent from the dict while it holds None (the loader's ``raw`` rate without a table, scaling's
``quantized`` run when the run already quantizes). A field whose key is a Python keyword (``async``) names its
key in ``metadata={"key": ...}``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field


class FindingError(ValueError):
    """A finding whose keys do not match its experiment's schema (an experiment and its schema out of step)."""


@dataclass
class NotApplicable:
    """An experiment that does not apply to this config (h2d on a CPU run, scaling at one worker)."""

    why: str
    applicable: bool = False


@dataclass
class RunFinding:
    """One short training run (``experiments.short_run``): its rate and where each step's time went."""

    workers: int
    samples_per_s: float
    step_s: float
    data_wait_share: float
    comm_share: float
    checkpoint_share: float
    intervals: dict  # share name -> its 90% interval
    per_step: dict  # the per-step samples behind comm_share
    bytes_per_step: float
    inter_node_bytes_per_step: float
    comm_exposed_measured: typing.Any
    launch_s: float
    held_per_rank: list
    summary: dict


@dataclass
class QuantizedRun(RunFinding):
    """The scaling experiment's N-worker run with quantized collectives."""

    zero_stage: int
    settings: list
    speedup: float


@dataclass
class SaveRun(RunFinding):
    """A checkpoint experiment's run that saves every other step, and its stall per save."""

    stall_s_per_save: float
    saves: int
    stall_interval: list


@dataclass
class ComputeFinding:
    samples_per_s_per_worker: float
    samples_per_s: float
    workers: int
    interval: list
    batch_per_worker: int
    device: str
    threads: int
    num_params: int
    mfu: float | None
    # the trainer's step at one worker in the configured layout (shortrun.trainer_step): compute_s, interval,
    # steps, layout; or {"error": ...} when it could not run. None in a diagnosis recorded before it was measured
    trainer: dict | None = None
    # the same at ZeRO stage 0, nothing quantized or offloaded (the configured one's dict when that is flat)
    trainer_flat: dict | None = None
    # the bare loop's rate when the trainer's flat step was faster and became the ceiling (samples_per_s_per_worker)
    bare_samples_per_s_per_worker: float | None = None


@dataclass
class LoaderFinding:
    global_batch_size: int
    intervals: dict  # source name -> its rate's 90% interval
    slow_ms: float
    synthetic: float | None = None
    cache: float | None = None
    raw: float | None = None
    in_ram: float | None = None
    not_measured: dict | None = None  # source name -> why it was not measured (a base config's cache, ...)
    paths: dict | None = None  # the run's own data: its table, its cache (when one of this table exists), size


@dataclass
class ContentionFinding:
    """The step alone and beside the configured loader (experiments.contention), and the cores each took."""

    source: str
    loader_mode: str
    raw_threads: int
    prefetch: int
    workers: int
    batch_per_worker: int
    threads: int  # the step's intra-op threads
    cores: int  # the cores this process may use
    steps_alone: int
    steps_beside: int
    alone_step_s: float  # trimmed mean (noise.trimmed_mean)
    beside_step_s: float  # trimmed mean, one batch taken from the loader before each step
    slowdown: float  # beside / alone - 1
    slowdown_interval: list
    wait_s_per_batch: float  # the mean time taken to get a batch beside the step (the loader's pace)
    alone: dict | None = None  # cores used while the step ran alone: step, loader, others (None off Linux)
    beside: dict | None = None  # and beside the loader, with its threads and processes counted


@dataclass
class EndToEndFinding:
    configured: str  # the configured data.source: the key of the run the verdict reads
    synthetic: RunFinding | None = None
    cache: RunFinding | None = None
    raw: RunFinding | None = None


@dataclass
class H2DFinding:
    applicable: bool
    copy_s_per_batch: float
    gb_per_s: float
    share_of_step: float | None


@dataclass
class ScalingFinding:
    workers: int
    zero_stage: int
    replicate: int
    tensor: int
    quant_grads: str
    quant_block: int
    one: RunFinding
    many: RunFinding
    speedup: float
    efficiency: float
    quantized: QuantizedRun | None = None


@dataclass
class CheckpointFinding:
    configured_every: int
    configured_async: bool
    every: int
    sync: SaveRun
    async_: SaveRun = field(metadata={"key": "async"})


@dataclass
class MemoryFinding:
    num_params: int
    workers: int
    node_size: int
    budget_bytes: int
    budget_from: str
    rows: list  # one dict per layout (layouts._layout_row), the cheapest first
    configured: dict  # the configured layout's row
    activations_counted: bool


@dataclass
class FailuresFinding:
    """The failures experiment: measured costs, and the configured job's failures at ``workers`` (failures.py)."""

    measured: dict  # save_s, launch_s, restore_s, restart_s, step_s, async
    configured_every: int
    job_from: str  # where the job's steps and step time come from
    detect_from: str  # where the detection time comes from
    workers: int
    job_steps: int
    job_s: float  # T: the job's training seconds
    mtbf_s: float | None  # None: no failures (a rate of 0)
    failures_per_hour: float
    expected_failures: float | None  # in the whole job, as configured (None: it never ends)
    lost_s: float | None  # work done again, detection and restart over the job, as configured
    lost_s_per_failure: float | None
    failure_share: float  # lost_s over the expected wall time
    ettr: float  # as configured
    ettr_no_checkpoints: float
    interval_s: float | None  # the configured commit interval (None: no checkpoints)
    intervals: dict  # young, daly, nvidia, exact -> every, interval_s, ettr (and the formula's own seconds)
    recommended_every: int  # 0: no checkpoints needed
    recommended_interval_s: float | None
    recommended_by: str  # the interval that gave the best exact ETTR, or "no checkpoints"
    ettr_recommended: float
    margin: float  # no checkpoints when they gain less ETTR than this
    model: str
    costs: dict
    to_reach_97: str


FINDINGS: dict[str, type] = {
    "compute": ComputeFinding,
    "loader": LoaderFinding,
    "contention": ContentionFinding,
    "end_to_end": EndToEndFinding,
    "h2d": H2DFinding,
    "scaling": ScalingFinding,
    "checkpoint": CheckpointFinding,
    "memory": MemoryFinding,
    "failures": FailuresFinding,
}


def _key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def _optional(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING


def to_dict(finding) -> dict:
    """The finding as a JSON-ready dict (nested findings as dicts; optional fields holding None left out)."""
    out = {}
    for f in dataclasses.fields(finding):
        value = getattr(finding, f.name)
        if value is None and _optional(f):
            continue
        out[_key(f)] = to_dict(value) if dataclasses.is_dataclass(value) else value
    return out


def _finding_type(hint) -> type | None:
    """The dataclass a field holds (``RunFinding`` or ``RunFinding | None``), or None for plain values."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), None)
    return None


def from_dict(cls: type, data: dict, where: str = ""):
    """``data`` read as a ``cls``; a key that is missing (and not optional) or not in the schema is an error
    naming it and where it is (``scaling.many.step_s``)."""
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise FindingError(f"{where}: expected an object of {cls.__name__}'s keys, got {type(data).__name__}")
    by_key = {_key(f): f for f in dataclasses.fields(cls)}
    extra = sorted(set(data) - set(by_key))
    missing = sorted(k for k, f in by_key.items() if k not in data and not _optional(f))
    if extra or missing:
        said = ([f"missing key(s) {', '.join(missing)}"] if missing else []) + \
            ([f"unexpected key(s) {', '.join(extra)}"] if extra else [])
        raise FindingError(f"{where}: {' and '.join(said)} for {cls.__name__}")
    hints = typing.get_type_hints(cls)
    values = {}
    for key, f in by_key.items():
        if key not in data:
            continue
        nested = _finding_type(hints[f.name])
        value = data[key]
        values[f.name] = from_dict(nested, value, f"{where}.{key}") if nested and value is not None else value
    return cls(**values)


def read(experiment: str, data: dict):
    """An experiment's result as its finding: ``NotApplicable`` when it says so, else its experiment's schema."""
    if data.get("applicable") is False:
        return from_dict(NotApplicable, data, experiment)
    return from_dict(FINDINGS[experiment], data, experiment)
