"""From measured findings to one plain-language verdict: the run's dominant wait, the number behind it, and the
dutycycle setting that addresses it. A pure function of the experiments' results, so it is tested on its own.

The order of questions:

1. memory: does the configured ZeRO stage's model state fit the per-rank budget at all? If not, nothing else
   matters yet: name the least-communicating stage (or offload) that fits.
2. the waits of a running step, as shares of its time: data (waiting on the loader, end to end), communication
   (exposed collectives at N workers, the steps of the end-to-end and scaling runs pooled), checkpoint (stall
   per save), failures (work done again and restarts at the modelled worker count, ``failures.py``). Each share
   carries a 90% interval from its own samples (``noise``). The largest is the verdict when its whole interval
   lies above ``THRESHOLD`` and above every other share's interval; when its interval lies below ``THRESHOLD``
   the run is compute-bound (and the verdict says how close to the ceiling it runs). Otherwise noise decides
   nothing: "balanced" when the largest wait clears the line but another's interval reaches it (both matter,
   their order is in doubt), "inconclusive" when its interval reaches below the line (a wait, or compute), with
   what to measure longer; either names the waits with their numbers rather than flip between them from run to
   run. A step slowed by the loader's CPU use (the contention experiment: the step beside
   the loader against the step alone) is a data cost beside the wait. The layout's host work per step (the
   trainer's step at one worker in the configured layout against the model's bare step: FSDP2's hooks,
   quantizing) is a cost of the same standing: ``layout-bound`` when it is the largest.
3. the whole gap: the run's gap to its compute ceiling (1 - run / ceiling, a share of its step) is the step's
   waits and layout, its host work outside compute (``overhead``) and ``unexplained``, which makes them add up.
   When unexplained is, its whole interval, more than a quarter of a gap of at least ``THRESHOLD``, the verdict
   is ``unexplained``: it says what it measured instead of naming the largest small wait.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dutycycle.engine.numbers import megabytes, share_interval, thousands

from . import noise
from .failures import NO_CHECKPOINT_MARGIN, duration, workers_text
from .parts import (
    NOT_WAITS,
    SHARED,
    STEP_WAITS,
    contention_of,
    contention_share,
    flat_step_s,
    layout_share,
)
from .parts import gap as split_gap
from .projection import comm_measured_at, project

THRESHOLD = 0.2  # a wait taking a fifth of the step is worth removing before anything else
CONTENTION_NAMED = 0.05  # a slowdown beside the loader this large a share of the step is named in the verdict


@dataclass
class Verdict:
    # memory-, data-, communication-, checkpoint-, failure-, layout-bound, balanced, inconclusive, compute-bound,
    # unexplained, unknown
    kind: str
    share: float | None  # the dominant wait's share of the step
    headline: str  # one line: "data-bound: 41% of each step waits on the loader; ..."
    fix: str  # the setting or command that addresses it
    shares: dict  # every measured wait share, and ``unexplained`` (see ``gap``)
    intervals: dict = field(default_factory=dict)  # share name -> [low, high], its 90% interval
    # the run against its compute ceiling: ``share`` (1 - run / ceiling) is data + communication + checkpoint +
    # overhead + unexplained (failures, modelled over wall time, stand beside); ``parts`` splits data into its
    # wait and the step's slowdown beside the loader (contention)
    gap: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def layout_settings(row: dict, configured: dict) -> list[tuple[str, object]]:
    """The config keys and values that select one memory-experiment layout (a row: stage, offload, replica
    groups, tensor-parallel ranks) from the ``configured`` one's: all but the stage only where they differ."""
    out: list[tuple[str, object]] = [("parallel.zero_stage", row["zero_stage"])]
    if row["offload"] != configured.get("offload", False):  # True: host memory; "nvme": the state in files
        out.append(("parallel.offload", {False: "none", True: "optimizer"}.get(row["offload"], row["offload"])))
    if row.get("replicate", 1) != configured.get("replicate", 1):
        out.append(("parallel.replicate", row.get("replicate", 1)))
    if row.get("tensor", 1) != configured.get("tensor", 1):
        out.append(("parallel.tensor", row.get("tensor", 1)))
    return out


