"""What ``dutycycle trace`` costs for one step at 10M rows, and what ``run.record_sample_loss`` costs per step.

    python benchmarks/trace.py                  # 10M rows: about 2-4 minutes on 2 cores
    python benchmarks/trace.py --quick --out /tmp/trace.json

Rows (each figure the median of ``--repeats``):

- ``plan_one_step``: the split indices of one global batch of a 10M-sample epoch (``--global-batch``), computed by
  ``plan.global_batch`` (only the shuffle windows the batch touches), against the baseline that plans the whole
  epoch (``plan.plan_epoch``, what a trace would do without it); at one partition and at ``--partitions``.
- ``table_lookup``: the table's rows (uri, label, split, ...) of one batch's ids in a 10M-row metadata table
  (Parquet, written here through the table's own commit), the Daft query trace runs (``rows.table_rows``): it
  reads the sample_id column whole, so it grows with the table.
- ``trace_step_small``: a whole ``Tracer.step_rows`` (records, plan, the cache's ids, the table's rows, the
  per-sample losses) on a real run over a small cache (``--cache-samples``): what the rest of a trace costs
  (the cache's ids are gathered for the batch's rows only, so that part does not grow with the cache).
- ``sample_loss_hook``: the log's own work per step measured apart (the per-sample cross-entropy of each
  micro-batch and a part's write, amortized over a logging interval): the figure to read on a shared machine,
  where the end-to-end rows below are dominated by other load.
- ``sample_loss``: the same short local training run with ``run.record_sample_loss`` off and on, ``--rounds`` of
  each interleaved, the median step time of each and their ratio (synthetic 16x16 data, a small CNN, 64 samples in
  2 micro-batches: a cheap step, so the log's share is an upper bound; ``--steps`` steps a run, the first
  ``--warmup`` left out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import default_out, machine, main_for, read_result  # noqa: E402


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def plan_rows(n: int, gbs: int, partitions: int, repeats: int) -> dict:
    from dutycycle.loader import plan

    step = (n // gbs) // 2  # a batch in the middle of the epoch
    kw = {"partitions": partitions}
    one = _median_s(lambda: plan.global_batch(n, 0, 3, "fp", gbs, True, step, **kw), repeats)
    whole = _median_s(lambda: plan.plan_epoch(n, 0, 3, "fp", gbs, True, **kw)[step], max(1, repeats // 2))
    same = np.array_equal(plan.global_batch(n, 0, 3, "fp", gbs, True, step, **kw),
                          plan.plan_epoch(n, 0, 3, "fp", gbs, True, **kw)[step])
    return {"samples": n, "global_batch": gbs, "partitions": partitions, "one_step_s": one, "whole_epoch_s": whole,
            "speedup": whole / one if one else None, "identical": bool(same)}


def _hex_ids(n: int, seed: int) -> np.ndarray:
    """``n`` random 32-hex-character ids (content-hash-like), as fixed-width bytes, vectorized."""
    raw = np.random.default_rng(seed).integers(0, 256, size=(n, 16), dtype=np.uint8)
    digits = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    out = np.empty((n, 32), dtype=np.uint8)
    out[:, 0::2], out[:, 1::2] = digits[raw >> 4], digits[raw & 15]
    return out.view("S32").reshape(n)


def table_lookup(n: int, gbs: int, root: str, repeats: int) -> dict:
    import pyarrow as pa
    import pyarrow.compute as pc
    from dutycycle.engine.table import format as tf
    from dutycycle.engine.table.commit import write_version
    from dutycycle.trainer.trace.rows import table_rows

    ids = pa.array(_hex_ids(n, 0)).cast(pa.string())
    uri = pc.binary_join_element_wise("/data/images/", pc.cast(pa.array(np.arange(n)), pa.string()), ".jpg", "")
    cols = {"sample_id": ids, "uri": uri, "label": pa.array(np.where(np.arange(n) % 2, "cat", "dog")),
            "split": pa.array(np.where(np.arange(n) % 10 < 8, "train", "val"))}
    table = pa.table({f.name: cols.get(f.name, pa.nulls(n, f.type)).cast(f.type) for f in tf.SCHEMA}, tf.SCHEMA)
    t0 = time.perf_counter()
    write_version(os.path.join(root, "table"), table, classes=["cat", "dog"], source="benchmark",
                  options={"roots": ["/data/images"]})
    write_s = time.perf_counter() - t0
    manifest = tf.read_manifest(os.path.join(root, "table"))
    pick = np.random.default_rng(1).choice(n, gbs, replace=False)
    wanted = [ids[int(i)].as_py() for i in pick]
    got = table_rows(os.path.join(root, "table"), manifest, wanted)
    assert len(got) == gbs
    s = _median_s(lambda: table_rows(os.path.join(root, "table"), manifest, wanted), repeats)
    return {"rows": n, "ids": gbs, "lookup_s": s, "table_write_s": write_s}


def small_run(root: str, cache_samples: int, steps: int) -> str:
    import dutycycle

    from tests.support.tablemaker import make_shapes_table

    table, _ = make_shapes_table(os.path.join(root, "data"), n=cache_samples, size=(20, 28))
    dutycycle.materialize(table, os.path.join(root, "cache"), dutycycle.TransformSpec(size=16))
    cfg = dutycycle.load_config(None, [f"data.cache={root}/cache", "data.global_batch_size=32", "model.width=8",
                                       f"run.max_steps={steps}", "run.eval_every=0", f"run.dir={root}/run",
                                       "run.report=false", "run.record_sample_loss=true", "run.log_every=5"])
    dutycycle.train(cfg, local=True, quiet=True)
    return f"{root}/run"


def trace_small(run_dir: str, repeats: int) -> dict:
    from dutycycle.trainer.trace.trace import Tracer

    tracer = Tracer(run_dir)
    tracer.step_rows(2)  # opens the cache and the table once, as a command that traces several steps does
    warm = _median_s(lambda: tracer.step_rows(3), repeats)
    cold = _median_s(lambda: Tracer(run_dir).step_rows(3), repeats)
    return {"warm_s": warm, "cold_s": cold, "samples": len(tracer.step_rows(3))}


def sample_loss_cost(root: str, steps: int, warmup: int, rounds: int) -> dict:
    """Median step time with the per-sample loss log off and on: ``rounds`` runs of each, interleaved (off, on,
    off, on, ...) so that a load that drifts on a shared machine falls on both alike."""
    import dutycycle
    from dutycycle.trainer.step.metrics import read_metrics

    times: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    for k in range(rounds):
        for record in (False, True):
            run_dir = os.path.join(root, f"loss-{record}-{k}")
            cfg = dutycycle.load_config(None, [
                "data.source=synthetic", "data.synthetic_samples=1024", "data.size=16", "model.width=8",
                "data.global_batch_size=64",
                "data.micro_batches=2", f"run.max_steps={steps}", "run.eval_every=0", f"run.dir={run_dir}",
                "run.report=false", "run.save_model=false", "run.log_every=10", "run.health_check=false",
                f"run.record_sample_loss={str(record).lower()}"])
            c0 = time.process_time()
            dutycycle.train(cfg, local=True, quiet=True)
            key = "on" if record else "off"
            cpu[key].append((time.process_time() - c0) / steps)  # the whole run's CPU, start-up included
            times[key] += [r["step_s"] for r in read_metrics(run_dir) if "loss" in r and r["step"] > warmup]
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    cpu_off, cpu_on = statistics.median(cpu["off"]), statistics.median(cpu["on"])
    return {"off_step_s": off, "on_step_s": on, "extra_s_per_step": on - off, "ratio": on / off,
            # CPU seconds of this process per step (less sensitive than wall time to other load on the machine)
            "off_cpu_s_per_step": cpu_off, "on_cpu_s_per_step": cpu_on, "cpu_ratio": cpu_on / cpu_off,
            "samples_per_step": 64, "micro_batches": 2, "rounds": rounds, "steps_per_run": steps,
            "load_average": os.getloadavg()[0]}


def sample_loss_hook(repeats: int, log_every: int = 10) -> dict:
    """The per-sample loss log's own work per step, measured apart (the best of ``repeats`` timings of many
    calls, so that other load on a shared machine inflates it least): the detached per-sample cross-entropy of
    two micro-batches of 32 samples and 4 classes (what ``loop._micro_batch`` adds), and a part's write
    (``SampleLosses.flush``: one device-to-host copy, one gather, Parquet, an atomic rename) per ``log_every``
    steps, against a step of the small model trained in ``sample_loss``."""
    import torch
    import torch.nn.functional as F
    from dutycycle.trainer.step.provenance import SampleLosses

    logits, y = torch.randn(32, 4), torch.randint(0, 4, (32,))
    n = 2000

    def ce():
        for _ in range(n):
            F.cross_entropy(logits.detach(), y, reduction="none")
            F.cross_entropy(logits.detach(), y, reduction="none")

    ce_s = min(_median_s(ce, 1) for _ in range(repeats)) / n
    ids = [f"{i:032x}" for i in range(64)]
    losses = [torch.rand(32), torch.rand(32)]
    with tempfile.TemporaryDirectory() as run_dir:
        log = SampleLosses(run_dir, rank=0, world_size=1, attempt=1, start=time.time(), log_every=10**9)

        def part():
            for step in range(2, 2 + log_every):
                log.add(step, 0, step, ids, losses)
            log.flush()

        flush_s = min(_median_s(part, 1) for _ in range(repeats)) / log_every
    return {"cross_entropy_s_per_step": ce_s, "write_s_per_step": flush_s, "log_every": log_every,
            "hook_s_per_step": ce_s + flush_s, "samples_per_step": 64, "micro_batches": 2,
            "load_average": os.getloadavg()[0]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    p.add_argument("--samples", type=int, default=10_000_000)
    p.add_argument("--global-batch", type=int, default=1024)
    p.add_argument("--partitions", type=int, default=8)
    p.add_argument("--cache-samples", type=int, default=200)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="interleaved off/on training runs for sample_loss")
    p.add_argument("--only", default="", help="comma-separated parts to run (plan, table, small, sample_loss, hook); "
                   "the others are kept from --out's JSON")
    p.add_argument("--out", default=default_out("trace"))
    args = p.parse_args(argv)
    if args.quick:
        args.samples, args.global_batch, args.cache_samples, args.steps, args.warmup, args.repeats, args.rounds = \
            20_000, 64, 60, 12, 2, 2, 1
    return args


def run(args) -> dict:
    os.environ.setdefault("DAFT_PROGRESS_BAR", "0")
    only = set(filter(None, args.only.split(",")))
    want = (lambda part: not only or part in only)  # noqa: E731 - a one-line filter
    result = read_result(args.out) if only else {}
    result.update({"benchmark": "trace", "machine": machine(), "quick": args.quick})
    # the whole run's load; a run of some parts keeps the figures (and the load) of the others
    result.setdefault("load_average_at_start", os.getloadavg()[0])
    with tempfile.TemporaryDirectory() as root:
        # the per-sample loss first: the 10M table's pages would otherwise crowd the machine while it trains
        if want("sample_loss"):
            result["sample_loss"] = sample_loss_cost(root, args.steps, args.warmup, args.rounds)
        if want("hook"):
            result["sample_loss_hook"] = sample_loss_hook(args.repeats)
        if want("table"):
            result["table_lookup"] = table_lookup(args.samples, args.global_batch, root, args.repeats)
        if want("small"):
            run_dir = small_run(root, args.cache_samples, 6)
            result["trace_step_small"] = trace_small(run_dir, args.repeats)
    if want("plan"):
        result["plan_one_step"] = [plan_rows(args.samples, args.global_batch, p, args.repeats)
                                   for p in sorted({1, args.partitions})]
    plan1 = result["plan_one_step"][-1]
    result["trace_one_step_s"] = plan1["one_step_s"] + result["table_lookup"]["lookup_s"] + \
        result["trace_step_small"]["warm_s"]
    return result


def render(d: dict) -> str:
    """The docs' block (render_docs.py: ``trace``)."""
    from benchmarks import docs_format as fmt

    plans, look, small, hook = d["plan_one_step"], d["table_lookup"], d["trace_step_small"], d["sample_loss_hook"]
    n = plans[0]["samples"]
    caption = (f"One step of a {fmt.count(n)}-sample epoch (global batch {fmt.count(plans[0]['global_batch'])}) on a "
               f"{d['machine']['cpus']}-core machine shared with other work (load average about "
               f"{d['load_average_at_start']:.0f}); the median of the repeats.")
    rows = [[f"plan: one global batch, {p['partitions']} partition{'s' if p['partitions'] > 1 else ''}",
             fmt.secs(p["one_step_s"]), fmt.secs(p["whole_epoch_s"]), fmt.times(p["speedup"])] for p in plans]
    rows.append([f"table: the batch's rows among {fmt.count(look['rows'])}", fmt.secs(look["lookup_s"]), None, None])
    rows.append(["the rest (records, the cache's ids, losses; a small run)", fmt.secs(small["warm_s"]), None, None])
    rows.append(["trace of one step", fmt.secs(d["trace_one_step_s"]), None, None])
    loss = (f"run.record_sample_loss costs {fmt.secs(hook['hook_s_per_step'])} per step of {hook['samples_per_step']} "
            f"samples in {hook['micro_batches']} micro-batches, measured apart: "
            f"{fmt.secs(hook['cross_entropy_s_per_step'])} for the per-sample cross-entropy and "
            f"{fmt.secs(hook['write_s_per_step'])} for a Parquet part every {hook['log_every']} steps.")
    whole = d.get("sample_loss")
    if whole:  # end to end: the same short training run with the log off and on, interleaved
        loss += (f" End to end, {whole['rounds']} interleaved runs of {whole['steps_per_run']} steps each way (load "
                 f"average {whole['load_average']:.0f}): a median step of {fmt.secs(whole['on_step_s'])} with it "
                 f"against {fmt.secs(whole['off_step_s'])} without ({fmt.times(whole['ratio'])}), a step of a "
                 "small model, where its share is largest.")
    return "\n\n".join([fmt.para(caption),
                         fmt.table(["part", "time", "whole epoch planned", "one batch against the epoch"], rows),
                         fmt.para(loss), fmt.source("trace")])


if __name__ == "__main__":
    sys.exit(main_for(parse_args, run))
