"""Workers for tests/trainer/test_parity_check.py: short runs of the Trainer at 2 gloo ranks with
``parallel.check_every``, and the same with a reduce-scatter that drops a rank's contribution."""

from __future__ import annotations

import json

from .ckpt_worker import small_cfg, train

STAGE3_QGZ_EF = ["parallel.zero_stage=3", "parallel.quant_grads=int8", "parallel.error_feedback=true",
                 "checkpoint.every=0", "run.max_steps=3", "run.health_check=false"]


def rows(run_dir: str) -> list[dict]:
    with open(f"{run_dir}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _run(rank: int, world: int, run_dir: str, *extra: str) -> dict:
    summary = train(small_cfg(run_dir, f"parallel.num_workers={world}", *STAGE3_QGZ_EF, *extra), rank, world)
    return {"weights": summary["weights_sha256"], "rows": rows(run_dir) if rank == 0 else None,
            "summary": summary.get("parity_check")}


def _dropping_rank_1(rank: int):
    """Every quantized reduce-scatter (comm.QuantReduceScatter, the seam FSDP2 calls) loses rank 1's
    contribution: rank 1 sends zeros. The output is then half the mean where rank 0's gradient is and zero where
    only rank 1's was: the kind of silent error a broken bucket or routing makes."""
    from dutycycle.trainer.parallel import comm

    real = comm.QuantReduceScatter.__call__

    def dropping(self, output_tensor, input_tensor, group, op, async_op=False):
        if rank == 1:
            input_tensor = input_tensor.new_zeros(input_tensor.shape)
        return real(self, output_tensor, input_tensor, group, op, async_op)

    comm.QuantReduceScatter.__call__ = dropping
    return lambda: setattr(comm.QuantReduceScatter, "__call__", real)


def parity_runs(rank: int, world: int, root: str) -> dict:
    """Stage 3, int8 qgZ with error feedback, 3 steps: checked at every step; the same run unchecked (off by
    default); the checked run with a reduce-scatter that drops rank 1's contribution (stopped at step 1)."""
    from dutycycle.engine.errors import ParityCheckFailed

    out = {"checked": _run(rank, world, f"{root}/checked", "parallel.check_every=1"),
           "off": _run(rank, world, f"{root}/off"),
           # float64: FSDP2 pre-divides the reduce-scatter's input (a SUM, then a post-division) where fp32 is an
           # AVG, so the quantizer sees the gradient scaled down and the bound must scale its A back up
           "fp64": _run(rank, world, f"{root}/fp64", "parallel.check_every=1", "run.precision=fp64")}
    restore = _dropping_rank_1(rank)
    try:
        _run(rank, world, f"{root}/corrupted", "parallel.check_every=1")
        out["corrupted"] = {"caught": False}
    except ParityCheckFailed as e:
        out["corrupted"] = {"caught": True, "message": str(e), "step": e.step, "parameter": e.parameter,
                            "measured": e.error, "bound": e.bound, "rows": rows(f"{root}/corrupted")
                            if rank == 0 else None, "is_value_error": isinstance(e, ValueError)}
    finally:
        restore()
    return out
