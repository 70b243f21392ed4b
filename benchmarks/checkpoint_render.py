"""benchmarks/checkpoint.py's block of docs/benchmarks.md (benchmarks/render_docs.py writes it between the page's
render markers): the save rows, the end-to-end costs, the recovery and the peer-memory rows."""

from __future__ import annotations

from benchmarks import docs_format as fmt
from benchmarks.checkpoint_peer import render_peer

CHECKPOINT_LABELS = {"none": "none (no checkpoints)", "sync": "synchronous (`async_save = false`)",
                     "async": "asynchronous (the default)", "sync-throttled": "synchronous, throttled storage",
                     "async-throttled": "asynchronous, throttled storage"}


def signed_secs(x: float) -> str:
    return fmt.secs(x) if x >= 0 else "−" + fmt.secs(-x)


def _cost_ratio(a: float, b: float, target: float | None = None) -> str:
    """Asynchronous over synchronous end-to-end cost, with both costs; a synchronous cost at or below zero means
    checkpoints cost less than the machine's noise, and no ratio is given."""
    costs = f"{signed_secs(a)} against {signed_secs(b)}"
    if b <= 0:
        return f"not measurable ({costs}: within the run-to-run noise)"
    goal = f", target {fmt.times(target)}" if target is not None else ""
    return f"{fmt.times(a / b) if a > 0 else signed_secs(a) + ' (no cost measurable)'} ({costs}{goal})"


def render(d: dict) -> str:
    s = d["settings"]
    rows = {r["name"]: r for r in d["rows"]}
    saved = rows["async"]
    shown = [n for n in CHECKPOINT_LABELS if n in rows and "error" not in rows[n]]
    # the training loop's wall time where the results have it (benchmarks/checkpoint.py's docstring says why);
    # results written before it was recorded have only the whole process's
    loop = all("loop_wall_s" in rows[n] for n in shown)
    wall = "loop_wall_s" if loop else "process_wall_s"
    base = rows["none"][wall]
    throttled = [n for n in shown if n.endswith("-throttled")]
    repeats = s.get("repeats") or 1

    def cost_of(name: str) -> float:
        # the benchmark's own cost (with rounds: the median of each round's cost against that round's run without
        # checkpoints, not a difference of medians); results without it have only the whole process's wall
        r = rows[name]
        return r["overhead_s"] if loop and "overhead_s" in r else r[wall] - base

    caption = (f"A ViT of {saved['num_params'] / 1e6:.1f}M parameters at {s['ranks']} ranks, ZeRO stage {s['stage']}, "
               f"AdamW fp32 ({fmt.nbytes(saved['bytes_per_save'])} of model and optimizer state per save), a save every "
               f"{s['every']} steps over {s['steps']} steps, through the torchrun launcher.")
    if throttled:
        caption += (f" Throttled storage: `checkpoint.dir` on a `throttled://` path whose writes are paced to "
                    f"{s['throttle_mb_s']:g} MB/s for both ranks together (benchmarks/throttle.py).")
    caption += (" End-to-end cost: the row's run wall time minus the run without checkpoints, measured "
                + ("over the training loop (steps, final evaluation and the wait for the last save to commit; "
                   "process start-up left out)." if loop else
                   "over the whole torchrun process (start-up included: these results predate the loop's wall time)."))
    if repeats > 1:
        caption += (f" Every row ran {repeats} times in rounds; each figure is the median over the rounds, and a cost "
                    "the median of each round's cost against that round's run without checkpoints.")
    body = []
    for name in shown:
        r = rows[name]
        has = r["saves"] > 0
        body.append([CHECKPOINT_LABELS[name], fmt.secs(r["stall_s_per_save"]) if has else "-",
                     f"{r['write_mb_per_s'] * 1e6 / 2**20:.0f} MiB/s" if has else "-",
                     fmt.nbytes(r["bytes_per_save"]) if has else "-", fmt.secs(r["step_s_median"]),
                     fmt.secs(r["step_s_median_after_save"]) if has else "-", fmt.secs(r[wall]),
                     signed_secs(cost_of(name)) if has else "-"])
    headers = ["save mode", "stall per save", "write throughput", "bytes per save", "median step",
               "median step after a save", "run wall (training loop)" if loop else "run wall (whole process)",
               "end-to-end cost"]
    ratio = d["ratios"]
    target = d["target"]
    cost = {n: cost_of(n) for n in shown if n != "none"}
    facts = [
        ["asynchronous stall over synchronous stall", f"{fmt.times(ratio['async_stall_vs_sync'])} "
                                                      f"(target {fmt.times(target['async_stall_vs_sync'])})"],
        ["asynchronous end-to-end cost over synchronous", _cost_ratio(cost["async"], cost["sync"])],
    ]
    if loop and "overhead_steps_s" in saved:
        facts.append(["the same, by the sum of step times (stalls and contention, without the last save's drain)",
                      _cost_ratio(saved["overhead_steps_s"], rows["sync"]["overhead_steps_s"])])
    if {"sync-throttled", "async-throttled"} <= set(shown):
        at = rows["async-throttled"]
        facts += [
            ["throttled storage: asynchronous stall over synchronous",
             fmt.times(ratio["async_stall_vs_sync_throttled"])],
            ["throttled storage: asynchronous end-to-end cost over synchronous",
             _cost_ratio(cost["async-throttled"], cost["sync-throttled"],
                         target.get("async_overhead_vs_sync_throttled"))],
            ["throttled storage: saves that waited for the previous one", str(at["waited_for_previous_save"])],
        ]
        if "async_final_save_vs_sync_overhead_throttled" in ratio:
            facts.append(["throttled storage: the asynchronous run's last save and its wait (no policy hides it), "
                          "over the synchronous cost",
                          f"{fmt.secs(at['final_save_s'])}, {fmt.times(ratio['async_final_save_vs_sync_overhead_throttled'])}"])
    facts += [
        ["asynchronous: time in the save call (state dict and hand-off)",
         fmt.secs(saved["stall_s_per_save_in_maybe_save"])],
        ["asynchronous: snapshot copy per save (overlapping the next forward/backward)", fmt.secs(saved["snapshot_s"])],
        ["saves that waited for the previous one", str(saved["waited_for_previous_save"])],
        ["step after an asynchronous save over the median step",
         fmt.times(ratio["async_step_after_save_vs_median_step"])],
    ]
    rec = rows["recovery"]
    recovery = fmt.table(["recovery (whole job SIGKILLed, same command with --resume)", "value"], [
        ["killed after step", str(rec["killed_after_step"])],
        ["resumed from step", str(rec["resumed_from_step"])],
        ["steps lost", str(rec["steps_lost"])],
        ["find, verify and load the checkpoint", fmt.secs(rec["restore_s"])],
        ["from the kill to the first resumed step", fmt.secs(rec["recovery_s"])],
    ])
    blocks = [fmt.para(caption), fmt.table(headers, body), fmt.table(["measured", "value"], facts), recovery]
    if d.get("peer"):
        blocks += render_peer(d["peer"])
    return "\n\n".join([*blocks, fmt.source("checkpoint")])
