"""Each remedy a verdict can name, as a config change with the samples/s it should give, predicted from the
measured components; ``dutycycle diagnose --verify`` then runs the top one and records what it gave.

The predictions, each a small model over numbers the experiments measured:

- data (raw -> cache): the step without its data wait, ``samples/s / (1 - data wait share)``, capped by the
  cache loader's rate alone: the cache removes the decode, not the compute or the exchange.
- communication (fp32 -> int8 collectives): the step's exposed communication scaled by the bytes the quantized
  format sends (8 bits per element plus one fp32 scale per block) against fp32's, the rest of the step unchanged.
- checkpoint (synchronous -> asynchronous saves): the step time with the asynchronous stall per save in place
  of the synchronous one, spread over ``checkpoint.every`` steps.

Memory (a stage that fits) has no rate to predict: the run does not fit as configured. Failures predict an ETTR,
which ``failures.py`` gives, not a rate a short run could verify.
"""

from __future__ import annotations

from typing import Any


def _run(findings: dict) -> dict:
    e2e = findings.get("end_to_end") or {}
    return e2e.get(e2e.get("configured", ""), {}) if "error" not in e2e else {}


def data_remedy(findings: dict) -> dict | None:
    run, loaders = _run(findings), findings.get("loader") or {}
    if not run or (findings.get("end_to_end") or {}).get("configured") != "raw":
        return None
    cache = loaders.get("cache")
    if not isinstance(cache, float):
        return None
    free = run["samples_per_s"] / max(1e-9, 1.0 - run["data_wait_share"])
    return {"for": "data", "set": ["data.source=cache"], "predicted_samples_per_s": min(free, cache),
            "from": f"the step without its data wait ({free:,.0f} samples/s), capped by the cache loader alone "
                    f"({cache:,.0f})"}


def comm_remedy(findings: dict) -> dict | None:
    scaling = findings.get("scaling") or {}
    many, q = scaling.get("many"), scaling.get("quantized")
    if not many or not q:
        return None
    block = scaling.get("quant_block", 256)  # parallel.quant_block: one fp32 scale per block
    ratio = (8 + 32 / block) / 32  # int8 elements and one fp32 scale per block, against fp32
    run = _run(findings)
    # the configured data's end-to-end run when it exchanges (what --verify runs), else the synthetic one
    base = run if run.get("comm_share", 0.0) > 0 and run.get("workers", 1) > 1 else many
    step = base["step_s"]
    predicted_step = step * (1 - base["comm_share"]) + step * base["comm_share"] * ratio
    gbs = base["samples_per_s"] * step
    return {"for": "communication", "set": [*q["settings"], f"parallel.zero_stage={q['zero_stage']}"],
            "predicted_samples_per_s": gbs / predicted_step,
            "from": f"exposed communication ({base['comm_share']:.0%} of the step) scaled by the bytes int8 sends "
                    f"against fp32 ({ratio:.2f}x)"}


def checkpoint_remedy(findings: dict) -> dict | None:
    ckpt, run = findings.get("checkpoint") or {}, _run(findings)
    sync, asyn, every = ckpt.get("sync"), ckpt.get("async"), ckpt.get("configured_every")
    if not run or not sync or not asyn or not every or ckpt.get("configured_async"):
        return None
    step = run["step_s"] + (asyn["stall_s_per_save"] - sync["stall_s_per_save"]) / every
    gbs = run["samples_per_s"] * run["step_s"]
    return {"for": "checkpoint", "set": ["checkpoint.async_save=true"],
            "predicted_samples_per_s": gbs / max(step, 1e-9),
            "from": f"the step with the asynchronous stall per save ({asyn['stall_s_per_save']:.3f} s) in place of "
                    f"the synchronous one ({sync['stall_s_per_save']:.3f} s), every {every} steps"}


def remedies(findings: dict, kind: str) -> list[dict[str, Any]]:
    """The remedies with a predicted rate, the one for the verdict's ``kind`` first."""
    found = [r for r in (data_remedy(findings), comm_remedy(findings), checkpoint_remedy(findings)) if r]
    top = kind.split("-")[0]
    return sorted(found, key=lambda r: r["for"] != top)


def verify(ctx, remedy: dict, short_run) -> dict:
    """Run the config with ``remedy``'s settings as a short run (``short_run``: ``experiments.short_run``) and
    record measured against predicted."""
    got = short_run(ctx, f"verify-{remedy['for']}", *remedy["set"])
    measured = got["samples_per_s"]
    return {**remedy, "measured_samples_per_s": measured,
            "measured_over_predicted": measured / max(remedy["predicted_samples_per_s"], 1e-9)}
