"""``dutycycle evaluate RUN``: its arguments. What it does is in evaluate.py, imported when the command runs (it
loads torch)."""

from __future__ import annotations

import argparse
import sys

SPLITS = ("test", "val", "train")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "evaluate",
        help="score a trained run on a split: loss, accuracy, per-class precision/recall, confusion matrix",
        description="Load RUN's newest verified checkpoint (whatever parallel layout saved it) into one process "
        "and score it on a split: from the run's cache when it holds the split, else from the table the cache was "
        "made from, decoded with the cache's transform. Writes RUN/evaluation/SPLIT.json, SPLIT.png (confusion "
        "matrix) and SPLIT.parquet (per-sample predictions), and adds the split to RUN/report.html.",
    )
    p.add_argument("run", metavar="RUN", help="the run directory (run.dir of the training config)")
    p.add_argument("--split", default="test", choices=SPLITS, help="the split to score (default: test)")
    p.add_argument("--table", default=None, metavar="T",
                   help="read the split from this metadata table (default: the run's cache, else its source table)")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="the checkpoint commit of step N (default: the newest that verifies)")
    p.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help="samples per forward pass (default: the run's data.eval_batch_size)")
    p.add_argument("--device", default="auto",
                   help="where the forward passes run: auto (a GPU when there is one), cpu, cuda:0, ...")
    p.set_defaults(func=cmd_evaluate)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from .evaluate import evaluate  # heavy: torch, which `dutycycle --help` does without

    ev = evaluate(args.run, args.split, table=args.table, step=args.step, batch_size=args.batch_size,
                  device=args.device)
    print(report(ev.metrics))
    print(f"wrote {ev.files['json']}, {ev.files['png']}, {ev.files['predictions']}; page {ev.files['page']}",
          file=sys.stderr)
    return 0


def report(m: dict) -> str:
    """The scores as a person reads them in a terminal: a headline, then one line per class (up to 50)."""
    step = "final model" if m["step"] is None else f"step {m['step']}"
    skipped = sum(m["skipped"].values())
    lines = [f"{m['split']}: accuracy {m['accuracy']:.2%}, loss {m['loss']:.4f} over {m['samples']:,} samples "
             f"({step}, {m['data']['source']})" + (f"; {skipped:,} rows left out ({_counts(m['skipped'])})"
                                                   if skipped else "")]
    rows = m["per_class"]
    width = min(32, max([5, *(len(c["class"]) for c in rows)]))
    lines.append(f"  {'class':<{width}}  precision  recall     f1  support")
    for c in rows[:50]:
        lines.append(f"  {c['class'][:width]:<{width}}  {c['precision']:9.3f}  {c['recall']:6.3f}  {c['f1']:5.3f}  "
                     f"{c['support']:7,}")
    if len(rows) > 50:
        lines.append(f"  ... {len(rows) - 50} more classes in the JSON")
    macro = m["macro"]
    lines.append(f"  {'macro avg':<{width}}  {macro['precision']:9.3f}  {macro['recall']:6.3f}  {macro['f1']:5.3f}  "
                 f"{m['samples']:7,}")
    return "\n".join(lines)


def _counts(d: dict) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in d.items())
