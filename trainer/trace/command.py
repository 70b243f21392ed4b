"""What ``dutycycle trace`` does (trainer/app/commands.py holds its arguments)."""

from __future__ import annotations

import argparse
import json

from dutycycle.engine import io
from dutycycle.engine.errors import ConfigError

from .page import describe_step, write_step_page
from .trace import STEP_COLUMNS, Tracer


def cmd_trace(args: argparse.Namespace) -> int:
    if args.html is not None and args.step is None:
        raise ConfigError("--html draws a step's thumbnails; pass it with --step N")
    tracer = Tracer(args.run)
    if args.sample is not None:
        got = tracer.sample(args.sample)
        if args.json:
            print(json.dumps(got.to_dict(), indent=2))
            return 0
        where = got.uri or "(no table row)"
        print(f"sample {got.sample_id} {where}: label {got.row.get('label')!r}, split {got.split!r}"
              + (" (the evaluation split)" if got.evaluation else ""))
        if got.note:
            print(got.note)
        for s in got.steps:
            print(f"  step {s['step']:>7}  epoch {s['epoch']:>3}  batch {s['batch']:>6}  rank {s['rank']:>3}  "
                  f"micro {s['micro_batch']:>2}  attempt {s['attempt']} (world size {s['world_size']})")
        print(f"{len(got.steps)} steps trained on it")
        return 0
    rows = tracer.step_rows(args.step)
    if args.json:
        print(json.dumps({"step": args.step, "rows": [{k: r[k] for k in STEP_COLUMNS} for r in rows]}, indent=2))
    else:
        for line in describe_step(rows):
            print(line)
        for r in rows:
            loss = "" if r["loss"] is None else f"{r['loss']:.4f}"
            print(f"  rank {r['rank']:>3}  micro {r['micro_batch']:>2}  {r['sample_id']}  {str(r['label']):<12} "
                  f"{loss:>8}  {r['uri']}")
    if args.html is not None:
        out = args.html or io.join(args.run, "trace", f"step-{args.step}.html")
        start = tracer.batch(args.step)[0]
        write_step_page(rows, tracer.data(start), out, f"dutycycle trace: {args.run} step {args.step}",
                        describe_step(rows))
        print(f"page: {out}")
    return 0
