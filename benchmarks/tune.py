"""How close does ``dutycycle tune`` come to an exhaustive grid over the same knobs, and in how many verified
experiments? The goal: 90% of the grid's best throughput within 5 verified experiments.

Two configs on the demo's data (shapes drawn by ``dutycycle synth``'s generator, ingested and materialized as a
small cache, as the demo does): the demo's own config (``configs/demo.toml``: the cache, 2 workers, ZeRO stage 2,
int8 gradients, asynchronous saves) and a raw one (the same file at one worker decoding the table every step,
``data.source = raw``, the cache named beside it). For each:

1. ``dutycycle tune CONFIG --max-experiments 5`` runs as a user runs it (a process of its own);
2. every point of the grid and the tuned config run as short training runs of the same steps, one after another
   in this process (``experiments.short_run``, what tune's own verifications run), ``--repeats`` times in turns,
   each point's figure the median of its runs: the tuned config is measured in the same conditions as the grid,
   not by tune's figures.

The grid is over the knobs tune's remedies set, at the values a 2-core machine can run in minutes (each point at
2 workers is a Ray Train run): for the demo config, workers {2, 1} x int8 gradients {on, off} (at 2 workers) x
asynchronous saves {on, off}, and one worker at ZeRO stage 0 with nothing quantized (8 points); for the raw
config, the source {raw, cache} x {one worker as configured (stage 2, int8 gradients), one worker at stage 0
with nothing quantized, two workers} (6 points).

    python benchmarks/tune.py                 # both configs (about 20 minutes on 2 cores)
    python benchmarks/tune.py --quick         # a smoke run: the raw config, a tiny table, no time to tune

Writes ``benchmarks/results/tune.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

if __name__ == "__main__":  # run as `python benchmarks/tune.py`: the siblings import as `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import docs_format as fmt  # noqa: E402
from benchmarks._common import bench_env, default_out, machine, write_result  # noqa: E402

GOAL_RATIO, GOAL_EXPERIMENTS = 0.9, 5
# each grid: (name, the --set items of each point); the config's own values are the first point's where they apply
ONE_FLAT = ["parallel.zero_stage=0", "parallel.quant_grads=none"]  # one worker with nothing sharded or quantized
GRIDS = {
    "demo": [[f"parallel.num_workers={w}", f"parallel.quant_grads={q}", f"checkpoint.async_save={a}"]
             for w, quants in ((2, ("int8", "none")), (1, ("none",))) for q in quants for a in ("true", "false")]
    + [["parallel.num_workers=1", *ONE_FLAT, f"checkpoint.async_save={a}"] for a in ("true", "false")],
    "raw": [[f"data.source={s}", *layout] for s in ("raw", "cache")
            for layout in ([], ONE_FLAT, ["parallel.num_workers=2"])],
}
QUICK_GRID = {"raw": [["data.source=raw"], ["data.source=cache"]]}


def make_data(root: str, images: int) -> tuple[str, str]:
    """The demo's data path at a small size: synth -> ingest -> materialize (the demo's sample side). Returns the
    table and the cache."""
    from dutycycle.engine import TransformSpec, materialize
    from dutycycle.engine.synth import synthesize
    from dutycycle.engine.table.catalog import ingest

    synthesize(f"{root}/images", images, seed=0)
    ingest(f"{root}/images", f"{root}/table")
    cache = materialize(f"{root}/table", f"{root}/cache", TransformSpec(size=32)).uri
    return f"{root}/table", cache


def config_files(root: str, table: str, cache: str, quick: bool) -> dict[str, Path]:
    """The configs tune starts from, as TOML files a user would write: the demo's, and the raw one."""
    from dutycycle.trainer.config import packaged_config

    demo = packaged_config("demo.toml").replace('cache = "dutycycle-demo/cache"', f'cache = "{cache}"')
    demo = demo.replace('dir = "dutycycle-demo/run"', f'dir = "{root}/run"')
    raw = demo.replace('source = "cache"', f'source = "raw"\ntable = "{table}"').replace(
        "num_workers = 2", "num_workers = 1")
    if quick:  # a narrow model and small batches: seconds per run
        raw = raw.replace("global_batch_size = 128", "global_batch_size = 32").replace(
            "eval_batch_size = 256", "eval_batch_size = 32").replace("width = 32", "width = 8")
    out = {}
    for name, text in (("demo", demo), ("raw", raw)):
        tomllib.loads(text)  # a replacement that broke the file fails here, not in a run
        out[name] = Path(root) / f"{name}.toml"
        out[name].write_text(text)
    return out


