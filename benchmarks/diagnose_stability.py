"""Does ``dutycycle diagnose`` give the same verdict when run again? Its verdict names a wait only beyond the
noise of its own measurements (``trainer/diagnose/noise.py``); this runs the command ``--runs`` times on one
config, each in its own process as a user would, and records every run's kind, shares and intervals.

    python benchmarks/diagnose_stability.py --config configs/demo.toml --runs 3 --budget-s 150

Writes ``benchmarks/results/diagnose_stability.json``: ``kinds`` (one per run), ``same_kind`` (all equal), and
per run the shares with their 90% intervals and the headline. The demo's cache must exist (``dutycycle demo``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as `python benchmarks/diagnose_stability.py`: the siblings import as `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import docs_format as fmt  # noqa: E402
from benchmarks._common import bench_env, default_out, machine, write_result  # noqa: E402


def run_once(config: str, budget_s: float, out: Path, overrides: list[str]) -> dict:
    sets = [a for kv in overrides for a in ("--set", kv)]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dutycycle.trainer", "diagnose", config, "--budget-s",
                           str(budget_s), "--out", str(out), *sets], capture_output=True, text=True,
                          env=bench_env(), timeout=budget_s + 300)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:], "wall_s": wall}
    d = json.loads((out / "diagnosis.json").read_text())
    v = d["verdict"]
    return {"kind": v["kind"], "share": v["share"], "shares": v["shares"], "intervals": v.get("intervals", {}),
            "headline": v["headline"], "wall_s": round(wall, 1),
            "experiments_s": {k: round(r.get("seconds", 0.0), 1) for k, r in d["findings"].items()}}


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/demo.toml")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=150.0)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default=default_out("diagnose_stability"))
    return p.parse_args(argv)


def run(args) -> dict:
    t0 = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="dc-bench-diagnose-") as tmp:
        for k in range(args.runs):
            r = run_once(args.config, args.budget_s, Path(tmp) / f"run{k}", args.overrides)
            print(f"run {k}: {r.get('kind') or r.get('error', '')[:300]}", file=sys.stderr)
            runs.append(r)
    kinds = [r.get("kind") for r in runs]
    return {
        "benchmark": "diagnose_stability",
        "config": {"config": args.config, "runs": args.runs, "budget_s": args.budget_s, "overrides": args.overrides},
        "machine": machine(),
        "kinds": kinds,
        "same_kind": len(set(kinds)) == 1 and None not in kinds,
        "runs": runs,
        "total_s": round(time.perf_counter() - t0, 1),
    }


# -- the docs' blocks (benchmarks/render_docs.py writes them between a page's render markers) --------------------------


def render(d: dict) -> str:
    c = d["config"]
    rows = []
    for k, r in enumerate(d["runs"], 1):
        if "kind" not in r:
            rows.append([str(k), "failed", "-", fmt.secs(r["wall_s"])])
            continue
        iv = r.get("intervals", {})
        shares = ", ".join(f"{name} {fmt.pct(v)}" + (f" ({fmt.pct(iv[name][0])}-{fmt.pct(iv[name][1])})" if name in iv else "")
                           for name, v in sorted(r["shares"].items(), key=lambda kv: -kv[1]))
        rows.append([str(k), r["kind"], shares, fmt.secs(r["wall_s"])])
    line = (f"`dutycycle diagnose {c['config']} --budget-s {c['budget_s']:g}`, {c['runs']} runs one after another: "
            f"{'the same kind every time' if d['same_kind'] else 'the kind changed between runs'}.")
    return "\n\n".join([fmt.para(line), fmt.table(["run", "verdict", "shares (90% interval)", "wall time"], rows),
                         fmt.source("diagnose_stability")])


def main(argv: list[str] | None = None) -> int:
    write_result((args := parse_args(argv)).out, run(args), ("kinds", "same_kind"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
