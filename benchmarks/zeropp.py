"""ZeRO++ in training: the ViT's step at stage 3 over a slow inter-node link, and what quantization costs in accuracy.

    sudo python benchmarks/zeropp.py               # writes benchmarks/results/zeropp.json
    python benchmarks/zeropp.py --quick            # tiny sizes, seconds (the smoke test)

1. Step time (needs root for network namespaces; benchmarks/netns.py): 4 ranks as two "nodes" of 2, whose only
   link is a veth pair rate-limited to ``--rate`` Gbit/s (default 1), intra-node traffic on each namespace's own
   loopback. The ViT of benchmarks/zero.py (~22M parameters) at ZeRO stage 3, fp32, the same synthetic batches;
   rows: no quantization, with gloo's reduce-scatter (an all-reduce underneath: twice the bytes) and with the
   fp32 all-to-all that qgZ uses (``parallel.reduce_scatter = "all_to_all"``, two hops: qgZ's algorithm without
   its quantization); qwZ (int8 weight gathers), qgZ (int8 gradients, two hops), hpZ (backward gathers inside
   the node), and all three. Every row overlaps its all-gathers with compute (``parallel.overlap``, the
   default); the ``no overlap`` rows run stage 3, hpZ and all three with FSDP2's blocking gathers, the same work.
   Figures: steady-state step time and samples/s, exposed communication, bytes per step inside and across
   nodes. Headline: each row's speed-up over stage 3 with the *same reduce-scatter algorithm* (``<row>_speedup``,
   its baseline in ``baseline_of``): gloo's reduce-scatter for stage 3, qwZ, hpZ, hybrid and tensor parallelism,
   the fp32 all-to-all for qgZ's rows, so that no remedy is credited with the change of algorithm. The swap
   itself, the fp32 all-to-all against gloo's reduce-scatter with no quantization in either, is its own figure
   (``reduce_scatter_swap_speedup``); ``<row>_speedup_vs_stage3`` is the two together, against stage 3 as it
   runs by default. Targets: qwZ + int8 qgZ + hpZ at least 2x faster than stage 3 alone; overlap's exposed
   communication share at most 0.7x of the blocking gathers' at equal step work. hpZ's cost, measured: every row
   also times its collectives per kind and phase (benchmarks/zeropp_probe.py, rank 0: the seconds each held the
   training thread), and ``ratios.hpz`` (benchmarks/zeropp_hpz.py) sets each pair of rows that differ only by
   hpZ side by side: the step split into forward gathers and compute, backward gathers (stage 3's across nodes,
   hpZ's ``all_gather_hpz`` inside), the reduce-scatter, the optimizer and the rest, with hpZ's secondary copy
   per forward, its start-up (process groups) and memory. The ``stage3 hybrid`` row is the fp32 alternative to
   quantization: hybrid sharding (``parallel.replicate = 2``: stage 3 inside each node, one all-reduce of the
   gradient shards across), against which the figures set memory held per rank beside step time. The
   ``stage3 tensor 2`` row splits every block over the 2 ranks of each node (``parallel.tensor = 2``, sequence
   parallel) with stage 3 over the 2 data ranks, one per node: its activation exchanges stay inside the node and
   stage 3's gathers cross it over half the ranks. ``diagnose_comm_prediction``: what ``dutycycle diagnose``
   predicts for its communication remedy (int8 gradients and weight gathers) from the fp32 ``stage3`` row,
   against the ``stage3+qwZ+qgZ-int8`` row that applies it (target: within 15%).
2. Convergence (no root needed): the demo's CNN on 32x32 shape images, 2 ranks on loopback, stage 3, the same
   steps and batches: fp32, qwZ + int8 qgZ, qwZ + int4 qgZ, and int4 with error feedback. Figures: validation
   loss and accuracy, and their ratio to fp32 (int8 is expected within 1.05x loss and 1 point of accuracy on
   this data; int4 reported).

Every row runs benchmarks/zero_worker.py (the product's ``Trainer``) in fresh processes (in ``--quick``, the smoke
test's, one launch of each part trains its rows in turn).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":  # run as `python benchmarks/zeropp.py`: the siblings import as `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import docs_format as fmt  # noqa: E402
from benchmarks import zeropp_hpz  # noqa: E402
from benchmarks._common import default_out, machine, read_result, write_result  # noqa: E402
from benchmarks.netns import launch, two_nodes, unavailable  # noqa: E402
from benchmarks.zero_worker import RESULT_PREFIX, ROW_SEPARATOR, VIT_DEFAULTS, VIT_QUICK, WORKER  # noqa: E402

ALL_THREE = ["--quant-weights", "int8", "--quant-grads", "int8", "--hpz"]
SPEED_ROWS = {  # name -> worker flags (all at stage 3, node size 2)
    "stage3": [],
    "stage3 fp32 all-to-all": ["--reduce-scatter", "all_to_all"],
    "stage3+qwZ": ["--quant-weights", "int8"],
    "stage3+qgZ-int8": ["--quant-grads", "int8"],
    "stage3+hpZ": ["--hpz"],
    "stage3+qwZ+qgZ-int8": ["--quant-weights", "int8", "--quant-grads", "int8"],
    "stage3+qwZ+qgZ-int8+hpZ": ALL_THREE,
    "stage3 no overlap": ["--no-overlap"],
    "stage3+hpZ no overlap": ["--hpz", "--no-overlap"],
    "stage3+qwZ+qgZ-int8+hpZ no overlap": [*ALL_THREE, "--no-overlap"],
    "stage3 hybrid": ["--replicate", "2"],
    "stage3 tensor 2": ["--tensor", "2"],
}
# every row's speed-up is against stage 3 with the same reduce-scatter algorithm, so that no remedy is credited
# with the change of algorithm: gloo's reduce-scatter (an all-reduce underneath) or qgZ's all-to-all (two hops;
# in fp32 for the baseline). The swap between the two baselines is its own figure.
BASELINES = {"gloo": "stage3", "all_to_all": "stage3 fp32 all-to-all"}


def reduce_scatter_of(name: str) -> str:
    """The reduce-scatter algorithm a speed row runs: ``"all_to_all"`` (qgZ, or ``parallel.reduce_scatter =
    "all_to_all"``) or ``"gloo"`` (FSDP2's own, over gloo; hybrid sharding's too, inside each group)."""
    flags = SPEED_ROWS[name]
    return "all_to_all" if "--quant-grads" in flags or "all_to_all" in flags else "gloo"


def speedups(by: dict[str, dict]) -> dict:
    """Each measured row's speed-up against the baseline with its own reduce-scatter algorithm
    (``<row>_speedup``, the baseline named in ``baseline_of``), the algorithm swap alone (``reduce_scatter_swap_
    speedup``: the fp32 all-to-all baseline against gloo's, no quantization in either) and, for reference,
    against stage 3 as it runs by default (``<row>_speedup_vs_stage3``: the swap and the remedy together)."""
    ratios: dict = {"baseline_of": {}}
    for name, r in by.items():
        base = by.get(BASELINES[reduce_scatter_of(name)])
        if base is not None:
            ratios["baseline_of"][name] = base["name"]
            ratios[f"{name}_speedup"] = base["step_s_median"] / r["step_s_median"]
    gloo, a2a = (by.get(BASELINES[k]) for k in ("gloo", "all_to_all"))
    if gloo and a2a:
        ratios["reduce_scatter_swap_speedup"] = gloo["step_s_median"] / a2a["step_s_median"]
    if gloo:
        for name, r in by.items():
            ratios[f"{name}_speedup_vs_stage3"] = gloo["step_s_median"] / r["step_s_median"]
    return ratios


CONVERGENCE_ROWS = {
    "fp32": [],
    "qwZ+qgZ-int8": ["--quant-weights", "int8", "--quant-grads", "int8"],
    "qwZ+qgZ-int4": ["--quant-weights", "int8", "--quant-grads", "int4"],
    "qwZ+qgZ-int4+error-feedback": ["--quant-weights", "int8", "--quant-grads", "int4", "--error-feedback"],
}


def _run(net, world: int, rows: list[tuple[list[str], str]], timeout: float) -> list[dict]:
    """Each of ``rows`` (its flags and run directory) at ``world`` ranks, all in one launch that trains them in
    turn (zero_worker.py's ``--next-row``): a result, or an error, per row."""
    argv = [sys.executable, str(WORKER)]
    for i, (flags, run_dir) in enumerate(rows):
        argv += [*([ROW_SEPARATOR] if i else []), "--stage", "3", "--run-dir", run_dir, *flags]
    ranks = launch(net, argv, world, timeout=timeout * len(rows), env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [x for x in ranks[0].stdout.splitlines() if x.startswith(RESULT_PREFIX)]
    if len(lines) != len(rows) or any(r.returncode != 0 for r in ranks):
        error = "\n".join(f"rank {r.rank} exit {r.returncode}: {r.stderr[-3000:]}" for r in ranks)
        return [{"error": error}] * len(rows)
    return [json.loads(line.removeprefix(RESULT_PREFIX)) for line in lines]


def _launches(names: list[str], args) -> list[list[str]]:
    """Which rows share a launch: each its own (fresh processes), or all of them in ``--quick``, where only that
    they run (and their exact bytes) matters: a rank's start, torch's import and its process group, once."""
    return [names] if args.quick and names else [[n] for n in names]


def _vit_shape(args) -> list[str]:
    return ["--model", "vit", "--width", str(args.width), "--depth", str(args.depth), "--heads", str(args.heads),
            "--size", str(args.size), "--batch", str(args.batch), "--steps", str(args.steps), "--skip",
            str(args.skip), "--node-size", "2", "--breakdown"]


def _speed_rows(net, names: list[str], args, workdir: str, tag: str = "") -> list[dict]:
    """Run the named speed rows over ``net`` (4 ranks, two nodes), each in fresh processes (``--quick``: one
    launch)."""
    rows = []
    for group in _launches(names, args):
        got = _run(net, 4, [(_vit_shape(args) + SPEED_ROWS[n], os.path.join(workdir, tag + n)) for n in group],
                   args.timeout)
        for name, r in zip(group, got, strict=True):
            r = {**r, "name": name}
            rows.append(r)
            if "error" in r:
                print(f"{name}: error\n{r['error']}", flush=True)
                continue
            r["inter_node_bytes_per_step"] = r["traffic"]["inter_node_bytes"] / args.steps
            r["bytes_per_step"] = r["traffic"]["bytes"] / args.steps
            print(f"{tag}{name:26s} step {r['step_s_median']:6.2f} s, {r['samples_per_s']:6.1f} samples/s, exposed "
                  f"comm {r['exposed_comm_share']:.0%}, inter-node {r['inter_node_bytes_per_step'] / 2**20:.0f} MB "
                  "per step per rank", flush=True)
    return rows


def speed(args, workdir: str) -> dict:
    why = unavailable()
    if why:
        return {"skipped": why}
    with two_nodes(args.rate) as net:
        rows = _speed_rows(net, [n for n in SPEED_ROWS if not args.rows or n in args.rows], args, workdir)
    by = {r["name"]: r for r in rows if "error" not in r}
    ratios = speedups(by)
    for name in ("stage3", "stage3+qwZ+qgZ-int8+hpZ"):  # overlap: exposed share against the blocking gathers'
        on, off = by.get(name), by.get(f"{name} no overlap")
        if on and off and off["exposed_comm_share"] > 0:
            ratios[f"{name}_exposed_comm_share_overlap_vs_blocking"] = \
                on["exposed_comm_share"] / off["exposed_comm_share"]
    hybrid, quant, flat = by.get("stage3 hybrid"), by.get("stage3+qwZ+qgZ-int8+hpZ"), by.get("stage3")
    if hybrid and quant and flat:  # the fp32 alternative to quantization: step, bytes across nodes, state held
        ratios["hybrid_step_vs_qwZ+qgZ-int8+hpZ"] = hybrid["step_s_median"] / quant["step_s_median"]
        ratios["hybrid_inter_node_bytes_vs_qwZ+qgZ-int8+hpZ"] = \
            hybrid["inter_node_bytes_per_step"] / quant["inter_node_bytes_per_step"]
        ratios["hybrid_held_per_rank_vs_stage3"] = _held(hybrid) / _held(flat)
        ratios["qwZ+qgZ-int8+hpZ_held_per_rank_vs_stage3"] = _held(quant) / _held(flat)
    hpz = zeropp_hpz.hpz_pairs(by)
    if hpz:
        ratios["hpz"] = hpz
    prediction = comm_prediction(by.get("stage3"), by.get("stage3+qwZ+qgZ-int8"))
    if prediction:
        ratios["diagnose_comm_prediction"] = prediction
    tensor = by.get("stage3 tensor 2")
    if tensor and flat:  # tensor parallelism inside each node, stage 3 across: step, bytes, state held
        ratios["tensor_step_vs_stage3"] = tensor["step_s_median"] / flat["step_s_median"]
        ratios["tensor_inter_node_bytes_vs_stage3"] = \
            tensor["inter_node_bytes_per_step"] / flat["inter_node_bytes_per_step"]
        ratios["tensor_held_per_rank_vs_stage3"] = _held(tensor) / _held(flat)
        if hybrid:
            ratios["tensor_step_vs_hybrid"] = tensor["step_s_median"] / hybrid["step_s_median"]
    return {"rate_gbit": args.rate, "rows": rows, "ratios": ratios}


HPZ_PAIR = ("stage3", "stage3+hpZ")


def hpz_rates(args, workdir: str) -> dict:
    """hpZ against stage 3 over other links between the nodes (``--hpz-rates``, Gbit/s; 0: no rate limit, the
    veth pair as fast as each node's loopback): where hpZ starts to pay, with both rows' steps split per
    collective (zeropp_hpz.hpz_pairs)."""
    why = unavailable()
    if why:
        return {"skipped": why}
    out = []
    for rate in args.hpz_rates:
        with two_nodes(rate or None) as net:
            rows = _speed_rows(net, list(HPZ_PAIR), args, workdir, tag=f"{rate:g} Gbit/s: " if rate else "no limit: ")
        by = {r["name"]: r for r in rows if "error" not in r}
        out.append({"rate_gbit": rate or None, "rows": rows, "pairs": zeropp_hpz.hpz_pairs(by)})
    return {"rates": out}


def comm_prediction(fp32: dict | None, quantized: dict | None) -> dict | None:
    """``dutycycle diagnose``'s communication remedy, checked over the link: its prediction (``remedies.
    comm_remedy``, the product's own model) from the fp32 stage-3 row as the diagnosed run, against the row that
    applies what the remedy sets at stage 3 (int8 gradients and int8 weight gathers), measured in the same run."""
    if not fp32 or not quantized:
        return None
    from dutycycle.trainer.config_parallel import ParallelSection
    from dutycycle.trainer.diagnose.remedies import comm_remedy

    many = {"step_s": fp32["step_s_median"], "comm_share": fp32["exposed_comm_share"],
            "samples_per_s": fp32["samples_per_s"]}
    remedy = comm_remedy({"scaling": {"many": many, "quant_block": ParallelSection().quant_block,  # zero.py's
                                      "quantized": {"zero_stage": 3, "settings": ["parallel.quant_grads=int8",
                                                                                  "parallel.quant_weights=int8"]}}})
    assert remedy is not None
    predicted, measured = remedy["predicted_samples_per_s"], quantized["samples_per_s"]
    return {"set": remedy["set"], "from": remedy["from"], "predicted_samples_per_s": predicted,
            "measured_samples_per_s": measured, "measured_over_predicted": measured / predicted,
            "target": "within 15% (0.85 to 1.15)"}


def _held(r: dict) -> float:
    """The most model state any rank held (parameters, gradients, optimizer state)."""
    return max(sum(h[k] for k in ("params", "grads", "optimizer")) for h in r["held_per_rank"])


def convergence(args, workdir: str) -> dict:
    shape = ["--model", "cnn", "--width", str(args.cnn_width), "--depth", "3", "--size", str(args.cnn_size),
             "--batch", str(args.cnn_batch), "--steps", str(args.cnn_steps), "--skip", "1", "--samples",
             str(args.cnn_samples), "--eval-batches", "0", "--lr", "0.005"]
    rows = []
    for group in _launches([n for n in CONVERGENCE_ROWS if not args.rows or n in args.rows], args):
        got = _run(None, 2, [(shape + CONVERGENCE_ROWS[n], os.path.join(workdir, "conv-" + n)) for n in group],
                   args.timeout)
        for name, r in zip(group, got, strict=True):
            rows.append({**r, "name": name})
            if "error" in r:
                print(f"{name}: error\n{r['error']}", flush=True)
            else:
                print(f"{name:30s} val loss {r['val_loss']:.4f}, val accuracy {r['val_accuracy']:.2%}", flush=True)
    by = {r["name"]: r for r in rows if "error" not in r}
    ratios = {}
    if "fp32" in by:
        for name, r in by.items():
            ratios[f"{name}_val_loss_vs_fp32"] = r["val_loss"] / by["fp32"]["val_loss"]
            ratios[f"{name}_val_accuracy_minus_fp32"] = r["val_accuracy"] - by["fp32"]["val_accuracy"]
    return {"rows": rows, "ratios": ratios}


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=1.0, help="inter-node link in Gbit/s (default 1)")
    for name, default in VIT_DEFAULTS.items():  # the ZeRO benchmark's ViT
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--cnn-width", type=int, default=32, help="the demo CNN (default width 32, 3 blocks)")
    p.add_argument("--cnn-size", type=int, default=32)
    p.add_argument("--cnn-batch", type=int, default=128)
    p.add_argument("--cnn-steps", type=int, default=300)
    p.add_argument("--cnn-samples", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--hpz-rates", type=float, nargs="*", default=None,
                   help="also run stage 3 and hpZ over these inter-node links, Gbit/s (0: no limit; default 0, "
                        "none in --quick; with no value, none)")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-convergence", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rows", nargs="+", default=[], choices=[*SPEED_ROWS, *CONVERGENCE_ROWS],
                   help="run only these rows (default: all)")
    p.add_argument("--out", default=default_out("zeropp"))
    p.add_argument("--merge", action="store_true",
                   help="keep the parts skipped (speed, hpz_rates, convergence) from the existing --out file")
    args = p.parse_args(argv)
    if args.hpz_rates is None:  # not in --quick: the smoke test's time
        args.hpz_rates = [] if args.quick else [0.0]
    if args.quick:
        vars(args).update(VIT_QUICK)
        args.cnn_width, args.cnn_size, args.cnn_batch, args.cnn_steps, args.cnn_samples = 8, 16, 32, 6, 256

    return args


def run(args) -> dict:
    result = {"benchmark": "zeropp", "machine": machine(),
              "settings": {k: v for k, v in vars(args).items() if k != "out"}}
    with tempfile.TemporaryDirectory() as workdir:
        if not args.skip_speed:
            result["speed"] = speed(args, workdir)
        if args.hpz_rates and not (args.rows and not set(HPZ_PAIR) <= set(args.rows)):
            result["hpz_rates"] = hpz_rates(args, workdir)
        if not args.skip_convergence:
            result["convergence"] = convergence(args, workdir)
    old = read_result(args.out) if args.merge else {}
    for part in ("speed", "hpz_rates", "convergence"):
        if part not in result and part in old:
            result[part] = old[part]
    return result


# -- the docs' blocks (benchmarks/render_docs.py writes them between a page's render markers) --------------------------


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
                 "stage3+hpZ no overlap": "hpZ, blocking all-gathers",
                 "stage3+qwZ+qgZ-int8+hpZ no overlap": "qwZ + int8 qgZ + hpZ, blocking all-gathers"}


