"""CLI subcommands of the trainer: ``dutycycle train``, ``dutycycle diagnose`` and ``dutycycle demo``."""

from __future__ import annotations

import argparse

from dutycycle.trainer.configtree import add_overrides


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a model from a TOML config (on Ray Train, or --local in this process)",
        description="Train from CONFIG.toml. The resolved config is printed and saved in the run directory; "
        "outputs: config.json, metrics.jsonl, summary.json, report.png.",
    )
    p.add_argument("config", help="a TOML config file, e.g. configs/demo.toml")
    add_overrides(p)
    p.add_argument("--local", action="store_true",
                   help="run one worker in this process, without Ray (sets parallel.num_workers=1)")
    p.set_defaults(func=cmd_train)

    g = subparsers.add_parser(
        "diagnose",
        help="name what a run waits on (data, communication, memory, checkpoints) with short experiments",
        description="Run short, measured experiments on CONFIG and its data (compute ceiling, loaders alone, end to "
        "end, host-to-device, scaling, checkpoint stall, memory per ZeRO stage) and print a verdict: the "
        "dominant wait, the number behind it and the setting that addresses it. Writes diagnosis.json, "
        "diagnosis.png and diagnosis.html under --out.",
    )
    g.add_argument("config", help="a TOML config file, e.g. configs/demo.toml")
    add_overrides(g)
    g.add_argument("--budget-s", type=float, default=300.0, help="time for all experiments (default 300)")
    g.add_argument("--out", default="", help="where the report goes (default: RUN_DIR/diagnose)")
    g.add_argument("--memory-budget-mb", type=float, default=None,
                   help="memory per rank to check the model state against (default: the device's)")
    g.add_argument("--only", default="", help="comma-separated experiments to run (default: all)")
    g.add_argument("--verify", action="store_true",
                   help="run the top remedy's settings as a short run and report measured against predicted")
    g.add_argument("--scale", type=int, default=None,
                   help="project the failures wait to this many workers (default: parallel.num_workers)")
    g.set_defaults(func=cmd_diagnose)

    d = subparsers.add_parser(
        "demo",
        help="the main job: synth -> ingest -> curate -> materialize -> train on a local Ray cluster",
        description="Run the whole pipeline on generated shapes and print the validation accuracy, "
        "the time breakdown and where the report is.",
    )
    d.add_argument("--out", default="dutycycle-demo", help="output folder (default: ./dutycycle-demo)")
    d.add_argument("--workers", type=int, default=2, help="training workers on the local Ray cluster (default 2)")
    d.add_argument("--small", action="store_true", help="a quick run: a few hundred images, a few steps")
    add_overrides(d, "a training config key")
    d.set_defaults(func=cmd_demo)


def cmd_train(args: argparse.Namespace) -> int:
    from dutycycle.trainer.config import load_config
    from dutycycle.trainer.launch.train import train
    from dutycycle.trainer.step.metrics import format_breakdown

    overrides = list(args.overrides)
    if args.local:  # one worker in this process; the global batch (and so the training) stays the same
        overrides.append("parallel.num_workers=1")
    cfg = load_config(args.config, overrides)
    summary = train(cfg, local=args.local)
    acc = summary.get("val_accuracy")
    print(f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
          f"val accuracy {acc:.3f}, {summary['samples_per_s']:.0f} samples/s, world size {summary['world_size']}")
    print(format_breakdown(summary))
    if summary.get("launch"):
        from dutycycle.trainer.launch.account import format_job

        print(format_job(summary["launch"]))
    print(f"run directory: {cfg.run.dir}" + (f"\nreport: {summary['report']}" if summary.get("report") else ""))
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    from dutycycle.engine import io
    from dutycycle.engine.errors import ConfigError
    from dutycycle.trainer.config import load_config
    from dutycycle.trainer.diagnose import diagnose

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


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(args.out, workers=args.workers, small=args.small, overrides=args.overrides)
    return 0
