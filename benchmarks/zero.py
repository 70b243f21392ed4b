"""ZeRO stages side by side: bytes held per rank, logical bytes sent per step, samples/s and exposed communication.

    python benchmarks/zero.py                    # writes benchmarks/results/zero.json
    python benchmarks/zero.py --quick            # a tiny model, seconds (the smoke test): one launch per
                                                 # world size trains every row in turn (only that they run, and
                                                 # their exact bytes, matter there)

Rows, at 2 and 4 ranks (torchrun, gloo, one process per rank on this machine): stages 0 (DDP), 1, 2, 3 (FSDP2)
and stage 3 with optimizer offload, all on the same ViT (default widened to ~22M parameters), the same synthetic
global batches, AdamW, fp32. At 2 ranks a baseline row runs the trainer's previous gradient sync: after the last
backward, gradients copied into flat 25 MB buckets, all-reduced (SUM) and divided by the world size, blocking.
Every row goes through the same step loop (``Trainer.train``, in benchmarks/zero_worker.py, the ranks' code); only
the wrapping differs.

Micro-batches: the stage 1 and stage 2 rows accumulate over ``--micro-batches`` micro-batches per optimizer step
(default 4, ``--quick`` 2; the global batch must divide by ranks x micro-batches), the other rows take one. At one
micro-batch stages 1 and 2 produce the same torch settings (FSDP2 without reshard after forward), so a gap between
them there is noise. With accumulation they differ as trainer/parallel/plan.py maps them: stage 1 keeps parameters
(and the full gradients) unsharded across the whole accumulation window, gathers them once per step and
reduce-scatters once, at the window's end; stage 2 reshards after every micro-batch's backward and gathers again
for the next forward, and reduce-scatters every micro-batch's gradients into their owners' shards (DeepSpeed's
stage 2: 1/W of the gradients held). Each row records its ``micro_batches``; the ratio
``stage1_bytes_sent_vs_stage2_{W}ranks`` is the traffic stage 1's window saves (1/M in fp32).

Offload (``stage3-offload``, ``parallel.offload = "optimizer"``: FSDP2's ``CPUOffloadPolicy``, sharded parameters,
gradients and optimizer state kept in host memory and the optimizer step run there): this benchmark runs on the
CPU, where host memory is the device's memory. The row exercises the code path and its accounting (held bytes,
traffic, convergence), and measures neither a host-device transfer nor device memory saved: its speed next to the
stage 3 row is noise plus what FSDP2's offload path costs on the CPU alone. The row says so in ``note``.

Figures per row: steady-state samples/s (the first ``--skip`` steps excluded: lazy init, the memory sampling
step), the exposed-communication share of the step (time the step waited on collectives that compute did not
hide; trainer/parallel/comm.py), logical bytes sent per step by collective kind, and model-state bytes held per
rank (parameters, gradients, optimizer state) beside the ZeRO paper's formula. Speed figures on a shared 2-core
machine are noisy and 4 ranks oversubscribe the cores; the byte figures are exact.

Activation checkpointing (``parallel.activation_checkpointing``), the ``activation-checkpointing`` row set: per
stage 0-3, the same ViT wrapped by ``parallelize`` with checkpointing off and on, one micro-batch of the global
batch per rank, forward and backward (no optimizer: activations do not depend on it). Measured per rank by
``live_bytes_mode``: every storage an operator allocates while forward and backward run, counted until freed
(views and in-place results not again; not counted: parameters, FSDP2's resized-in-place parameter storage and
bare ``torch.empty`` buffers, i.e. DDP's and FSDP2's communication buffers). Figures: ``activation_bytes`` (live
right after forward: what forward leaves for backward) and ``peak_bytes`` (the peak through backward:
activations, a block's recomputed activations, gradients that operators compute, such as FSDP2's unsharded block
gradients; not DDP's bucket-view gradients), each as the ratio checkpointed / not, and forward+backward seconds
(the recomputation's cost; noisy here). ``--merge`` keeps what ``--out`` already holds that this run did not
measure, so this part can be rerun alone::

    python benchmarks/zero.py --rows activation-checkpointing --worlds 2 --merge

Offload memory (``--rows offload-memory``, not run by default; benchmarks/zero_offload.py): stage 3 with no
offload, host offload and NVMe offload on a ViT with several GB of optimizer state, the host memory each rank
holds and the step time::

    python benchmarks/zero.py --rows offload-memory --worlds 2 --merge
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dutycycle.trainer.cluster.local import free_port

if __name__ == "__main__":  # run as `python benchmarks/zero.py`: the siblings import as `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import docs_format as fmt  # noqa: E402
from benchmarks._common import default_out, machine, read_result, write_result  # noqa: E402
from benchmarks.zero_activation import ACTIVATION_ROWS, activation_ratios, run_activation_rows  # noqa: E402
from benchmarks.zero_offload import OFFLOAD_ROWS, offload_ratios, run_offload_rows  # noqa: E402
from benchmarks.zero_worker import RESULT_PREFIX, ROW_SEPARATOR, STEPS, VIT_DEFAULTS, VIT_QUICK, WORKER  # noqa: E402

ROWS = [  # (name, zero_stage, offload, baseline)
    ("allreduce-manual", 0, "none", True),
    ("stage0-ddp", 0, "none", False),
    ("stage1", 1, "none", False),
    ("stage2", 2, "none", False),
    ("stage3", 3, "none", False),
    ("stage3-offload", 3, "optimizer", False),
]
ACCUMULATING = ("stage1", "stage2")  # rows run at --micro-batches: where stage 1 differs from stage 2
OFFLOAD_NOTE = ("CPU-only run: host memory is the device's memory, so offload here exercises the code path "
                "(state kept and stepped on the host) and measures no host-device transfer and no device memory "
                "saved")


# ------------------------------------------------------------------------------------------------- driver


def _row_flags(name, stage, offload, baseline, world, args, workdir) -> list[str]:
    micro = args.micro_batches if name in ACCUMULATING else 1
    return ["--stage", str(stage), "--offload", offload, "--run-dir", os.path.join(workdir, f"{name}-{world}"),
            "--micro", str(micro), *(["--baseline"] if baseline else []), *_shared_args(args)]


def run_rows(specs: list[tuple], world: int, args, workdir) -> list[dict]:
    """The rows of ``specs`` (ROWS' tuples) at ``world`` ranks through torchrun: each in a launch of its own, or
    (``--quick``) all in one launch that trains them in turn (zero_worker.py's ``--next-row``): ``process_wall_s``
    is then the whole launch's."""
    groups = [specs] if args.quick else [[spec] for spec in specs]
    out = []
    for group in groups:
        flags = []
        for spec in group:
            flags += [*([ROW_SEPARATOR] if flags else []), *_row_flags(*spec, world, args, workdir)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
               "--master-port", str(free_port()), str(WORKER), *flags]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout * len(group),
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        wall = time.perf_counter() - t0
        lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_PREFIX)]
        for i, (name, stage, offload, _baseline) in enumerate(group):
            micro = args.micro_batches if name in ACCUMULATING else 1
            if proc.returncode != 0 or len(lines) != len(group):
                # torchrun's own summary comes last; the ranks' tracebacks and C++ aborts come before it
                out.append({"name": name, "world_size": world, "micro_batches": micro, "returncode": proc.returncode,
                            "error": (proc.stdout + proc.stderr)[-12000:]})
                continue
            out.append({"name": name, "world_size": world, "zero_stage": stage, "offload": offload,
                        "micro_batches": micro, **({"note": OFFLOAD_NOTE} if offload != "none" else {}),
                        "process_wall_s": wall, **json.loads(lines[i].removeprefix(RESULT_PREFIX))})
    return out


