"""The rendered blocks of the docs: one function per block, each turning benchmarks/results/*.json into the
markdown between a page's ``<!-- render:NAME -->`` markers (``BLOCKS`` names them; the trainer's blocks are in
docs_blocks_trainer.py). A value missing from a results file raises (KeyError, IndexError, TypeError), which the
renderer reports as a broken block."""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.docs_blocks_trainer import (
    checkpoint,
    collectives,
    collectives_codec,
    collectives_crossover,
    diagnose_comm_prediction,
    layouts,
    train,
    zero,
    zero_offload,
    zero_ratios,
    zeropp,
    zeropp_convergence,
)
from benchmarks.docs_format import (
    RESULTS,
    command_line,
    count,
    mib,
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
         ["goodput of the training loop (every attempt's kept steps)", pct(tr["goodput"])]]
        + [[f"share of the step: {labels.get(k, k)}", pct(fr[k])] for k in order],
    )
    launch = tr.get("launch")
    if launch:  # every second from launch to exit under a name (trainer/launch/account.py)
        from dutycycle.trainer.launch.account import NAMES
        from dutycycle.trainer.step.timing import JOB_ONE_TIME, PHASES

        sec, lfr = launch["seconds"], launch["fractions"]
        rows = [[f"per step: {NAMES[k]}", secs(sec[k]), pct(lfr[k], 1)] for k in PHASES]
        rows += [[f"once: {NAMES[k]}", secs(sec[k]), pct(lfr[k], 1)] for k in JOB_ONE_TIME]
        rows += [["other (the residue)", secs(sec["other"]), pct(lfr["other"], 1)],
                 ["the job, from launch to exit", secs(launch["wall_s"]), "100%"]]
        training += "\n\n" + table(["the job's time", "seconds", "share"], rows)
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


def diagnose_stability(results: dict) -> str:
    d = results_file(results, "diagnose_stability")
    c = d["config"]
    rows = []
    for k, r in enumerate(d["runs"], 1):
        if "kind" not in r:
            rows.append([str(k), "failed", "-", secs(r["wall_s"])])
            continue
        iv = r.get("intervals", {})
        shares = ", ".join(f"{name} {pct(v)}" + (f" ({pct(iv[name][0])}-{pct(iv[name][1])})" if name in iv else "")
                           for name, v in sorted(r["shares"].items(), key=lambda kv: -kv[1]))
        rows.append([str(k), r["kind"], shares, secs(r["wall_s"])])
    line = (f"`dutycycle diagnose {c['config']} --budget-s {c['budget_s']:g}`, {c['runs']} runs one after another: "
            f"{'the same kind every time' if d['same_kind'] else 'the kind changed between runs'}.")
    return "\n\n".join([para(line), table(["run", "verdict", "shares (90% interval)", "wall time"], rows),
                         source("diagnose_stability")])


def diagnose_accuracy(results: dict) -> str:
    d = results_file(results, "diagnose_accuracy")
    c = d["config"]
    rows = []
    for r in d["cases"]:
        shares = [x["share"] for x in r["runs"] if x.get("share") is not None]
        measured = f"{pct(min(shares))} to {pct(max(shares))}" if shares else "-"
        expected = pct(r["expected_share"]) if r["expected_share"] is not None else "-"
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
            f"baseline step {secs(d['baseline']['step_s'])}, whole benchmark {secs(d['total_s'])}.")
    return "\n\n".join([para(line), table(["cause", "strength", "right cause", "injected share", "measured share",
                                              "largest error (points)", "wait accounted - injected, per step",
                                              "rest of the step / baseline step",
                                              "measured / predicted"], rows),
                         source("diagnose_accuracy")])


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
    "plan_daft": "one bucketing query, then bucket by bucket, native runner (what `materialize` runs)",
    "plan_lists": "Python lists per row",
    "plan_daft_ray": "the same, Ray runner",
    "plan_daft_large": "what `materialize` runs, native runner, the large table",
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
            + (f"Ray's shards byte-identical to the native runner's: "
               f"{'yes' if r['ray']['same_shards_as_native'] else 'no'}." if "ray" in r else
               "The Ray row was not run (`--ray`); tests/engine/test_cache_ray.py checks its shards byte for byte."))
    plan = table(
        ["planning", "table rows", "median", "runs (min-max)", "driver peak RSS"],
        [[label, count(r[k]["rows"]), secs(r[k]["seconds"]),
          f"{min(r[k]['runs_seconds']):.1f}-{max(r[k]['runs_seconds']):.1f} s", mib(r[k]["peak_rss_self_mb"])]
         for k, label in PLAN_ROWS.items() if k in r],
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


def scale(results: dict) -> str:
    d = results_file(results, "scale")
    st = d["settings"]
    caption = (f"{count(st['samples'])} samples in shards of {count(st['shard_samples'])}, {count(st['world_size'])} "
               f"ranks on {count(st['world_size'] // st['ranks_per_node'])} nodes of {st['ranks_per_node']}, global "
               f"batch {count(st['global_batch'])}, {nbytes(st['sample_bytes'])} per sample; ranged reads in "
               f"{nbytes(st['chunk_bytes'])} chunks through a {nbytes(st['cache_bytes'])} chunk cache. Shuffle "
               f"quality from {count(d['quality']['samples'])} samples over two epochs.")
    def blocks(n: int) -> str:
        return "blocks at the cache's chunks" if n == 0 else f"blocks of {count(n)}"

    rows = [[f"{r['name']} ({count(r['partitions'])} partition{'s' if r['partitions'] > 1 else ''}, "
             f"{blocks(r['block_size'])})",
             secs(r["plan_s_per_rank"]), mib(r["plan_peak_mib_per_rank"]), times(r["shards_per_node_vs_ideal"]),
             times(r["disk_copy_vs_share"]), times(r["range_amplification"]), f"{r['reopens_per_batch']:.3g}"]
            for r in d["rows"]]
    headers = ["plan", "plan per rank", "plan memory per rank", "shards per node vs ideal",
               "node-local copy vs share", "range bytes fetched per used", "shard reopens per batch"]
    q = d["quality"]["rows"]
    qrows = [[name, f"{v['batchmate_repeat']:.3g}", f"{v['label_entropy_bits']:.4g}"] for name, v in q.items()]
    return "\n\n".join([para(caption), table(headers, rows),
                         table(["shuffle", "batch-mates met again next epoch", "label entropy per batch (bits)"],
                               qrows), source("scale")])


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
    "diagnose-stability": diagnose_stability,
    "diagnose-accuracy": diagnose_accuracy,
    "diagnose-comm-prediction": diagnose_comm_prediction,
    "ingest": ingest,
    "materialize": materialize,
    "cache-formats": cache_formats,
    "cache": cache,
    "loader": loader,
    "loader-ratios": loader_ratios,
    "loader-remote": loader_remote,
    "scale": scale,
    "train": train,
    "zero": zero,
    "zero-ratios": zero_ratios,
    "zeropp": zeropp,
    "layouts": layouts,
    "zero-offload": zero_offload,
    "zeropp-convergence": zeropp_convergence,
    "collectives": collectives,
    "collectives-crossover": collectives_crossover,
    "collectives-codec": collectives_codec,
    "checkpoint": checkpoint,
    "results-index": results_index,
}