ZEROPP_ALL = "stage3+qwZ+qgZ-int8+hpZ"
RS_LABELS = {"gloo": "gloo's", "all_to_all": "all-to-all"}


def render(d: dict) -> str:
    s, speed = d["settings"], d["speed"]
    rows = speed["rows"]
    by = {r["name"]: r for r in rows}
    # from the rows, not the recorded ratios: results recorded before the baselines were split render right too
    ratios = {**speed["ratios"], **speedups(by)}
    gloo, a2a = by[BASELINES["gloo"]], by[BASELINES["all_to_all"]]
    caption = (f"The ViT of the ZeRO benchmark ({rows[0]['num_params'] / 1e6:.1f}M parameters) at stage 3, 4 ranks "
               f"as two nodes of 2 joined by a {fmt.gbit(speed['rate_gbit'])} link, {s['steps']} steps (median step "
               f"of the last {s['steps'] - s['skip']}). Each speed-up is against stage 3 with the same "
               "reduce-scatter: gloo's (an all-reduce underneath, twice the bytes) or the all-to-all in two hops "
               "that qgZ runs (in fp32 for its baseline), so that no remedy is credited with the change of "
               "algorithm; the change itself is the row between the two groups.")

    def row(r: dict) -> list[str]:
        return [ZEROPP_LABELS.get(r["name"], r["name"]), RS_LABELS[reduce_scatter_of(r["name"])],
                fmt.secs(r["step_s_median"]), f"{r['samples_per_s']:.1f}", fmt.pct(r["exposed_comm_share"]),
                fmt.nbytes(r["inter_node_bytes_per_step"]), fmt.times(ratios[f"{r['name']}_speedup"])]

    def arrow(f, key: str) -> str:
        return f"{f(gloo[key])} to {f(a2a[key])}"

    groups = {k: [r for r in rows if reduce_scatter_of(r["name"]) == k] for k in ("gloo", "all_to_all")}
    swap = ["**the swap alone:** gloo's reduce-scatter to the fp32 all-to-all, no quantization", "both",
            arrow(fmt.secs, "step_s_median"), arrow(lambda x: f"{x:.1f}", "samples_per_s"),
            arrow(fmt.pct, "exposed_comm_share"), arrow(fmt.nbytes, "inter_node_bytes_per_step"),
            fmt.times(ratios["reduce_scatter_swap_speedup"])]
    body = [*map(row, groups["gloo"]), swap, *map(row, groups["all_to_all"])]
    headers = ["stage 3 with", "reduce-scatter", "step", "samples/s", "exposed comm",
               "inter-node bytes per step per rank", "speed-up (same reduce-scatter)"]
    last = by[ZEROPP_ALL]
    cut = (f"{ZEROPP_LABELS[ZEROPP_ALL]} against stage 3 as it runs by default (gloo's reduce-scatter): inter-node "
           f"bytes {fmt.times(gloo['inter_node_bytes_per_step'] / last['inter_node_bytes_per_step'])} fewer, step "
           f"{fmt.times(ratios[f'{ZEROPP_ALL}_speedup_vs_stage3'])} shorter, of which "
           f"{fmt.times(ratios['reduce_scatter_swap_speedup'])} is the swap of algorithm and "
           f"{fmt.times(ratios[f'{ZEROPP_ALL}_speedup'])} the remedies.")
    overlap = ratios.get(f"{ZEROPP_ALL}_exposed_comm_share_overlap_vs_blocking")
    if overlap is not None:
        cut += (f" Overlapping the all-gathers (prefetched and asynchronous, the default) against blocking ones: "
                f"exposed communication share {fmt.times(overlap)} with all three, "
                f"{fmt.times(ratios['stage3_exposed_comm_share_overlap_vs_blocking'])} at stage 3 alone.")
    conditions = fmt.para(f"Conditions recorded with the results: {d['notes'].strip().rstrip('.')}.")
    return "\n\n".join([fmt.para(caption), fmt.table(headers, body), fmt.para(cut), conditions, fmt.source("zeropp")])