def run_row(name, stage, offload, baseline, world, args, workdir) -> dict:
    """One row in a launch of its own."""
    (r,) = run_rows([(name, stage, offload, baseline)], world, argparse.Namespace(**{**vars(args), "quick": False}),
                    workdir)
    return r


def _shared_args(args) -> list[str]:
    return ["--width", str(args.width), "--depth", str(args.depth), "--heads", str(args.heads), "--size",
            str(args.size), "--batch", str(args.batch), "--steps", str(args.steps), "--skip", str(args.skip)]


def ratios(rows: list[dict]) -> dict:
    by = {(r["name"], r["world_size"]): r for r in rows if "error" not in r}
    out = {}
    for world in sorted({w for _, w in by}):
        s0 = by.get(("stage0-ddp", world))
        if s0 is None:
            continue
        o0 = s0["held_per_rank"][0]["optimizer"]
        for name in ("stage1", "stage2", "stage3", "stage3-offload"):
            r = by.get((name, world))
            if r:
                held = max(h["optimizer"] for h in r["held_per_rank"])
                out[f"{name}_optimizer_bytes_vs_stage0_over_N_{world}ranks"] = held / (o0 / world)
        r1, r2 = by.get(("stage1", world)), by.get(("stage2", world))
        if r1 and r2 and r1.get("micro_batches", 1) == r2.get("micro_batches", 1):
            out[f"stage1_bytes_sent_vs_stage2_{world}ranks"] = (
                sum(r1["bytes_sent_per_step"].values()) / sum(r2["bytes_sent_per_step"].values()))
        r3 = by.get(("stage3", world))
        if r3:
            out[f"stage3_bytes_sent_vs_stage0_{world}ranks"] = (
                sum(r3["bytes_sent_per_step"].values()) / sum(s0["bytes_sent_per_step"].values()))
        base = by.get(("allreduce-manual", world))
        if base:
            out[f"stage0_samples_per_s_vs_manual_allreduce_{world}ranks"] = s0["samples_per_s"] / base["samples_per_s"]
            out[f"manual_allreduce_exposed_comm_share_{world}ranks"] = base["exposed_comm_share"]
            out[f"stage0_exposed_comm_share_{world}ranks"] = s0["exposed_comm_share"]
    return out