def memory_verdict(mem: dict) -> Verdict | None:
    mine = mem["configured"]
    if mine["fits"]:
        return None
    fitting = [r for r in mem["rows"] if r["fits"]]
    stage_name = f"parallel.zero_stage = {mine['zero_stage']}" + \
        ({True: " with offload", "nvme": " with NVMe offload"}.get(mine["offload"], "")) + \
        (f" in {mine['replicate']} replica groups" if mine.get("replicate", 1) > 1 else "") + \
        (f" with tensor parallelism over {mine['tensor']} ranks" if mine.get("tensor", 1) > 1 else "")
    head = (f"memory-bound: {stage_name} holds {megabytes(mine['device_bytes'])} of model state per rank, "
            f"over the budget of {megabytes(mem['budget_bytes'])} ({mem['budget_from']})")
    if fitting:
        best = fitting[0]  # rows go from the least communication (across nodes, then in all) to the most
        setting = " and ".join(f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {v}"
                               for k, v in layout_settings(best, mine))
        fix = f"set {setting}: it holds {megabytes(best['device_bytes'])} per rank"
    else:
        fix = "no ZeRO stage fits: add workers (each stage >= 1 divides the state by their number) or memory"
    return Verdict("memory-bound", None, f"{head}; {fix}", fix, {})


def decide(findings: dict, settings: dict | None = None) -> Verdict:
    """``findings``: experiment name -> its result dict (or ``{"error": ...}``). ``settings``: the diagnosed
    config's own values the fixes depend on (``quant_grads``), so a fix is never one already in effect even when
    the experiment that records it (scaling) did not run; and with ``scale`` (``--scale N``), ``workers`` and
    ``zero_stage``, every share is projected to N workers (``projection.py``) before the verdict is drawn."""
    v = _decide(findings, settings)
    s = settings or {}
    if s.get("scale") and s["scale"] != s.get("workers", 1) and v.shares:
        v.headline += f" [shares projected from {s.get('workers', 1)} to {s['scale']:,} workers]"
    busy, cores = s.get("others_cores"), s.get("cores")
    if busy is not None and cores and busy >= SHARED * cores:
        v.headline += (f" [the machine was shared: other processes took {busy:.1f} of its {cores} cores while it "
                       "measured; figures from a shared machine move between runs]")
    return v


