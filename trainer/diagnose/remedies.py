"""Each remedy a verdict can name, as a config change with the samples/s it should give, predicted from the
measured components; ``dutycycle diagnose --verify`` then runs the top one and records what it gave.

The predictions, each a small model over numbers the experiments measured:

- data (raw -> cache): the step without its data wait and without the slowdown decoding causes beside it (the
  contention experiment), ``samples/s / (1 - wait - contention)``, capped by the cache loader's rate alone (or,
  with no cache of the table yet, by the run's samples held in RAM; --verify then materializes the cache): the
  cache removes the decode, not the compute or the exchange.
- data (fewer decode threads, ``data.raw_threads = 1``): the step's slowdown scaled by the cores decoding takes,
  the raw loader's rate by its cores; the slower of the two.
- data (a larger node): the step at its speed alone, the loader at its rate alone; not a config change (its
  ``set`` is empty and ``node`` names it), so --verify cannot run it.
- communication (fp32 -> int8 collectives): the step's exposed communication scaled by the bytes the quantized
  format sends (8 bits per element plus one fp32 scale per block) against fp32's, the rest of the step unchanged.
- layout (one worker sharded or quantizing -> stage 0, nothing quantized): the step without the layout's work
  beyond the model's bare step (the compute experiment's trainer step against its bare step).
- checkpoint (synchronous -> asynchronous saves): the step time with the asynchronous runs' step in place of the
  synchronous runs' (the checkpoint experiment's, which save every other step: the stall and the background
  write's contention for the cores), spread over ``checkpoint.every`` steps.

Memory (a stage that fits) has no rate to predict (the run does not fit as configured): its prediction is the
model-state bytes per rank at that stage, and --verify reads what the ranks held. Failures predict an ETTR, which
``failures.py`` gives, not a rate a short run could verify.
"""

from __future__ import annotations

import math
from typing import Any

from dutycycle.engine import io
from dutycycle.engine.cache.materialize import materialize
from dutycycle.engine.numbers import megabytes
from dutycycle.engine.transform import TransformSpec

from .context import share_steps
from .parts import compute_share, contention_of, contention_share, flat_step_s, layout_share
from .verdict import layout_settings

CACHE_HERE = "CACHE"  # a raw run without a cache of its table: the remedy's cache, made by --verify (materialize)


def _run(findings: dict) -> dict:
    e2e = findings.get("end_to_end") or {}
    return e2e.get(e2e.get("configured", ""), {}) if "error" not in e2e else {}


def _data_parts(findings: dict) -> tuple[dict, float, float] | None:
    """The configured run, the share of its step spent waiting on the loader, and the share the loader's CPU
    use added to the step (the contention experiment; 0 when not measured)."""
    run = _run(findings)
    if not run:
        return None
    cont = contention_of(findings)
    c = contention_share(cont, run)[0] if cont else 0.0
    return run, run["data_wait_share"], c


def data_remedy(findings: dict) -> dict | None:
    """Raw decoding -> the cache: the step without its data wait and without the slowdown decoding caused
    (contention), capped by the cache loader's rate alone, or, with no cache of this table yet, by the rate of
    the run's own samples held in RAM (no loader of this data beats it; the remedy then materializes one)."""
    got, loaders = _data_parts(findings), findings.get("loader") or {}
    if not got or (findings.get("end_to_end") or {}).get("configured") != "raw":
        return None
    run, wait, c = got
    paths = loaders.get("paths") or {}
    cache, cap_name = loaders.get("cache"), "the cache loader alone"
    if not isinstance(cache, float):
        cache, cap_name = loaders.get("in_ram"), "the run's samples held in RAM"
    if not isinstance(cache, float):
        return None
    free = run["samples_per_s"] / max(1e-9, 1.0 - wait - c)
    without = f"its data wait ({wait:.0%})" + (f" and decoding's slowdown of the step ({c:.0%})" if c else "")
    out = {"for": "data", "set": ["data.source=cache", f"data.cache={paths.get('cache') or CACHE_HERE}"],
           "predicted_samples_per_s": min(free, cache),
           "from": f"the step without {without}: {free:,.0f} samples/s, capped by {cap_name} ({cache:,.0f})"}
    if not paths.get("cache") and paths.get("table"):  # no cache of this table yet: --verify materializes one
        out["materialize"] = {"table": paths["table"], "size": paths.get("size")}
    return out


