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
import json
import os
import platform
import tempfile
import time
from pathlib import Path


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
    s = train(cfg, quiet=True)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=2000, help="synthetic images (default 2000)")
    p.add_argument("--size", type=int, default=32, help="sample side in pixels (default 32)")
    p.add_argument("--batch", type=int, default=128, help="global batch size (default 128)")
    p.add_argument("--width", type=int, default=32, help="CNN width (default 32, the demo model)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default 30)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "train.json"))
    p.add_argument("--workdir", default=None, help="keep images, table, cache and runs here")
    args = p.parse_args(argv)
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
    result = {
        "benchmark": "train",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
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
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result["ratios"], indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