def _decide(findings: dict, settings: dict | None) -> Verdict:
    mem = findings.get("memory") or {}
    if "configured" in mem:
        v = memory_verdict(mem)
        if v is not None:
            return v

    e2e = findings.get("end_to_end") or {}
    run = e2e.get(e2e.get("configured", ""), {}) if "error" not in e2e else {}
    own = {k: v for k, v in (settings or {}).items() if k in ("quant_grads", "inject_comm_ms")}
    scaling = {**own, **(findings.get("scaling") or {})}
    many = scaling.get("many") if scaling.get("applicable", True) and "error" not in scaling else None
    ckpt = findings.get("checkpoint") or {}
    ceiling = (findings.get("compute") or {}).get("samples_per_s")
    loaders = findings.get("loader") or {}
    shares: dict[str, float] = {}
    iv: dict[str, list[float]] = {}  # each share's 90% interval; a figure without samples is its own interval

    def put(name: str, value: float, interval: list[float] | None) -> None:
        lo, hi = interval or (value, value)
        if name in shares:  # two measures of one wait: the larger, bound by bound
            value, lo, hi = max(value, shares[name]), max(lo, iv[name][0]), max(hi, iv[name][1])
        shares[name], iv[name] = value, [lo, hi]

    cont = contention_of(findings)
    parts: dict[str, float] = {}
    if run:
        got = run.get("intervals", {})
        wait = run["data_wait_share"]
        parts["data_wait"] = wait
        # Waiting on the loader understates it when decoding shares the cores with compute (CPU runs): decode
        # threads then slow forward/backward instead. The contention experiment measures that slowdown (the step
        # beside the loader against the step alone); its seconds per step are a data cost beside the wait.
        if cont:
            c, (c_lo, c_hi) = contention_share(cont, run)
            parts["contention"] = c
            w_lo, w_hi = got.get("data_wait_share") or (wait, wait)
            put("data", wait + c, [w_lo + c_lo, min(1.0, w_hi + c_hi)])  # a share: never above the whole step
        else:
            put("data", wait, got.get("data_wait_share"))
        # Without that measurement (an older diagnosis.json, or the experiment not run), the part of the compute
        # ceiling the loader alone cannot feed counts as data pressure.
        rate = loaders.get(e2e.get("configured"))
        if not cont and isinstance(rate, float) and ceiling:
            r_lo, r_hi = (loaders.get("intervals") or {}).get(e2e.get("configured")) or (rate, rate)
            c_lo, c_hi = (findings.get("compute") or {}).get("interval") or (ceiling, ceiling)
            put("data", max(0.0, 1.0 - rate / ceiling), [max(0.0, 1.0 - r_hi / c_lo), max(0.0, 1.0 - r_lo / c_hi)])
        put("checkpoint", run.get("checkpoint_share", 0.0), got.get("checkpoint_share"))
    # communication: the configured run and the scaling experiment's run at N workers make the same exchange,
    # so their steps are pooled into one share and interval (twice the samples: a narrower interval, and not
    # the larger of two noisy figures); with either missing, or without per-step samples, each counts alone
    pooled = noise.pooled_ratio([run, many], "comm") if run and many and run.get("workers", 1) > 1 else None
    if pooled:
        put("communication", pooled[0], pooled[1])
    else:
        if run:
            put("communication", run["comm_share"], run.get("intervals", {}).get("comm_share"))
        if many:
            put("communication", many["comm_share"], many.get("intervals", {}).get("comm_share"))
    mode = "async" if ckpt.get("configured_async") else "sync"
    if ckpt.get("configured_every") and isinstance(ckpt.get(mode), dict) and run:
        # the configured cadence: one stall per `every` steps of the end-to-end step time
        def cadence(stall: float) -> float:
            return stall / (ckpt["configured_every"] * run["step_s"] + stall)

        stall = ckpt[mode]["stall_s_per_save"]
        put("checkpoint", cadence(stall), [cadence(x) for x in ckpt[mode].get("stall_interval") or (stall, stall)])
    fails = findings.get("failures") or {}
    if fails.get("failure_share") is not None:  # redone work and restarts at the modelled worker count
        put("failures", fails["failure_share"], None)
    if run:
        lay = layout_share(findings.get("compute") or {}, run)
        if lay:
            put("layout", *lay)
    gap = split_gap(run, findings.get("compute") or {}, shares, iv, parts)
    settings = settings or {}
    scale, workers = settings.get("scale"), settings.get("workers", 1)
    if scale and scale != workers and shares:  # --scale: every wait at N workers, each by its model

        shares, iv = project(shares, iv, measured_at=workers, comm_measured_at=comm_measured_at(findings, workers),
                             workers=scale, zero_stage=settings.get("zero_stage", 0))
    if not shares:
        failed = [k for k in ("end_to_end", "scaling") if "error" in (findings.get(k) or {})]
        if failed:
            return Verdict("unknown", None, f"the {' and '.join(failed)} experiment failed (see its error above), "
                           "so no wait could be measured", "fix the error and run dutycycle diagnose again", {})
        return Verdict("unknown", None, "the waits of a running step were not measured (the end_to_end and scaling "
                       "experiments did not run)", "run dutycycle diagnose without --only, or with end_to_end", {})

    def named(k: str) -> Verdict:
        if k == "data":
            return _data(shares[k], shares, e2e, run, loaders, ceiling, cont)
        if k == "communication":
            return _comm(shares[k], shares, scaling)
        if k == "failures":
            return _failures(shares[k], shares, fails)
        if k == "layout":
            return _layout(shares[k], shares, findings, settings or {})
        return _checkpoint(shares[k], shares, ckpt)

    waits = {k: v for k, v in shares.items() if k not in NOT_WAITS}
    if not waits:
        return Verdict("unknown", None, "no wait of a running step was measured", "run dutycycle diagnose without "
                       "--only, or with end_to_end", shares, iv, gap)
    kind, share = max(waits.items(), key=lambda kv: kv[1])
    lo = iv[kind][0]
    if gap:  # the step's waits and unexplained add up to the gap (projected with --scale: their sum there)
        whole = sum(shares.get(k, 0.0) for k in (*STEP_WAITS, *NOT_WAITS))
        # beyond its noise, as every share is compared: its whole interval above a quarter of the gap
        if whole >= THRESHOLD and iv["unexplained"][0] > whole / 4:
            return _unexplained(whole, shares, iv, gap, cont, findings, kind, named_fix=lambda k: named(k).fix)
    # compute-bound only when no wait's interval reaches the line (the largest by its point figure may be
    # measured tightly below it while another's interval reaches above: noise, not compute, decides that one)
    if all(iv[k][1] < THRESHOLD for k in waits):
        got = run.get("samples_per_s") if run else None
        frac = (f" ({got / ceiling:.0%} of the compute ceiling of {thousands(ceiling)} samples/s)"
                if got and ceiling else "")
        waits = ", ".join(f"{k} {shares[k]:.0%}" for k in ("data", "communication", "checkpoint", "layout",
                                                             "failures", "overhead", "unexplained") if k in shares)
        head = (f"compute-bound: no wait takes more than {share:.0%} of a step ({waits}); it trains at "
                f"{thousands(got)} samples/s{frac}")
        fix = "a faster model step (larger batch per worker, bf16 on GPU, more devices) is what shortens this run"
        if many and scaling.get("efficiency", 1.0) < 0.7:
            # the workers wait on nothing, yet N of them barely beat one: they share the compute itself (on CPU,
            # the same cores; the compute ceiling per worker assumes each gets its share)
            head += (f"; but {scaling['workers']} workers reach only {scaling['speedup']:.2f}x of one (efficiency "
                     f"{scaling['efficiency']:.0%}) with communication at {many['comm_share']:.0%} of the step: "
                     "they share the same compute")
            fix = ("workers that share one machine's cores do not add compute: put them on separate devices or nodes "
                   "(parallel.num_workers per node = its accelerators), or run one worker with all the cores")
        return Verdict("compute-bound", share, head, fix, shares, iv, gap)

    # another wait whose interval reaches this one's (and the line): noise cannot order them
    rivals = [k for k in waits if k != kind and iv[k][1] >= max(lo, THRESHOLD)]
    if lo >= THRESHOLD and not rivals:
        v = named(kind)
        v.intervals, v.gap = iv, gap
        return v
    v = _balanced(kind, rivals, shares, iv, named, settings.get("budget_s"))
    v.gap = gap
    return v


