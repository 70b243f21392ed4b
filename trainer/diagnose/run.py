"""Run the experiments within a time budget, one progress line each; a failed experiment is reported and the
others still run; then decide and write the report."""

from __future__ import annotations

import time
import traceback

from dutycycle.engine import io

from .experiments import EXPERIMENTS, Context
from .report import describe, write
from .verdict import decide


def diagnose(cfg, *, out: str, budget_s: float = 300.0, memory_budget_mb: float | None = None,
             only: list[str] | None = None, say=print, config_name: str = "") -> dict:
    """Diagnose ``cfg`` (a TrainConfig); write ``diagnosis.json/.png/.html`` under ``out``; return the result.

    ``budget_s`` bounds the whole diagnosis: measuring loops get a share of it and short training runs take
    fewer steps when it is small; an experiment that would start after the budget is spent is skipped (said so).
    ``only``: run just these experiments (names as in ``experiments.EXPERIMENTS``)."""
    from dutycycle.engine.errors import ConfigError

    names = [k for k, _, _ in EXPERIMENTS]
    unknown = sorted(set(only or []) - set(names))
    if unknown:
        raise ConfigError(f"--only {','.join(unknown)}: unknown experiment; choose from {', '.join(names)}")
    if io.protocol(out) == "file":
        import os

        out = os.path.abspath(out)
    ctx = Context(cfg=cfg, workdir=io.join(out, "runs"), seconds=max(1.0, min(5.0, budget_s / 40)),
                  steps=12 if budget_s >= 180 else 8,
                  memory_budget_bytes=int(memory_budget_mb * 2**20) if memory_budget_mb else None)
    chosen = [(k, t, f) for k, t, f in EXPERIMENTS if not only or k in only]
    deadline = time.perf_counter() + budget_s
    findings = ctx.results  # later experiments read earlier ones' results (scaling reads end_to_end)
    for i, (key, title, fn) in enumerate(chosen, 1):
        tag = f"[diagnose] {i}/{len(chosen)} {title}"
        if time.perf_counter() > deadline:
            res = {"skipped": f"the budget of {budget_s:.0f} s was spent (raise --budget-s)"}
        else:
            say(f"{tag} ...")
            t0 = time.perf_counter()
            try:
                res = fn(ctx)
            except Exception as e:  # noqa: BLE001 - one experiment's failure is reported; the others still run
                res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
            res["seconds"] = time.perf_counter() - t0
        findings[key] = res
        say(f"{tag}: {describe(key, res)}")
    verdict = decide(findings)
    result = {"config_name": config_name, "budget_s": budget_s, "findings": findings,
              "verdict": verdict.to_dict()}
    result["files"] = write(out, result)
    say(f"[diagnose] verdict: {verdict.headline}")
    say(f"[diagnose] report: {result['files']['html']}")
    return result