def render_hpz(d: dict) -> str:
    """hpZ's cost, measured: benchmarks/zeropp_hpz.py's block."""
    return zeropp_hpz.render(d, ZEROPP_LABELS)


def render_comm_prediction(d: dict) -> str:
    """diagnose's communication remedy over the rate-limited link: predicted from the fp32 row, then measured."""
    p = d["speed"]["ratios"]["diagnose_comm_prediction"]
    by = {r["name"]: r for r in d["speed"]["rows"]}
    fp32 = by["stage3"]
    return "\n\n".join([fmt.para(
        f"`python benchmarks/zeropp.py` (root): the ViT at stage 3, 4 ranks as two nodes joined by a "
        f"{fmt.gbit(d['speed']['rate_gbit'])} link. Diagnosed run: fp32, {fp32['samples_per_s']:.1f} samples/s with "
        f"{fmt.pct(fp32['exposed_comm_share'])} of the step in exposed communication. The remedy "
        f"(`--set {' --set '.join(p['set'])}`) is predicted from {p['from']}: {p['predicted_samples_per_s']:.1f} "
        f"samples/s; measured in the same run: {p['measured_samples_per_s']:.1f} samples/s, "
        f"**{fmt.times(p['measured_over_predicted'])} of the prediction** (target: within 15%)."), fmt.source("zeropp")])


