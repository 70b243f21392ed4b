"""What the experiments of ``dutycycle diagnose`` share (experiments.py, layouts.py): the context they run in,
config variants, values computed once per diagnosis, the configured data's description."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dutycycle.trainer.cluster.world import World
from dutycycle.trainer.config import load_config
from dutycycle.trainer.step.data import make_sources


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


def share_steps(ctx: Context) -> int:
    """Steps for the short runs whose figures decide the verdict or predict and check a remedy's gain (the
    configured end-to-end run, the scaling runs, --verify's run); the others take ``ctx.steps`` (the checkpoint
    runs too: with a save every other step they cost the most per step, and took the failures experiment's time
    in the demo's diagnosis).
    A share's interval narrows with the steps behind it: six steady steps gave the demo's communication share
    (17%) an interval 5 points wide, which reached the 20% line in one run of three and flipped the verdict. So
    these runs take as many steps as fit in ``ctx.seconds`` at the compute ceiling's step time, between
    ``ctx.steps`` and three times that: a cheap step buys a narrow interval, a slow one costs no more than before.
    (At four times, one of three diagnoses of the demo's config at ``--budget-s 150`` left its last experiment,
    failures, 13 s: too little to finish.)"""
    ceiling = (ctx.results.get("compute") or {}).get("samples_per_s")
    if not ceiling:
        return ctx.steps
    step_s = ctx.cfg.data.global_batch_size / ceiling
    return max(ctx.steps, min(3 * ctx.steps, int(ctx.seconds / step_s)))


def variant(cfg, *overrides: str) -> Any:
    """A copy of ``cfg`` with ``--set``-style overrides applied and validated."""
    return load_config(None, list(overrides), base=cfg.to_dict())


def once(ctx: Context, key: str, make):
    """A value several experiments need (the data's shape, the source table), computed once per diagnosis."""
    if key not in ctx.cache:
        ctx.cache[key] = make()
    return ctx.cache[key]


def data_info(ctx: Context):
    """The configured data's description (shape, classes, fingerprint)."""
    # one process reads for itself: the whole global batch, not a tensor-parallel group's share of it
    return once(ctx, "data_info", lambda: make_sources(variant(ctx.cfg, "data.loader_mode=sync", "parallel.tensor=1"),
                                                        World())[2])