def _balanced(kind: str, rivals: list[str], shares: dict, iv: dict, named, budget_s: float | None) -> Verdict:
    """No wait stands out beyond noise. When the largest wait's whole interval clears the line, a wait surely
    matters and only their order is in doubt: ``balanced``, naming the level ones with their intervals and each
    one's remedy. When it reaches below the line, the run may as well be compute-bound: ``inconclusive``, with
    what to measure longer."""
    level = [f"{k} {share_interval(shares[k], iv[k])}" for k in (kind, *rivals)]
    fix = "; or ".join(f"for {k}: {named(k).fix}" for k in (kind, *rivals))
    if iv[kind][0] >= THRESHOLD:
        head = f"balanced: {' and '.join(level)} within noise; a longer diagnosis (--budget-s) orders them"
        return Verdict("balanced", shares[kind], f"{head}; {fix}", fix, shares, iv)
    longer = f"--budget-s {2 * budget_s:.0f}" if budget_s else "a larger --budget-s"
    head = (f"inconclusive: {' and '.join(level)} reach both sides of the line of {THRESHOLD:.0%} (a wait worth "
            f"removing, or compute): measure longer ({longer}: more steps narrow every interval), and on a machine "
            "no other work shares")
    return Verdict("inconclusive", shares[kind], f"{head}; if it is a wait, {fix}",
                   f"measure longer ({longer}); {fix}", shares, iv)


def _data(share, shares, e2e, run, loaders, ceiling, cont=None) -> Verdict:
    configured = e2e.get("configured")
    rate = loaders.get(configured)
    c = contention_share(cont, run)[0] if cont else 0.0
    busy = (cont.get("beside") or {}).get("loader") if cont else None
    if c >= CONTENTION_NAMED:  # the step slowed by the loader's CPU use: named first, with the cores it takes
        what = "decoding" if configured == "raw" else f"the {configured} loader"
        cores = f"takes {busy:.1f} of {cont['cores']} cores and " if busy is not None else ""
        head = (f"data-bound: {what} {cores}slows each step by {cont['slowdown']:.0%} ({c:.0%} of the step); "
                f"{run['data_wait_share']:.0%} of each step waits on the loader")
    else:
        head = f"data-bound: {run['data_wait_share']:.0%} of each step waits on the loader"
    head += f" and training reaches {thousands(run['samples_per_s'])} samples/s"
    if ceiling:
        head += f", {run['samples_per_s'] / ceiling:.0%} of its compute ceiling"
    if isinstance(rate, float):
        what = "the raw path decodes" if configured == "raw" else f"the {configured} loader delivers"
        head += f"; {what} at {thousands(rate)} samples/s alone against a compute ceiling of {thousands(ceiling)}"
    if configured == "raw":
        fix = "materialize a cache (dutycycle materialize TABLE CACHE) and train with data.source = 'cache'"
        if loaders.get("cache"):
            fix += f" (the cache reads at {thousands(loaders['cache'])} samples/s here)"
        if c >= CONTENTION_NAMED and cont.get("raw_threads", 1) > 1:
            fix += (f"; or fewer decode threads (data.raw_threads, now {cont['raw_threads']}); or a node with more "
                    "cores, so decoding does not take the step's")
    elif loaders.get("slow_ms"):
        fix = "remove data.slow_ms (the loader is slowed on purpose)"
    elif c >= CONTENTION_NAMED:
        fix = ("a loader that takes fewer cores (data.loader_mode = 'sync' reads in the step's thread, 'memory' "
               "holds the split in RAM) or a node with more cores")
    else:
        fix = ("raise data.prefetch, use data.loader_mode = 'thread' or 'memory', or give workers more CPUs "
               "(parallel.cpus_per_worker)")
    return Verdict("data-bound", share, f"{head}; {fix}", fix, shares)


