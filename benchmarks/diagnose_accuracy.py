"""Does ``dutycycle diagnose`` name the cause that is there? Each cause is injected at two strengths into the
demo's config, and the diagnosis is run again and again on it: how often does the verdict name the injected
cause, and how far is the measured share from the injected one?

    python benchmarks/diagnose_accuracy.py --cache dutycycle-demo/cache/<fingerprint> --repeats 10

The injections (each documented as fault injection in the config, or a measurement setting):

    data         data.slow_ms = k x the step time: the step sleeps for its batch; its share is k / (1 + k); and
                 the raw path decoding in the step (the remedy, the cache, is what --verify runs)
    comm         parallel.inject_comm_ms = k x the step time: the exchange waits longer; its share is k / (1 + k)
    checkpoint   synchronous saves every 2 steps to a path throttled (benchmarks/throttle.py) so that a save
                 writes for k x the step time; its share is (k + s) / (2 + k + s), s the unthrottled stall in steps
    memory       --memory-budget-mb = f x the configured stage's model state (f < 1): it cannot fit
    failures     checkpoint.failures_per_worker_hour set so the modelled loss is a share p of the job's time
                 (from the baseline's measured save, restore and restart, its detection time and the job's
                 steps and step: trainer/diagnose/failures.py): the verdict must say failure-bound

Every run is one worker, in this process (no Ray: a diagnosis in about 20 s), with only the experiments the
verdict needs for that cause. A baseline diagnosis first measures the step time, the checkpoint's bytes and
stall, the model state and the failure costs the strengths are set from (only what the chosen ``--causes``
read: every cause's step time, the rest for checkpoint, memory and failures). Where the verdict names a remedy
with a prediction, ``--verify`` runs it and the run records measured against predicted.

Writes ``benchmarks/results/diagnose_accuracy.json``: per case the strength, the expected share, per run the
kind, the measured share and (verified) the prediction's ratio; per case the hits out of the runs and the largest
share error.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as `python benchmarks/diagnose_accuracy.py`: the siblings import as `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import docs_format as fmt  # noqa: E402
from benchmarks import throttle  # noqa: E402
from benchmarks._common import default_out, machine, write_result  # noqa: E402

HERE = Path(__file__).resolve().parent
KIND = {"data": "data-bound", "comm": "communication-bound", "checkpoint": "checkpoint-bound",
        "memory": "memory-bound", "failures": "failure-bound",
        # runs nobody tuned: what is right for each is the case's own ``expect``
        "untuned": None, "short_job": None, "external": None, "compute": None}
SHARE = {"data": "data", "comm": "communication", "checkpoint": "checkpoint"}  # verdict.shares keys
BASE_ONLY = ["compute", "loader", "end_to_end"]
WITH_CONTENTION = ["compute", "loader", "contention", "end_to_end"]  # what `dutycycle diagnose` runs for these
ONLY = {"data": BASE_ONLY, "comm": BASE_ONLY, "checkpoint": [*BASE_ONLY, "checkpoint"],
        "memory": [*BASE_ONLY, "memory"], "failures": [*BASE_ONLY, "failures"],
        "untuned": WITH_CONTENTION, "short_job": [*BASE_ONLY, "failures"], "external": WITH_CONTENTION,
        "compute": WITH_CONTENTION}


def diagnose_once(config: str, overrides: list[str], out: Path, only: list[str], budget_s: float,
                  memory_budget_mb: float | None = None, verify: bool = False) -> dict:
    from dutycycle.trainer.config import load_config
    from dutycycle.trainer.diagnose import diagnose

    cfg = load_config(config, overrides)
    t0 = time.perf_counter()
    d = diagnose(cfg, out=str(out), budget_s=budget_s, only=only, memory_budget_mb=memory_budget_mb,
                 verify=verify, say=lambda m: None, config_name=config)
    d["wall_s"] = time.perf_counter() - t0
    return d


# what each cause's cases read from the baseline beyond its step, its verdict and the table (BASE_ONLY measures
# those): a run of some causes measures only what they read (the baseline of all of them runs all six)
BASELINE_READS = {"checkpoint": ["checkpoint"], "memory": ["memory"], "failures": ["failures"]}


def baseline(config: str, common: list[str], tmp: Path, budget_s: float,
             causes: frozenset[str] | set[str] = frozenset(KIND)) -> dict:
    extra = {e for c in causes for e in BASELINE_READS.get(c, [])}
    only = [k for k in ["compute", "loader", "end_to_end", "checkpoint", "memory", "failures"]
            if k in BASE_ONLY or k in extra]
    d = diagnose_once(config, common, tmp / "baseline", only, budget_s * 2)
    f = d["findings"]
    failed = {k: v["error"] for k, v in f.items() if isinstance(v, dict) and "error" in v}
    if failed:  # every figure below is read from these experiments: name what stopped them
        raise RuntimeError(f"the baseline diagnosis's experiments failed: {failed} (raise --budget-s on a busy machine)")
    run = f["end_to_end"][f["end_to_end"]["configured"]]
    from dutycycle.trainer.config import load_config
    from dutycycle.trainer.diagnose.experiments import table_of

    base = {"step_s": run["step_s"], "kind": d["verdict"]["kind"], "shares": d["verdict"]["shares"],
            "table": table_of(load_config(config, common)), "experiments": only, "wall_s": d["wall_s"]}
    if "checkpoint" in only:
        sync = f["checkpoint"]["sync"]
        base.update(save_bytes=sync["summary"]["checkpoint"]["bytes_per_save"],
                    sync_stall_s=sync["stall_s_per_save"])
    if "memory" in only:
        base["state_bytes"] = f["memory"]["configured"]["device_bytes"]
    if "failures" in only:
        base.update(failure_costs=f["failures"]["costs"], failure_job_steps=f["failures"]["job_steps"])
    return base


def failure_rate_for(share: float, base: dict) -> float:
    """The per-worker-hour rate whose modelled loss is ``share`` of the job's time, from the baseline's failure
    costs and job (one worker, every 2 steps, as the injected config)."""
    from dutycycle.trainer.diagnose import failures as fm

    c = base["failure_costs"]
    costs = fm.FailureCosts(save_s=c["save_s"], restart_s=c["restart_s"], step_s=c["step_s"],
                            detect_s=c["detect_s"])
    return fm.rate_for_share(share, costs, 1, 2, base["failure_job_steps"])


def cases(base: dict, tmp: Path, wanted: frozenset[str] | set[str] = frozenset(KIND)) -> list[dict]:
    """Each cause in ``wanted`` at two strengths: the settings, and the share the injection fixes (None where it
    does not). A cause not wanted is not built: the baseline may not have measured what it reads."""
    c = base["step_s"]
    out = []
    for k in (2.0, 4.0):
        out.append({"cause": "data", "strength": f"loader period {k:g}x the step", "set": [f"data.slow_ms={k * c * 1e3:.0f}"],
                    "expected_share": k / (1 + k), "injected_s_per_step": round(k * c * 1e3) / 1e3})
    if base.get("table"):  # the raw path decoding in the step: data-bound, and the cache is the remedy to verify
        # a prediction case: whether the demo's small images make it data-bound depends on the machine
        out.append({"cause": "data", "strength": "raw decode in the step (loader_mode = sync)",
                    "set": ["data.source=raw", f"data.table={base['table']}", "data.loader_mode=sync"],
                    "expected_share": None, "prediction_only": True})
    for k in (0.5, 2.0):
        out.append({"cause": "comm", "strength": f"exchange delay {k:g}x the step",
                    "set": [f"parallel.inject_comm_ms={k * c * 1e3:.0f}"], "expected_share": k / (1 + k),
                    "injected_s_per_step": round(k * c * 1e3) / 1e3})
    s = base["sync_stall_s"] / c if "checkpoint" in wanted else 0.0
    for k in (1.0, 3.0) if "checkpoint" in wanted else ():
        mb_s = base["save_bytes"] / (k * c) / 1e6
        out.append({"cause": "checkpoint", "strength": f"a save writes {k:g}x the step", "throttle_mb_s": mb_s,
                    "set": ["checkpoint.every=2", "checkpoint.async_save=false", "checkpoint.resume=none"],
                    "expected_share": (k + s) / (2 + k + s), "injected_s_per_step": (k * c + base["sync_stall_s"]) / 2})
    for f in (0.5, 0.9) if "memory" in wanted else ():
        out.append({"cause": "memory", "strength": f"budget {f:g}x the model state",
                    "memory_budget_mb": f * base["state_bytes"] / 2**20, "set": [], "expected_share": None})
    for p in (0.3, 0.6) if "failures" in wanted else ():
        rate = failure_rate_for(p, base)
        out.append({"cause": "failures", "strength": f"modelled loss {p:.0%} of the time",
                    "set": [f"checkpoint.failures_per_worker_hour={rate:.6g}", "checkpoint.every=2"],
                    "expected_share": None})
    out += untuned_cases(base)
    return [{**c, "index": i} for i, c in enumerate(x for x in out if x["cause"] in wanted)]


def untuned_cases(base: dict) -> list[dict]:
    """Runs nobody tuned, each with what a right verdict says (``expect``, read by ``right``):

    - untuned: the demo's table decoded every step (data.source = raw, the loader as it comes): data-bound, with
      the cache the remedy (the issue's run: 44% of its ceiling read "compute-bound");
    - short_job: the demo's job with no checkpoints (checkpoint.every = 0, a new user's default): not
      failure-bound, its failures projecting an ETTR of 99% or more;
    - external: the cache run beside another process spinning on a core: the verdict says the machine was shared;
    - compute: the cache run of a wider model at ZeRO stage 0 with nothing quantized and one loader thread's
      work per step dwarfed by compute: compute-bound."""
    out = []
    if base.get("table"):
        out.append({"cause": "untuned", "strength": "raw decoding, the loader as configured",
                    "set": ["data.source=raw", f"data.table={base['table']}"], "expected_share": None,
                    "expect": {"kinds": ["data-bound"], "fix_has": "dutycycle materialize"}})
    out.append({"cause": "short_job", "strength": "the demo's job, checkpoint.every = 0",
                "set": ["checkpoint.every=0"], "expected_share": None,
                "expect": {"not_kinds": ["failure-bound"], "ettr_at_least": 0.99}})
    out.append({"cause": "external", "strength": "another process spinning on one core", "set": [],
                "expected_share": None, "spinner": True,
                "expect": {"headline_has": "the machine was shared"}})
    out.append({"cause": "compute", "strength": "width 96, stage 0, nothing quantized",
                "set": ["model.width=96", "parallel.zero_stage=0", "parallel.quant_grads=none"],
                "expected_share": None, "expect": {"kinds": ["compute-bound"]}})
    return out


def right(case: dict, d: dict) -> bool:
    """Whether diagnosis ``d`` is right for ``case``: the injected cause's kind, or the case's ``expect``."""
    v = d["verdict"]
    want = case.get("expect")
    if want is None:
        return v["kind"] == KIND[case["cause"]]
    ettr = (d["findings"].get("failures") or {}).get("ettr")
    return all([v["kind"] in want.get("kinds", [v["kind"]]), v["kind"] not in want.get("not_kinds", []),
                want.get("fix_has", "") in v["fix"], want.get("headline_has", "") in v["headline"],
                "ettr_at_least" not in want or (ettr is not None and ettr >= want["ettr_at_least"])])


def spinner() -> int:
    """Another process spinning on a core, not this one's descendant (a shell starts it and exits), as another
    user's job is: its pid."""
    import subprocess

    got = subprocess.run(["sh", "-c", f"'{sys.executable}' -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True)
    return int(got.stdout)


def run_case(config: str, common: list[str], case: dict, tmp: Path, repeats: int, budget_s: float,
             verify: bool, base_step: float) -> dict:
    name = f"{case['cause']}-{case['index']}"
    runs = []
    for i in range(repeats):
        sets = list(case["set"])
        rate_before = None
        if "throttle_mb_s" in case:  # the checkpoint path, paced (benchmarks/throttle.py)
            rate_before = os.environ.get(throttle.RATE_ENV)
            os.environ[throttle.RATE_ENV] = f"{case['throttle_mb_s']:.6g}"
            throttle._LINK = None  # the link reads its rate once
            sets.append(f"checkpoint.dir=throttled://{tmp}/ckpt-{name}-{i}")
        spun = spinner() if case.get("spinner") else None
        try:
            d = diagnose_once(config, [*common, *sets], tmp / f"{name}-{i}", ONLY[case["cause"]],
                              budget_s, case.get("memory_budget_mb"), verify)
        except Exception as e:  # noqa: BLE001 - recorded: a run that fails is a miss, with its reason
            runs.append({"error": f"{type(e).__name__}: {e}"[:500]})
            continue
        finally:
            if spun is not None:
                os.kill(spun, signal.SIGKILL)
            if "throttle_mb_s" in case:  # the pace of the next case is its own
                if rate_before is None:
                    os.environ.pop(throttle.RATE_ENV, None)
                else:
                    os.environ[throttle.RATE_ENV] = rate_before
        v = d["verdict"]
        r = {"kind": v["kind"], "wall_s": round(d["wall_s"], 1),
             "others_cores": (d.get("machine_load") or {}).get("others")}  # other work on the machine meanwhile
        if not case.get("prediction_only"):
            r["hit"] = right(case, d)
        if case.get("expect"):  # what the verdict said, for the note's right / total
            r["headline"] = v["headline"][:400]
            r["ettr"] = (d["findings"].get("failures") or {}).get("ettr")
        e2e = d["findings"].get("end_to_end") or {}
        run = e2e.get(e2e.get("configured", ""), {}) if "error" not in e2e else {}
        if run:  # the step as this run measured it: what the compute took beside the injection
            r["step_s"] = run["step_s"]
        key = SHARE.get(case["cause"])
        if key:
            r["share"] = v["shares"].get(key)
            if case["expected_share"] is not None and r["share"] is not None:
                r["share_error_points"] = 100 * abs(r["share"] - case["expected_share"])
            if "injected_s_per_step" in case and "step_s" in r and r["share"] is not None:
                # the accounting itself: the wait measured per step against the seconds injected per step
                r["wait_error_ms"] = 1e3 * (r["share"] * r["step_s"] - case["injected_s_per_step"])
        for rem in d.get("remedies") or []:
            if "measured_samples_per_s" in rem:
                r["verified"] = {"for": rem["for"], "set": rem["set"], "predicted": rem["predicted_samples_per_s"],
                                 "measured": rem["measured_samples_per_s"],
                                 "measured_over_predicted": rem["measured_over_predicted"]}
        runs.append(r)
        print(f"  {case['cause']} ({case['strength']}) run {i}: {r.get('kind')}, share {r.get('share')}",
              file=sys.stderr)
    errors = [r["share_error_points"] for r in runs if "share_error_points" in r]
    # what the step spent beside the injected wait, against the baseline's step: when it grows, a share set from the
    # baseline's step reads low (a core that sleeps between steps, as the injected waits make it, runs slower)
    rest = sorted(r["step_s"] * (1 - r["share"]) for r in runs if "step_s" in r and r.get("share") is not None)
    counted = [] if case.get("prediction_only") else runs
    return {**case, "runs": runs, "hits": sum(r.get("hit", False) for r in counted), "of": len(counted),
            "largest_share_error_points": max(errors) if errors else None,
            "rest_of_step_vs_baseline": rest[len(rest) // 2] / base_step if rest and base_step else None}


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(HERE.parent / "configs" / "demo.toml"))
    p.add_argument("--cache", required=True, help="the demo's cache (dutycycle demo makes one)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=120.0)
    p.add_argument("--causes", default=",".join(KIND))
    p.add_argument("--verify", action="store_true", help="also run each verdict's top remedy (slower)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run (after the cache and the worker count)")
    p.add_argument("--out", default=default_out("diagnose_accuracy"))
    return p.parse_args(argv)


def run(args) -> dict:
    throttle.register()  # the throttled:// protocol, in this process (every run is in it)

    common = [f"data.cache={os.path.abspath(args.cache)}", "parallel.num_workers=1", "ray.max_failures=0",
              *args.overrides]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dc-bench-accuracy-") as d:
        tmp = Path(d)
        wanted = set(args.causes.split(","))
        unknown = sorted(wanted - set(KIND))
        if unknown:
            raise SystemExit(f"--causes {','.join(unknown)}: unknown; choose from {', '.join(KIND)}")
        base = baseline(args.config, common, tmp, args.budget_s, wanted)
        print(f"baseline: step {base['step_s']:.3f} s, {base['kind']}", file=sys.stderr)
        rows = [run_case(args.config, common, case, tmp, args.repeats, args.budget_s, args.verify, base["step_s"])
                for case in cases(base, tmp, wanted)]
    return {
        "benchmark": "diagnose_accuracy",
        "config": {"config": os.path.relpath(args.config, HERE.parent), "overrides": args.overrides,
                   "repeats": args.repeats, "budget_s": args.budget_s, "workers": 1,
                   "verify": args.verify},
        "machine": machine(),
        "baseline": base,
        "cases": rows,
        "right_cause": {f"{r['cause']}: {r['strength']}": f"{r['hits']}/{r['of']}" for r in rows if r["of"]},
        "total_s": round(time.perf_counter() - t0, 1),
    }


# -- the docs' blocks (benchmarks/render_docs.py writes them between a page's render markers) --------------------------


def render(d: dict) -> str:
    c = d["config"]
    rows = []
    for r in d["cases"]:
        shares = [x["share"] for x in r["runs"] if x.get("share") is not None]
        measured = f"{fmt.pct(min(shares))} to {fmt.pct(max(shares))}" if shares else "-"
        expected = fmt.pct(r["expected_share"]) if r["expected_share"] is not None else "-"
        err = r["largest_share_error_points"]
        ratios = [x["verified"]["measured_over_predicted"] for x in r["runs"] if "verified" in x]
        kinds = sorted({x.get("kind", "failed") for x in r["runs"]})
        right = f"{r['hits']} of {r['of']}" if r["of"] else f"a prediction case ({', '.join(kinds)})"
        rest = r.get("rest_of_step_vs_baseline")
        waits = [x["wait_error_ms"] for x in r["runs"] if "wait_error_ms" in x]
        accounted = f"{min(waits):+.1f} to {max(waits):+.1f} ms" if waits else "-"
        rows.append([r["cause"], r["strength"], right, expected, measured,
                     f"{err:.1f}" if err is not None else "-", accounted, f"{rest:.2f}x" if rest else "-",
                     f"{sum(abs(x - 1) <= 0.15 for x in ratios)} of {len(ratios)} within 15% "
                     f"({min(ratios):.2f}x to {max(ratios):.2f}x)" if ratios else "-"])
    line = (f"`python benchmarks/diagnose_accuracy.py --repeats {c['repeats']}"
            + (" --verify" if c.get("verify") else "") + f"`: {c['workers']} worker, the demo's config and cache; "
            f"baseline step {fmt.secs(d['baseline']['step_s'])}, whole benchmark {fmt.secs(d['total_s'])}.")
    return "\n\n".join([fmt.para(line), fmt.table(["cause", "strength", "right cause", "injected share", "measured share",
                                              "largest error (points)", "wait accounted - injected, per step",
                                              "rest of the step / baseline step",
                                              "measured / predicted"], rows),
                         fmt.source("diagnose_accuracy")])


def render_untuned(d: dict) -> str:
    """The runs nobody tuned (``--causes untuned,short_job,external,compute``): right / total for each, the kinds
    the verdicts took, and one verdict as it read."""
    c = d["config"]
    rows = []
    for r in d["cases"]:
        kinds = sorted({x.get("kind", "failed") for x in r["runs"]})
        said = next((x["headline"] for x in r["runs"] if x.get("headline")), "")
        cut = said[:160] + ("..." if len(said) > 160 else "")
        rows.append([r["cause"], r["strength"], f"{r['hits']} of {r['of']}", ", ".join(kinds), cut])
    line = (f"`python benchmarks/diagnose_accuracy.py --causes untuned,short_job,external,compute --repeats "
            f"{c['repeats']} --budget-s {c['budget_s']:g}`: {c['workers']} worker, the demo's config and cache; "
            f"whole benchmark {fmt.secs(d['total_s'])}.")
    return "\n\n".join([fmt.para(line), fmt.table(["case", "run", "right", "verdicts", "a verdict as it read"], rows),
                         fmt.source("diagnose_accuracy_untuned")])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    write_result(args.out, run(args), ("right_cause",))
    return 0


if __name__ == "__main__":
    sys.exit(main())
