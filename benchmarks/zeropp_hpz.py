"""What hpZ costs and saves, from benchmarks/zeropp.py's rows: each pair of rows that differ only by hpZ, their
steps broken down per collective (benchmarks/zeropp_probe.py, rank 0), and hpZ's fixed costs.

hpZ (``parallel.hpz``: FSDP2's ``reshard_after_forward=<node size>``) keeps, after forward, a secondary shard of
1/node_size of each unit's parameters (a copy of the forward gather's output), so that the backward all-gather runs
over the ranks of one node (``all_gather_hpz``) instead of over every rank, across nodes. It changes nothing
else: the forward gathers and the reduce-scatter are stage 3's. So it can save at most what the backward gathers
of stage 3 expose, and it pays for the secondary shard in memory (parameters held per rank: 1/W + 1/n of them
instead of 1/W), in a copy per forward, in its own intra-node gathers and in the process groups FSDP2 creates
for it (one mesh per sharded unit, at start-up).
"""

from __future__ import annotations

from benchmarks import docs_format as fmt

# (what the pair shows, the row without hpZ, the row with it): both rows of a pair run the same reduce-scatter
PAIRS = (("with overlap (the default)", "stage3", "stage3+hpZ"),
         ("blocking all-gathers", "stage3 no overlap", "stage3+hpZ no overlap"),
         ("on top of qwZ + int8 qgZ", "stage3+qwZ+qgZ-int8", "stage3+qwZ+qgZ-int8+hpZ"))


def _blocked(b: dict, phase: str, kinds: tuple[str, ...]) -> float:
    return sum(b["collectives"].get(f"{phase} {k}", {}).get("blocked_s", 0.0) for k in kinds)


def parts(r: dict) -> dict:
    """One row's mean step, split: forward gathers (exposed), forward compute, backward gathers (exposed; hpZ's
    inside the node and any across), the reduce-scatter, the optimizer and the rest (backward compute, the
    loop)."""
    b = r["breakdown"]
    gathers = ("all_gather", "all_gather_hpz")
    out = {"step_s": b["step_s_mean"], "forward_gathers_s": _blocked(b, "forward", gathers),
           "backward_gathers_s": _blocked(b, "backward", gathers),
           "reduce_scatter_s": _blocked(b, "backward", ("reduce_scatter",)), "optimizer_s": b["optimizer_s_mean"]}
    out["forward_compute_s"] = b["forward_s"] - out["forward_gathers_s"]
    out["rest_s"] = out["step_s"] - b["forward_s"] - out["backward_gathers_s"] - out["reduce_scatter_s"] - \
        out["optimizer_s"]
    return out


def control(pair: dict) -> float:
    """How far apart the two rows' optimizer steps were (the larger over the smaller): hpZ does not change the
    optimizer's work, so this is the run's own noise, the scale below which a difference says nothing."""
    a, b = (q["optimizer_s"] for q in pair["parts"])
    return max(a, b) / min(a, b)


def hpz_pairs(by: dict[str, dict]) -> list[dict]:
    """Each measured pair: both rows' parts, hpZ's speed-up (means of the same steps), the backward gathers'
    inter-node bytes, hpZ's fixed costs (its secondary copy per step, start-up, parameters held, peak RSS)."""
    out = []
    for label, off, on in PAIRS:
        a, b = by.get(off), by.get(on)
        if not (a and b and "breakdown" in a and "breakdown" in b):
            continue
        pa, pb = parts(a), parts(b)
        out.append({
            "label": label, "without": off, "with": on, "parts": [pa, pb], "speedup": pa["step_s"] / pb["step_s"],
            "backward_gathers_saved_s": pa["backward_gathers_s"] - pb["backward_gathers_s"],
            "secondary_copy_s": b["breakdown"].get("secondary_copy_s", 0.0),
            "init_s": [a["init_s"], b["init_s"]],
            "params_held": [max(h["params"] for h in r["held_per_rank"]) for r in (a, b)],
            "peak_rss": [r["host_after_steps"]["peak_rss"] for r in (a, b)],
            "inter_node_bytes_per_step": [a["inter_node_bytes_per_step"], b["inter_node_bytes_per_step"]],
        })
    return out