def run_tune(config: Path, out: Path, budget_s: float, only: str, max_experiments: int) -> dict:
    """``dutycycle tune`` as a user runs it; its tune.json, with the command's wall time."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dutycycle.trainer", "tune", str(config), "--budget-s",
                           str(budget_s), "--out", str(out), "--only", only, "--max-experiments",
                           str(max_experiments)], capture_output=True, text=True, env=bench_env(),
                          timeout=budget_s + 600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-3000:], "wall_s": wall}
    print(proc.stdout[-4000:], file=sys.stderr)
    d = json.loads((out / "tune.json").read_text())
    return {"wall_s": round(wall, 1), "experiments": d["experiments"], "kept": d["kept"], "stopped": d["stopped"],
            "rounds": [{k: r[k] for k in ("round", "changes", "verdict", "baseline", "passed_over")} for r in d["rounds"]],
            "start": d["start"], "tuned": d["tuned"], "tuned_toml": (out / "tuned.toml").read_text()}


def measure(cfg, workdir: str, name: str, sets: list[str], steps: int) -> dict:
    """One short run of ``cfg`` with ``sets``: its training rate over its steady steps, with its interval."""
    from dutycycle.trainer.diagnose.context import Context
    from dutycycle.trainer.diagnose.experiments import short_run
    from dutycycle.trainer.diagnose.tuning import rate_interval

    try:
        got = short_run(Context(cfg=cfg, workdir=workdir, steps=steps), name, *sets)
    except Exception as e:  # noqa: BLE001 - a point that does not run is recorded, the others run
        return {"error": f"{type(e).__name__}: {e}"}
    return {"samples_per_s": round(got["samples_per_s"], 1), "interval": [round(x, 1) for x in rate_interval(got)]}


def one_config(name: str, config: Path, grid: list[list[str]], args, tmp: Path) -> dict:
    """Tune first; then every grid point and the tuned config, one after another, ``args.repeats`` times over (a
    busy machine moves a run's rate by more than the differences measured: each point's figure is the median of
    its runs, taken in turns with the others')."""
    from dutycycle.trainer.config import load_config

    print(f"[{name}] tune ...", file=sys.stderr)
    tuned = run_tune(config, tmp / f"tune-{name}", args.budget_s, args.only, GOAL_EXPERIMENTS)
    out: dict = {"config": str(config.name), "tune": tuned}
    if "error" in tuned:
        return out
    cfg, mine = load_config(str(config)), load_config(str(tmp / f"tune-{name}" / "tuned.toml"))
    points = [(cfg, sets) for sets in grid] + [(mine, [])]
    workdir = str(tmp / f"grid-{name}")
    # a first short run in this process pays its one-off costs (imports, Ray's start for 2 workers), not a point
    measure(cfg, workdir, "warm-up", grid[0], min(args.steps, 8))
    runs: list[list[dict]] = [[] for _ in points]
    for r in range(args.repeats):
        for i, (c, sets) in enumerate(points):
            runs[i].append(measure(c, workdir, f"point-{i}", sets, args.steps))
            print(f"[{name}] repeat {r + 1}: {' '.join(sets) or 'tuned'}: "
                  f"{runs[i][-1].get('samples_per_s', runs[i][-1].get('error'))}", file=sys.stderr)
    rows = []
    for (_, sets), got in zip(points, runs, strict=True):
        rates = [g["samples_per_s"] for g in got if "samples_per_s" in g]
        row = {"set": sets, "runs": got}
        if rates:
            row["samples_per_s"] = round(statistics.median(rates), 1)
            row["spread"] = [min(rates), max(rates)]
        rows.append(row)
    out["grid"], out["tuned"] = rows[:-1], rows[-1]
    ok = [r for r in out["grid"] if "samples_per_s" in r]
    if ok and "samples_per_s" in out["tuned"]:
        best = max(ok, key=lambda r: r["samples_per_s"])
        out["best"] = best
        out["ratio_vs_best"] = round(out["tuned"]["samples_per_s"] / best["samples_per_s"], 3)
        out["experiments_used"] = len(tuned["experiments"])
        out["goal_met"] = out["ratio_vs_best"] >= GOAL_RATIO and out["experiments_used"] <= GOAL_EXPERIMENTS
    return out


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: the raw config, a tiny table, no time to tune")
    p.add_argument("--images", type=int, default=1200, help="images drawn for the demo's data (default 1200)")
    p.add_argument("--steps", type=int, default=24, help="optimizer steps of each grid point's short run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each grid point and the tuned config, in turns")
    p.add_argument("--budget-s", type=float, default=600.0, help="tune's --budget-s for each config")
    p.add_argument("--only", default="compute,loader,contention,end_to_end,scaling,checkpoint,memory",
                   help="the experiments of tune's diagnoses (failures predicts an ETTR, no rate to verify)")
    p.add_argument("--configs", default="demo,raw", help="which configs (demo, raw)")
    p.add_argument("--out", default=default_out("tune"))
    args = p.parse_args(argv)
    if args.quick:  # the benchmark's path end to end in seconds: tune's command runs, and stops before its first
        # diagnosis (what tune measures is tested in tests/trainer/test_tune.py); the grid and the tuned config run
        args.images, args.steps, args.repeats, args.budget_s, args.only, args.configs = (160, 8, 1, 1.0, "end_to_end",
                                                                                          "raw")
    return args


def run(args) -> dict:
    t0 = time.perf_counter()
    os.environ.setdefault("RAY_ADDRESS", "local")  # a cluster of this benchmark's own, never one left running here
    grids = QUICK_GRID if args.quick else GRIDS
    with tempfile.TemporaryDirectory(prefix="dc-bench-tune-") as tmp:
        table, cache = make_data(os.path.join(tmp, "data"), args.images)
        files = config_files(tmp, table, cache, args.quick)
        configs = {}
        for name in args.configs.split(","):
            configs[name] = one_config(name, files[name], grids[name], args, Path(tmp))
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():  # the grid's Ray Train runs started it
        sys.modules["ray"].shutdown()
    return {"benchmark": "tune", "quick": args.quick, "machine": machine(),
            "settings": {"images": args.images, "steps": args.steps, "repeats": args.repeats,
                         "budget_s": args.budget_s, "only": args.only,
                         "goal": {"ratio": GOAL_RATIO, "experiments": GOAL_EXPERIMENTS}},
            "configs": configs, "total_s": round(time.perf_counter() - t0, 1)}


# -- the docs' block (benchmarks/render_docs.py writes it between a page's render markers) ------------------------


def render(d: dict) -> str:
    rows = []
    for name, c in d["configs"].items():
        t = c["tune"]
        if "error" in t or "ratio_vs_best" not in c:
            rows.append([name, "failed", "-", "-", "-", "-", "-"])
            continue
        kept = ", ".join(f"`{k}`" for k in t["kept"]) or "nothing"
        tuned, best = c["tuned"], c["best"]
        rows.append([name, str(c["experiments_used"]), kept,
                     f"{fmt.rate(tuned['samples_per_s'])} ({fmt.rate(tuned['spread'][0])}-{fmt.rate(tuned['spread'][1])})",
                     f"{fmt.rate(best['samples_per_s'])} (`{' '.join(best['set'])}`)",
                     fmt.times(c["ratio_vs_best"]), "yes" if c["goal_met"] else "no"])
    s = d["settings"]
    line = (f"`python benchmarks/tune.py`: the demo's data ({s['images']:,} images, cache and table); tune with "
            f"--budget-s {s['budget_s']:g} and at most {s['goal']['experiments']} verified experiments, then every "
            f"grid point and the tuned config as short runs of {s['steps']} steps, {s.get('repeats', 1)} times in "
            f"turns (the median of each; the tuned config's range beside it); whole benchmark "
            f"{fmt.secs(d['total_s'])}.")
    table = fmt.table(["config", "verified experiments", "kept", "tuned samples/s", "grid's best samples/s",
                       "tuned / best", f"goal ({s['goal']['ratio']:.0%} in {s['goal']['experiments']})"], rows)
    # where nothing was kept the tuned config is the one given, which is also the grid's first point: the two
    # figures of one config say how far this machine moved a rate between runs
    same = [f"{name}: {fmt.rate(c['tuned']['samples_per_s'])} as the tuned row, {fmt.rate(c['grid'][0]['samples_per_s'])} "
            f"as the grid's first point ({fmt.rate(c['grid'][0]['spread'][0])}-{fmt.rate(c['grid'][0]['spread'][1])})"
            for name, c in d["configs"].items()
            if "ratio_vs_best" in c and not c["tune"]["kept"] and "samples_per_s" in c["grid"][0]]
    parts = [fmt.para(line), table]
    if same:
        parts.append(fmt.para("Nothing kept, so the tuned config is the config as given, which is also the grid's "
                              "first point; the one config measured twice: " + "; ".join(same) + "."))
    return "\n\n".join([*parts, fmt.source("tune")])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    write_result(args.out, result)
    for name, c in result["configs"].items():
        if "ratio_vs_best" in c:
            print(f"{name}: {c['experiments_used']} verified experiment(s), tuned {c['tuned']['samples_per_s']:,.0f} "
                  f"samples/s against the grid's best {c['best']['samples_per_s']:,.0f} ({c['ratio_vs_best']:.2f}x)")
        else:
            print(f"{name}: failed: {c['tune'].get('error', '')[-500:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
