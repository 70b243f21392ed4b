"""``dutycycle tune CONFIG --budget-s S``: diagnose the config, apply the remedy with the largest predicted gain as
a config change, verify it by a measured short run, keep it only when it beats the noise, and repeat from the new
config until no remedy's predicted gain exceeds the noise or the budget is spent.

The knobs are the remedies the diagnosis names (``remedies.py``: the data source, quantized collectives, the
checkpoint mode, the ZeRO stage and offload that fit, the worker count that has the cores), each a ``--set``
change with a predicted rate. The decisions, each against the noise of the measurements (``noise.py``):

- the baseline is the configured run's training rate from the round's diagnosis (its end-to-end run), with the
  90% interval of that rate when its steps are resampled;
- a remedy is tried only when its predicted rate lies above the baseline's interval (a smaller predicted gain
  could not be told from noise by a run of the same length); the largest predicted gain first, except that a
  layout that fits the memory budget comes before any rate (a run that does not fit has no rate to improve);
- a remedy is verified by a short run of its settings of the same steps as the baseline's (``remedies.verify``),
  right after a short run of the config as it is (the baseline again, in the same process: a config's rate moves
  between runs minutes apart on a shared machine), and kept only when the measured rate's interval lies above
  that baseline's interval (a memory layout: when the
  bytes its ranks held fit the budget). A kept change makes a new config, which is diagnosed again; a rejected
  one is not tried again from the same config, and the next remedy of the same diagnosis is tried.

The loop itself (``loop``) is a function of two measuring functions, so its decisions are tested on recorded
findings; ``tune`` runs it with real diagnoses and verifications, each in processes of their own within what is
left of the budget (``run.py``). A second tune into the same folder measures afresh and replaces the first one's
files, as a diagnosis does.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

from dutycycle.engine import formats, io
from dutycycle.engine.numbers import thousands

from . import noise
from .context import share_steps, variant
from .experiments import short_run
from .remedies import verify as check_remedy
from .run import Interrupted, context, diagnose, job_for, ray_address, run_bounded
from .tuned import to_toml, tuned_tree

ROUND_MIN_S = 30.0  # a diagnosis or a verification that would start with less of the budget left is not started:
#                     each starts Python and torch in a process of its own (seconds on a busy machine) and trains


# ------------------------------------------------------------------------------------------- the decisions


def rate_interval(run: dict) -> list[float]:
    """90% interval of a short run's samples/s (``experiments.short_run``'s dict) when its steps are resampled: its
    rate is the global batch times the steps over their summed time."""
    steps = (run.get("per_step") or {}).get("step_s") or []
    rate = run["samples_per_s"]
    if len(steps) < 2:
        return [rate, rate]
    gbs = rate * sum(steps) / len(steps)  # samples per step, back from the run's own rate
    return noise.ratio_interval([gbs] * len(steps), steps)


def baseline(findings: dict) -> dict | None:
    """The configured run's training rate and its interval, from a diagnosis's end-to-end run; None when that run
    failed or did not run."""
    e2e = findings.get("end_to_end") or {}
    run = e2e.get(e2e.get("configured", "")) if "error" not in e2e else None
    if not isinstance(run, dict) or not run.get("samples_per_s"):
        return None
    return {"samples_per_s": run["samples_per_s"], "interval": rate_interval(run)}


def key_of(remedy: dict) -> tuple[str, ...]:
    return tuple(sorted(remedy["set"]))


def candidates(found: list[dict], base: dict | None, tried: set) -> tuple[list[dict], list[dict]]:
    """The remedies worth verifying from a diagnosis's ``found`` (its ``remedies``), in the order to try them, and
    the ones passed over, each as ``{"remedy": ..., "why": ...}``. ``tried``: the settings already run from this
    config (``key_of``). ``base`` None (the configured run measured no rate; it may not fit): a memory layout
    only."""
    hi = base["interval"][1] if base else None
    go, passed = [], []
    for r in found:
        if key_of(r) in tried:
            continue
        if not r["set"]:  # a larger node: a remedy to say, not a setting a run here can verify
            passed.append({"remedy": r, "why": f"not a setting: {r.get('node', 'a different machine')}"})
        elif "predicted_bytes_per_rank" in r:
            go.append(r)  # the configured layout does not fit: this comes first
        elif "predicted_samples_per_s" not in r:
            passed.append({"remedy": r, "why": "its prediction is not a rate a short run can measure"})
        elif hi is None:
            passed.append({"remedy": r, "why": "the configured run measured no rate to compare it with"})
        elif r["predicted_samples_per_s"] <= hi:
            passed.append({"remedy": r, "why": f"predicted {thousands(r['predicted_samples_per_s'])} samples/s, "
                                               f"within the noise of the baseline (its interval reaches "
                                               f"{thousands(hi)})"})
        else:
            go.append(r)
    go.sort(key=lambda r: ("predicted_bytes_per_rank" not in r, -r.get("predicted_samples_per_s", 0.0)))
    return go, passed


def judge(checked: dict, base: dict, budget_bytes: float | None = None) -> tuple[bool, str]:
    """Whether a verified remedy (``check_remedy``'s dict with ``measured_interval``) is kept, and why."""
    if "verify_error" in checked:
        return False, f"its run failed: {checked['verify_error']}"
    if "measured_bytes_per_rank" in checked:
        held = checked["measured_bytes_per_rank"]
        if budget_bytes is None or held <= budget_bytes:
            return True, "its ranks held model state within the memory budget"
        return False, "its ranks held more model state than the memory budget"
    lo, hi = checked["measured_interval"]
    b_lo, b_hi = base["interval"]
    gain = checked["measured_samples_per_s"] / base["samples_per_s"] - 1
    if lo > b_hi:
        return True, f"{gain:+.0%}: its interval lies above the baseline's"
    if hi < b_lo:
        return False, f"{gain:+.0%}: slower than the baseline beyond the noise"
    return False, f"{gain:+.0%}: within the noise (its interval reaches the baseline's)"


def merged(kept: list[str], changes: list[str]) -> list[str]:
    """``kept`` with ``changes`` applied: a key set again takes its new value in its old place."""
    out = dict(item.split("=", 1) for item in kept)
    out.update(item.split("=", 1) for item in changes)
    return [f"{k}={v}" for k, v in out.items()]


def loop(diagnose_round: Callable, verify_round: Callable, time_left: Callable[[], float], *,
         max_experiments: int | None = None, min_round_s: float = ROUND_MIN_S, say=print,
         state: dict | None = None) -> dict:
    """The tune loop over two measuring functions:

    - ``diagnose_round(kept, k)``: round ``k``'s diagnosis of the config with the ``kept`` changes (a dict with
      ``findings``, ``verdict`` and ``remedies``, as ``diagnose`` returns);
    - ``verify_round(kept, remedy, diagnosis, k)``: ``remedy`` with ``measured_samples_per_s`` and
      ``measured_interval`` (or ``measured_bytes_per_rank``, or ``verify_error``);
    - ``time_left()``: seconds of the budget left.

    Returns ``{"kept", "experiments", "rounds", "stopped"}``: the changes kept, every verified remedy (predicted,
    measured, kept or not and why), each round's baseline and verdict, and why the loop stopped. ``state``: that
    dict, filled as the loop goes (what a caller interrupted by a signal still has)."""
    state = state if state is not None else {}
    state.update(kept=[], experiments=[], rounds=[], stopped="")
    experiments, rounds = state["experiments"], state["rounds"]
    kept: list[str] = []
    stopped = ""
    while not stopped:
        if max_experiments is not None and len(experiments) >= max_experiments:
            stopped = f"{max_experiments} experiments verified (the limit)"
            break
        if time_left() < min_round_s:
            stopped = "budget spent" + (" before the first diagnosis" if not rounds else "")
            break
        k = len(rounds) + 1
        diag = diagnose_round(list(kept), k)
        base = baseline(diag["findings"])
        budget_bytes = (diag["findings"].get("memory") or {}).get("budget_bytes")
        rnd = {"round": k, "changes": list(kept), "verdict": diag["verdict"]["headline"], "baseline": base,
               "remedies": len(diag.get("remedies") or []), "passed_over": []}
        rounds.append(rnd)
        if base is None and not any("predicted_bytes_per_rank" in r for r in diag.get("remedies") or []):
            stopped = f"round {k}'s diagnosis measured no training rate (its end-to-end run failed or did not run)"
            break
        say(f"[tune] round {k}: {_rate(base)} samples/s; {diag['verdict']['headline']}")
        tried: set = set()
        while True:
            go, passed = candidates(diag.get("remedies") or [], base, tried)
            rnd["passed_over"] = [{"for": p["remedy"]["for"], "set": p["remedy"]["set"], "why": p["why"]}
                                  for p in passed]
            if not go:
                stopped = ("no remedy's predicted gain exceeds the noise" if not tried else
                           "no remedy left whose predicted gain exceeds the noise: the ones tried did not beat it")
                break
            if max_experiments is not None and len(experiments) >= max_experiments:
                stopped = f"{max_experiments} experiments verified (the limit)"
                break
            if time_left() < min_round_s:
                stopped = "budget spent"
                break
            remedy = go[0]
            tried.add(key_of(remedy))
            say(f"[tune] round {k}: verifying {remedy['for']}: --set {' --set '.join(remedy['set'])}")
            checked = verify_round(list(kept), remedy, diag, k)
            against = checked.get("baseline_again") or base  # the paired baseline, when the check measured one
            keep, why = judge(checked, against, budget_bytes)
            row = {"round": k, "for": remedy["for"], "set": list(remedy["set"]), "from": remedy.get("from", ""),
                   "baseline": against, "kept": keep, "why": why,
                   **{key: checked[key] for key in ("predicted_samples_per_s", "measured_samples_per_s",
                                                    "measured_interval", "measured_over_predicted",
                                                    "predicted_bytes_per_rank", "measured_bytes_per_rank",
                                                    "verify_error") if key in checked}}
            experiments.append(row)
            say(f"[tune] {'kept' if keep else 'not kept'}: {why}")
            if keep:
                kept = state["kept"] = merged(kept, remedy["set"])
                break  # a new config: diagnose it again
    state["stopped"] = stopped
    return state


def tuned_rate(result: dict) -> dict | None:
    """The rate of the tuned config as last measured: the last round's baseline when it diagnosed the final
    config, else the last kept experiment's measurement."""
    rounds, kept = result["rounds"], result["kept"]
    if rounds and rounds[-1]["changes"] == kept and rounds[-1]["baseline"]:
        return rounds[-1]["baseline"]
    done = [e for e in result["experiments"] if e["kept"] and "measured_samples_per_s" in e]
    if done:
        return {"samples_per_s": done[-1]["measured_samples_per_s"], "interval": done[-1]["measured_interval"]}
    return rounds[0]["baseline"] if rounds else None


# ------------------------------------------------------------------------------------------ the measuring


def measure(ctx, remedy: dict) -> dict:
    """In an experiment's process (worker.py): ``remedy``'s settings as a short run, measured against its
    prediction (``remedies.verify``), with the measured rate's 90% interval."""
    runs: list[dict] = []

    def recorded(*args, **kwargs) -> dict:
        runs.append(short_run(*args, **kwargs))
        return runs[-1]

    again = None
    if "predicted_bytes_per_rank" not in remedy:
        # the config as it is, measured again right before its change, in this process: judged against the
        # diagnosis's run minutes earlier, one config's rate moved 20% on this shared machine (a stage-0 run
        # read 20% slower than stage 2 and was refused, where the grid measured it 20% faster)
        again = short_run(ctx, "verify-baseline", steps=share_steps(ctx))
    checked = check_remedy(ctx, remedy, recorded)
    if "measured_samples_per_s" in checked:
        checked["measured_interval"] = rate_interval(runs[-1])
        if again is not None:
            checked["baseline_again"] = {"samples_per_s": again["samples_per_s"], "interval": rate_interval(again)}
    return checked


def _on_signal(signum, frame):
    raise Interrupted(signum)


def tune(cfg, *, out: str, budget_s: float = 900.0, base: dict | None = None, config_name: str = "",
         only: list[str] | None = None, diagnose_s: float | None = None, max_experiments: int | None = None,
         memory_budget_mb: float | None = None, say=print) -> dict:
    """Tune ``cfg`` (a TrainConfig) within ``budget_s`` seconds; write ``tuned.toml`` (``base``, the config's
    tree as the user wrote it, default ``cfg.to_dict()``, plus the kept changes), ``tune.json`` (every experiment)
    and each round's diagnosis (``rounds/<k>/``) under ``out``; print the experiments' table; return the result.

    ``diagnose_s``: the most one round's diagnosis may take (default: what is left of the budget); ``only``: the
    diagnosis's experiments (``diagnose``'s); ``max_experiments``: stop after this many verified remedies.
    Raises ``Interrupted`` on SIGINT or SIGTERM, after writing what was measured."""
    if io.protocol(out) == "file":
        out = os.path.abspath(out)
    rounds_dir = io.join(out, "rounds")
    fs, path = io.filesystem(rounds_dir)
    if fs.exists(path):  # an earlier tune's rounds: this one measures afresh (as a diagnosis written again does)
        fs.rm(path, recursive=True)
    base = base if base is not None else cfg.to_dict()
    t0 = time.perf_counter()
    deadline = t0 + budget_s

    def time_left() -> float:
        return deadline - time.perf_counter()

    def current(kept: list[str]):
        return variant(cfg, *kept)

    def diagnose_round(kept: list[str], k: int) -> dict:
        seconds = min(time_left(), diagnose_s or time_left())
        return diagnose(current(kept), out=io.join(rounds_dir, str(k)), budget_s=seconds, only=only,
                        memory_budget_mb=memory_budget_mb, config_name=config_name,
                        say=lambda line: say("  " + line))

    def verify_round(kept: list[str], remedy: dict, diag: dict, k: int) -> dict:
        c = current(kept)
        ctx = context(c, io.join(rounds_dir, str(k)), diag["budget_s"], memory_budget_mb)
        ctx.results = diag["findings"]  # the diagnosis's compute ceiling sets the steps (the baseline's)
        try:
            return run_bounded(f"{__name__}:measure", {**job_for(ctx), "kwargs": {"remedy": remedy}},
                               max(1.0, time_left()), ray=ray_address(c))
        except Exception as e:  # noqa: BLE001 - a remedy that does not run is not kept; the loop goes on
            return {**remedy, "verify_error": f"{type(e).__name__}: {e}"}

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_signal) if main else None
    state: dict = {"kept": [], "experiments": [], "rounds": [], "stopped": ""}
    interrupted = None
    try:
        loop(diagnose_round, verify_round, time_left, max_experiments=max_experiments, say=say, state=state)
    except KeyboardInterrupt as e:
        interrupted = e if isinstance(e, Interrupted) else Interrupted(signal.SIGINT)
        state["stopped"] = f"interrupted by {interrupted}"
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    result = {"config_name": config_name, "budget_s": budget_s, "seconds": time.perf_counter() - t0, **state,
              "start": state["rounds"][0]["baseline"] if state["rounds"] else None, "tuned": tuned_rate(state)}
    result["files"] = write(out, result, base)
    say(table(result))
    say(f"[tune] {summary(result)}")
    say(f"[tune] tuned config: {result['files']['toml']}")
    if interrupted is not None:
        raise interrupted
    return result


