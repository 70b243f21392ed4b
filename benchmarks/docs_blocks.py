"""The rendered blocks of the docs: one function per block, each turning benchmarks/results/*.json into the
markdown between a page's ``<!-- render:NAME -->`` markers (``BLOCKS`` names them). A value missing from a
results file raises (KeyError, IndexError, TypeError), which the renderer reports as a broken block."""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.docs_format import (
    RESULTS,
    command_line,
    count,
    elements,
    gbit,
    mib,
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
    verdict_block,
)


def demo_run(results: dict) -> str:
    d = results_file(results, "demo")
    st, tr, rc = d["stages"], d["training"], d["recovery"]
    hand = d["measured_by_hand"]
    whole, exact = hand["whole_process"], hand["recovery_exact"]
    stages = table(
        ["stage", "seconds"],
        [[name, secs(st[name])] for name in ("synth", "ingest", "curate", "materialize", "train", "diagnose")]
        + [["all stages (`dutycycle demo`)", secs(d["total_s"])],
           [f"whole process, timed by hand: {command_line(whole['command'])}", secs(whole["real_s"])]],
    )
    fr = tr["time_breakdown"]["fractions"]
    order = ["forward_backward", "comm", "optimizer", "eval", "checkpoint", "data_wait", "h2d", "other"]
    labels = {"forward_backward": "forward/backward", "comm": "exposed communication", "h2d": "host-to-device",
              "data_wait": "data wait", "eval": "evaluation"}
    training = table(
        ["training", "value"],
        [["validation accuracy", pct(d["val_accuracy"], 1)],
         ["validation loss", f"{tr['val_loss']:.3g}"],
         ["optimizer steps", count(tr["steps"])],
         ["samples/s (the resumed attempt)", rate(tr["samples_per_s"])],
         ["goodput", pct(tr["goodput"])]]
        + [[f"share of the step: {labels.get(k, k)}", pct(fr[k])] for k in order],
    )
    recovery = table(
        ["recovery", "value"],
        [["rank killed (SIGKILL)", f"rank {rc['killed_rank']} after step {rc['killed_at_step']}"],
         ["resumed from the commit of step", str(rc["resumed_from_step"])],
         ["from the kill to the resumed group's first step", secs(rc["recovery_s"])],
         ["steps trained again", str(rc["steps_lost"])],
         [f"largest per-step loss difference against an uninterrupted run ({count(exact['steps_compared'])} "
          "steps)", f"{exact['max_abs_loss_diff']:g}"],
         ["the uninterrupted run's validation loss", f"{exact['uninterrupted_val_loss']:.3g}"]],
    )
    return "\n\n".join([stages, training, recovery, source("demo")])


def demo_verdict(results: dict) -> str:
    v = results_file(results, "demo")["diagnosis"]["verdict"]
    return "\n\n".join([verdict_block(v["headline"]), para(f"Suggested fix: {v['fix']}."), source("demo")])


def diagnose_example(results: dict) -> str:
    d = results_file(results, "diagnose_example")
    f = d["findings"]
    raw = f["end_to_end"]["raw"]
    rows = [
        ["compute ceiling (one worker, a batch already in place)", f"{rate(f['compute']['samples_per_s'])} samples/s"],
        ["loader alone, raw decode path", f"{rate(f['loader']['raw'])} samples/s"],
        ["end to end, raw", f"{rate(raw['samples_per_s'])} samples/s, step {secs(raw['step_s'])}"],
        ["data-wait share of the step, end to end", pct(raw["data_wait_share"])],
        ["data share the verdict weighs (the larger of the wait and the part of the ceiling the loader alone "
         "cannot feed)", pct(d["verdict"]["shares"]["data"])],
    ]
    return "\n\n".join([verdict_block(d["verdict"]["headline"]), table(["measured", "value"], rows),
                        source("diagnose_example")])


def ingest(results: dict) -> str:
    d = results_file(results, "ingest")
    cols = ["ingest_no_phash", "ingest_phash", "pil_decode_1proc", "pil_decode_pool"]
    headers = ["data", "images", "ingest, no perceptual hash", "ingest (default: with hash)",
               "PIL full decode, 1 process", f"PIL full decode, {d['cpus']} processes",
               "ingest vs the decode pool"]
    rows = []
    for name, ds in d["datasets"].items():
        ips = ds["images_per_s"]
        rows.append([f"`{name}`", count(ds["images"])] + [f"{rate(ips[c])}/s" for c in cols]
                    + [times(ds["ratios"]["ingest_phash_vs_pil_decode_pool"])])
    note = para(f"Runner: {d['runner']}. {sentence(d['note'])}")
    return "\n\n".join([table(headers, rows), note, source("ingest")])