def table(rows: list[dict]) -> str:
    """The rows as this run printed them (the docs' table is ``render``'s)."""
    body = []
    for r in rows:
        head = [r["world_size"], r["name"], r.get("micro_batches", 1)]
        if "error" in r:
            body.append([*head, "error", None, None, None, None])
            continue
        body.append([*head, f"{r['samples_per_s']:.1f}", fmt.pct(r["exposed_comm_share"]),
                     fmt.nbytes(sum(r["bytes_sent_per_step"].values())), _held_text(r["held_per_rank"][0]),
                     _held_text(r["zero_formula"])])
    return fmt.table(["ranks", "row", "micro-batches", "samples/s", "exposed comm", "sent per step",
                      "params / grads / optimizer held per rank", "ZeRO formula"], body)


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    v = VIT_DEFAULTS
    p.add_argument("--width", type=int, default=v["width"],
                   help="ViT width (default 512: ~22M parameters at depth 7)")
    p.add_argument("--depth", type=int, default=v["depth"])
    p.add_argument("--heads", type=int, default=v["heads"])
    p.add_argument("--size", type=int, default=v["size"],
                   help="image side (default 16: 17 tokens of 4x4 patches)")
    p.add_argument("--batch", type=int, default=v["batch"], help="global batch size (default 16)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps per row (default {STEPS})")
    p.add_argument("--skip", type=int, default=v["skip"],
                   help="first steps excluded from speed figures (default 2)")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches per optimizer step of the stage 1 and 2 rows (default 4, --quick 2; the "
                        "other rows take one): at one, stages 1 and 2 run the same torch settings")
    p.add_argument("--rows", nargs="+", default=[r[0] for r in ROWS] + [ACTIVATION_ROWS],
                   choices=[r[0] for r in ROWS] + [ACTIVATION_ROWS, OFFLOAD_ROWS],
                   help=f"rows to run (default: all but {OFFLOAD_ROWS!r}, which needs ~10 GB of RAM and "
                        "benchmarks/zero_offload.py's ViT of ~303M parameters)")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows (and the activation section) already in --out that this run does not measure")
    p.add_argument("--repeat", type=int, default=3,
                   help="run the baseline and stage 0 at 2 ranks this many times, alternating (default 3): the "
                        "speed ratio is the median of the pairs, which holds when the machine's speed drifts")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--quick", action="store_true", help="a tiny ViT and few steps: seconds, for the smoke test")
    p.add_argument("--out", default=default_out("zero"))
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update(VIT_QUICK, repeat=1)
    if args.micro_batches is None:
        args.micro_batches = 2 if args.quick else 4
    return args