def _layout(share: float, shares: dict, findings: dict, settings: dict) -> Verdict:
    """The layout's host work per step is the largest cost: name it with the two steps behind it, and the
    setting that removes it (at one worker nothing is sharded or exchanged: stage 0 with no quantizing)."""
    compute = findings.get("compute") or {}
    t, (b, _) = compute["trainer"], flat_step_s(compute)
    against = "at ZeRO stage 0 with nothing quantized" if compute.get("trainer_flat") else "of the bare model"
    head = (f"layout-bound: the trainer's step in its layout ({t['layout']}) takes {t['compute_s'] * 1e3:.1f} ms "
            f"against {b * 1e3:.1f} ms {against} at one worker: {share:.0%} of each step is the layout's own "
            "work (hooks, sharded parameters, quantizing), not the model's")
    if settings.get("workers", 1) == 1:
        fix = ("set parallel.zero_stage = 0, parallel.quant_grads = 'none' and parallel.quant_weights = 'none': "
               "one worker has nothing to shard or exchange" + (" (keep the offload if the model needs it to fit)"
                                                                  if "offload" in t["layout"] else ""))
    else:
        fix = ("a larger batch per worker (data.global_batch_size) spreads the layout's fixed work over more "
               "samples; or a lower ZeRO stage where memory allows (the memory experiment names the stages that fit)")
    return Verdict("layout-bound", share, f"{head}; {fix}", fix, shares)


def _unexplained(whole, shares, iv, gap, cont, findings, kind, named_fix) -> Verdict:
    """The measured waits leave more than a quarter of the gap to the ceiling (``whole``) unexplained: say so,
    with what was measured, instead of naming the largest small wait."""
    u = shares["unexplained"]
    waits = ", ".join(f"{k} {shares[k]:.0%}" for k in (*STEP_WAITS, "overhead") if k in shares)
    head = (f"unexplained: the run trains at {thousands(gap['samples_per_s'])} samples/s, "
            f"{1 - gap['share']:.0%} of its compute ceiling of {thousands(gap['ceiling_samples_per_s'])}; the "
            f"measured waits ({waits}) explain {whole - u:.0%} of the step and {u:.0%} of the {whole:.0%} gap is "
            "unexplained")
    measured = []
    loaders = findings.get("loader") or {}
    rates = [f"{k} {thousands(loaders[k])}" for k in ("raw", "cache", "synthetic", "in_ram")
             if isinstance(loaders.get(k), float)]
    if rates:
        measured.append(f"loader alone {', '.join(rates)} samples/s")
    if cont:
        b, a = cont.get("beside") or {}, cont.get("alone") or {}
        line = f"the step {cont['slowdown']:+.0%} beside the loader"
        if "loader" in b:
            line += f", whose threads took {b['loader']:.1f} of {cont['cores']} cores"
        measured.append(line)
        if "others" in b:  # CPU contention from outside the run: no wait of its own, and no part of the loader's
            measured.append(f"other processes took {max(a.get('others', 0.0), b['others']):.1f} of "
                            f"{cont['cores']} cores while the step ran")
    else:
        measured.append("the step beside the loader was not measured (the contention experiment)")
    head += "; measured: " + "; ".join(measured)
    fix = ("measure again, longer (--budget-s) and on a machine no other work shares: the run's compute was slower "
           "than the ceiling's step by more than the loader's contention explains")
    if shares.get(kind, 0.0) >= THRESHOLD:
        fix += f"; the largest measured wait is {kind} ({shares[kind]:.0%}): {named_fix(kind)}"
    return Verdict("unexplained", u, f"{head}; {fix}", fix, shares, iv, gap)


