"""The rendered blocks of the trainer's measurements: training throughput, the ZeRO stages, ZeRO++, the collectives
and checkpoints (``docs_blocks.BLOCKS`` names every block; the data side's blocks live there)."""

from __future__ import annotations

from benchmarks.docs_format import (
    count,
    elements,
    gbit,
    millis,
    nbytes,
    para,
    pct,
    rate,
    results_file,
    secs,
    sentence,
    source,
    table,
    times,
)


def train(results: dict) -> str:
    d = results_file(results, "train")
    s = d["settings"]
    caption = (f"{count(s['n'])} images at {s['size']}x{s['size']}, global batch {s['batch']}, {s['steps']} steps, "
               f"the demo's CNN at width {s['width']}, Ray Train workers with gloo on a {d['machine']['cpus']}-core "
               "machine.")
    labels = {"cache": "cache", "raw": "raw (decode per step)"}
    rows = [[labels.get(r["source"], r["source"]), str(r["workers"]), rate(r["samples_per_s"]),
             pct(r["time_fractions"]["forward_backward"], 1), pct(r["comm_fraction"], 1),
             pct(r["data_wait_fraction"], 1), pct(r["goodput"])] for r in d["rows"]]
    headers = ["data", "workers", "samples/s", "forward+backward", "communication", "data wait", "goodput"]
    ratio = d["ratios"]
    ratios = table(["ratio (samples/s)", "value"], [
        ["cache over raw, 1 worker", times(ratio["cache_over_raw_1_worker"])],
        ["cache over raw, 2 workers", times(ratio["cache_over_raw_2_workers"])],
        ["2 workers over 1, from the cache", times(ratio["two_over_one_worker_cache"])],
        ["2 workers over 1, raw", times(ratio["two_over_one_worker_raw"])],
    ])
    return "\n\n".join([para(caption), table(headers, rows), ratios, para(sentence(d["notes"])), source("train")])


ZERO_LABELS = {"allreduce-manual": "hand-written all-reduce (baseline)", "stage0-ddp": "stage 0 (DDP)",
               "stage1": "stage 1", "stage2": "stage 2", "stage3": "stage 3", "stage3-offload": "stage 3 + offload"}


def _held(h: dict) -> str:
    return " / ".join(nbytes(h[k]) for k in ("params", "grads", "optimizer"))


def zero(results: dict) -> str:
    d = results_file(results, "zero")
    s = d["settings"]
    n = d["rows"][0]["num_params"]
    caption = (f"A ViT of {n / 1e6:.1f}M parameters (width {s['width']}, {s['depth']} blocks, {s['size']}x{s['size']} "
               f"images), AdamW, fp32, global batch {s['batch']}, {s['steps']} steps with the first {s['skip']} left "
               f"out of the speed; each row its own torchrun job, one process and one thread per rank, on a "
               f"{d['machine']['cpus']}-core machine.")
    # results from before the stage 1 and 2 rows accumulated have no micro_batches: every row took one
    micro = s.get("micro_batches")
    if micro and micro > 1:
        caption += (f" The stage 1 and 2 rows accumulate {micro} micro-batches per optimizer step, where the two "
                    "differ: stage 1 gathers the parameters once per step and keeps them (and the full gradients) "
                    "unsharded across the window, stage 2 gathers them again for every micro-batch; the other rows "
                    "take one micro-batch.")
    else:
        caption += (" Every row takes one micro-batch per step, where stages 1 and 2 run the same torch settings: "
                    "the gap between them is noise.")
    rows = [[str(r["world_size"]), ZERO_LABELS.get(r["name"], r["name"]), str(r.get("micro_batches", 1)),
             f"{r['samples_per_s']:.1f}", pct(r["exposed_comm_share"]), nbytes(sum(r["bytes_sent_per_step"].values())),
             _held(r["held_per_rank"][0]), _held(r["zero_formula"])] for r in d["rows"]]
    headers = ["ranks", "row", "micro-batches", "samples/s", "exposed comm", "sent per step per rank",
               "params / grads / optimizer held by rank 0", "ZeRO formula"]
    parts = [para(caption), table(headers, rows)]
    if any(r.get("offload", "none") != "none" for r in d["rows"]):
        parts.append(para("Stage 3 + offload ran on the CPU, where host memory is the device's memory: the row "
                          "exercises the offload code path and its accounting, and measures no host-device "
                          "transfer and no device memory saved; its speed next to stage 3 is noise plus what the "
                          "offload path costs on the CPU alone."))
    return "\n\n".join([*parts, source("zero")])