def run(args) -> dict:
    rows, pairs = [], []
    with tempfile.TemporaryDirectory() as workdir:
        if 2 in args.worlds and {"allreduce-manual", "stage0-ddp"} <= set(args.rows):
            for i in range(args.repeat - 1):  # the extra alternations; the last pair runs with the table below
                a = run_row(*ROWS[0], 2, args, os.path.join(workdir, f"pair{i}"))
                b = run_row(*ROWS[1], 2, args, os.path.join(workdir, f"pair{i}"))
                pairs.append((a, b))
        for world in args.worlds:
            specs = [spec for spec in ROWS if spec[0] in args.rows and (world == 2 or not spec[3])]
            for r in run_rows(specs, world, args, workdir) if specs else []:
                rows.append(r)
                if "error" in r:
                    print(f"{world} ranks {r['name']}: error\n{r['error']}", flush=True)
                else:
                    print(f"{world} ranks {r['name']:17s} {r['samples_per_s']:8.1f} samples/s at {r['micro_batches']} "
                          f"micro-batch(es), exposed comm {r['exposed_comm_share']:.0%}, sent/step "
                          f"{sum(r['bytes_sent_per_step'].values()) / 2**20:.0f} MB, "
                          f"optimizer held {r['held_per_rank'][0]['optimizer'] / 2**20:.0f} MB"
                          + (f"\n    ({r['note']})" if "note" in r else ""), flush=True)
        act_rows = []
        for world in args.worlds if ACTIVATION_ROWS in args.rows else ():
            new = run_activation_rows(world, args, _shared_args(args))
            act_rows += new
            for r in new:
                print(f"{world} ranks {r['name']:17s} " + (f"error\n{r['error']}" if "error" in r else (
                      f"activations {r['activation_bytes'] / 2**20:.2f} MB, peak {r['peak_bytes'] / 2**20:.2f} MB, "
                      f"forward+backward {r['forward_backward_s_median']:.3f} s")), flush=True)
        off_rows = []
        for world in args.worlds if OFFLOAD_ROWS in args.rows else ():
            new = run_offload_rows(world, args, workdir)
            off_rows += new
            for r in new:
                print(f"{world} ranks {r['name']:24s} " + (f"error\n{r['error']}" if "error" in r else (
                      f"step {r['step_s_median']:.2f} s, optimizer state {r['optimizer_state_bytes'] / 2**20:.0f} MB, "
                      f"resident {r['optimizer_state_resident_bytes'] / 2**20:.1f} MB, private "
                      f"{r['host_after_steps']['private'] / 2**20:.0f} MB")), flush=True)
    by = {(r["name"], r["world_size"]): r for r in rows}
    if ("allreduce-manual", 2) in by and ("stage0-ddp", 2) in by:
        pairs.append((by["allreduce-manual", 2], by["stage0-ddp", 2]))
    pairs = [(a, b) for a, b in pairs if "error" not in a and "error" not in b]
    measured_on = machine()
    settings = {k: v for k, v in vars(args).items() if k in ("width", "depth", "heads", "size", "batch", "steps",
                                                             "skip", "worlds", "rows", "repeat", "quick",
                                                             "micro_batches")}
    old = read_result(args.out) if args.merge else {}
    if old and not rows:  # only the activation or offload rows ran: the other rows' settings stay theirs
        measured_on, settings = old.get("machine", measured_on), old.get("settings", settings)
    if old:
        measured = {(r["name"], r["world_size"]) for r in rows}
        rows = [r for r in old.get("rows", []) if (r["name"], r["world_size"]) not in measured] + rows
        order = [name for name, *_ in ROWS]  # merged rows in the table's order: by ranks, then as ROWS lists them
        rows.sort(key=lambda r: (r["world_size"], order.index(r["name"]) if r["name"] in order else len(order)))
        # which rows this run measured (the others are the earlier run's): their speeds are not comparable
        settings["remeasured_rows"] = sorted({name for name, _ in measured}, key=order.index)
        settings["rows"] = [n for n in order if any(r["name"] == n for r in rows)] + \
            [n for n in settings.get("rows", []) if n not in order]
    result = {
        "benchmark": "zero",
        "machine": measured_on,
        "settings": settings,
        "rows": rows,
        "ratios": ratios(rows),
    }
    if act_rows:
        result["activation_checkpointing"] = {
            "settings": {k: v for k, v in vars(args).items() if k in ("width", "depth", "heads", "size", "batch",
                                                                       "worlds", "quick")},
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "rows": act_rows, "ratios": activation_ratios(act_rows)}
    elif "activation_checkpointing" in old:
        result["activation_checkpointing"] = old["activation_checkpointing"]
    if off_rows:
        result["offload_memory"] = {
            "settings": {k: v for k, v in vars(args).items() if k in ("size", "batch", "worlds", "quick")},
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "rows": off_rows, "ratios": offload_ratios(off_rows)}
    elif "offload_memory" in old:
        result["offload_memory"] = old["offload_memory"]
    if not pairs and "stage0_vs_manual_pairs" in old:
        result["stage0_vs_manual_pairs"] = old["stage0_vs_manual_pairs"]
        key = "stage0_samples_per_s_vs_manual_allreduce_2ranks_median_of_pairs"
        if key in old.get("ratios", {}):
            result["ratios"][key] = old["ratios"][key]
    if pairs:
        result["stage0_vs_manual_pairs"] = [
            {"manual_samples_per_s": a["samples_per_s"], "ddp_samples_per_s": b["samples_per_s"],
             "ratio": b["samples_per_s"] / a["samples_per_s"], "manual_exposed_comm_share": a["exposed_comm_share"],
             "ddp_exposed_comm_share": b["exposed_comm_share"]} for a, b in pairs]
        result["ratios"]["stage0_samples_per_s_vs_manual_allreduce_2ranks_median_of_pairs"] = statistics.median(
            p["ratio"] for p in result["stage0_vs_manual_pairs"])
    return result