def render_convergence(d: dict) -> str:
    s, conv = d["settings"], d["convergence"]
    caption = (f"The demo's CNN (width {s['cnn_width']}) on {s['cnn_size']}x{s['cnn_size']} shape images, 2 ranks, "
               f"stage 3, {s['cnn_steps']} steps of {s['cnn_batch']}:")
    rows = [[r["name"], f"{r['val_loss']:.3g}", fmt.times(conv["ratios"][f"{r['name']}_val_loss_vs_fp32"]),
             fmt.pct(r["val_accuracy"], 1)] for r in conv["rows"]]
    return "\n\n".join([fmt.para(caption), fmt.table(["run", "validation loss", "vs fp32", "validation accuracy"], rows),
                        fmt.source("zeropp")])


# what each layout of the ZeRO++ run serves: making the run fit (state per rank) or making it faster (traffic)
LAYOUT_ROWS = {"stage3": ("stage 3, flat", "fitting: state / W"),
               "stage3+qwZ+qgZ-int8+hpZ": ("stage 3 + qwZ + int8 qgZ + hpZ", "speed, keeping stage 3's fit: "
                                           "quantized bytes across nodes"),
               "stage3 hybrid": ("stage 3, hybrid (2 groups of 2)", "speed, in fp32: state / S, more than "
                                 "flat; only a gradient-shard all-reduce crosses nodes"),
               "stage3 tensor 2": ("stage 3, tensor parallel 2 x data 2", "fitting a layer: a block's working set "
                                   "and activations / T (not counted here), state as flat; stage 3 crosses nodes over "
                                   "W / T ranks, the activation exchanges stay inside")}