def zero_ratios(results: dict) -> str:
    d = results_file(results, "zero")
    ratio = d["ratios"]
    worlds = d["settings"]["worlds"]
    rows = []
    for w in worlds:
        stages = [k for k in ratio if k.endswith(f"_optimizer_bytes_vs_stage0_over_N_{w}ranks")]
        vals = sorted({round(ratio[k], 4) for k in stages})
        rows.append([f"optimizer state per rank, stages 1-3, over stage 0's / {w}",
                     " to ".join(f"{v:.4f}x" for v in vals)])
    for w in worlds:
        rows.append([f"bytes sent, stage 3 over stage 0, {w} ranks",
                     times(ratio[f"stage3_bytes_sent_vs_stage0_{w}ranks"])])
    for w in worlds:  # results from before the stage 1 and 2 rows accumulated do not have it
        if f"stage1_bytes_sent_vs_stage2_{w}ranks" in ratio:
            rows.append([f"bytes sent, stage 1 over stage 2, {d['settings']['micro_batches']} micro-batches, {w} ranks",
                         times(ratio[f"stage1_bytes_sent_vs_stage2_{w}ranks"])])
    pairs = table(
        ["pair", "hand-written all-reduce", "DDP", "DDP / hand-written", "exposed comm, hand-written", "exposed comm, DDP"],
        [[str(i), f"{p['manual_samples_per_s']:.1f}/s", f"{p['ddp_samples_per_s']:.1f}/s", times(p["ratio"]),
          pct(p["manual_exposed_comm_share"]), pct(p["ddp_exposed_comm_share"])]
         for i, p in enumerate(d["stage0_vs_manual_pairs"], 1)],
    )
    median = ratio["stage0_samples_per_s_vs_manual_allreduce_2ranks_median_of_pairs"]
    return "\n\n".join([table(["ratio", "value"], rows),
                        f"Stage 0 against the hand-written all-reduce, 2 ranks, alternating pairs in one run "
                        f"(median {times(median)}):", pairs, source("zero")])


ZEROPP_LABELS = {"stage3": "nothing (gloo's reduce-scatter)",
                 "stage3 fp32 all-to-all": "nothing (fp32 all-to-all reduce-scatter, two hops)",
                 "stage3+qwZ": "qwZ (int8 weight gathers)",
                 "stage3+qgZ-int8": "qgZ (int8 gradients, two hops)",
                 "stage3+hpZ": "hpZ (backward gathers inside the node)",
                 "stage3+qwZ+qgZ-int8": "qwZ + int8 qgZ (what `dutycycle diagnose` names for communication)",
                 "stage3+qwZ+qgZ-int8+hpZ": "qwZ + int8 qgZ + hpZ",
                 "stage3 hybrid": "hybrid sharding: 2 replica groups of 2, fp32 (`parallel.replicate = 2`)",
                 "stage3 tensor 2": "tensor parallelism in each node, stage 3 over 2 data ranks (`parallel.tensor = 2`)",
                 "stage3 no overlap": "nothing, blocking all-gathers",
                 "stage3+qwZ+qgZ-int8+hpZ no overlap": "qwZ + int8 qgZ + hpZ, blocking all-gathers"}
ZEROPP_ALL = "stage3+qwZ+qgZ-int8+hpZ"