MATERIALIZE_ROWS = {
    "materialize": "`materialize`, native runner (the default)",
    "serial": "hand-written loop, one process",
    "pool": "hand-written loop, process pool",
    "ray": "`materialize`, Ray runner",
}
PLAN_ROWS = {
    "plan_daft": "Daft queries, native runner (what `materialize` runs)",
    "plan_lists": "Python lists per row",
    "plan_daft_ray": "Daft queries, Ray runner",
}


def materialize(results: dict) -> str:
    d = results_file(results, "materialize")
    r = d["rows"]
    build = table(
        ["row", "median", "runs (min-max)", "images/s", "CPU seconds", "shards", "driver peak RSS"],
        [[label, secs(r[k]["seconds"]), f"{min(r[k]['runs_seconds']):.1f}-{max(r[k]['runs_seconds']):.1f} s",
          rate(r[k]["images_per_s"]), f"{r[k]['cpu_s']:.1f}", str(r[k]["shards"]), mib(r[k]["peak_rss_self_mb"])]
         for k, label in MATERIALIZE_ROWS.items() if k in r],
    )
    ratios = d["ratios"]
    line = (f"`materialize` against the loop: {times(ratios['materialize_vs_serial'])}; against the pool: "
            f"{times(ratios['materialize_vs_pool'])} (target {times(d['targets']['materialize_vs_pool'])}). "
            f"Ray's shards byte-identical to the native runner's: "
            f"{'yes' if r['ray']['same_shards_as_native'] else 'no'}.")
    plan = table(
        [f"planning {count(d['config']['plan_rows'])} rows", "median", "runs (min-max)", "driver peak RSS"],
        [[label, secs(r[k]["seconds"]), f"{min(r[k]['runs_seconds']):.1f}-{max(r[k]['runs_seconds']):.1f} s",
          mib(r[k]["peak_rss_self_mb"])] for k, label in PLAN_ROWS.items() if k in r],
    )
    return "\n\n".join([build, para(line), plan, source("materialize")])


FORMAT_LABELS = {"arrow": "Arrow IPC, memory-mapped", "arrow-lz4": "Arrow IPC, lz4",
                 "parquet": "Parquet, uncompressed", "parquet-zstd": "Parquet, zstd"}


def cache_formats(results: dict) -> str:
    d = results_file(results, "cache_formats")
    rows = [[FORMAT_LABELS.get(r["format"], r["format"]), f"{r['size_vs_raw_pixels']:.3f}", rate(r["samples_per_s"]),
             f"{r['vs_ram']:.2f}"] for r in d["rows"]]
    rows.append(["the same samples in one array in RAM", "-", rate(d["ram_samples_per_s"]), "1"])
    return "\n\n".join([table(["format", "size vs raw pixels", "samples/s", "vs in-RAM gather"], rows),
                        source("cache_formats")])


def cache(results: dict) -> str:
    d = results_file(results, "cache")
    r, ratio, tgt, m = d["rows"], d["ratios"], d["targets"], d["materialization"]
    inter = r["interleaved"]
    rows = [
        ["(b) `CacheLoader`, `auto` mode, uint8 out", rate(inter["cache"]["samples_per_s"]),
         rate(r["cache"]["samples_per_s"]), secs(r["cache"]["time_to_first_batch_s"])],
        ["(c) the same split in one array in RAM, same plan and gather", rate(inter["ram"]["samples_per_s"]),
         rate(r["ram"]["samples_per_s"]), secs(r["ram"]["time_to_first_batch_s"])],
        ["(a) torch DataLoader, 2 workers, PIL decode of the JPEGs", "-", rate(r["torch-jpeg"]["samples_per_s"]),
         secs(r["torch-jpeg"]["time_to_first_batch_s"])],
    ]
    reads = table(["loader", "samples/s, alternating epochs in one process", "samples/s, own process",
                   "first batch"], rows)
    ratios = table(["ratio", "value", "target"], [
        ["(b) / (c), alternating epochs", times(ratio["cache_vs_ram"]), times(tgt["cache_vs_ram"])],
        ["(b) / (a)", times(ratio["cache_vs_torch_jpeg"]), times(tgt["cache_vs_torch_jpeg"])],
    ])
    made = table(["materialization", "value"], [
        ["images/s", rate(m["materialize_images_per_s"])],
        ["peak RSS", mib(m["materialize_peak_rss_mb"])],
        ["reusing the existing cache, fresh process (imports included)", secs(m["reuse_s_fresh_process"])],
        ["reusing it again in the same process", secs(m["reuse_s_warm_process"])],
    ])
    return "\n\n".join([reads, ratios, made, source("cache")])


def _loader_rows(d: dict) -> list[dict]:
    return [r for r in d["rows"] if isinstance(r.get("samples_per_s"), (int, float))]


