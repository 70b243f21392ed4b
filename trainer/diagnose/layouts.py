"""Experiment 7 of ``dutycycle diagnose`` (experiments.py lists them all): model-state bytes per rank for every
layout (ZeRO stages, host and NVMe offload, hybrid sharding, tensor parallelism), from the formulas the tests
check, ordered from the least communication to the most, against the device's memory budget."""

from __future__ import annotations

import os

from dutycycle.loader.budget import node_memory_limit
from dutycycle.trainer.parallel.apply import root_parameters
from dutycycle.trainer.parallel.dims import ParallelDims
from dutycycle.trainer.parallel.plan import expected_held, expected_traffic, inter_node_bytes, make_plan
from dutycycle.trainer.parallel.tensor import expected_for, tensor_share
from dutycycle.trainer.step.models import build_model
from dutycycle.trainer.step.optim import optimizer_state_tensors

from .context import Context, data_info
from .findings import MemoryFinding


def memory(ctx: Context) -> MemoryFinding:
    """Model-state bytes per rank (parameters, gradients, optimizer state) for every layout: ZeRO stages without
    offload, with host offload and with NVMe offload (the optimizer state on disk), on several nodes hybrid
    sharding (one replica group per node) at each stage, and tensor parallelism in groups inside a node where
    the model has a plan (parallel/tensor.py; activations, which it also divides, are not counted); from the
    model's parameter count and the formulas the tests check; and the budget they must fit. Rows go from the
    least communication to the most: bytes per step across nodes first (parallel.node_size; 0 = one node), then
    in all, NVMe offload after every other layout, so the first row that fits is the cheapest layout that fits."""
    import torch

    cfg = ctx.cfg
    info = data_info(ctx)
    model = build_model(cfg.model, info.channels, info.num_classes, info.size)
    numel = sum(p.numel() for p in model.parameters())
    w = cfg.parallel.num_workers
    gpu = torch.cuda.is_available() and cfg.parallel.use_gpu != "false"
    master = 8 if cfg.run.precision == "fp64" else 4
    compute = 2 if (cfg.run.precision == "bf16" or (cfg.run.precision == "auto" and gpu)) else master
    optim_bytes = (optimizer_state_tensors(cfg.optim) or 2) * master
    budget, source = ctx.memory_budget_bytes, "--memory-budget-mb"
    if budget is None:
        budget, source = device_budget(gpu, w)
    node_size = cfg.parallel.node_size or w
    nodes = w // node_size
    dims = ParallelDims.from_config(cfg.parallel, world_size=w, node_size=node_size, validate=False)
    # hybrid sharding: one replica group per node when there are nodes, and the configured count
    mine_replicate = dims.replicate
    replicates = sorted({1, nodes if nodes > 1 and node_size > 1 else 1, mine_replicate})
    # tensor parallelism: every group size inside a node that the model's plan accepts (with ZeRO, no offload).
    # Not offered beside ZeRO++ options, which it does not combine with: the fix would have to turn quantization
    # off as well, a speed decision this memory experiment does not make
    p = cfg.parallel
    zeropp = p.quant_grads != "none" or p.quant_weights != "none" or p.hpz or p.reduce_scatter == "all_to_all"
    sizes = [] if zeropp else [t for t in range(2, node_size + 1) if node_size % t == 0]
    if dims.tp_enabled and dims.tensor not in sizes:  # the configured one, even beside ZeRO++ (then refused at config)
        sizes.append(dims.tensor)
    shares = {t: tensor_share(model, t) for t in sizes}
    shares = {1: numel, **{t: n for t, n in shares.items() if n is not None}}
    rows = []
    for stage in (0, 1, 2, 3):
        # offload: False, True (host memory), "nvme" (optimizer state in files; nothing of it in memory)
        for offload in ((False, True, "nvme") if stage else (False,)):
            for replicate in (replicates if stage else (1,)):
                for tensor in (shares if stage and not offload and replicate == 1 else (1,)):
                    row = _layout_row(stage, offload, replicate, tensor, shares[tensor], ctx, model, w, node_size,
                                      master, compute, optim_bytes, gpu)
                    rows.append({**row, "fits": row["device_bytes"] <= budget})
    # NVMe last: it makes a run fit at the price of reading and writing the whole optimizer state every step;
    # then by bytes across nodes, then in all (stable: ties keep the stage order)
    rows.sort(key=lambda r: (r["offload"] == "nvme", r["inter_node_bytes"], r["traffic_bytes"]))
    offload = "nvme" if dims.nvme else dims.offload_enabled  # the rows' values: False, True (host memory), "nvme"
    # the configured layout is always a row: config.validate refuses a tensor size this model or node cannot take
    mine = next(r for r in rows if r["zero_stage"] == cfg.parallel.zero_stage and r["offload"] == offload
                and r["replicate"] == mine_replicate and r["tensor"] == dims.tensor)
    return MemoryFinding(num_params=numel, workers=w, node_size=node_size, budget_bytes=budget, budget_from=source,
                         rows=rows, configured=mine, activations_counted=False)


def _layout_row(stage, offload, replicate: int, tensor: int, share: int, ctx, model, w: int, node_size: int,
                master: int, compute: int, optim_bytes: int, gpu: bool) -> dict:
    """One layout's model state per rank (the formulas the tests check) and its bytes per step, in all and across
    nodes. Under tensor parallelism ZeRO shards one tensor rank's ``share`` over the W / T data ranks, which span
    the nodes as a flat group of W / T would with node_size / T ranks per node; the activation exchanges stay
    inside the node."""
    cfg = ctx.cfg
    plan = make_plan(stage, w, cfg.data.micro_batches, cfg.parallel.reduce_every_micro_step, bool(offload),
                     replicate=replicate, optimizer_on_disk=offload == "nvme", tensor=tensor)
    # the root unit's parameters (stage 3 keeps them unsharded through a micro-batch); under tensor parallelism
    # the model's plan splits the blocks only, so every rank holds the whole root
    root = sum(q.numel() for q in root_parameters(model))
    held = expected_held(plan, share, master, compute if stage else master, master, optim_bytes, root_numel=root)
    traffic = expected_traffic(plan, share * (compute if stage else master), share * master,
                               root_param_bytes=root * (compute if stage else master))
    data_plan = make_plan(stage, w // tensor, cfg.data.micro_batches, cfg.parallel.reduce_every_micro_step)
    across = inter_node_bytes(data_plan if tensor > 1 else plan, traffic, node_size // tensor)
    traffic = {**traffic, **(expected_for(model, plan, cfg.data.global_batch_size, compute,
                                          cfg.parallel.sequence_parallel) or {})}
    # offload keeps the shards (parameters, gradients, optimizer state) in host memory: on a GPU only the
    # unsharded working copy is device memory; on CPU the device is the host, so nothing moves
    on_device = held["params"] - (share / plan.shard_size * master if offload and gpu else 0) + \
        (0 if offload and gpu else held["grads"] + held["optimizer"])
    return {"zero_stage": stage, "offload": offload, "replicate": replicate, "tensor": tensor, **held,
            "device_bytes": on_device, "traffic_bytes": sum(traffic.values()), "inter_node_bytes": across}


def device_budget(gpu: bool, workers: int) -> tuple[int, str]:
    """Per-rank memory: the GPU's, or the host's (cgroup limit if lower) shared by the workers of this node."""
    import torch

    if gpu:
        return int(torch.cuda.get_device_properties(0).total_memory), "GPU memory"

    total = node_memory_limit() or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // max(1, workers), "host memory (cgroup limit if lower) / workers"