def zeropp(results: dict) -> str:
    d = results_file(results, "zeropp")
    s, speed = d["settings"], d["speed"]
    rows, ratios = speed["rows"], speed["ratios"]
    by = {r["name"]: r for r in rows}
    # the headline is against the better fp32 row when the results have both (older results: stage 3 alone)
    key = "speedup_vs_best_fp32" if "best_fp32_row" in ratios else "speedup_vs_stage3"
    base = by[ratios.get("best_fp32_row", "stage3")]
    caption = (f"The ViT of the ZeRO benchmark ({rows[0]['num_params'] / 1e6:.1f}M parameters) at stage 3, 4 ranks "
               f"as two nodes of 2 joined by a {gbit(speed['rate_gbit'])} link, {s['steps']} steps (median step "
               f"of the last {s['steps'] - s['skip']}). Speed-up against the faster of the unquantized rows "
               f"(stage 3 with {ZEROPP_LABELS.get(base['name'], base['name'])}), so that quantization is not "
               "credited with the change of algorithm.")
    body = [[ZEROPP_LABELS.get(r["name"], r["name"]), secs(r["step_s_median"]), f"{r['samples_per_s']:.1f}",
             pct(r["exposed_comm_share"]), nbytes(r["inter_node_bytes_per_step"]),
             times(ratios[f"{r['name']}_{key}"])] for r in rows]
    headers = ["stage 3 with", "step", "samples/s", "exposed comm", "inter-node bytes per step per rank", "speedup"]
    last = by[ZEROPP_ALL]
    cut = (f"{ZEROPP_LABELS[ZEROPP_ALL]} against that row: inter-node bytes "
           f"{times(base['inter_node_bytes_per_step'] / last['inter_node_bytes_per_step'])} fewer, step "
           f"{times(base['step_s_median'] / last['step_s_median'])} shorter")
    if "stage3" in by and key != "speedup_vs_stage3":
        cut += (f" (against gloo's reduce-scatter, an all-reduce underneath: "
                f"{times(ratios[f'{ZEROPP_ALL}_speedup_vs_stage3'])})")
    cut += "."
    overlap = ratios.get(f"{ZEROPP_ALL}_exposed_comm_share_overlap_vs_blocking")
    if overlap is not None:
        cut += (f" Overlapping the all-gathers (prefetched and asynchronous, the default) against blocking ones: "
                f"exposed communication share {times(overlap)} with all three, "
                f"{times(ratios['stage3_exposed_comm_share_overlap_vs_blocking'])} at stage 3 alone.")
    conditions = para(f"Conditions recorded with the results: {d['notes'].strip().rstrip('.')}.")
    return "\n\n".join([para(caption), table(headers, body), para(cut), conditions, source("zeropp")])


def diagnose_comm_prediction(results: dict) -> str:
    """diagnose's communication remedy over the rate-limited link: predicted from the fp32 row, then measured."""
    d = results_file(results, "zeropp")
    p = d["speed"]["ratios"]["diagnose_comm_prediction"]
    by = {r["name"]: r for r in d["speed"]["rows"]}
    fp32 = by["stage3"]
    return "\n\n".join([para(
        f"`python benchmarks/zeropp.py` (root): the ViT at stage 3, 4 ranks as two nodes joined by a "
        f"{gbit(d['speed']['rate_gbit'])} link. Diagnosed run: fp32, {fp32['samples_per_s']:.1f} samples/s with "
        f"{pct(fp32['exposed_comm_share'])} of the step in exposed communication. The remedy "
        f"(`--set {' --set '.join(p['set'])}`) is predicted from {p['from']}: {p['predicted_samples_per_s']:.1f} "
        f"samples/s; measured in the same run: {p['measured_samples_per_s']:.1f} samples/s, "
        f"**{times(p['measured_over_predicted'])} of the prediction** (target: within 15%)."), source("zeropp")])


def zeropp_convergence(results: dict) -> str:
    d = results_file(results, "zeropp")
    s, conv = d["settings"], d["convergence"]
    caption = (f"The demo's CNN (width {s['cnn_width']}) on {s['cnn_size']}x{s['cnn_size']} shape images, 2 ranks, "
               f"stage 3, {s['cnn_steps']} steps of {s['cnn_batch']}:")
    rows = [[r["name"], f"{r['val_loss']:.3g}", times(conv["ratios"][f"{r['name']}_val_loss_vs_fp32"]),
             pct(r["val_accuracy"], 1)] for r in conv["rows"]]
    return "\n\n".join([para(caption), table(["run", "validation loss", "vs fp32", "validation accuracy"], rows),
                        source("zeropp")])


COLLECTIVE_COLUMNS = [("rs_gloo_fp32", "gloo reduce_scatter"), ("rs_fp32_flat", "fp32 all-to-all"),
                      ("rs_int8_flat", "int8"), ("rs_int4_flat", "int4"), ("rs_int8_hier", "int8 two-hop"),
                      ("ag_gloo_fp32", "gloo all-gather"), ("ag_int8", "int8 all-gather")]
