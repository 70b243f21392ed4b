"""The GPU input path: bytes a batch sends host -> device and the step time, normalized on the host against on
the device.

One cache (``--samples`` random 64x64x3 uint8 samples, batch 256), read by the trainer's loader configuration
on ``--device`` (``step.data.delivery``: on CUDA the prefetch thread pins each batch and copies it on a side
stream, ``non_blocking``), in two rows run alternately in one process so both see the same machine:

- ``host`` (the baseline, what every run did before): ``normalize_on = "host"``, float32 crosses;
- ``device`` (the default on CUDA): ``normalize_on = "device"``, uint8 crosses and is normalized after the copy.

Each batch then trains a small CNN (dutycycle's ``cnn``, ``--width`` 64) for one step with fused AdamW where the
device has it, so the copy of the next batch has compute to hide behind. Per row: bytes per batch
(``LoaderStats.bytes_per_batch``, exact on any device), mean step time over ``--epochs`` epochs after a warm-up
epoch, and ``ratio``: host's time over device's (above 1: the device path is faster). On a CPU there is no copy,
pinning or side stream: the bytes are what would be sent, and the times compare only NumPy's normalization
in the prefetch thread with torch's on the consumer's thread.

    python benchmarks/gpu_input.py --device cuda --out /tmp/gpu_input.json
    python benchmarks/gpu_input.py --quick --out /tmp/gpu_input.json          # CPU: the bytes only mean much
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

from benchmarks._common import machine, main_for


def _cache(path: str, samples: int) -> str:
    import hashlib

    import numpy as np
    from dutycycle.engine.cache.write import write_cache

    uri = os.path.join(path, f"gpu-input-{samples}")
    if not os.path.exists(os.path.join(uri, "manifest.json")):
        rng = np.random.default_rng(0)
        images = rng.integers(0, 256, size=(samples, 64, 64, 3), dtype=np.uint8)
        ids = sorted(hashlib.sha256(f"s{i}".encode()).hexdigest()[:32] for i in range(samples))
        write_cache(uri, ids, np.arange(samples) % 4, ["train"] * samples, images,
                    classes=[f"c{i}" for i in range(4)], rows_per_shard=4096)
    return uri


def _step_time(loader, model, optimizer, device, epochs: int) -> float:
    """Mean seconds per training step over ``epochs`` passes (after one warm-up pass)."""
    import torch
    import torch.nn.functional as F

    def one_pass() -> int:
        n = 0
        for batch in loader:
            x = batch["image"].to(device, non_blocking=True)
            y = batch["label"].to(device, non_blocking=True)
            if not x.is_floating_point():
                x = x.float().div_(255.0)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            n += 1
        return n

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    one_pass()
    sync()
    t0, steps = time.perf_counter(), 0
    for _ in range(epochs):
        steps += one_pass()
    sync()
    return (time.perf_counter() - t0) / max(steps, 1)


def run(args) -> dict:
    import torch
    from dutycycle.loader import AugmentConfig, CacheLoader, LoaderConfig
    from dutycycle.trainer.config import ModelSection, OptimSection
    from dutycycle.trainer.step.data import delivery
    from dutycycle.trainer.step.models import build_model
    from dutycycle.trainer.step.optim import fused_choice, implementation, make_optimizer

    device = torch.device(args.device)
    uri = _cache(args.workdir, args.samples)
    base = LoaderConfig(global_batch_size=args.batch, mode="thread", prefetch=2, augment=AugmentConfig(flip=True),
                        **delivery(device))
    loaders = {where: CacheLoader(uri, "train", config=dataclasses.replace(base, normalize_on=where))
               for where in ("host", "device")}
    model = build_model(ModelSection(width=args.width), 3, 4, 64).to(device)
    optim = OptimSection(lr=1e-3)
    optimizer = make_optimizer(model.parameters(), optim)
    times: dict[str, list[float]] = {w: [] for w in loaders}
    for _ in range(args.rounds):  # alternate, so both rows see the same machine
        for where, loader in loaders.items():
            times[where].append(_step_time(loader, model, optimizer, device, args.epochs))
    rows = {}
    for where, loader in loaders.items():
        d = loader.delivery
        rows[where] = {"normalize_on": d["normalize_on"], "pinned": d["pinned"], "side_stream": d["side_stream"],
                       "copy_ahead": d["copy_ahead"], "bytes_per_batch": d["bytes_per_batch"],
                       "step_s": min(times[where]), "step_s_all": times[where]}
    host, dev = rows["host"], rows["device"]
    return {
        "benchmark": "gpu_input",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "samples": args.samples, "batch": args.batch, "epochs": args.epochs, "rounds": args.rounds,
        "optimizer": {"implementation": implementation(optimizer),
                      "why": fused_choice(list(model.parameters()), optim)[1]},
        "rows": rows,
        "bytes_ratio": host["bytes_per_batch"] / dev["bytes_per_batch"],
        "ratio": host["step_s"] / dev["step_s"],
        "machine": machine(),
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    p.add_argument("--samples", type=int, default=16384)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=64, help="the CNN's first channels (the compute per step)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "dutycycle-bench"))
    p.add_argument("--quick", action="store_true", help="1,024 samples, width 8, one round of one epoch")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "gpu_input.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.samples, args.epochs, args.rounds, args.width = 1024, 1, 1, 8
    return args


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    raise SystemExit(main_for(parse_args, run))
