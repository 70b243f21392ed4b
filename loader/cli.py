"""``dutycycle plan``: print which samples each rank sees at each step, without loading pixels or torch."""

from __future__ import annotations

import argparse
import json
import sys


def cmd_plan(args) -> int:
    # heavy: pyarrow and numpy, which every other `dutycycle` command starts without
    from .audit import plan_records

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