COLLECTIVE_CASES = {
    "rs_fp32_flat": "fp32 reduce-scatter (all-to-all)", "rs_bf16_flat": "bf16 reduce-scatter",
    "rs_int8_flat": "int8 reduce-scatter", "rs_int4_flat": "int4 reduce-scatter",
    "rs_fp32_hier": "fp32 reduce-scatter, two hops", "rs_bf16_hier": "bf16 reduce-scatter, two hops",
    "rs_int8_hier": "int8 reduce-scatter, two hops", "rs_int4_hier": "int4 reduce-scatter, two hops",
    "ag_gloo_fp32": "gloo all-gather (fp32)", "ag_bf16": "bf16 all-gather", "ag_int8": "int8 all-gather",
    "rs_gloo_fp32": "gloo reduce_scatter (fp32)",
}


def _link(run: dict) -> str:
    measured = gbit(run["link"]["inter_node_gbit_s"])
    return measured if run["rate_gbit"] else f"unshaped veth ({measured})"


def collectives(results: dict) -> str:
    d = results_file(results, "collectives")
    runs = d["two_nodes"]["runs"]
    rows = []
    for run in runs:
        by = {(r["case"], r["numel"]): r for r in run["rows"]}
        for numel in sorted({r["numel"] for r in run["rows"]}):
            rows.append([_link(run), elements(numel)] + [millis(by[(c, numel)]["wall_ms"]) for c, _ in
                                                          COLLECTIVE_COLUMNS])
    headers = ["link (measured)", "elements"] + [label for _, label in COLLECTIVE_COLUMNS]
    links = table(["link limit", "measured inter-node", "measured intra-node"], [
        [gbit(run["rate_gbit"]) if run["rate_gbit"] else "none", gbit(run["link"]["inter_node_gbit_s"]),
         gbit(run["link"]["intra_node_gbit_s"])] for run in runs])
    caption = (f"4 ranks as two nodes of {d['two_nodes']['ranks_per_node']}, fastest of {d['config']['repeats']} "
               f"calls, one thread per rank, quantization included:")
    return "\n\n".join([links, para(caption), table(headers, rows), source("collectives")])


def collectives_crossover(results: dict) -> str:
    d = results_file(results, "collectives")
    rows = [[COLLECTIVE_CASES.get(c["case"], c["case"]), COLLECTIVE_CASES.get(c["baseline"], c["baseline"]),
             elements(c["numel"]), c["verdict"]] for c in d["two_nodes"]["crossover"]]
    lo, hi = d["two_nodes"]["crossover"][0]["measured_gbit_s"]
    caption = f"Where each collective beats its baseline (a fit over measured links of {gbit(lo)} to {gbit(hi)}):"
    return "\n\n".join([caption, table(["collective", "baseline", "elements", "faster"], rows),
                        source("collectives")])


def collectives_codec(results: dict) -> str:
    d = results_file(results, "collectives")
    rows = [[c["wire"], elements(c["numel"]), f"{c['encode_melem_s']:,.0f}", f"{c['encode_gb_s_of_fp32']:.1f}",
             f"{c['decode_melem_s']:,.0f}", f"{c['decode_sum_melem_s']:,.0f}"] for c in d["codec"]]
    headers = ["wire", "elements", "encode (M elements/s)", "encode (GB/s of fp32)", "decode (M elements/s)",
               "decode and sum 4 senders (M elements/s)"]
    return "\n\n".join([table(headers, rows), source("collectives")])


CHECKPOINT_LABELS = {"none": "none (no checkpoints)", "sync": "synchronous (`async_save = false`)",
                     "async": "asynchronous (the default)", "sync-throttled": "synchronous, throttled storage",
                     "async-throttled": "asynchronous, throttled storage"}


def _signed_secs(x: float) -> str:
    return secs(x) if x >= 0 else "−" + secs(-x)


def _cost_ratio(a: float, b: float, target: float | None = None) -> str:
    """Asynchronous over synchronous end-to-end cost, with both costs; a synchronous cost at or below zero means
    checkpoints cost less than the machine's noise, and no ratio is given."""
    costs = f"{_signed_secs(a)} against {_signed_secs(b)}"
    if b <= 0:
        return f"not measurable ({costs}: within the run-to-run noise)"
    goal = f", target {times(target)}" if target is not None else ""
    return f"{times(a / b) if a > 0 else _signed_secs(a) + ' (no cost measurable)'} ({costs}{goal})"


