"""CLI subcommands of the trainer: ``dutycycle train``, ``diagnose``, ``tune``, ``demo`` and ``trace``: their
arguments. What they do is in run.py, imported when a command runs (it loads torch)."""

from __future__ import annotations

import argparse

from dutycycle.trainer.configtree import add_overrides


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a model from a TOML config (on Ray Train, or --local in this process)",
        description="Train from CONFIG, showing step, loss, samples/s and an ETA while it trains. The data, the "
        "model's module and the run directory are checked before Ray starts. A run directory that holds a run is "
        "never replaced unless asked: --resume continues it, --overwrite replaces it. Outputs in RUN_DIR: "
        "metrics.jsonl, summary.json, model.safetensors, report.png, report.html, config.json, checkpoints/, and "
        "attempts/<k>/ (each launch's config.json and health.json); an MLflow run with [tracking] mlflow_uri.",
    )
    p.add_argument("config", help="a TOML config (e.g. configs/demo.toml), a run's config.json, or a run directory")
    add_overrides(p)
    p.add_argument("--local", action="store_true",
                   help="run one worker in this process, without Ray (sets parallel.num_workers=1)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--resume", action="store_true",
                     help="continue the run in run.dir from its newest commit (e.g. with a larger run.max_steps); "
                     "changed keys are named, and a change to its data is refused unless --force")
    how.add_argument("--overwrite", action="store_true",
                     help="replace the run in run.dir (removes dutycycle's files there and its commits)")
    p.add_argument("--force", action="store_true",
                   help="with --resume: accept config changes that alter the data already trained on (the cache, "
                   "global batch size, seed, loader plan, augmentation)")
    p.set_defaults(func=command("cmd_train"))

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
    g.set_defaults(func=command("cmd_diagnose"))

    t = subparsers.add_parser(
        "tune",
        help="apply diagnose's remedies one by one, each verified by a measured run, kept only beyond the noise",
        description="Diagnose CONFIG, apply the remedy with the largest predicted gain as a config change, verify it "
        "with a short measured run, keep it only when its rate's interval lies above the baseline's, and repeat from "
        "the new config until no remedy's predicted gain exceeds the noise or --budget-s is spent. Writes tuned.toml "
        "(CONFIG plus the kept changes, for dutycycle train), tune.json (every experiment: predicted, measured, "
        "kept and why) and rounds/<k>/ (each round's diagnosis) under --out, and prints the experiments' table.",
    )
    t.add_argument("config", help="a TOML config file, e.g. configs/demo.toml")
    add_overrides(t)
    t.add_argument("--budget-s", type=float, default=900.0,
                   help="time for the whole loop: diagnoses and verifications (default 900)")
    t.add_argument("--out", default="", help="where tuned.toml and tune.json go (default: RUN_DIR/tune)")
    t.add_argument("--diagnose-s", type=float, default=None,
                   help="the most one round's diagnosis may take (default: what is left of --budget-s)")
    t.add_argument("--only", default="", help="comma-separated experiments of each diagnosis (default: all)")
    t.add_argument("--max-experiments", type=int, default=None, help="stop after this many verified remedies")
    t.add_argument("--memory-budget-mb", type=float, default=None,
                   help="memory per rank to check the model state against (default: the device's)")
    t.set_defaults(func=command("cmd_tune"))

    r = subparsers.add_parser(
        "trace",
        help="which rows trained step N of a run, and which steps trained a given row",
        description="Recompute from the run's records and the plan (not from a per-step log) the rows of step N, per "
        "rank and micro-batch: row id (the content hash), label, source URI, table version and the curation that "
        "selected them, with each sample's loss when the run recorded it (run.record_sample_loss); or every step "
        "and epoch that trained on a sample, and whether it was in the evaluation split. Correct across resumes, "
        "restarts at another world size, gradient accumulation and skipped batches.",
    )
    r.add_argument("run", help="a run directory (run.dir)")
    what = r.add_mutually_exclusive_group(required=True)
    what.add_argument("--step", type=int, help="the step, as metrics.jsonl numbers it (1 = the first)")
    what.add_argument("--sample", help="a sample id (the table's row id) or a source URI as the table records it")
    r.add_argument("--html", nargs="?", const="", default=None, metavar="OUT",
                   help="with --step: write a page with the step's thumbnails (default RUN/trace/step-N.html)")
    r.add_argument("--json", action="store_true", help="print JSON (one object) instead of a table")
    r.set_defaults(func=command("cmd_trace"))

    d = subparsers.add_parser(
        "demo",
        help="the main job: synth -> ingest -> curate -> materialize -> train on a local Ray cluster",
        description="Run the whole pipeline on generated shapes and print the validation accuracy, "
        "the time breakdown and where the report is.",
    )
    d.add_argument("--out", default="dutycycle-demo", help="output folder (default: ./dutycycle-demo)")
    d.add_argument("--workers", type=int, default=None,
                   help="training workers on the local Ray cluster (default 2; with --elastic, nodes and the most "
                        "workers: default 3)")
    d.add_argument("--small", action="store_true", help="a quick run: a few hundred images, a few steps")
    d.add_argument("--elastic", action="store_true",
                   help="train elastically on a local multi-node Ray cluster (one node per worker): a node is "
                        "removed mid-run, training continues on fewer workers, the node comes back and the run "
                        "grows again; the diagnosis is left out")
    add_overrides(d, "a training config key")
    d.set_defaults(func=command("cmd_demo"))


def command(name: str):
    """The handler ``name`` of run.py, imported when the command runs."""

    def handler(args: argparse.Namespace) -> int:
        from . import run  # heavy: torch, which `dutycycle --help` and the engine's commands do without

        return getattr(run, name)(args)

    return handler
