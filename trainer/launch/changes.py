"""What a resume changes: the config a run continues with against the one it was trained with, key by key.

``dutycycle train CONFIG --resume`` continues a run from its newest commit. The config may differ from the run's
(its newest attempt's ``config.json``), and each changed key falls in one of four kinds (``kind_of``):

- **schedule**: ``run.max_steps``, ``run.epochs`` and the learning-rate schedule's inputs (``optim.lr``,
  ``optim.warmup_steps``, ``optim.schedule``, ``optim.min_lr_ratio``). Allowed and named: the schedule is a
  pure function of the step and the total (``step/loop.lr_at``), so it is recomputed for the new total, and the
  learning rate at the resumed step moves (the message says from what to what).
- **data**: what would change the samples already planned or trained on: the data itself (``data.source``, the
  cache: its fingerprint, a path to a cache with the same fingerprint is only a move; ``data.table``,
  ``data.size``, ``data.synthetic_samples``), the plan's inputs (``run.seed``, ``data.global_batch_size``,
  ``data.drop_last``, ``data.block_size``, ``data.window``, ``data.partitions``) and what a sample looks like
  (``data.augment.*``). Refused, naming each, unless ``--force``: then the resumed loader continues this config's
  own plan from the saved position (``checkpoint.force_loader_state = true``). Any ``data.*`` key not listed as
  a performance setting below counts as data, so a key added later is refused until it is classified.
  ``data.micro_batches`` is not data: ``data.global_batch_size`` counts the samples of one optimizer step over
  every rank and micro-batch, so splitting a step differently trains on the same samples per step.
- **model**: ``model.*`` and ``optim.name``: the checkpoint's weights and optimizer state have that shape and
  would not load. Refused even with ``--force``: train into a fresh ``run.dir``.
- **other**: everything else (the parallel layout, which a resume reshards to; Ray; logging; checkpoint policy;
  the data path's performance settings). Allowed and named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dutycycle.engine.errors import ConfigError
from dutycycle.trainer.configtree import shown
from dutycycle.trainer.step.loop import lr_at

SCHEDULE = frozenset({"run.max_steps", "run.epochs", "optim.lr", "optim.warmup_steps", "optim.schedule",
                      "optim.min_lr_ratio"})
# data.* keys that change how fast samples arrive, never which or what they are
DATA_PERFORMANCE = frozenset({"data.micro_batches", "data.eval_batch_size", "data.loader_mode", "data.slow_ms",
                              "data.prefetch", "data.ray_max_retries", "data.raw_threads", "data.memory_fraction"})
DATA_ALSO = frozenset({"run.seed"})  # outside [data], the plan's seed
MODEL_ALSO = frozenset({"optim.name"})
IGNORED = frozenset({"run.dir"})  # the run's own location (a moved run directory is the same run)
# keys a data source does not read: a change to them changes nothing the run trains on
UNUSED_BY_SOURCE = {"cache": {"data.table", "data.size", "data.synthetic_samples"},
                    "raw": {"data.cache", "data.synthetic_samples"},
                    "synthetic": {"data.cache", "data.table"}}


def kind_of(key: str) -> str:
    """``"schedule"``, ``"data"``, ``"model"`` or ``"other"`` for a dotted config key (see the module doc)."""
    if key in SCHEDULE:
        return "schedule"
    if key.startswith("model.") or key in MODEL_ALSO:
        return "model"
    if key in DATA_ALSO or (key.startswith("data.") and key not in DATA_PERFORMANCE
                            and not key.startswith("data.read.")):
        return "data"
    return "other"


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"data": {"cache": x}}`` -> ``{"data.cache": x}``; a table value (``ray.label_selector``) stays one key."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key.count(".") < 2 and key not in ("ray.label_selector",):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value))  # tuples as lists, as config.json holds them


@dataclass
class Changes:
    """The keys a resume changes, each ``key -> (old, new)``, by kind; and the data fingerprints compared."""

    keys: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    fingerprint: tuple[str, str] | None = None  # (trained on, this config's) when they differ
    # changed keys that change nothing trained on: a cache moved (same fingerprint), a key the source ignores
    harmless: set[str] = field(default_factory=set)

    def of(self, kind: str) -> dict[str, tuple[Any, Any]]:
        return {k: v for k, v in self.keys.items()
                if (kind_of(k) if k not in self.harmless else "other") == kind}

    @property
    def data(self) -> list[str]:
        """The data changes, as a person reads them: each key, and the fingerprint when it moved."""
        out = [f"{k} {shown(a)} -> {shown(b)}" for k, (a, b) in self.of("data").items()]
        if self.fingerprint:
            out.append(f"the cache's data (fingerprint {self.fingerprint[0][:12]} -> {self.fingerprint[1][:12]})")
        return out

    def line(self) -> str:
        """Every change on one line: ``key old -> new, ...``."""
        parts = [f"{k} {shown(a)} -> {shown(b)}" for k, (a, b) in sorted(self.keys.items())]
        if self.fingerprint:
            parts.append(f"data fingerprint {self.fingerprint[0][:12]} -> {self.fingerprint[1][:12]}")
        return ", ".join(parts) or "nothing"

    def to_dict(self) -> dict:
        return {"keys": {k: [a, b] for k, (a, b) in sorted(self.keys.items())},
                "fingerprint": list(self.fingerprint) if self.fingerprint else None}


def compare(old: dict[str, Any], new: dict[str, Any], *, old_fingerprint: str = "",
            new_fingerprint: str = "") -> Changes:
    """The changes from the config a run was trained with (``old``: a ``config.json`` tree) to ``new``
    (``TrainConfig.to_dict()``). A key the old config lacks (written by an older dutycycle) is not a change. A
    cache path that moved to a cache of the same fingerprint is named but is no data change."""
    before, after = flatten(_plain(old)), flatten(_plain(new))
    changes = Changes()
    for key, value in after.items():
        if key in IGNORED or key not in before or before[key] == value:
            continue
        changes.keys[key] = (before[key], value)
    if old_fingerprint and old_fingerprint == new_fingerprint:  # moved or copied, the same samples
        changes.harmless.add("data.cache")
    if before.get("data.source") == after.get("data.source"):
        changes.harmless |= UNUSED_BY_SOURCE.get(after.get("data.source"), set())
    if old_fingerprint and new_fingerprint and old_fingerprint != new_fingerprint:
        changes.fingerprint = (old_fingerprint, new_fingerprint)
    return changes


def check_resume(changes: Changes, *, force: bool, where: str) -> None:
    """Refuse a resume whose changes would not load (model) or would alter data already trained on (data,
    unless ``force``), naming each key. ``where``: the run directory, for the message."""
    model = changes.of("model")
    if model:
        named = ", ".join(f"{k} {shown(a)} -> {shown(b)}" for k, (a, b) in model.items())
        raise ConfigError(f"--resume of {where}: {named} changes the model its checkpoints hold, whose weights and "
                          "optimizer state would not load (not even with --force); put the old value back, or train "
                          "into a fresh run.dir (or --overwrite)")
    if changes.data and not force:
        raise ConfigError(f"--resume of {where} would alter the data it has trained on: {'; '.join(changes.data)}. "
                          "Put the old values back, or add --force to continue with this config's own data and "
                          "sample order from the saved position (checkpoint.force_loader_state = true), or train "
                          "into a fresh run.dir")


def schedule_note(changes: Changes, *, step: int, old_total: int | None, new_total: int | None, old_optim,
                  new_optim) -> str:
    """Why the learning rate moves at the resumed step, when a schedule key changed: the schedule is recomputed
    for the new total, and the rate at ``step`` before and after. ``old_optim`` / ``new_optim``: objects with
    the optimizer section's fields (lr, warmup_steps, schedule, min_lr_ratio)."""
    if not changes.of("schedule"):
        return ""
    if new_total is None:
        return "the learning-rate schedule is recomputed for the new total"
    note = f"the learning-rate schedule is recomputed for the new total of {new_total} steps"
    if old_total is None:
        return note
    before, after = lr_at(step, old_total, old_optim), lr_at(step, new_total, new_optim)
    if abs(before - after) > 1e-12 * max(abs(before), 1e-30):
        note += f": the learning rate at step {step} goes from {before:.3g} to {after:.3g}"
    return note