def checkpoint(results: dict) -> str:
    d = results_file(results, "checkpoint")
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
               f"AdamW fp32 ({nbytes(saved['bytes_per_save'])} of model and optimizer state per save), a save every "
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
        body.append([CHECKPOINT_LABELS[name], secs(r["stall_s_per_save"]) if has else "-",
                     f"{r['write_mb_per_s'] * 1e6 / 2**20:.0f} MiB/s" if has else "-",
                     nbytes(r["bytes_per_save"]) if has else "-", secs(r["step_s_median"]),
                     secs(r["step_s_median_after_save"]) if has else "-", secs(r[wall]),
                     _signed_secs(cost_of(name)) if has else "-"])
    headers = ["save mode", "stall per save", "write throughput", "bytes per save", "median step",
               "median step after a save", "run wall (training loop)" if loop else "run wall (whole process)",
               "end-to-end cost"]
    ratio = d["ratios"]
    target = d["target"]
    cost = {n: cost_of(n) for n in shown if n != "none"}
    facts = [
        ["asynchronous stall over synchronous stall", f"{times(ratio['async_stall_vs_sync'])} "
                                                      f"(target {times(target['async_stall_vs_sync'])})"],
        ["asynchronous end-to-end cost over synchronous", _cost_ratio(cost["async"], cost["sync"])],
    ]
    if loop and "overhead_steps_s" in saved:
        facts.append(["the same, by the sum of step times (stalls and contention, without the last save's drain)",
                      _cost_ratio(saved["overhead_steps_s"], rows["sync"]["overhead_steps_s"])])
    if {"sync-throttled", "async-throttled"} <= set(shown):
        at = rows["async-throttled"]
        facts += [
            ["throttled storage: asynchronous stall over synchronous",
             times(ratio["async_stall_vs_sync_throttled"])],
            ["throttled storage: asynchronous end-to-end cost over synchronous",
             _cost_ratio(cost["async-throttled"], cost["sync-throttled"],
                         target.get("async_overhead_vs_sync_throttled"))],
            ["throttled storage: saves that waited for the previous one", str(at["waited_for_previous_save"])],
        ]
        if "async_final_save_vs_sync_overhead_throttled" in ratio:
            facts.append(["throttled storage: the asynchronous run's last save and its wait (no policy hides it), "
                          "over the synchronous cost",
                          f"{secs(at['final_save_s'])}, {times(ratio['async_final_save_vs_sync_overhead_throttled'])}"])
    facts += [
        ["asynchronous: time in the save call (state dict and hand-off)",
         secs(saved["stall_s_per_save_in_maybe_save"])],
        ["asynchronous: snapshot copy per save (overlapping the next forward/backward)", secs(saved["snapshot_s"])],
        ["saves that waited for the previous one", str(saved["waited_for_previous_save"])],
        ["step after an asynchronous save over the median step",
         times(ratio["async_step_after_save_vs_median_step"])],
    ]
    rec = rows["recovery"]
    recovery = table(["recovery (whole job SIGKILLed, same command again)", "value"], [
        ["killed after step", str(rec["killed_after_step"])],
        ["resumed from step", str(rec["resumed_from_step"])],
        ["steps lost", str(rec["steps_lost"])],
        ["find, verify and load the checkpoint", secs(rec["restore_s"])],
        ["from the kill to the first resumed step", secs(rec["recovery_s"])],
    ])
    return "\n\n".join([para(caption), table(headers, body), table(["measured", "value"], facts), recovery,
                        source("checkpoint")])


# what each layout of the ZeRO++ run serves: making the run fit (state per rank) or making it faster (traffic)
LAYOUT_ROWS = {"stage3": ("stage 3, flat", "fitting: state / W"),
               "stage3+qwZ+qgZ-int8+hpZ": ("stage 3 + qwZ + int8 qgZ + hpZ", "speed, keeping stage 3's fit: "
                                           "quantized bytes across nodes"),
               "stage3 hybrid": ("stage 3, hybrid (2 groups of 2)", "speed, in fp32: state / S, more than "
                                 "flat; only a gradient-shard all-reduce crosses nodes"),
               "stage3 tensor 2": ("stage 3, tensor parallel 2 x data 2", "fitting a layer: a block's working set "
                                   "and activations / T (not counted here), state as flat; stage 3 crosses nodes over "
                                   "W / T ranks, the activation exchanges stay inside")}