# ---------------------------------------------------------------------------------------------- the report


def _rate(r: dict | None) -> str:
    if not r:
        return "-"
    lo, hi = r["interval"]
    return f"{thousands(r['samples_per_s'])} ({thousands(lo)}-{thousands(hi)})"


def table(result: dict) -> str:
    """Every experiment as a text table: the remedy, its settings, predicted, measured with its interval against
    the baseline's, kept or not and why."""
    head = ["#", "round", "remedy", "settings", "baseline samples/s", "predicted", "measured samples/s", "kept", "why"]
    rows = []
    for i, e in enumerate(result["experiments"], 1):
        if "measured_bytes_per_rank" in e:
            predicted = f"{e['predicted_bytes_per_rank'] / 2**20:.1f} MB/rank"
            measured = f"{e['measured_bytes_per_rank'] / 2**20:.1f} MB/rank"
        else:
            predicted = thousands(e["predicted_samples_per_s"]) if "predicted_samples_per_s" in e else "-"
            measured = _rate({"samples_per_s": e["measured_samples_per_s"], "interval": e["measured_interval"]}) \
                if "measured_samples_per_s" in e else "failed"
        rows.append([str(i), str(e["round"]), e["for"], " ".join(e["set"]), _rate(e["baseline"]), predicted,
                     measured, "yes" if e["kept"] else "no", e["why"]])
    if not rows:
        return "[tune] no experiment was verified"
    widths = [max(len(r[j]) for r in [head, *rows]) for j in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*r).rstrip() for r in [head, ["-" * w for w in widths], *rows])


