"""The run's summary at the end of the loop: per-rank phase totals and held memory gathered (collectives: every
rank calls it), the consolidated model written, the parallel layout, traffic and memory against their formulas."""

from __future__ import annotations

import dataclasses

from dutycycle.engine import io
from dutycycle.trainer.parallel.plan import expected_held, expected_traffic, zero_formula
from dutycycle.trainer.parallel.state import full_state_dict, to_safetensors
from dutycycle.trainer.parallel.tensor import expected_for

from .modelfile import MODEL_FILE, model_metadata, weights_digest
from .optim import optimizer_state_tensors
from .timing import ALL_PHASES, gather_stats


def summarize_run(cfg, ctx, strategy, optimizer, sampler, timer, log, M, *, info, wall, eval_s, steps, epochs,
               steps_per_epoch, num_params, precision, fps, peak, val, once) -> dict:
    """Gather per-rank totals and memory, write the consolidated model, build the summary (every rank calls
    this: it holds collectives)."""
    import torch

    world = ctx.world_size
    totals = dict(timer.totals)
    totals["eval"] = totals.get("eval", 0.0) + eval_s
    per_rank = gather_stats([totals[k] for k in ALL_PHASES])
    per_rank_totals = [dict(zip(ALL_PHASES, row.tolist(), strict=True)) for row in per_rank]
    held_keys = ("params", "grads", "optimizer", "residuals", "optimizer_file")
    held = gather_stats([sampler.peak[k] for k in held_keys])
    full = full_state_dict(strategy)  # a collective; rank 0 gets the tensors
    digest = weights_digest(full) if ctx.rank == 0 else None
    if ctx.rank == 0 and ctx.run_dir and cfg.run.save_model:
        # the weights with what they need to stand alone (class names, preprocessing, model, lineage): modelfile.py
        metadata = model_metadata(cfg, info, full, digest)
        io.write_bytes_atomic(io.join(ctx.run_dir, MODEL_FILE), to_safetensors(full, metadata))

    plan = strategy.plan
    master = torch.finfo(strategy.compute_dtype).bits // 8
    compute = 2 if precision == "bf16" and plan.fsdp else master
    state_per_param = optimizer_state_tensors(cfg.optim)
    optim_bytes = None if state_per_param is None else state_per_param * master
    # FSDP2 gathers parameters in the compute dtype (bf16 under mixed precision) and reduces gradients in its
    # reduce dtype (fp32 there, the master's otherwise); DDP all-reduces the fp32 gradients autocast leaves
    # the parameters ZeRO shards: one tensor-parallel rank's share under tensor parallelism, all of them otherwise
    numel = strategy.tensor_numel or num_params
    parallel = _parallel(cfg, strategy, precision, numel=numel, compute=compute, master=master, steps=steps)
    memory = {
        "held_per_rank": [dict(zip(held_keys, r.tolist(), strict=True)) for r in held],
        "expected": expected_held(plan, numel, master, compute, master, optim_bytes or 0,
                                  residual_bytes=4 if plan.fsdp and strategy.quant.error_feedback else 0,
                                  root_numel=strategy.root_numel),
        # the paper's formula over the ranks that share the state (a replica group under hybrid sharding, the
        # data-parallel ranks under tensor parallelism, each holding one tensor-parallel rank's share)
        "zero_formula": zero_formula(plan.zero_stage, numel, plan.shard_size, compute, master, optim_bytes or 0),
        "optimizer_formula_known": optim_bytes is not None,
        "cuda_peak_bytes": sampler.cuda_peak(ctx.device),
    }
    return M.summarize(
        steps=steps, samples=log.samples, first_loss=log.first_loss, final_loss=log.last_loss, val_accuracy=val[0],
        val_loss=val[1], wall_s=wall, per_rank_totals=per_rank_totals, world_size=world,
        device=str((ctx.device or torch.device("cpu")).type), num_params=num_params, flops_per_sample=fps,
        peak_flops_per_device=peak, rows=log.writer.rows if log.writer.enabled else None, one_time=once,
        extra={
            "epochs": epochs, "steps_per_epoch": steps_per_epoch, "global_batch_size": cfg.data.global_batch_size,
            "micro_batches": cfg.data.micro_batches, "data_source": cfg.data.source,
            "data_fingerprint": info.fingerprint, "data": info.to_dict(), "parallel": parallel, "memory": memory,
            "threads_per_worker": torch.get_num_threads(),
            "weights_sha256": digest,
            **ctx.info,
        },
    )


def _parallel(cfg, strategy, precision: str, *, numel: int, compute: int, master: int, steps: int) -> dict:
    """The layout as run, and its traffic measured and by formula."""
    plan = strategy.plan
    gathered_bytes, reduced_bytes = numel * compute, numel * master
    traffic = strategy.meter.traffic["train"]
    return {
        "zero_stage": plan.zero_stage, "strategy": strategy.name, "offload": cfg.parallel.offload,
        "micro_batches": plan.micro_batches, "reduce_every_micro_step": plan.reduce_every_micro_step,
        "reshard_after_forward": plan.reshard_after_forward, "units": strategy.units, "precision": precision,
        # the root unit's parameter elements: never resharded after forward (parallel/apply.py)
        "root_numel": strategy.root_numel,
        # hybrid sharding: replica groups, and the ranks each parameter is sharded over (the world when flat)
        "replicate": plan.replicate, "shard_size": plan.shard_size,
        # tensor parallelism: ranks per group, the token split, and its activation exchanges (measured on the
        # first step, and the formula's: parallel/tensor.py)
        "tensor": plan.tensor, "sequence_parallel": strategy.sequence_parallel, "tensor_numel": numel,
        "tensor_traffic_per_step": dict(strategy.tensor_traffic.bytes) if strategy.tensor_traffic else {},
        "expected_tensor_traffic_per_step": expected_for(strategy.module, plan, cfg.data.global_batch_size, compute,
                                                         strategy.sequence_parallel),
        "quantization": dataclasses.asdict(strategy.quant),
        "node_ids": list(strategy.meter.topology.node_ids),  # each rank's node, as observed
        "comm_exposed_measured": strategy.meter.host_timing,
        "traffic": traffic.to_dict(),
        "traffic_per_step": {k: v / max(1, steps) for k, v in traffic.per_kind_bytes().items()},
        "expected_traffic_per_step": expected_traffic(plan, gathered_bytes, reduced_bytes,
                                                      root_param_bytes=strategy.root_numel * compute),
        "eval_traffic": strategy.meter.traffic["eval"].to_dict(),
    }