def _comm(share, shares, scaling) -> Verdict:
    many = scaling.get("many") or {}
    n = scaling.get("workers")
    head = f"communication-bound: {share:.0%} of each step waits on collectives"
    if n:
        sent = megabytes(many.get("bytes_per_step", 0))
        head += (f" at {n} workers (speedup {scaling['speedup']:.2f}x over 1 worker; {sent} sent per step "
                 f"per rank at ZeRO stage {scaling['zero_stage']})")
    q = scaling.get("quantized")
    if q and not scaling.get("inject_comm_ms"):
        fix = (f"set {', '.join(s.replace('=', ' = ') for s in q['settings'])} (and parallel.zero_stage = "
               f"{q['zero_stage']}): measured {q['comm_share']:.0%} of the step in communication, "
               f"{q['samples_per_s'] / max(many.get('samples_per_s', 1e-9), 1e-9):.2f}x the samples/s")
    elif scaling.get("inject_comm_ms"):
        fix = "remove parallel.inject_comm_ms (the exchange is slowed on purpose)"
    else:  # remedies the run does not already use
        fix = ("accumulate more micro-batches per exchange (data.micro_batches) or use a lower ZeRO stage if memory "
               "allows")
        if scaling.get("zero_stage") == 2:  # stage 2 reduce-scatters every micro-batch: accumulating does not help
            fix = ("use ZeRO stage 1 if memory allows (it exchanges gradients once per step; stage 2 reduce-scatters "
                   "every micro-batch to hold 1/W of them)")
        now = scaling.get("quant_grads", "none")
        if now == "none":
            fix += ", or quantized collectives (parallel.quant_grads = 'int8')"
        elif now == "int8":
            fix += ("; gradients are already int8: int4 halves them again (parallel.quant_grads = 'int4' with "
                    "parallel.error_feedback = true)")
    return Verdict("communication-bound", share, f"{head}; {fix}", fix, shares)


def _failures(share, shares, fails) -> Verdict:
    n, every, best = fails["workers"], fails.get("configured_every"), fails.get("recommended_every")
    failures = fails.get("expected_failures")
    expect = (f"{failures:,.1f} failures expected" if failures is not None and failures < 1e6 else
              "so many expected that it practically never finishes")
    head = (f"failure-bound: the job ({fails['job_steps']:,} steps, {duration(fails['job_s'])} of training) at "
            f"{workers_text(n)} meets a failure every {duration(fails['mtbf_s'])}: {expect}, "
            f"{share:.0%} of its time lost to work done again, detection and restart "
            f"(ETTR {fails['ettr']:.1%}{f' with checkpoint.every = {every}' if every else ', no checkpoints'})")
    if best and best != every:
        fix = (f"commit every {best} steps (checkpoint.every = {best}, the {fails['recommended_by']} interval): "
               f"projected ETTR {fails['ettr_recommended']:.1%}")
    elif every and best == 0:  # checkpoints keep less of this job than they cost, or under the margin more
        why = ("the saves cost this job more than the failures they guard against"
               if fails["ettr_recommended"] >= fails["ettr"] else  # recommended here: no checkpoints
               f"checkpoints gain this job under {fails.get('margin', NO_CHECKPOINT_MARGIN) * 100:g} point of ETTR")
        fix = (f"{why}: checkpoint.every = 0 gives a projected ETTR of {fails['ettr_recommended']:.1%} (keep them "
               "where a resume or rollback needs them)")
    else:
        fix = "faster restarts and saves (see the failures experiment)"
    if fails.get("ettr_recommended", 1.0) < 0.97 and fails.get("to_reach_97"):
        fix += f"; {fails['to_reach_97']}"
    return Verdict("failure-bound", share, f"{head}; {fix}", fix, shares)


def _checkpoint(share, shares, ckpt) -> Verdict:
    sync, asyn = ckpt.get("sync") or {}, ckpt.get("async") or {}
    head = f"checkpoint-bound: saving stalls {share:.0%} of the step time"
    if sync and asyn:
        fix = (f"save asynchronously (checkpoint.async = true: {asyn['stall_s_per_save']:.2f} s per save against "
               f"{sync['stall_s_per_save']:.2f} s synchronous) or less often (checkpoint.every)")
    else:
        fix = "save asynchronously (checkpoint.async = true) or less often (checkpoint.every)"
    return Verdict("checkpoint-bound", share, f"{head}; {fix}", fix, shares)