def summary(result: dict) -> str:
    start, tuned = result.get("start"), result.get("tuned")
    gain = (f"{thousands(start['samples_per_s'])} -> {thousands(tuned['samples_per_s'])} samples/s "
            f"({tuned['samples_per_s'] / start['samples_per_s']:.2f}x); " if start and tuned else "")
    kept = ", ".join(result["kept"]) or "nothing"
    return (f"{gain}kept {kept} after {len(result['experiments'])} verified experiment(s) in "
            f"{result['seconds']:.0f} s; stopped: {result['stopped']}")


def write(out: str, result: dict, base: dict) -> dict[str, str]:
    """``tuned.toml`` (the base config plus the kept changes) and ``tune.json`` (every number), each whole or not
    at all."""
    paths = {"toml": io.join(out, "tuned.toml"), "json": io.join(out, "tune.json")}
    comment = ["dutycycle tune" + (f" of {result['config_name']}" if result["config_name"] else "") + ": "
               + (", ".join(result["kept"]) or "no change kept") + ".",
               "Every experiment, predicted against measured: tune.json beside this file."]
    io.write_bytes_atomic(paths["toml"], to_toml(tuned_tree(base, result["kept"]), comment).encode())
    io.write_json_atomic(paths["json"], formats.stamp({**result, "files": paths}))
    return paths