def render_layouts(d: dict) -> str:
    """Which setting serves fitting and which serves speed, from the ZeRO++ run's rows (one model, one link)."""
    speed = d["speed"]
    by = {r["name"]: r for r in speed["rows"]}
    flat = by["stage3"]
    ratios = speedups(by)
    body = [[label, serves, fmt.nbytes(_held(by[name])), fmt.times(_held(by[name]) / _held(flat)),
             fmt.nbytes(by[name]["inter_node_bytes_per_step"]), fmt.secs(by[name]["step_s_median"]),
             fmt.times(ratios[f"{name}_speedup"]), RS_LABELS[reduce_scatter_of(name)]]
            for name, (label, serves) in LAYOUT_ROWS.items() if name in by]
    tp = by.get("stage3 tensor 2")
    inside = "" if tp is None else (
        f"The tensor-parallel row's activation exchanges, inside each node: "
        f"{fmt.nbytes(sum(tp['tensor_bytes_per_step'].values()))} per step per rank (counted on the first step).")
    caption = (f"Measured in the ZeRO++ run below ({by['stage3']['num_params'] / 1e6:.1f}M-parameter ViT, 4 ranks "
               f"as two nodes of 2, a {fmt.gbit(speed['rate_gbit'])} link): model state held per rank (parameters, "
               "gradients, optimizer state; the largest rank) and bytes each rank sends across nodes per step; "
               "speed-ups against flat stage 3 with the same reduce-scatter algorithm (as in benchmarks.md's ZeRO++ "
               "table). "
               "Offload (`parallel.offload`) serves fitting on a GPU only, moving state to host memory: its rows "
               "are the ZeRO benchmark's (one node).")
    parts = [fmt.para(caption), fmt.table(["layout", "serves", "state per rank", "vs flat", "across nodes per step", "step",
                                           "speed-up", "against stage 3 with the reduce-scatter"], body)]
    return "\n\n".join([*parts, *([fmt.para(inside)] if inside else []), fmt.source("zeropp")])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    write_result(args.out, result)
    print(json.dumps({k: v.get("ratios", v) for k, v in result.items() if k in ("speed", "convergence")}, indent=2))
    failed = any("error" in r for part in ("speed", "convergence") for r in result.get(part, {}).get("rows", []))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
