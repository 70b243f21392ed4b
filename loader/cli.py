"""``dutycycle plan``: print which samples each rank sees at each step, without loading pixels or torch."""

from __future__ import annotations

import argparse
import json
import sys

from dutycycle.engine.errors import ConfigError


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
    # here, not at the top: every `dutycycle` command imports this module, and these load pyarrow and numpy
    from dutycycle.engine.cache.reader import CacheReader

    from .plan import check_partitions, num_steps, rank_plan
    from .source import ShardGatherer, split_rows

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


def cmd_plan(args) -> int:
    ranks = range(args.world_size) if args.rank is None else [args.rank]
    for rec in plan_records(
        args.cache, args.split, args.world_size, ranks, args.steps, args.epoch, args.seed, args.global_batch,
        drop_last=not args.keep_last, shuffle=not args.no_shuffle, partitions=args.partitions,
    ):
        sys.stdout.write(json.dumps(rec) + "\n")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="print the sample ids each rank sees at each step (JSON lines)",
        description="Print the loader's plan for a cache: one JSON line per (step, rank) with the sample ids and "
        "labels that rank gets, so you can audit label skew or duplicates without training.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("cache", help="cache URI (a folder with manifest.json)")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--rank", type=int, default=None, help="one rank (default: every rank)")
    p.add_argument("--steps", default="0:1", help="A:B (half-open), A: or a single step")
    p.add_argument("--epoch", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--split", default="train")
    p.add_argument("--partitions", type=int, default=1, help="canonical partitions of the plan (data.partitions)")
    p.add_argument("--keep-last", action="store_true", help="keep the short last batch (drop_last off)")
    p.add_argument("--no-shuffle", action="store_true", help="cache order, as evaluation uses")
    p.set_defaults(func=cmd_plan)