def loader(results: dict) -> str:
    d = results_file(results, "loader")
    data = d["data"]
    shape = "x".join(str(s) for s in d["config"]["sample_shape"])
    formats = ", ".join(f"{count(n)} {k.upper()}" for k, n in data["formats"].items())
    caption = (f"{count(data['n'])} synthetic images ({formats}, {nbytes(data['image_bytes'])}) made into a cache of "
               f"{shape} uint8 samples by {data['cache_writer']}; batch {d['config']['batch_size']}; "
               f"each row in its own process on a {d['machine']['cpus']}-core machine.")
    rows = [[r["group"], r["description"], rate(r["samples_per_s"]), secs(r["time_to_first_batch_s"]),
             mib(r["peak_rss_mb"]), mib(r["peak_private_mb"])] for r in _loader_rows(d)]
    headers = ["group", "loader", "samples/s", "first batch", "peak RSS", "peak private"]
    return "\n\n".join([para(caption), table(headers, rows), source("loader")])


def loader_ratios(results: dict) -> str:
    d = results_file(results, "loader")
    by_name = {r["name"]: r for r in d["rows"]}
    rows = [[f"`{d['config']['primary']}` vs {r['against']}", times(r["value"]), times(r["target"]),
             "yes" if r["met"] else "no"] for r in d["ratios"]]
    inter = by_name["interleaved"]
    rates = ", ".join(f"`{k}` {rate(v)} samples/s" for k, v in inter["samples_per_s"].items())
    auto, thread = by_name["dutycycle-auto"], by_name["dutycycle-thread"]
    batch = d["config"]["batch_size"]
    handoff = batch / thread["samples_per_s"] - batch / auto["samples_per_s"]
    lines = (f"Alternating epochs in one process ({count(inter['epochs_each'])} epochs each): {rates}. "
             f"The prefetch thread's hand-off, when the consumer does no work: {secs(handoff)} per batch "
             f"(`dutycycle-thread` against `dutycycle-auto`, batch {batch}).")
    return "\n\n".join([table(["ratio", "value", "target", "met"], rows), para(lines), source("loader")])


def loader_remote(results: dict) -> str:
    d = results_file(results, "loader")
    # no request column: the recorded counts predate a fix to how ranged fetches were counted
    rows = [[r["description"], secs(r["time_to_first_batch_s"]), nbytes(r["bytes_fetched"]),
             nbytes(r["cache_bytes"]), times(r["bytes_fetched"] / r["cache_bytes"])]
            for r in _loader_rows(d) if "requests" in r]
    headers = ["remote cache", "first batch (cold node)", "fetched", "cache size", "fetched / cache"]
    return "\n\n".join([table(headers, rows), source("loader")])


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
                 "stage3+qwZ+qgZ-int8+hpZ": "qwZ + int8 qgZ + hpZ",
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
    body = []
    for name in shown:
        r = rows[name]
        has = r["saves"] > 0
        body.append([CHECKPOINT_LABELS[name], secs(r["stall_s_per_save"]) if has else "-",
                     f"{r['write_mb_per_s'] * 1e6 / 2**20:.0f} MiB/s" if has else "-",
                     nbytes(r["bytes_per_save"]) if has else "-", secs(r["step_s_median"]),
                     secs(r["step_s_median_after_save"]) if has else "-", secs(r[wall]),
                     _signed_secs(r[wall] - base) if has else "-"])
    headers = ["save mode", "stall per save", "write throughput", "bytes per save", "median step",
               "median step after a save", "run wall (training loop)" if loop else "run wall (whole process)",
               "end-to-end cost"]
    ratio = d["ratios"]
    target = d["target"]
    cost = {n: rows[n][wall] - base for n in shown if n != "none"}
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


def results_index(results: dict) -> str:
    rows = []
    for name in sorted(results):
        d = results[name]
        cpus = (d.get("machine") or {}).get("cpus", d.get("cpus"))
        rows.append([f"[`{name}.json`](../{RESULTS.as_posix()}/{name}.json)", f"{cpus} CPUs" if cpus else "not recorded"])
    return table(["results file", "machine"], rows)


BLOCKS: dict[str, Callable[[dict], str]] = {
    "demo-run": demo_run,
    "demo-verdict": demo_verdict,
    "diagnose-example": diagnose_example,
    "ingest": ingest,
    "materialize": materialize,
    "cache-formats": cache_formats,
    "cache": cache,
    "loader": loader,
    "loader-ratios": loader_ratios,
    "loader-remote": loader_remote,
    "train": train,
    "zero": zero,
    "zero-ratios": zero_ratios,
    "zeropp": zeropp,
    "zeropp-convergence": zeropp_convergence,
    "collectives": collectives,
    "collectives-crossover": collectives_crossover,
    "collectives-codec": collectives_codec,
    "checkpoint": checkpoint,
    "results-index": results_index,
}
