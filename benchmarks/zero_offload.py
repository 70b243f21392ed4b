"""benchmarks/zero.py's offload rows: the host memory a rank holds at ZeRO stage 3 with no offload, host offload
(``parallel.offload = "optimizer"``) and NVMe offload (``"nvme"``: the optimizer state in files on local disk,
trainer/parallel/nvme.py), for a ViT whose AdamW state is several GB (default ~303M parameters: 2.4 GB of state,
1.2 GB per rank at 2 ranks), and what each costs in step time.

    python benchmarks/zero.py --rows offload-memory --worlds 2 --merge

Figures per row, rank 0, after its last step (``trainer/parallel/memory.host_memory``, from /proc): RSS, private
memory, peak RSS; the optimizer state's bytes and how much of it is resident in host memory (without NVMe: the
state tensors, every byte touched each step; with NVMe: the resident pages of the state files' mappings, plus the
scalars left in memory); the median step. Target: NVMe's resident optimizer state at most 0.1x host offload's.

On this CPU-only machine host offload keeps the state in the same RAM as no offload (the two rows differ only by
FSDP2's offload path), and the NVMe row's files are on the machine's virtual disk (ext4), not an NVMe drive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dutycycle.trainer.cluster.local import free_port

from benchmarks import docs_format as fmt
from benchmarks.zero_worker import RESULT_PREFIX, ROW_SEPARATOR

WORKER = Path(__file__).with_name("zero_worker.py")  # the ranks
OFFLOAD_ROWS = "offload-memory"  # the --rows name of these rows
OFFLOAD_VIT = {"width": 1024, "depth": 24, "heads": 16, "steps": 4, "skip": 1}
OFFLOAD_QUICK = {"width": 64, "depth": 2, "heads": 2, "steps": 3, "skip": 1}
MODES = ("none", "optimizer", "nvme")


def run_offload_rows(world: int, args, workdir: str) -> list[dict]:
    shape = OFFLOAD_QUICK if args.quick else OFFLOAD_VIT
    flags = ["--width", str(shape["width"]), "--depth", str(shape["depth"]), "--heads", str(shape["heads"]),
             "--size", str(args.size), "--batch", str(args.batch), "--steps", str(shape["steps"]), "--skip",
             str(shape["skip"])]
    # one launch per mode, or (--quick) one launch training every mode in turn (zero_worker.py's --next-row; the
    # host figures are then that process's after each mode's steps, with the earlier modes' leftovers)
    groups = [list(MODES)] if args.quick else [[mode] for mode in MODES]
    rows = []
    for group in groups:
        argv = []
        for mode in group:
            argv += [*([ROW_SEPARATOR] if argv else []), "--stage", "3", "--offload", mode, "--run-dir",
                     os.path.join(workdir, f"offload-{mode}-{world}"), "--offload-dir",
                     os.path.join(workdir, "offload-files"), *flags]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
               str(free_port()), str(WORKER), *argv]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout * len(group),
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_PREFIX)]
        for mode, line in zip(group, lines if len(lines) == len(group) else [None] * len(group), strict=True):
            name = f"stage3-offload-{mode}"
            if proc.returncode != 0 or line is None:
                rows.append({"name": name, "world_size": world, "returncode": proc.returncode,
                             "error": (proc.stdout + proc.stderr)[-12000:]})
                continue
            r = json.loads(line.removeprefix(RESULT_PREFIX))
            held, host = r["held_per_rank"][0], r["host_after_steps"]
            rows.append({"name": name, "world_size": world, "offload": mode, **shape, "process_wall_s":
                         time.perf_counter() - t0, "num_params": r["num_params"], "step_s_median": r["step_s_median"],
                         "held_per_rank": r["held_per_rank"], "host_after_steps": host,
                         "offload_files": r.get("offload_files"),
                         "optimizer_state_bytes": held["optimizer"] + held["optimizer_file"],
                         "optimizer_state_resident_bytes": held["optimizer"] + host.get("files_resident", 0)})
    return rows


def offload_ratios(rows: list[dict]) -> dict:
    by = {(r["offload"], r["world_size"]): r for r in rows if "error" not in r}
    out = {}
    for world in sorted({w for _, w in by}):
        none, host, nvme = by.get(("none", world)), by.get(("optimizer", world)), by.get(("nvme", world))
        if host and nvme:
            out[f"nvme_resident_optimizer_state_vs_host_offload_{world}ranks"] = (
                nvme["optimizer_state_resident_bytes"] / host["optimizer_state_resident_bytes"])
            out[f"nvme_private_vs_host_offload_{world}ranks"] = (
                nvme["host_after_steps"]["private"] / host["host_after_steps"]["private"])
            out[f"nvme_step_vs_host_offload_{world}ranks"] = nvme["step_s_median"] / host["step_s_median"]
        if none and nvme:
            out[f"nvme_step_vs_no_offload_{world}ranks"] = nvme["step_s_median"] / none["step_s_median"]
        if none and host:
            out[f"host_offload_step_vs_no_offload_{world}ranks"] = host["step_s_median"] / none["step_s_median"]
    return out


# -- the docs' blocks (benchmarks/render_docs.py writes them between a page's render markers) --------------------------


OFFLOAD_LABELS = {"none": ("stage 3, no offload", "-"),
                  "optimizer": ("stage 3, host offload (`offload = \"optimizer\"`)", "fitting on a GPU: state in host memory"),
                  "nvme": ("stage 3, NVMe offload (`offload = \"nvme\"`)", "fitting beyond host memory: optimizer state on disk")}


def render(zero: dict) -> str:
    """benchmarks/zero.py's offload rows: host memory per rank and step time, no offload, host and NVMe offload."""
    d = zero["offload_memory"]
    rows = [r for r in d["rows"] if "error" not in r]
    first = rows[0]
    body = []
    for r in rows:
        label, serves = OFFLOAD_LABELS[r["offload"]]
        host = r["host_after_steps"]
        body.append([label, serves, fmt.nbytes(r["optimizer_state_bytes"]), fmt.nbytes(r["optimizer_state_resident_bytes"]),
                     fmt.nbytes(host["private"]), fmt.nbytes(host["rss"]), fmt.nbytes(host["peak_rss"]), fmt.secs(r["step_s_median"])])
    world = first["world_size"]
    ratios = d["ratios"]
    caption = (f"A ViT of {first['num_params'] / 1e6:.0f}M parameters (width {first['width']}, depth "
               f"{first['depth']}), AdamW, fp32, stage 3 at {world} ranks on one machine, {first['steps']} steps "
               f"(median of the last {first['steps'] - first['skip']}); rank 0's host memory after its last step, "
               "from the kernel's accounting. On this CPU-only machine host offload keeps the state in the same "
               "RAM as no offload, and the NVMe row's files are on the machine's virtual disk.")
    cut = (f"NVMe offload's optimizer state resident in host memory: "
           f"{fmt.times(ratios[f'nvme_resident_optimizer_state_vs_host_offload_{world}ranks'])} host offload's "
           f"(target at most 0.1x); private memory {fmt.times(ratios[f'nvme_private_vs_host_offload_{world}ranks'])}; "
           f"its step {fmt.times(ratios[f'nvme_step_vs_host_offload_{world}ranks'])} host offload's and "
           f"{fmt.times(ratios[f'nvme_step_vs_no_offload_{world}ranks'])} no offload's. Every step reads and writes "
           "the rank's whole state once; this machine's virtual disk absorbs that in its host's cache, so the "
           "figure is a lower bound: a drive of B GB/s adds about 2 x state / B per step.")
    headers = ["layout", "serves", "optimizer state", "of it in host memory", "private", "RSS", "peak RSS", "step"]
    return "\n\n".join([fmt.para(caption), fmt.table(headers, body), fmt.para(cut), fmt.source("zero")])
