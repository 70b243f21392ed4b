"""Quantized collectives on real gloo process groups (2 and 4 ranks): results against the exact float64 sum within
the derived bounds, flat against hierarchical, the all-gather's identical weights, bytes on the wire, and error
feedback. One spawn per world size; every rank runs all checks and returns numbers, asserted here."""

from __future__ import annotations

import hashlib

import pytest
import torch
from dutycycle.engine.errors import ConfigError
from dutycycle.trainer.parallel.qcollectives import node_layout
from dutycycle.trainer.parallel.traffic import Topology

from ..support.harness import run_distributed

N = 1000  # elements per rank's output chunk: not a multiple of the 256-element block
STEPS = 20  # error-feedback repetitions
E = {8: 1 / 254, 4: 1 / 14}  # per-quantization error over the block's absmax
# Tolerance on the bound ratios. Quantization in fp32 exceeds its real-arithmetic bound by a factor of at most
# 1 + 3e-5 (tests/trainer/test_quant.py: slack). Summing W dequantized fp32 values adds at most (W-1) U sum|v| with
# sum|v| <= W A (1 + e), i.e. relative to the bound W e A at most W U (1 + e) / e <= 4 * 6e-8 * 255 = 6e-5 (int8,
# W=4); AVG's division adds U. Two hops double it. 2e-4 covers all.
TOL = 1 + 2e-4


