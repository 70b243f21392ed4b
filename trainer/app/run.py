"""What the trainer's subcommands do (``train``, ``diagnose``, ``tune``, ``demo``, ``trace``: trace/command.py;
their arguments are in commands.py). This module loads torch: commands.py imports it only when one of its commands runs."""

from __future__ import annotations

import argparse

from dutycycle.engine import io
from dutycycle.engine.errors import ConfigError
from dutycycle.trainer.config import ALIASES, TrainConfig, load_config, read_config_tree
from dutycycle.trainer.configtree import parse_overrides, set_dotted
from dutycycle.trainer.diagnose import diagnose, tune
from dutycycle.trainer.launch.account import format_job, format_startup
from dutycycle.trainer.launch.train import train
from dutycycle.trainer.step.metrics import format_breakdown
from dutycycle.trainer.trace.command import cmd_trace  # noqa: F401 - commands.command("cmd_trace") finds it here

from .demo import run_demo


def cmd_train(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.local:  # one worker in this process; the global batch (and so the training) stays the same
        overrides.append("parallel.num_workers=1")
    cfg = load_config(args.config, overrides)
    summary = train(cfg, local=args.local, resume=args.resume, overwrite=args.overwrite, force=args.force)
    acc = summary.get("val_accuracy")
    print(f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
          f"val accuracy {acc:.3f}, {summary['samples_per_s']:.0f} samples/s, world size {summary['world_size']}")
    print(format_breakdown(summary))
    if summary.get("launch"):
        print(format_job(summary["launch"]))
    if summary.get("startup"):
        print(format_startup(summary["startup"]))
    print(f"run directory: {cfg.run.dir}" + (f"\nreport: {summary['report']}" if summary.get("report") else ""))
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    if args.budget_s <= 0:
        raise ConfigError(f"--budget-s {args.budget_s} must be positive, e.g. --budget-s 300")
    if args.scale is not None and args.scale < 1:
        raise ConfigError(f"--scale {args.scale} must be a worker count, e.g. --scale 16384")
    cfg = load_config(args.config, args.overrides)
    out = args.out or io.join(cfg.run.dir, "diagnose")
    # SIGINT / SIGTERM: the report is written, then diagnose raises an Interrupted carrying the signal, which the
    # CLI turns into exit 130 / 143
    diagnose(cfg, out=out, budget_s=args.budget_s, memory_budget_mb=args.memory_budget_mb,
             only=[x for x in args.only.split(",") if x] or None, config_name=args.config, scale=args.scale,
             verify=args.verify)
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    if args.budget_s <= 0:
        raise ConfigError(f"--budget-s {args.budget_s} must be positive, e.g. --budget-s 900")
    if args.diagnose_s is not None and args.diagnose_s <= 0:
        raise ConfigError(f"--diagnose-s {args.diagnose_s} must be positive, e.g. --diagnose-s 150")
    if args.max_experiments is not None and args.max_experiments < 1:
        raise ConfigError(f"--max-experiments {args.max_experiments} must be at least 1, e.g. --max-experiments 5")
    cfg = load_config(args.config, args.overrides)
    # the tuned file is the user's own config plus the --set items given here, then the kept changes
    base = read_config_tree(args.config)
    for k, v in parse_overrides(args.overrides):
        set_dotted(TrainConfig, base, k, v, ALIASES)
    tune(cfg, out=args.out or io.join(cfg.run.dir, "tune"), budget_s=args.budget_s, base=base,
         config_name=args.config, only=[x for x in args.only.split(",") if x] or None, diagnose_s=args.diagnose_s,
         max_experiments=args.max_experiments, memory_budget_mb=args.memory_budget_mb)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    run_demo(args.out, workers=args.workers, small=args.small, overrides=args.overrides, elastic=args.elastic)
    return 0
