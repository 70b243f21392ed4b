"""Quantized collectives (ZeRO++ qgZ, qwZ) against the same algorithms unquantized: bytes on the wire, wall time.

    python benchmarks/collectives.py            # writes benchmarks/results/collectives.json (~15 min here)
    python benchmarks/collectives.py --quick    # seconds: small sizes, one shaped rate (a smoke test)

Rows, per world size and size (elements of the full, unsharded buffer):

- ``rs_gloo_fp32``: gloo's own reduce_scatter_single, fp32, a reference only (gloo runs an all-reduce
  underneath: about twice the bytes its logical count says).
- ``rs_{fp32,bf16,int8,int4}_{flat,hier}``: ``quantized_reduce_scatter`` with that wire format: one
  all-to-all, or two hops (inside the node, then across nodes, 4 ranks as 2 nodes of 2). The fp32 row is the
  fair baseline: the same all-to-all, summed in the same slabs, without quantization.
- ``ag_gloo_fp32`` (the baseline: gloo's all-gather, what FSDP2 does by default), ``ag_{bf16,int8}``:
  ``quantized_all_gather``.

Each time is the slowest rank's wall time for one call (quantization, exchange, dequantization and summation
included), the fastest of the repeats: other work on this shared machine only ever adds time (the median is
kept beside it). Bytes are what a rank puts on the wire (``Traffic``: packed codes plus
scales), split intra/inter-node. Loopback runs every rank on this machine's loopback (faster than quantization
here). The two-node runs put ranks 0-1 and 2-3 in two network namespaces joined by a veth pair limited with
``tc tbf`` (benchmarks/netns.py; needs root, skipped with the reason otherwise), so only inter-node traffic pays
the slow link; the link rate actually reached is measured with a point-to-point send. The crossover fits
``t = c + k / rate`` per row over the measured link rates and reports the rate below which the quantized row beats
its fp32 baseline. Every rank runs with one thread (4 ranks share 2 cores here).

Not here: the ViT training step at ZeRO stage 3 at 1 Gbit/s with and without qwZ/qgZ/hpZ, which runs these
functions in FSDP2's comm seams (trainer/parallel/comm.py), is benchmarks/zeropp.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as `python benchmarks/collectives.py`: the siblings import as `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import docs_format as fmt  # noqa: E402
from benchmarks._common import (  # noqa: E402
    default_out,
    markdown_table,  # noqa: E402
    write_result,
)
from benchmarks.netns import launch, two_nodes, unavailable  # noqa: E402

M = 1 << 20
WIRE = {"fp32": 32, "bf16": 16, "int8": 8, "int4": 4}
RS_BASELINE, AG_BASELINE = "rs_fp32_flat", "ag_gloo_fp32"


# ---------------------------------------------------------------------------------------- in each rank


def _cases(world: int) -> list[str]:
    rs = [f"rs_{w}_flat" for w in WIRE] + ([f"rs_{w}_hier" for w in WIRE] if world >= 4 else [])
    return ["rs_gloo_fp32", *rs, "ag_gloo_fp32", "ag_bf16", "ag_int8"]


def _probe(world: int, nbytes: int, repeats: int) -> dict:
    """Point-to-point rate from rank 0 to the first rank of the other node (and to rank 1, same node)."""
    import torch
    import torch.distributed as dist

    rank, out = dist.get_rank(), {}
    buf = torch.zeros(nbytes // 4)
    for name, dst in (("inter_node", world // 2), ("intra_node", 1)):
        if dst == world // 2 and name == "intra_node":
            continue  # 2 ranks: rank 1 is on the other node
        times = []
        for _ in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, dst)
                dist.recv(buf[:1], dst)  # the receiver's acknowledgement: the whole buffer arrived
            elif rank == dst:
                dist.recv(buf, 0)
                dist.send(buf[:1], 0)
            times.append(time.perf_counter() - t0)
        t = torch.tensor(times[1:], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[name + "_gbit_s"] = round(nbytes * 8 / float(t.median()) / 1e9, 3)
    return out


def _case_call(case: str, b: dict, topo, hierarchy):
    """``call(traffic=None)``: one collective of ``case`` on the buffers ``b``, counting into ``traffic``."""
    import torch.distributed as dist
    from dutycycle.trainer.parallel.qcollectives import quantized_all_gather, quantized_reduce_scatter

    rank, world, avg = dist.get_rank(), dist.get_world_size(), dist.ReduceOp.AVG
    if case == "rs_gloo_fp32":
        def call(t=None):
            dist.reduce_scatter_single(b["rs_out"], b["rs_in"], op=avg)
            if t is not None:  # logical bytes: what a real reduce-scatter sends, not what gloo does
                t.count("reduce_scatter", 4 * b["rs_out"].numel(), rank, range(world), topo)
    elif case == "ag_gloo_fp32":
        def call(t=None):
            dist.all_gather_single(b["ag_out"], b["ag_in"])
            if t is not None:
                t.count("all_gather", 4 * b["ag_in"].numel(), rank, range(world), topo)
    elif case.startswith("rs_"):
        _, wire, mode = case.split("_")

        def call(t=None):
            quantized_reduce_scatter(b["rs_out"], b["rs_in"], None, avg, bits=WIRE[wire], traffic=t, topology=topo,
                                     hierarchy=hierarchy if mode == "hier" else None)
    else:
        def call(t=None):
            quantized_all_gather(b["ag_out"], b["ag_in"], bits=WIRE[case.split("_")[1]], traffic=t, topology=topo)
    return call


def worker(spec_path: str) -> None:
    import torch
    import torch.distributed as dist
    from dutycycle.trainer.parallel.qcollectives import make_hierarchy
    from dutycycle.trainer.parallel.traffic import Topology, Traffic

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.uniform(world, spec["node_size"])
    hierarchy = make_hierarchy(topo) if world >= 4 else None
    result = {"world": world, "node_size": spec["node_size"], "rows": []}
    if spec.get("probe_bytes"):
        result["link"] = _probe(world, spec["probe_bytes"], spec["repeats"])

    for numel in spec["sizes"]:
        gen = torch.Generator().manual_seed(rank)
        rs_in, rs_out = torch.randn(numel, generator=gen), torch.empty(numel // world)
        ag_in, ag_out = torch.randn(numel // world, generator=gen), torch.empty(numel)
        bufs = {"rs_in": rs_in, "rs_out": rs_out, "ag_in": ag_in, "ag_out": ag_out}
        for case in _cases(world):
            traffic = Traffic()
            call = _case_call(case, bufs, topo, hierarchy)
            call(traffic)  # warm-up, and the one call whose bytes are counted
            times = []
            for _ in range(spec["repeats"]):
                dist.barrier()
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            t = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a collective takes as long as its slowest rank
            d = traffic.to_dict()
            result["rows"].append({
                # the least disturbed repeat: other work on a shared machine only ever adds time
                "case": case, "numel": numel, "wall_ms": round(float(t.min()) * 1e3, 2),
                "wall_ms_median": round(float(t.median()) * 1e3, 2),
                "wall_ms_each": [round(v * 1e3, 2) for v in t.tolist()],
                "bytes_sent": d["bytes"], "inter_node_bytes": d["inter_node_bytes"],
                "intra_node_bytes": d["bytes"] - d["inter_node_bytes"],
            })
        del rs_in, rs_out, ag_in, ag_out, bufs
    dist.destroy_process_group()
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------ the driver


def run_world(world: int, sizes: list[int], repeats: int, net=None, probe_bytes: int = 0,
              timeout: float = 3600) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"sizes": sizes, "repeats": repeats, "node_size": max(1, world // 2), "probe_bytes": probe_bytes,
                "out": os.path.join(tmp, "result.json")}
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        t0 = time.perf_counter()
        ranks = launch(net, [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)], world,
                       timeout=timeout)
        failed = [r for r in ranks if r.returncode != 0]
        if failed or not os.path.exists(spec["out"]):
            tail = (failed[0].stderr if failed else ranks[0].stderr).strip().splitlines()[-8:]
            return {"error": " | ".join(tail)}
        result = json.loads(Path(spec["out"]).read_text())
        result["launch_wall_s"] = round(time.perf_counter() - t0, 1)
    _add_ratios(result["rows"])
    return result


def _add_ratios(rows: list[dict]) -> None:
    by = {(r["case"], r["numel"]): r for r in rows}
    for r in rows:
        base = by[(RS_BASELINE if r["case"].startswith("rs_") else AG_BASELINE, r["numel"])]
        r["bytes_vs_fp32"] = round(r["bytes_sent"] / base["bytes_sent"], 4)
        if base["inter_node_bytes"]:
            r["inter_bytes_vs_fp32"] = round(r["inter_node_bytes"] / base["inter_node_bytes"], 4)
        r["time_vs_fp32"] = round(r["wall_ms"] / base["wall_ms"], 3)
        if r["case"].startswith("rs_"):
            r["time_vs_gloo_rs"] = round(r["wall_ms"] / by[("rs_gloo_fp32", r["numel"])]["wall_ms"], 3)


def _best(repeats: int, fn, *args) -> float:
    """Seconds of the fastest of ``repeats`` calls after a warm-up: the least disturbed run on a shared machine."""
    fn(*args)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times)


def codec_throughput(sizes: list[int], repeats: int) -> list[dict]:
    """Single-thread encode (quantize + pack) and decode rates, and the fused decode-and-sum of 4 senders."""
    import torch
    from dutycycle.trainer.parallel.quant import decode, decode_sum, encode

    torch.set_num_threads(1)
    rows = []
    for numel in sizes:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        for wire in ("bf16", "int8", "int4"):
            bits = WIRE[wire]
            buf = encode(x, bits)
            rows4 = encode(x.view(4, -1), bits)

            te = _best(repeats, encode, x, bits)
            td = _best(repeats, decode, buf, numel, bits)
            ts = _best(repeats, decode_sum, rows4, numel // 4, bits)
            rows.append({
                "wire": wire, "numel": numel,
                "encode_melem_s": round(numel / te / 1e6, 1), "encode_gb_s_of_fp32": round(4 * numel / te / 1e9, 3),
                "decode_melem_s": round(numel / td / 1e6, 1), "decode_sum_melem_s": round(numel / ts / 1e6, 1),
            })
    return rows


def crossover(rates: list[dict]) -> list[dict]:
    """Fit ``t = c + k / rate`` (rate: the measured inter-node Gbit/s) per case and size over the two-node runs;
    the quantized case wins below ``rate* = (k_q - k_b) / (c_b - c_q)`` when it has the higher fixed cost."""
    out = []
    ok = [r for r in rates if "rows" in r and r.get("link", {}).get("inter_node_gbit_s")]
    if len(ok) < 2:
        return out
    measured = sorted(r["link"]["inter_node_gbit_s"] for r in ok)
    series: dict = {}
    for r in ok:
        u = 1.0 / r["link"]["inter_node_gbit_s"]
        for row in r["rows"]:
            series.setdefault((row["case"], row["numel"]), []).append((u, row["wall_ms"]))

    def fit(points):
        us, ts = [p[0] for p in points], [p[1] for p in points]
        mu, mt = statistics.fmean(us), statistics.fmean(ts)
        var = sum((u - mu) ** 2 for u in us)
        k = sum((u - mu) * (t - mt) for u, t in points) / var if var else 0.0
        k = max(k, 0.0)  # less bandwidth never makes a collective faster: a negative slope is noise
        return mt - k * mu, k  # c in ms, k in ms * Gbit/s

    for (case, numel), points in sorted(series.items()):
        base = RS_BASELINE if case.startswith("rs_") else AG_BASELINE
        if case in (base, "rs_gloo_fp32") or (base, numel) not in series:
            continue
        cq, kq = fit(points)
        cb, kb = fit(series[(base, numel)])
        row = {"case": case, "baseline": base, "numel": numel, "fixed_ms": round(cq, 2),
               "ms_per_inv_gbit": round(kq, 2), "baseline_fixed_ms": round(cb, 2),
               "baseline_ms_per_inv_gbit": round(kb, 2), "wins_below_gbit_s": None, "wins_at_every_rate": False,
               "measured_gbit_s": [measured[0], measured[-1]]}  # a crossover outside it is extrapolated
        if kq < kb and cq > cb:  # fewer bytes on the slow link, more fixed work: wins below a rate
            row["wins_below_gbit_s"] = round((kb - kq) / (cq - cb), 2)
            beyond = " (extrapolated)" if row["wins_below_gbit_s"] > measured[-1] else ""
            row["verdict"] = f"below {row['wins_below_gbit_s']} Gbit/s{beyond}"
        elif kq < kb:
            row["wins_at_every_rate"], row["verdict"] = True, "at every rate"
        elif cq < cb:
            row["verdict"] = f"only above {(kq - kb) / (cb - cq):.2f} Gbit/s (cheaper work, more link time)"
        else:
            row["verdict"] = "never"
        out.append(row)
    return out


def table(rows: list[dict]) -> str:
    return markdown_table(
        ["case", "elements", "ms", "vs fp32", "vs gloo rs", "bytes/rank", "inter-node", "bytes vs fp32"],
        [[r["case"], f"{r['numel'] // M}M" if r["numel"] >= M else r["numel"], r["wall_ms"], r["time_vs_fp32"],
          r.get("time_vs_gloo_rs"), r["bytes_sent"], r["inter_node_bytes"], r["bytes_vs_fp32"]] for r in rows])


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat, one shaped rate: seconds")
    p.add_argument("--sizes", default="1,4,16,64", help="loopback sizes, in Mi elements (default 1,4,16,64)")
    p.add_argument("--net-sizes", default="4,16", help="two-node sizes, in Mi elements (default 4,16)")
    p.add_argument("--rates", default="1,10,25,0", help="two-node link rates in Gbit/s, 0 = unshaped veth")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--no-netns", action="store_true", help="skip the two-node rows")
    p.add_argument("--out", default=default_out("collectives"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run(args) -> dict:
    if args.quick:
        sizes, net_sizes, rates, repeats = [1 << 16], [1 << 16], [1.0, 0.0], 1
        codec_sizes, probe = [1 << 18], 1 << 20
    else:
        sizes = [int(float(s) * M) for s in args.sizes.split(",")]
        net_sizes = [int(float(s) * M) for s in args.net_sizes.split(",")]
        rates, repeats = [float(r) for r in args.rates.split(",")], args.repeats
        codec_sizes, probe = sizes, 64 * M
    worlds = [int(w) for w in args.worlds.split(",")]
    t_start = time.perf_counter()
    result: dict = {
        "benchmark": "collectives",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": __import__("torch").__version__, "threads_per_rank": 1},
        "config": {"quick": args.quick, "sizes": sizes, "net_sizes": net_sizes, "rates_gbit": rates,
                   "repeats": repeats, "block": 256},
        "not_measured": ["vit_stage3_step_1gbit: the training step through FSDP2's comm seams is measured by "
                         "benchmarks/zeropp.py (results/zeropp.json)"],
    }
    print("codec throughput (1 thread) ...", flush=True)
    result["codec"] = codec_throughput(codec_sizes, repeats=max(3, repeats))
    result["loopback"] = {}
    for world in worlds:
        print(f"loopback, {world} ranks ...", flush=True)
        result["loopback"][str(world)] = run_world(world, sizes, repeats)
    reason = "skipped (--no-netns)" if args.no_netns else unavailable()
    if reason:
        result["two_nodes"] = {"skipped": reason}
    else:
        runs = []
        for rate in rates:
            print(f"two nodes of 2 ranks, link {rate or 'unshaped'} Gbit/s ...", flush=True)
            with two_nodes(rate or None) as net:
                run = run_world(4, net_sizes, repeats, net=net, probe_bytes=probe)
            run["rate_gbit"] = rate or None
            runs.append(run)
        result["two_nodes"] = {"ranks_per_node": 2, "runs": runs, "crossover": crossover(runs)}
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    return result


def show(result: dict) -> None:
    for world, r in result["loopback"].items():
        print(f"\n### loopback, {world} ranks\n")
        print(table(r["rows"]) if "rows" in r else r)
    for r in result["two_nodes"].get("runs", []):
        print(f"\n### two nodes, link {r['rate_gbit'] or 'unshaped'} Gbit/s (measured {r.get('link')})\n")
        print(table(r["rows"]) if "rows" in r else r)
    for c in result["two_nodes"].get("crossover", []):
        print(f"{c['case']:>14} {c['numel'] // M:>3}M: wins {c['verdict']}")
    if "skipped" in result["two_nodes"]:
        print("two-node rows:", result["two_nodes"]["skipped"])
    print(f"\nmeasured in {result['wall_s']} s")


# -- the docs' blocks (benchmarks/render_docs.py writes them between a page's render markers) --------------------------


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
    measured = fmt.gbit(run["link"]["inter_node_gbit_s"])
    return measured if run["rate_gbit"] else f"unshaped veth ({measured})"


def render(d: dict) -> str:
    runs = d["two_nodes"]["runs"]
    rows = []
    for run in runs:
        by = {(r["case"], r["numel"]): r for r in run["rows"]}
        for numel in sorted({r["numel"] for r in run["rows"]}):
            rows.append([_link(run), fmt.elements(numel)] + [fmt.millis(by[(c, numel)]["wall_ms"]) for c, _ in
                                                          COLLECTIVE_COLUMNS])
    headers = ["link (measured)", "elements"] + [label for _, label in COLLECTIVE_COLUMNS]
    links = fmt.table(["link limit", "measured inter-node", "measured intra-node"], [
        [fmt.gbit(run["rate_gbit"]) if run["rate_gbit"] else "none", fmt.gbit(run["link"]["inter_node_gbit_s"]),
         fmt.gbit(run["link"]["intra_node_gbit_s"])] for run in runs])
    caption = (f"4 ranks as two nodes of {d['two_nodes']['ranks_per_node']}, fastest of {d['config']['repeats']} "
               f"calls, one thread per rank, quantization included:")
    return "\n\n".join([links, fmt.para(caption), fmt.table(headers, rows), fmt.source("collectives")])


def render_crossover(d: dict) -> str:
    rows = [[COLLECTIVE_CASES.get(c["case"], c["case"]), COLLECTIVE_CASES.get(c["baseline"], c["baseline"]),
             fmt.elements(c["numel"]), c["verdict"]] for c in d["two_nodes"]["crossover"]]
    lo, hi = d["two_nodes"]["crossover"][0]["measured_gbit_s"]
    caption = f"Where each collective beats its baseline (a fit over measured links of {fmt.gbit(lo)} to {fmt.gbit(hi)}):"
    return "\n\n".join([caption, fmt.table(["collective", "baseline", "elements", "faster"], rows),
                        fmt.source("collectives")])


def render_codec(d: dict) -> str:
    rows = [[c["wire"], fmt.elements(c["numel"]), f"{c['encode_melem_s']:,.0f}", f"{c['encode_gb_s_of_fp32']:.1f}",
             f"{c['decode_melem_s']:,.0f}", f"{c['decode_sum_melem_s']:,.0f}"] for c in d["codec"]]
    headers = ["wire", "elements", "encode (M elements/s)", "encode (GB/s of fp32)", "decode (M elements/s)",
               "decode and sum 4 senders (M elements/s)"]
    return "\n\n".join([fmt.table(headers, rows), fmt.source("collectives")])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = run(args)
    write_result(args.out, result)
    show(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