def rank_input(r: int, world: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank r's reduce-scatter input (world x N), deterministic so every rank can rebuild everyone's: normal
    values whose magnitude spans 10^-3..10^1 across blocks, with a few heavy-tailed outliers. In float64 the
    values use all 53 bits (an fp32 cast changes every one of them)."""
    gen = torch.Generator().manual_seed(1000 + r)
    x = torch.randn(world * N, generator=gen, dtype=torch.float64)
    x *= 10 ** torch.empty(world * N // 64 + 1, dtype=torch.float64).uniform_(-3, 1, generator=gen).repeat_interleave(64)[: world * N]
    x[torch.randint(0, world * N, (5,), generator=gen)] *= 100.0
    return x.to(dtype)


def blockwise_absmax(t: torch.Tensor, block: int = 256) -> torch.Tensor:
    """Per-element absmax of the element's block (last dim, float64)."""
    t = t.double()
    n = t.shape[-1]
    nb = -(-n // block)
    padded = torch.nn.functional.pad(t.abs(), (0, nb * block - n)).view(*t.shape[:-1], nb, block)
    return padded.amax(-1).repeat_interleave(block, dim=-1)[..., :n]


def _max_ratio(err: torch.Tensor, bound: torch.Tensor) -> float:
    return float((err.double() / bound.clamp_min(1e-300)).max())


def _collective_checks(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from dutycycle.trainer.parallel.qcollectives import (
        make_hierarchy,
        quantized_all_gather,
        quantized_reduce_scatter,
    )
    from dutycycle.trainer.parallel.quant import dequantize, quantize
    from dutycycle.trainer.parallel.traffic import Topology, Traffic

    torch.set_num_threads(1)
    SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
    inputs = [rank_input(r, world) for r in range(world)]
    mine = inputs[rank].clone()
    chunks = torch.stack([x.view(world, N)[rank] for x in inputs])  # (world, N): every rank's chunk for me
    exact = chunks.double().sum(0)
    A = blockwise_absmax(chunks).amax(0)  # the largest magnitude in each element's block over all ranks
    out: dict = {"ratios": {}, "bytes": {}, "checks": {}, "ef": {}}

    node_size = 2 if world == 4 else 1
    topo = Topology.uniform(world, node_size)
    hierarchies = {"hier": make_hierarchy(topo)}
    if world == 2:  # the two degenerate layouts: 2 nodes of 1 (one inter hop) and 1 node of 2 (one intra hop)
        hierarchies["hier_one_node"] = make_hierarchy(Topology.uniform(2, 2))
    else:  # nodes that interleave ranks (0 and 2 on one node): routing must follow the topology, not rank order
        hierarchies["hier_interleaved"] = make_hierarchy(Topology((0, 1, 0, 1)))

    def reduce_scatter(bits, op, mode, residual=None, traffic=None):
        o = torch.empty(N)
        h = hierarchies.get(mode)
        quantized_reduce_scatter(o, mine, None, op, bits=bits, hierarchy=h, residual=residual, traffic=traffic,
                                 topology=h.topology if h else topo)
        assert torch.equal(mine, inputs[rank]), "the input must not be modified"
        return o

    # --- exact path: fp32 on the wire, flat and in two hops, equals the float64 sum up to fp32 summation
    sum_abs = chunks.double().abs().sum(0)
    for mode in ["flat", *hierarchies]:
        err = (reduce_scatter(32, SUM, mode).double() - exact).abs()
        out["ratios"][f"fp32_{mode}"] = _max_ratio(err, 2 * world * 2.0**-24 * sum_abs)

    # --- float64 stays float64: unquantized (bits=32) sends a float64 input as float64, flat, in two hops and
    # gathered, and sums it in float64. Any order of summing W float64 terms is within (W-1) u sum|v| of the exact
    # sum (u = 2^-53, first order), so this path and the reference sum differ by at most 2 (W-1) u sum|v|; AVG
    # divides by a power of two (exact). An fp32 wire errs by ~2^-24 |v|: ~10^8 times that bound.
    inputs64 = [rank_input(r, world, torch.float64) for r in range(world)]
    chunks64 = torch.stack([x.view(world, N)[rank] for x in inputs64])
    exact64, bound64 = chunks64.sum(0), 2 * (world - 1) * 2.0**-53 * chunks64.abs().sum(0)
    for mode in ["flat", *hierarchies]:
        h, t = hierarchies.get(mode), Traffic()
        for op, scale in ((SUM, 1), (AVG, world)):
            o = torch.empty(N, dtype=torch.float64)
            quantized_reduce_scatter(o, inputs64[rank], None, op, bits=32, hierarchy=h, traffic=t,
                                     topology=h.topology if h else topo)
            out["ratios"][f"fp64_{mode}_{'sum' if scale == 1 else 'avg'}"] = _max_ratio(
                (o - exact64 / scale).abs(), bound64 / scale)
            if world == 2:  # a + b is one correctly rounded addition in either order: bit for bit
                out["checks"][f"fp64_{mode}_{'sum' if scale == 1 else 'avg'}_bitwise"] = bool(
                    torch.equal(o, exact64 / scale))
        out["checks"][f"fp64_{mode}_wire_is_float64"] = t.wire()["reduce_scatter"]["dtypes"] == ["float64"]
    t, g64 = Traffic(), torch.empty(world * N, dtype=torch.float64)
    quantized_all_gather(g64, inputs64[rank][:N], bits=32, traffic=t, topology=topo)
    out["checks"]["fp64_all_gather_exact"] = bool(torch.equal(g64.view(world, N),
                                                              torch.stack([x[:N] for x in inputs64])))
    out["checks"]["fp64_all_gather_wire"] = t.wire()["all_gather"] == {
        "dtypes": ["float64"], "bytes": (world - 1) * 8 * N, "calls": 1,
        "intra_node_bytes": (node_size - 1) * 8 * N, "inter_node_bytes": (world - node_size) * 8 * N}

    # --- quantized paths against the exact sum, SUM and AVG; flat against hierarchical
    for bits in (8, 4):
        e = E[bits]
        res = {}
        for mode in ["flat", *hierarchies]:
            s, a = reduce_scatter(bits, SUM, mode), reduce_scatter(bits, AVG, mode)
            res[mode] = s
            factor = 1.0 if mode == "flat" else 2 + e  # two hops: the partial sums are quantized again
            if mode == "hier_one_node" or (mode == "hier" and world == 2):
                factor = 1.0  # one of the hops is a group of one: a single quantization, as in flat
            bound = world * e * A * factor
            out["ratios"][f"int{bits}_{mode}_sum"] = _max_ratio((s.double() - exact).abs(), bound)
            out["ratios"][f"int{bits}_{mode}_avg"] = _max_ratio((a.double() - exact / world).abs(), bound / world)
            out["checks"][f"int{bits}_{mode}_avg_is_sum_over_world"] = bool(torch.equal(a, s / world))
            out["checks"][f"int{bits}_{mode}_not_exact"] = bool((s.double() - exact).abs().max() > 0)
        for mode in hierarchies:
            bound_flat, bound_hier = world * e * A, world * e * A * (2 + e)
            out["ratios"][f"int{bits}_flat_vs_{mode}"] = _max_ratio((res["flat"] - res[mode]).abs(),
                                                                    bound_flat + bound_hier)
        if world == 2:  # degenerate hierarchies run the flat exchange itself: identical bits
            out["checks"][f"int{bits}_degenerate_hier_equals_flat"] = all(
                torch.equal(res["flat"], res[m]) for m in hierarchies)

    # --- bytes on the wire, split intra/inter-node by the topology
    for bits in (32, 16, 8, 4):
        for mode in ["flat", "hier"]:
            t = Traffic()
            reduce_scatter(bits, AVG, mode, traffic=t)
            out["bytes"][f"rs_{bits}_{mode}"] = t.to_dict()
        t = Traffic()
        gathered = torch.empty(world * N)
        quantized_all_gather(gathered, mine[:N], bits=bits, traffic=t, topology=topo)
        out["bytes"][f"ag_{bits}"] = t.to_dict()

    # --- all-gather (qwZ): identical on every rank, within the bound, own slot dequantized, master untouched
    shards = torch.stack([x[:N] for x in inputs])  # rank r's shard is its first N elements
    master = mine[:N].clone()
    gathered = torch.empty(world * N)
    quantized_all_gather(gathered, master)
    g = gathered.view(world, N)
    out["checks"]["ag_master_untouched"] = bool(torch.equal(master, mine[:N]))
    out["ag_sha256"] = hashlib.sha256(gathered.numpy().tobytes()).hexdigest()
    out["ratios"]["ag_int8"] = _max_ratio((g.double() - shards.double()).abs(),
                                          E[8] * blockwise_absmax(shards))
    own = dequantize(quantize(master, 8))
    out["checks"]["ag_own_slot_dequantized"] = bool(torch.equal(g[rank], own)) and not torch.equal(g[rank], master)
    # FSDP2 gathers in place: the input is this rank's slot of the output
    inplace = torch.zeros(world * N)
    inplace.view(world, N)[rank] = master
    quantized_all_gather(inplace, inplace.view(world, N)[rank])
    out["checks"]["ag_in_place_equals_out_of_place"] = bool(torch.equal(inplace, gathered))

    # --- error feedback: repeated reduce-scatters of the same input (int4, SUM)
    for mode in ["flat", "hier"]:
        h = hierarchies["hier"] if mode == "hier" else None
        L = h.node_size if h is not None else 1
        e = E[4]
        # Residual r per element: |r| <= c (A + |r|), so |r| <= c/(1-c) A, with c = e for one quantization and
        # c = e (1 + L (1 + e)) when this rank also holds the hop-2 error of a partial sum of L terms (whose
        # magnitude is at most L (A + |r|)(1 + e)). The accumulated error is minus the sum of W residuals.
        c = e if (h is None or L == 1 or h.num_nodes == 1) else e * (1 + L * (1 + e))
        bound = world * c / (1 - c) * A
        for feedback in (True, False):
            residual = torch.zeros(world * N) if feedback else None
            total = torch.zeros(N, dtype=torch.float64)
            worst, first = 0.0, None
            for step in range(1, STEPS + 1):
                total += reduce_scatter(4, SUM, mode, residual=residual).double()
                acc = (total - step * exact).abs()
                worst = max(worst, _max_ratio(acc, bound))
                first = acc.clone() if first is None else first
            out["ef"][f"{mode}_{'on' if feedback else 'off'}"] = {
                "worst": worst,  # max over the steps of |accumulated error| / bound
                "final": _max_ratio(acc, bound),
                "growth": float(acc.max() / first.max()),  # accumulated error after T steps over after 1
            }

    # --- error feedback after one non-finite gradient (the last rank's input holds a NaN once): that call's
    # output carries the NaN on every rank (the loop's check must fire), and the calls after it are finite again:
    # what the NaN block lost never enters the residual, which would otherwise send it at every later call
    for mode in ["flat", "hier"]:
        h = hierarchies["hier"] if mode == "hier" else None
        residual = torch.zeros(world * N)
        bad = mine.clone()
        if rank == world - 1:
            bad.view(world, N)[:, 0] = float("nan")  # element 0 of every rank's chunk
        outputs = []
        for x in (bad, mine, mine, mine):
            o = torch.empty(N)
            quantized_reduce_scatter(o, x, None, SUM, bits=4, hierarchy=h, residual=residual)
            outputs.append(o)
        out["checks"][f"ef_nan_{mode}_seen_once"] = bool(outputs[0].isnan().any())
        out["checks"][f"ef_nan_{mode}_later_calls_finite"] = all(bool(o.isfinite().all()) for o in outputs[1:])
        out["checks"][f"ef_nan_{mode}_residual_finite"] = bool(residual.isfinite().all())

    # --- misuse gets a clear error
    errors = {}
    for name, call in {
        "op": lambda: quantized_reduce_scatter(torch.empty(N), mine, op=dist.ReduceOp.MAX),
        "size": lambda: quantized_reduce_scatter(torch.empty(N + 1), mine),
        "traffic_without_topology": lambda: quantized_reduce_scatter(torch.empty(N), mine, traffic=Traffic()),
        "topology_size": lambda: make_hierarchy(Topology.uniform(2 * world, 2)),
        "residual": lambda: quantized_reduce_scatter(torch.empty(N), mine, residual=torch.zeros(N)),
    }.items():
        try:
            call()
            errors[name] = None
        except ValueError as exc:
            errors[name] = str(exc)
    out["errors"] = errors
    return out


def _wire(n: int, bits: int) -> int:
    return {32: 4 * n, 16: 2 * n, 8: n + 4 * -(-n // 256), 4: -(-n // 2) + 4 * -(-n // 256)}[bits]


def _check(results: list[dict], world: int) -> None:
    for rank, res in enumerate(results):
        for name, ratio in res["ratios"].items():
            assert ratio <= TOL, f"rank {rank}: {name} error is {ratio:.4f} x its bound"
        for name, ok in res["checks"].items():
            assert ok, f"rank {rank}: {name}"
        # error feedback: bounded with it; without it the error repeats and so grows linearly with the steps
        for mode in ("flat", "hier"):
            on, off = res["ef"][f"{mode}_on"], res["ef"][f"{mode}_off"]
            assert on["worst"] <= TOL, (mode, on)  # at every step, within the residual bound
            assert off["growth"] == pytest.approx(STEPS, rel=1e-6), (mode, off)  # the same error, T times
            # ... which after T=20 steps is past the bound with feedback and 5x its worst (measured 13-25x)
            assert off["final"] > 1.5 and off["final"] > 5 * on["worst"], (mode, on, off)
        errors = res["errors"]
        assert "ReduceOp.SUM and ReduceOp.AVG" in errors["op"]
        assert f"expected {world} x {N + 1}" in errors["size"]
        assert "topology=" in errors["traffic_without_topology"]
        assert f"covers {2 * world} ranks" in errors["topology_size"]
        assert "residual" in errors["residual"]
    # every rank computes with the same gathered weights
    assert len({r["ag_sha256"] for r in results}) == 1


WIRE_DTYPES = {32: "float32", 16: "bfloat16", 8: "int8+fp32 scales", 4: "int4+fp32 scales"}


def _check_bytes(b: dict, world: int, node_size: int) -> None:
    nodes = world // node_size
    fp32 = b["rs_32_flat"]
    # the unquantized all-to-all moves what a real reduce-scatter does: N*4 bytes to each of world-1 peers
    assert fp32["bytes"] == (world - 1) * 4 * N
    for bits, limit in ((8, 0.26), (4, 0.14)):
        q = b[f"rs_{bits}_flat"]
        assert q["bytes"] == (world - 1) * _wire(N, bits)  # codes and scales, nothing sent to itself
        assert q["bytes"] <= limit * fp32["bytes"], (bits, q["bytes"] / fp32["bytes"])
        assert b[f"ag_{bits}"]["bytes"] <= limit * b["ag_32"]["bytes"]
    assert b["rs_16_flat"]["bytes"] == fp32["bytes"] // 2
    for bits in (32, 16, 8, 4):
        flat, hier = b[f"rs_{bits}_flat"], b[f"rs_{bits}_hier"]
        assert flat["per_kind"]["reduce_scatter"]["calls"] == 1 and hier["per_kind"]["reduce_scatter"]["calls"] == 1
        assert flat["inter_node_bytes"] == (world - node_size) * _wire(N, bits)
        assert hier["inter_node_bytes"] == (nodes - 1) * _wire(N, bits)  # hop 2: one chunk per other node
        assert hier["bytes"] - hier["inter_node_bytes"] == (node_size - 1) * nodes * _wire(N, bits)  # hop 1
        assert hier["inter_node_bytes"] * node_size <= flat["inter_node_bytes"]
        ag = b[f"ag_{bits}"]["per_kind"]["all_gather"]
        # what each format puts on the wire, recorded per kind (fp32 inputs: bits=32 keeps fp32)
        for kind in (flat["per_kind"]["reduce_scatter"], hier["per_kind"]["reduce_scatter"], ag):
            assert kind["wire_dtypes"] == [WIRE_DTYPES[bits]], (bits, kind)
        assert ag["intra_node_bytes"] == (node_size - 1) * _wire(N, bits)
        assert ag["inter_node_bytes"] == (world - node_size) * _wire(N, bits)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quantized_collectives_two_ranks():
    results = run_distributed(_collective_checks, 2, timeout=240)
    _check(results, 2)
    _check_bytes(results[0]["bytes"], 2, 1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quantized_collectives_four_ranks_as_two_nodes():
    results = run_distributed(_collective_checks, 4, timeout=240)
    _check(results, 4)
    b = results[0]["bytes"]
    _check_bytes(b, 4, 2)
    # 4 ranks as 2 nodes of 2: hierarchical qgZ sends exactly half the flat path's inter-node bytes
    for bits in (8, 4):
        assert 2 * b[f"rs_{bits}_hier"]["inter_node_bytes"] == b[f"rs_{bits}_flat"]["inter_node_bytes"]


def test_node_layout_needs_equal_nodes():
    node_ranks, peers = node_layout(Topology((0, 1, 0, 1)))
    assert node_ranks == ((0, 2), (1, 3)) and peers == ((0, 1), (2, 3))
    node_ranks, peers = node_layout(Topology.uniform(6, 3))
    assert node_ranks == ((0, 1, 2), (3, 4, 5)) and peers == ((0, 3), (1, 4), (2, 5))
    with pytest.raises(ConfigError, match="same number of ranks"):
        node_layout(Topology((0, 0, 0, 1)))
