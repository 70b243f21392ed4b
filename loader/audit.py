"""The loader's plan for a cache as records a person can read: which sample ids and labels each rank gets at
each step, without pixels or torch (``dutycycle plan``, cli.py)."""

from __future__ import annotations

from dutycycle.engine.cache.reader import CacheReader
from dutycycle.engine.errors import ConfigError

from .plan import check_partitions, num_steps, rank_plan
from .source import ShardGatherer, split_rows


def parse_steps(text: str, num_steps: int) -> range:
    """``A:B`` (half-open), ``A:`` (to the end of the epoch), ``:B`` or a single step ``A``."""
    try:
        if ":" in text:
            a, b = text.split(":", 1)
            start, stop = int(a) if a else 0, int(b) if b else num_steps
        else:
            start = int(text)
            stop = start + 1
    except ValueError:
        raise ConfigError(f"--steps {text!r} is invalid; use A:B (for example 0:10), A: or a single step") from None
    if not 0 <= start <= stop <= num_steps:
        raise ConfigError(f"--steps {text!r} is outside the epoch's {num_steps} steps; use a range within 0:{num_steps}")
    return range(start, stop)


def plan_records(cache_uri, split, world_size, ranks, steps, epoch, seed, global_batch, drop_last=True, shuffle=True,
                 partitions=1):
    """Yield one dict per (step, rank): the sample ids and labels that rank gets."""
    if world_size < 1 or global_batch % world_size:
        raise ConfigError(
            f"--global-batch {global_batch} is not divisible by --world-size {world_size}; use a multiple of it"
        )
    reader = CacheReader(cache_uri, verify=False)  # ids and labels only; the loader verifies pixels
    rows = split_rows(reader, split)
    total = num_steps(len(rows), global_batch, drop_last)
    steps = parse_steps(steps, total) if isinstance(steps, str) else steps
    for r in ranks:
        if not 0 <= r < world_size:
            raise ConfigError(f"--rank {r} is outside --world-size {world_size}; use 0..{world_size - 1}")
    check_partitions(partitions, global_batch)
    plans = {r: rank_plan(len(rows), seed, epoch, reader.fingerprint, global_batch, drop_last, r, world_size,
                          shuffle=shuffle, partitions=partitions) for r in ranks}
    gatherer = ShardGatherer(reader)
    for step in steps:
        for r in ranks:
            raw = gatherer.read(rows[plans[r].indices(step)], pixels=False)
            yield {"epoch": epoch, "step": step, "rank": r, "sample_ids": list(raw.sample_ids),
                   "labels": raw.labels.tolist()}