def render(d: dict, labels: dict[str, str]) -> str:
    """benchmarks.md's hpZ block: the pairs' steps split per collective, then what hpZ saved and cost."""
    speed = d["speed"]
    pairs = hpz_pairs({r["name"]: r for r in speed["rows"]})
    if not pairs:  # results recorded before the probe
        return "\n\n".join([fmt.para("These results have no breakdown per collective: run `python benchmarks/"
                                       "zeropp.py` (root) to measure it."), fmt.source("zeropp")])
    body = []
    for p in pairs:
        for name, q in zip((p["without"], p["with"]), p["parts"], strict=True):
            body.append([labels.get(name, name), fmt.secs(q["step_s"]), fmt.secs(q["forward_gathers_s"]),
                         fmt.secs(q["forward_compute_s"]), fmt.secs(q["backward_gathers_s"]),
                         fmt.secs(q["reduce_scatter_s"]), fmt.secs(q["rest_s"]), fmt.secs(q["optimizer_s"])])
    headers = ["stage 3 with", "step (mean)", "forward gathers", "forward compute", "backward gathers",
               "reduce-scatter", "backward compute, rest", "optimizer"]
    caption = (f"hpZ's step, split (rank 0, the mean of the measured steps of the run above, {fmt.gbit(speed['rate_gbit'])} "
               "link): each gather and reduce-scatter column is the time the training thread waited for that "
               "collective (a prefetched gather only where it had not finished when needed); the forward's compute "
               "includes hpZ's secondary copy. Each pair differs only by hpZ.")
    lines = []
    for p in pairs:
        a, b = p["parts"]
        lines.append(f"{p['label'][:1].upper()}{p['label'][1:]}: hpZ {fmt.times(p['speedup'])} "
                     f"({fmt.secs(a['step_s'])} to {fmt.secs(b['step_s'])}). The backward gathers held the step "
                     f"{fmt.secs(a['backward_gathers_s'])} without hpZ and {fmt.secs(b['backward_gathers_s'])} with "
                     f"it: {fmt.secs(p['backward_gathers_saved_s'])} saved, all hpZ can save; the reduce-scatter "
                     f"{fmt.secs(a['reduce_scatter_s'])} to {fmt.secs(b['reduce_scatter_s'])}, backward compute and "
                     f"the rest {fmt.secs(a['rest_s'])} to {fmt.secs(b['rest_s'])}; the optimizer step, which "
                     f"hpZ does not change, {fmt.secs(a['optimizer_s'])} to {fmt.secs(b['optimizer_s'])} "
                     f"({fmt.times(control(p))} apart: differences of that size are the machine's, not hpZ's).")
    first = pairs[0]
    (ia, ib), (ma, mb), (ra, rb) = first["init_s"], first["params_held"], first["peak_rss"]
    (xa, xb) = first["inter_node_bytes_per_step"]
    costs = (f"hpZ's fixed costs (first pair): a secondary copy of {fmt.secs(first['secondary_copy_s'])} per forward "
             f"(measured apart, the same bytes); start-up (model built and sharded, hpZ's process groups created) "
             f"{fmt.secs(ia)} to {fmt.secs(ib)}; parameters held per rank {fmt.nbytes(ma)} to {fmt.nbytes(mb)} "
             f"({fmt.times(mb / ma)}); peak RSS of rank 0 {fmt.nbytes(ra)} to {fmt.nbytes(rb)}. Inter-node bytes "
             f"per step per rank {fmt.nbytes(xa)} to {fmt.nbytes(xb)}.")
    blocks = [fmt.para(caption), fmt.table(headers, body), fmt.para(" ".join(lines)), fmt.para(costs)]
    rates = [r for r in d.get("hpz_rates", {}).get("rates", []) if r["pairs"]]
    if rates:
        blocks.append(fmt.para("The first pair again over other links between the nodes, " + "; ".join(
            _over(r) for r in rates) + "."))
    return "\n\n".join([*blocks, fmt.source("zeropp")])


def _over(rate: dict) -> str:
    p = rate["pairs"][0]
    a, b = p["parts"]
    link = "with no rate limit (the veth pair about as fast as each node's loopback)" if rate["rate_gbit"] is None \
        else f"at {fmt.gbit(rate['rate_gbit'])}"
    return (f"{link}: hpZ {fmt.times(p['speedup'])} ({fmt.secs(a['step_s'])} to {fmt.secs(b['step_s'])}), the "
            f"backward gathers {fmt.secs(a['backward_gathers_s'])} to {fmt.secs(b['backward_gathers_s'])}")