def decode_threads_remedy(findings: dict) -> dict | None:
    """Fewer decode threads (``data.raw_threads = 1``) when decoding slows the step: the step's slowdown scaled
    by the cores decoding takes (L -> 1: s -> s / L), and the loader's rate alone by its cores (min(threads,
    cores) -> 1); the slower of the step and the loader sets the rate."""
    got, loaders = _data_parts(findings), findings.get("loader") or {}
    cont = contention_of(findings)
    if not got or not cont or cont.get("source") != "raw" or cont.get("raw_threads", 1) <= 1:
        return None
    run, wait, c = got
    taken = (cont.get("beside") or {}).get("loader")
    rate = loaders.get("raw")
    if not c or not taken or taken <= 1.0 or not isinstance(rate, float):
        return None
    step, own, s = run["step_s"], compute_share(run), max(0.0, cont["slowdown"])
    compute = step * own / (1.0 + s)  # the run's compute without decoding beside it
    rest = step * (1.0 - wait - own)  # the step's other parts: exchange, saves, host work
    one = rate / min(cont["raw_threads"], cont["cores"])
    gbs = run["samples_per_s"] * step
    predicted = gbs / max(compute * (1.0 + s / taken) + max(rest, 0.0), gbs / one)
    if predicted <= run["samples_per_s"]:
        return None
    return {"for": "data", "set": ["data.raw_threads=1"], "predicted_samples_per_s": predicted,
            "from": f"decoding's slowdown of the step ({cont['slowdown']:.0%}) scaled by the cores it takes "
                    f"({taken:.1f} -> 1) and the raw loader alone ({rate:,.0f} samples/s on "
                    f"{min(cont['raw_threads'], cont['cores'])} cores) by its cores (-> 1): the slower of the two"}


def node_remedy(findings: dict) -> dict | None:
    """A node with the cores decoding takes added: the step back at its speed alone, the loader at its rate
    alone (which it reached with the cores to itself); the slower of the two. Not a config change: it names
    the node, and --verify cannot run it."""
    got, loaders = _data_parts(findings), findings.get("loader") or {}
    cont = contention_of(findings)
    if not got or not cont or not got[2]:
        return None
    run, wait, c = got
    taken = (cont.get("beside") or {}).get("loader")
    rate = loaders.get(cont.get("source"))
    if not taken or not isinstance(rate, float):
        return None
    gbs = run["samples_per_s"] * run["step_s"]
    step = run["step_s"] * (1.0 - c)  # the slowdown gone; the wait stays unless the loader outpaces the step
    predicted = min(gbs / step, rate) if wait > 0.05 else gbs / step
    if predicted <= run["samples_per_s"]:
        return None
    cores = cont["cores"] + math.ceil(taken)
    return {"for": "data", "set": [], "node": f"a node with {cores} cores (decoding takes {taken:.1f})",
            "predicted_samples_per_s": predicted,
            "from": f"the step without decoding's slowdown ({c:.0%} of it), the loader at its rate alone "
                    f"({rate:,.0f} samples/s)"}


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
    # the whole step's difference between the experiment's asynchronous and synchronous runs (the same data, a
    # save every ``saved_every`` steps), not the stalls alone: a background write also competes with compute for
    # the cores, which shows in the step and not in the stall (on one 2-core worker the stalls alone predicted
    # 1.2-1.3x what async gave)
    saved_every = ckpt.get("every", 2)
    delta = (asyn["step_s"] - sync["step_s"]) * saved_every / every
    step = run["step_s"] + delta
    gbs = run["samples_per_s"] * run["step_s"]
    return {"for": "checkpoint", "set": ["checkpoint.async_save=true"],
            "predicted_samples_per_s": gbs / max(step, 1e-9),
            "from": f"the step with the asynchronous save's step ({asyn['step_s'] * 1e3:.0f} ms, stall "
                    f"{asyn['stall_s_per_save']:.3f} s per save) in place of the synchronous one's "
                    f"({sync['step_s'] * 1e3:.0f} ms, {sync['stall_s_per_save']:.3f} s), a save every {every} steps"}


def compute_remedy(findings: dict) -> dict | None:
    """Workers that share one machine's cores add no compute (the scaling experiment's efficiency below 0.7):
    one worker with all the cores, at the rate the scaling experiment measured for one worker against N, applied
    to the configured run's rate."""
    scaling, run = findings.get("scaling") or {}, _run(findings)
    one, many = scaling.get("one"), scaling.get("many")
    if not run or not one or not many or scaling.get("efficiency", 1.0) >= 0.7 or run.get("workers", 1) < 2:
        return None
    ratio = one["samples_per_s"] / max(many["samples_per_s"], 1e-9)
    flat = ["parallel.replicate=1"] if scaling.get("replicate", 1) != 1 else []  # one worker has no groups
    flat += ["parallel.tensor=1"] if scaling.get("tensor", 1) != 1 else []
    # and nothing to shard or exchange: the layout the scaling experiment's one-worker run had (its rate is the
    # prediction's); kept at stage 2 with int8 gradients, one worker measured 1% slower than the two it replaced
    flat += ["parallel.zero_stage=0", "parallel.quant_grads=none", "parallel.quant_weights=none"]
    return {"for": "compute", "set": ["parallel.num_workers=1", *flat],
            "predicted_samples_per_s": run["samples_per_s"] * ratio,
            "from": f"the configured run's rate times one worker's over {scaling['workers']} workers' in the "
                    f"scaling experiment ({ratio:.2f}x): they share the cores, one has them all"}