def _model_state(r: dict) -> float:
    return max(sum(h[k] for k in ("params", "grads", "optimizer")) for h in r["held_per_rank"])


def layouts(results: dict) -> str:
    """Which setting serves fitting and which serves speed, from the ZeRO++ run's rows (one model, one link)."""
    d = results_file(results, "zeropp")
    speed = d["speed"]
    by = {r["name"]: r for r in speed["rows"]}
    flat = by["stage3"]
    body = [[label, serves, nbytes(_model_state(by[name])), times(_model_state(by[name]) / _model_state(flat)),
             nbytes(by[name]["inter_node_bytes_per_step"]), secs(by[name]["step_s_median"]),
             times(flat["step_s_median"] / by[name]["step_s_median"])]
            for name, (label, serves) in LAYOUT_ROWS.items() if name in by]
    tp = by.get("stage3 tensor 2")
    inside = "" if tp is None else (
        f"The tensor-parallel row's activation exchanges, inside each node: "
        f"{nbytes(sum(tp['tensor_bytes_per_step'].values()))} per step per rank (counted on the first step).")
    caption = (f"Measured in the ZeRO++ run below ({by['stage3']['num_params'] / 1e6:.1f}M-parameter ViT, 4 ranks "
               f"as two nodes of 2, a {gbit(speed['rate_gbit'])} link): model state held per rank (parameters, "
               "gradients, optimizer state; the largest rank) and bytes each rank sends across nodes per step. "
               "Offload (`parallel.offload`) serves fitting on a GPU only, moving state to host memory: its rows "
               "are the ZeRO benchmark's (one node).")
    parts = [para(caption), table(["layout", "serves", "state per rank", "vs flat", "across nodes per step", "step",
                                   "speed-up"], body)]
    return "\n\n".join([*parts, *([para(inside)] if inside else []), source("zeropp")])


OFFLOAD_LABELS = {"none": ("stage 3, no offload", "-"),
                  "optimizer": ("stage 3, host offload (`offload = \"optimizer\"`)", "fitting on a GPU: state in host memory"),
                  "nvme": ("stage 3, NVMe offload (`offload = \"nvme\"`)", "fitting beyond host memory: optimizer state on disk")}


def zero_offload(results: dict) -> str:
    """benchmarks/zero.py's offload rows: host memory per rank and step time, no offload, host and NVMe offload."""
    d = results_file(results, "zero")["offload_memory"]
    rows = [r for r in d["rows"] if "error" not in r]
    first = rows[0]
    body = []
    for r in rows:
        label, serves = OFFLOAD_LABELS[r["offload"]]
        host = r["host_after_steps"]
        body.append([label, serves, nbytes(r["optimizer_state_bytes"]), nbytes(r["optimizer_state_resident_bytes"]),
                     nbytes(host["private"]), nbytes(host["rss"]), nbytes(host["peak_rss"]), secs(r["step_s_median"])])
    world = first["world_size"]
    ratios = d["ratios"]
    caption = (f"A ViT of {first['num_params'] / 1e6:.0f}M parameters (width {first['width']}, depth "
               f"{first['depth']}), AdamW, fp32, stage 3 at {world} ranks on one machine, {first['steps']} steps "
               f"(median of the last {first['steps'] - first['skip']}); rank 0's host memory after its last step, "
               "from the kernel's accounting. On this CPU-only machine host offload keeps the state in the same "
               "RAM as no offload, and the NVMe row's files are on the machine's virtual disk.")
    cut = (f"NVMe offload's optimizer state resident in host memory: "
           f"{times(ratios[f'nvme_resident_optimizer_state_vs_host_offload_{world}ranks'])} host offload's "
           f"(target at most 0.1x); private memory {times(ratios[f'nvme_private_vs_host_offload_{world}ranks'])}; "
           f"its step {times(ratios[f'nvme_step_vs_host_offload_{world}ranks'])} host offload's and "
           f"{times(ratios[f'nvme_step_vs_no_offload_{world}ranks'])} no offload's. Every step reads and writes "
           "the rank's whole state once; this machine's virtual disk absorbs that in its host's cache, so the "
           "figure is a lower bound: a drive of B GB/s adds about 2 x state / B per step.")
    headers = ["layout", "serves", "optimizer state", "of it in host memory", "private", "RSS", "peak RSS", "step"]
    return "\n\n".join([para(caption), table(headers, body), para(cut), source("zero")])
