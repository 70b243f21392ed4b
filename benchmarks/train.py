"""Training throughput and where the time goes: 1 and 2 Ray Train workers, from the cache and from the raw path.

    python benchmarks/train.py                       # writes benchmarks/results/train.json
    python benchmarks/train.py --n 2000 --steps 40

One run, one dataset, one model: synthetic shape images are drawn, ingested and materialized once; then four
training runs on a local Ray cluster (TorchTrainer, gloo) take the same number of optimizer steps over the same
global batches: {cache, raw} x {1, 2 workers}. The raw path (``RawLoader``) decodes and resizes every image on
every step; the cache path reads pre-transformed samples. Each row records samples/s and the time breakdown
(data wait, host-to-device, forward/backward, communication, optimizer, eval, other) from the run's summary.
Ratios compare rows of this same run: cache over raw, and 2 workers over 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as `python benchmarks/train.py`: the siblings import as `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import docs_format as fmt  # noqa: E402
from benchmarks._common import default_out, machine, write_result  # noqa: E402


def prepare(workdir: str, n: int, size: int) -> tuple[str, str]:
    from dutycycle.engine.cache.materialize import materialize
    from dutycycle.engine.synth import synthesize
    from dutycycle.engine.table.catalog import ingest
    from dutycycle.engine.transform import TransformSpec

    images, table, cache = (os.path.join(workdir, x) for x in ("images", "table", "cache"))
    synthesize(images, n, seed=1)
    ingest(images, table, phash=False)
    res = materialize(table, cache, TransformSpec(size=size))
    return table, res.uri


def run_one(source: str, workers: int, table: str, cache: str, args, run_dir: str) -> dict:
    from dutycycle.trainer.config import load_config
    from dutycycle.trainer.launch.train import train

    cfg = load_config(None, [
        f"data.source={source}", f"data.cache={cache}", f"data.table={table}", f"data.size={args.size}",
        f"data.global_batch_size={args.batch}", f"model.width={args.width}", f"run.max_steps={args.steps}",
        "run.eval_every=0", "run.eval_max_batches=2", "run.log_every=0", "run.report=false",
        f"parallel.num_workers={workers}", f"run.dir={run_dir}", f"run.name=bench-{source}-{workers}",
    ])
    t0 = time.perf_counter()
    s = train(cfg, quiet=True, overwrite=True)  # the benchmark's own run directory: a rerun replaces it
    return {
        "source": source,
        "workers": workers,
        "steps": s["steps"],
        "samples": s["samples"],
        "samples_per_s": s["samples_per_s"],
        "loop_wall_s": s["wall_s"],
        "launch_wall_s": time.perf_counter() - t0,
        "time_breakdown_s": s["time_breakdown"]["seconds"],
        "time_fractions": s["time_breakdown"]["fractions"],
        "goodput": s["goodput"],
        "data_wait_fraction": s["data_wait_fraction"],
        "comm_fraction": s["comm_fraction"],
        "comm_bytes": s["parallel"]["traffic"]["bytes"],
        "final_loss": s["final_loss"],
    }


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=2000, help="synthetic images (default 2000)")
    p.add_argument("--size", type=int, default=32, help="sample side in pixels (default 32)")
    p.add_argument("--batch", type=int, default=128, help="global batch size (default 128)")
    p.add_argument("--width", type=int, default=32, help="CNN width (default 32, the demo model)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default 30)")
    p.add_argument("--out", default=default_out("train"))
    p.add_argument("--workdir", default=None, help="keep images, table, cache and runs here")
    return p.parse_args(argv)


def run(args) -> dict:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("DAFT_ANALYTICS_ENABLED", "0")

    import ray
    from dutycycle.trainer.cluster.local import start_local_ray

    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or tmp
        t0 = time.perf_counter()
        table, cache = prepare(workdir, args.n, args.size)
        prep_s = time.perf_counter() - t0
        start_local_ray()  # every CPU of this machine, in a cluster of its own
        rows = []
        try:
            for source in ("cache", "raw"):
                for workers in (1, 2):
                    rows.append(run_one(source, workers, table, cache, args,
                                        os.path.join(workdir, "runs", f"{source}-{workers}")))
                    r = rows[-1]
                    print(f"{source:5s} x{workers}: {r['samples_per_s']:7.0f} samples/s, data wait "
                          f"{r['data_wait_fraction']:.0%}, comm {r['comm_fraction']:.0%}, goodput {r['goodput']:.0%}",
                          flush=True)
        finally:
            ray.shutdown()

    by = {(r["source"], r["workers"]): r["samples_per_s"] for r in rows}
    return {
        "benchmark": "train",
        "machine": machine(),
        "settings": vars(args) | {"prepare_s": prep_s},
        "rows": rows,
        "ratios": {
            "cache_over_raw_1_worker": by[("cache", 1)] / by[("raw", 1)],
            "cache_over_raw_2_workers": by[("cache", 2)] / by[("raw", 2)],
            "two_over_one_worker_cache": by[("cache", 2)] / by[("cache", 1)],
            "two_over_one_worker_raw": by[("raw", 2)] / by[("raw", 1)],
        },
        "notes": "samples/s over the training loop's wall time minus evaluation (Ray start-up excluded); "
        "all four runs take the same steps over the same global batches with the same model.",
    }


# -- the docs' blocks (benchmarks/render_docs.py writes them between a page's render markers) --------------------------


def render(d: dict) -> str:
    s = d["settings"]
    caption = (f"{fmt.count(s['n'])} images at {s['size']}x{s['size']}, global batch {s['batch']}, {s['steps']} steps, "
               f"the demo's CNN at width {s['width']}, Ray Train workers with gloo on a {d['machine']['cpus']}-core "
               "machine.")
    labels = {"cache": "cache", "raw": "raw (decode per step)"}
    rows = [[labels.get(r["source"], r["source"]), str(r["workers"]), fmt.rate(r["samples_per_s"]),
             fmt.pct(r["time_fractions"]["forward_backward"], 1), fmt.pct(r["comm_fraction"], 1),
             fmt.pct(r["data_wait_fraction"], 1), fmt.pct(r["goodput"])] for r in d["rows"]]
    headers = ["data", "workers", "samples/s", "forward+backward", "communication", "data wait", "goodput"]
    ratio = d["ratios"]
    ratios = fmt.table(["ratio (samples/s)", "value"], [
        ["cache over raw, 1 worker", fmt.times(ratio["cache_over_raw_1_worker"])],
        ["cache over raw, 2 workers", fmt.times(ratio["cache_over_raw_2_workers"])],
        ["2 workers over 1, from the cache", fmt.times(ratio["two_over_one_worker_cache"])],
        ["2 workers over 1, raw", fmt.times(ratio["two_over_one_worker_raw"])],
    ])
    return "\n\n".join([fmt.para(caption), fmt.table(headers, rows), ratios, fmt.para(fmt.sentence(d["notes"])), fmt.source("train")])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    write_result(args.out, run(args), ("ratios",))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
