"""What the experiments of ``dutycycle diagnose`` share (experiments.py, layouts.py): the context they run in,
config variants, values computed once per diagnosis, the configured data's description."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Context:
    cfg: Any  # the user's TrainConfig (never modified: experiments copy it)
    workdir: str  # run directories of the experiments' short runs
    seconds: float = 5.0  # how long a measuring loop may run
    steps: int = 12  # optimizer steps of each short training run
    memory_budget_bytes: int | None = None  # per rank; None = the device's memory (GPU) or the host's share (CPU)
    results: dict = field(default_factory=dict)  # earlier experiments' results (scaling reads compute, ...)
    scale: int | None = None  # --scale: the worker count failures are projected to (None: the configured one)
    cache: dict = field(default_factory=dict)  # what several experiments need, computed once (see once)


def variant(cfg, *overrides: str) -> Any:
    """A copy of ``cfg`` with ``--set``-style overrides applied and validated."""
    from dutycycle.trainer.config import load_config

    return load_config(None, list(overrides), base=cfg.to_dict())


def once(ctx: Context, key: str, make):
    """A value several experiments need (the data's shape, the source table), computed once per diagnosis."""
    if key not in ctx.cache:
        ctx.cache[key] = make()
    return ctx.cache[key]


def data_info(ctx: Context):
    """The configured data's description (shape, classes, fingerprint)."""
    from dutycycle.trainer.cluster.world import World
    from dutycycle.trainer.step.data import make_sources

    # one process reads for itself: the whole global batch, not a tensor-parallel group's share of it
    return once(ctx, "data_info", lambda: make_sources(variant(ctx.cfg, "data.loader_mode=sync", "parallel.tensor=1"),
                                                        World())[2])