def layout_remedy(findings: dict) -> dict | None:
    """One worker in a sharding or quantizing layout -> stage 0 without quantizing: the step without the layout's
    work beyond the model's bare step (the compute experiment's two steps). Nothing is sharded or exchanged at one
    worker, so nothing else changes; at N workers a lower stage changes the exchange too, which this does not
    predict."""
    run, compute = _run(findings), findings.get("compute") or {}
    lay = layout_share(compute, run) if run else None
    t = compute.get("trainer") or {}
    # offload is there to fit the model (one worker shards nothing): not a setting to drop for speed
    if not lay or lay[0] <= 0 or run.get("workers", 1) != 1 or "offload" in t.get("layout", ""):
        return None
    step = run["step_s"] * (1.0 - lay[0])
    return {"for": "layout", "set": ["parallel.zero_stage=0", "parallel.quant_grads=none",
                                     "parallel.quant_weights=none"],
            "predicted_samples_per_s": run["samples_per_s"] * run["step_s"] / max(step, 1e-9),
            "from": f"the step without the layout's work beyond the trainer's flat step ({t['layout']}: "
                    f"{t['compute_s'] * 1e3:.1f} ms against {flat_step_s(compute)[0] * 1e3:.1f} ms at stage 0, "
                    f"{lay[0]:.0%} of the step)"}


def memory_remedy(findings: dict) -> dict | None:
    """The least-sharded stage that fits, with the model-state bytes per rank it should hold (the memory
    experiment's formula); --verify runs it and reads what its ranks held."""
    mem = findings.get("memory") or {}
    mine = mem.get("configured")
    if not mine or mine["fits"]:
        return None
    fitting = [r for r in mem["rows"] if r["fits"]]
    if not fitting:
        return None
    best = fitting[0]
    sets = [f"{k}={v}" for k, v in layout_settings(best, mine)]
    return {"for": "memory", "set": sets, "predicted_bytes_per_rank": best["device_bytes"],
            "from": f"stage {best['zero_stage']}'s parameters, gradients and optimizer state per rank at "
                    f"{mem['workers']} workers, against the budget of {megabytes(mem['budget_bytes'])}"}


def remedies(findings: dict, kind: str) -> list[dict[str, Any]]:
    """The remedies with a prediction (a rate; for memory, the bytes per rank), the verdict's ``kind``'s first."""
    found = [r for r in (data_remedy(findings), decode_threads_remedy(findings), node_remedy(findings),
                         comm_remedy(findings), checkpoint_remedy(findings), memory_remedy(findings),
                         compute_remedy(findings), layout_remedy(findings)) if r]
    top = kind.split("-")[0]
    # the verdict's first; config changes before a node (--verify and tune run the first); a larger gain first
    return sorted(found, key=lambda r: (r["for"] != top, not r["set"], -r.get("predicted_samples_per_s", 0.0)))


def change_text(r: dict) -> str:
    """A remedy's change as a person applies it: its ``--set`` pairs, or the node it needs."""
    return " ".join(f"--set {x}" for x in r["set"]) if r["set"] else r.get("node", "no setting")


def predicted_text(r: dict) -> str:
    """A remedy's prediction as a person reads it."""
    if "predicted_bytes_per_rank" in r:
        return f"{megabytes(r['predicted_bytes_per_rank'])} of model state per rank"
    return f"{r['predicted_samples_per_s']:,.0f} samples/s"


def measured_text(r: dict) -> str | None:
    """What --verify measured, against the prediction; None before it ran."""
    if "measured_bytes_per_rank" in r:
        return f"{megabytes(r['measured_bytes_per_rank'])} per rank ({r['measured_over_predicted']:.2f}x)"
    if "measured_samples_per_s" in r:
        return f"{r['measured_samples_per_s']:,.0f} samples/s ({r['measured_over_predicted']:.2f}x)"
    return None


def verify(ctx, remedy: dict, short_run) -> dict:
    """Run the config with ``remedy``'s settings as a short run (``short_run``: ``experiments.short_run``) and
    record measured against predicted. It takes the steps of the run the prediction came from."""
    sets = list(remedy["set"])
    if remedy.get("materialize"):  # the cache the remedy trains from, materialized into the diagnosis's folder
        m = remedy["materialize"]
        spec = TransformSpec(size=m["size"]) if m.get("size") else TransformSpec()
        cache = materialize(m["table"], io.join(ctx.workdir, "cache"), spec).uri
        sets = [f"data.cache={cache}" if x == f"data.cache={CACHE_HERE}" else x for x in sets]
        remedy = {**remedy, "set": sets}
    got = short_run(ctx, f"verify-{remedy['for']}", *sets, steps=share_steps(ctx))
    if "predicted_bytes_per_rank" in remedy:  # memory: what the most loaded rank held (its model state)
        held = max(sum(r.get(k, 0.0) for k in ("params", "grads", "optimizer")) for r in got["held_per_rank"])
        return {**remedy, "measured_bytes_per_rank": held,
                "measured_over_predicted": held / max(remedy["predicted_bytes_per_rank"], 1e-9)}
    measured = got["samples_per_s"]
    return {**remedy, "measured_samples_per_s": measured,
            "measured_over_predicted": measured / max(remedy["predicted_samples_per_s"], 1e-9)}
