"""What a run reads, checked in the driver before Ray starts: its data and its model's code.

A run that cannot read its data or import its model fails inside a worker otherwise, after Ray started, the
worker group was placed and the health check ran (about 50 s on a 2-core machine). Here the same mistakes fail in
about a second, naming the key and the fix:

- ``data.source = "cache"``: a committed cache at ``data.cache`` (a cache folder, or a cache root with its
  ``latest`` pointer), with a ``train`` split of at least one global batch (``data.global_batch_size``; one
  sample with ``data.drop_last = false``) and a ``val`` split, which the trainer evaluates on. Only the
  manifest is read (a few kilobytes, local or on an object store); the shards are verified by the workers that
  read them.
- ``data.source = "raw"``: a committed metadata table at ``data.table`` (its manifest).
- ``model.name = "package.module:factory"``: the module imports in the driver, with the working directory on
  ``sys.path`` (usermodule.py), and names a callable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dutycycle.engine.cache import format as cache_format
from dutycycle.engine.errors import ConfigError, SourceError
from dutycycle.engine.table import format as table_format
from dutycycle.trainer.config import TrainConfig
from dutycycle.trainer.step.models import resolve_factory

from .usermodule import importable


@dataclass
class Inputs:
    """What the checks learned: the data's fingerprint and training samples where the driver can know them
    without planning (a cache's manifest; synthetic data from its keys), None otherwise (raw: the plan decides)."""

    fingerprint: str = ""
    train_samples: int | None = None

    def total_steps(self, cfg: TrainConfig) -> int | None:
        """The run's length in optimizer steps (``run.max_steps``, else ``run.epochs`` of the training split),
        as the Trainer computes it; None when the split's size is unknown here."""
        if cfg.run.max_steps:
            return cfg.run.max_steps
        if self.train_samples is None:
            return None
        per_epoch = self.train_samples // cfg.data.global_batch_size if cfg.data.drop_last else \
            math.ceil(self.train_samples / cfg.data.global_batch_size)
        return max(1, math.ceil(cfg.run.epochs * per_epoch))


def check_inputs(cfg: TrainConfig) -> Inputs:
    """Check the run's data and model before any worker starts; raise a ``DutycycleError`` naming the key."""
    inputs = check_data(cfg)
    check_model(cfg)
    return inputs


def check_data(cfg: TrainConfig) -> Inputs:
    d = cfg.data
    if d.source == "synthetic":
        return Inputs(f"synthetic-{d.synthetic_samples}-{d.size}-{cfg.run.seed}", d.synthetic_samples)
    if d.source == "raw":
        try:
            table_format.read_manifest(d.table)
        except SourceError as e:
            raise SourceError(f"data.table = {d.table!r}: {e}") from None
        return Inputs()
    try:
        folder = cache_format.resolve(d.cache)
        manifest = cache_format.read_manifest(folder)
    except SourceError as e:
        raise SourceError(f"data.cache = {d.cache!r}: {e}") from None
    counts = manifest.split_counts
    splits = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"
    need = d.global_batch_size if d.drop_last else 1
    train = counts.get("train", 0)
    if train < need:
        what = "no training split" if not train else f"{train} training samples"
        raise ConfigError(
            f"data.cache = {d.cache!r} has {what} (splits: {splits}), fewer than one global batch "
            f"(data.global_batch_size = {d.global_batch_size}); lower data.global_batch_size, or materialize a "
            "cache from a table with more samples in its train split")
    if not counts.get("val"):
        raise ConfigError(
            f"data.cache = {d.cache!r} has no val split (splits: {splits}); the trainer evaluates on it: "
            "ingest with a val fraction (dutycycle ingest --split 0.8,0.1,0.1) and materialize again")
    return Inputs(manifest.fingerprint, train)


def check_model(cfg: TrainConfig) -> None:
    """A plug-in ``model.name`` imports here and names a callable (the built-in ones always do)."""
    if ":" in cfg.model.name:
        importable(cfg.model.name)
        resolve_factory(cfg.model.name)
