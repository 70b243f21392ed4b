"""``python benchmarks/scale.py --elastic``: what one rank's epoch plan costs for an elastic run
(``parallel.num_workers = [min, max]``) at every size of its range, with the trainer's default partitions against
one partition (every rank plans the whole epoch). Each plan runs in a fresh process through scale.py's
``--plan-cost`` row; results in ``scale_elastic.json``, rendered into docs/benchmarks.md."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from benchmarks import docs_format as fmt
from benchmarks._common import machine, run_row

SCALE = Path(__file__).resolve().parent / "scale.py"  # its --plan-cost row plans in a fresh process


def elastic_plan(args) -> dict:
    """``--elastic``: one rank's plan per size of an elastic range, default partitions against one partition."""
    from dutycycle.loader.config import LoaderConfig
    from dutycycle.loader.plan import default_partitions

    lo, hi = args.elastic_workers
    sizes = list(range(lo, hi + 1))
    batch = args.elastic_batch or 8 * math.lcm(*sizes)
    parts = default_partitions(sizes, batch)
    block, window = LoaderConfig.block_size, LoaderConfig.window
    t0 = time.perf_counter()
    rows = []
    for name, p in (("default", parts), ("one partition", 1)):
        for w in sizes:
            # one partition: every rank plans the whole epoch alike, so rank 0 says it; partitioned: the first
            # and the last rank (they touch different partitions)
            for rank in ((0,) if p == 1 else (0, w - 1)):
                res, _ = run_row([str(SCALE), "--plan-cost", str(args.elastic_samples), str(w), str(rank), str(batch),
                                  str(block), str(window), str(p), str(args.shard_samples), str(args.chunk_rows)],
                                 timeout=args.timeout)
                if "error" in res:
                    raise SystemExit(f"elastic {name} at {w} workers: planning failed: {res['error']}")
                rows.append({"plan": name, "partitions": p, "workers": w, "rank": rank, "plan_s": res["plan_s"],
                             "plan_cpu_s": res["plan_cpu_s"], "peak_mib": res["peak_mib"]})
                print(f"elastic {name} ({p}) at {w} workers, rank {rank}: {res['plan_s']:.3f} s, "
                      f"{res['plan_cpu_s']:.3f} CPU-s, {res['peak_mib']:.1f} MiB", file=sys.stderr)

    def worst(plan: str, key: str) -> float:
        return max(r[key] for r in rows if r["plan"] == plan)

    product, baseline = ({"plan_s_per_rank": worst(plan, "plan_s"), "plan_cpu_s_per_rank": worst(plan, "plan_cpu_s"),
                          "plan_peak_mib_per_rank": worst(plan, "peak_mib")} for plan in ("default", "one partition"))
    return {"benchmark": "scale_elastic", "machine": machine(),
            "settings": {"samples": args.elastic_samples, "workers": [lo, hi], "global_batch": batch,
                         "block_size": block, "window": window},
            "partitions": parts, **product, "baseline": {"partitions": 1, **baseline},
            "plan_s_vs_baseline": product["plan_s_per_rank"] / baseline["plan_s_per_rank"],
            "plan_cpu_s_vs_baseline": product["plan_cpu_s_per_rank"] / baseline["plan_cpu_s_per_rank"],
            "plan_mib_vs_baseline": product["plan_peak_mib_per_rank"] / baseline["plan_peak_mib_per_rank"],
            "rows": rows, "wall_s": time.perf_counter() - t0}


def render_elastic(d: dict) -> str:
    st = d["settings"]
    lo, hi = st["workers"]
    caption = (f"One rank's epoch plan at {fmt.count(st['samples'])} samples for a run at parallel.num_workers = "
               f"[{lo}, {hi}] (global batch {fmt.count(st['global_batch'])}, blocks of {st['block_size']}, window "
               f"{fmt.count(st['window'])}): the trainer's default partitions for that range against one partition "
               "(every rank plans the whole epoch), the worst rank at any size, each in a fresh process.")
    rows = [[f"{name} ({fmt.count(v['partitions'] if name == 'one partition' else d['partitions'])} "
             f"partition{'s' if (v['partitions'] if name == 'one partition' else d['partitions']) > 1 else ''})",
             fmt.secs(v["plan_s_per_rank"]), fmt.secs(v["plan_cpu_s_per_rank"]), fmt.mib(v["plan_peak_mib_per_rank"])]
            for name, v in (("default", d), ("one partition", d["baseline"]))]
    headers = ["plan", "plan per rank (wall)", "plan per rank (CPU)", "plan memory per rank"]
    return "\n\n".join([fmt.para(caption), fmt.table(headers, rows),
                         fmt.para(f"Default against one partition: {fmt.times(d['plan_cpu_s_vs_baseline'])} the CPU "
                                  f"time, {fmt.times(d['plan_s_vs_baseline'])} the wall time, "
                                  f"{fmt.times(d['plan_mib_vs_baseline'])} the memory."),
                         fmt.source("scale_elastic")])