# -- the docs' blocks (benchmarks/render_docs.py writes them between a page's render markers) --------------------------


ZERO_LABELS = {"allreduce-manual": "hand-written all-reduce (baseline)", "stage0-ddp": "stage 0 (DDP)",
               "stage1": "stage 1", "stage2": "stage 2", "stage3": "stage 3", "stage3-offload": "stage 3 + offload"}


def _held_text(h: dict) -> str:
    return " / ".join(fmt.nbytes(h[k]) for k in ("params", "grads", "optimizer"))


def render(d: dict) -> str:
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
                    "unsharded across the window, stage 2 gathers them again for every micro-batch and "
                    "reduce-scatters every micro-batch's gradients into their owners' shards (1/W of the gradients "
                    "held); the other rows take one micro-batch.")
    else:
        caption += (" Every row takes one micro-batch per step, where stages 1 and 2 run the same torch settings: "
                    "the gap between them is noise.")
    again = s.get("remeasured_rows")
    if again:
        caption += (f" The {', '.join(ZERO_LABELS.get(n, n) for n in again)} rows were measured again in a later run "
                    "(`--merge`) on the same machine under other load: compare their bytes and memory with the other "
                    "rows, not their speed.")
    rows = [[str(r["world_size"]), ZERO_LABELS.get(r["name"], r["name"]), str(r.get("micro_batches", 1)),
             f"{r['samples_per_s']:.1f}", fmt.pct(r["exposed_comm_share"]), fmt.nbytes(sum(r["bytes_sent_per_step"].values())),
             _held_text(r["held_per_rank"][0]), _held_text(r["zero_formula"])] for r in d["rows"]]
    headers = ["ranks", "row", "micro-batches", "samples/s", "exposed comm", "sent per step per rank",
               "params / grads / optimizer held by rank 0", "ZeRO formula"]
    parts = [fmt.para(caption), fmt.table(headers, rows)]
    if any(r.get("offload", "none") != "none" for r in d["rows"]):
        parts.append(fmt.para("Stage 3 + offload ran on the CPU, where host memory is the device's memory: the row "
                          "exercises the offload code path and its accounting, and measures no host-device "
                          "transfer and no device memory saved; its speed next to stage 3 is noise plus what the "
                          "offload path costs on the CPU alone."))
    return "\n\n".join([*parts, fmt.source("zero")])


def render_ratios(d: dict) -> str:
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
                     fmt.times(ratio[f"stage3_bytes_sent_vs_stage0_{w}ranks"])])
    for w in worlds:  # results from before the stage 1 and 2 rows accumulated do not have it
        if f"stage1_bytes_sent_vs_stage2_{w}ranks" in ratio:
            rows.append([f"bytes sent, stage 1 over stage 2, {d['settings']['micro_batches']} micro-batches, {w} ranks",
                         fmt.times(ratio[f"stage1_bytes_sent_vs_stage2_{w}ranks"])])
    pairs = fmt.table(
        ["pair", "hand-written all-reduce", "DDP", "DDP / hand-written", "exposed comm, hand-written", "exposed comm, DDP"],
        [[str(i), f"{p['manual_samples_per_s']:.1f}/s", f"{p['ddp_samples_per_s']:.1f}/s", fmt.times(p["ratio"]),
          fmt.pct(p["manual_exposed_comm_share"]), fmt.pct(p["ddp_exposed_comm_share"])]
         for i, p in enumerate(d["stage0_vs_manual_pairs"], 1)],
    )
    median = ratio["stage0_samples_per_s_vs_manual_allreduce_2ranks_median_of_pairs"]
    return "\n\n".join([fmt.table(["ratio", "value"], rows),
                        f"Stage 0 against the hand-written all-reduce, 2 ranks, alternating pairs in one run "
                        f"(median {fmt.times(median)}):", pairs, fmt.source("zero")])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    write_result(args.out, result)
    print(table(result["rows"]))
    print(json.dumps(result["ratios"], indent=2))
    parts = [result[k] for k in ("activation_checkpointing", "offload_memory") if k in result]
    for part in parts:
        print(json.dumps(part["ratios"], indent=2))
    return 1 if any("error" in r for r in result["rows"] + [r for p in parts for r in p["rows"]]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
