"""FSDP2 set up as DeepSpeed and torchtitan set it, on real gloo ranks: stage 2 holds 1/W of the gradients at any
number of micro-batches (it reduce-scatters every micro-batch into the owner's shard), the root unit is not
resharded after forward at stage 3 (one all-gather per micro-batch less), and the unshards ask for async_op only
where FSDP2 has no streams of its own (CPU)."""

from __future__ import annotations

import pytest
import torch

from ..support.harness import run_distributed

WORLD = 2
MICRO = 4


def _cnn():
    from dutycycle.trainer.step.models import SmallCNN

    return SmallCNN(3, 4, width=8, depth=3, groups=2)  # rows divisible by 2: no FSDP2 padding in the bytes


def _worker(rank, world):
    from dutycycle.trainer.parallel.apply import root_parameters
    from dutycycle.trainer.parallel.fsdp_api import unshard_async
    from dutycycle.trainer.parallel.plan import expected_held

    from ..support.zero_worker import train

    numel = sum(p.numel() for p in _cnn().parameters())
    out = {"numel": numel, "root_numel": sum(p.numel() for p in root_parameters(_cnn()))}
    # one optimizer step each (memory is sampled in the first): the counts below are per step
    strategy, _, sampler, _ = train(rank, world, stage=2, micro_batches=MICRO, model_fn=_cnn, grad_clip=0.0,
                                    dtype=torch.float32, steps=1)
    out["stage2"] = {"held": sampler.peak, "expected": expected_held(strategy.plan, numel, 4, 4, 4, 8),
                     "calls": strategy.meter.traffic["train"].calls, "units": len(strategy.units) + 1}
    strategy = train(rank, world, stage=3, model_fn=_cnn, grad_clip=0.0, dtype=torch.float32, steps=1)[0]
    out["stage3"] = {"calls": strategy.meter.traffic["train"].calls, "units": len(strategy.units),
                     "unshard_async": unshard_async(strategy.model)}
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_worker, WORLD, timeout=240)


def test_stage2_holds_one_shard_of_the_gradients_under_accumulation(ranks):
    """At 4 micro-batches a stage-2 rank's peak gradient bytes are 1/W of the model's (fp32, no padding: exact),
    as the ledger's formula says (before, it held the full gradients across the window, as stage 1 does): every
    micro-batch reduce-scatters each unit once into the owners' shards."""
    for r in ranks:
        two = r["stage2"]
        assert two["expected"]["grads"] == r["numel"] * 4 / WORLD
        assert two["held"]["grads"] == pytest.approx(r["numel"] * 4 / WORLD, rel=1e-12), two["held"]
        assert two["calls"]["reduce_scatter"] == MICRO * two["units"], two["calls"]


def test_stage3_gathers_the_root_once_per_micro_batch(ranks):
    """Stage 3, one micro-batch: every block is gathered in forward and again in backward, the root (stem-less
    CNN: the head) once, as its parameters stay unsharded from forward to the end of backward."""
    for r in ranks:
        s3 = r["stage3"]
        assert s3["units"] == 3 and r["root_numel"] > 0
        assert s3["calls"]["all_gather"] == 2 * s3["units"] + 1, s3["calls"]


def test_unshard_async_only_where_fsdp2_has_no_streams(ranks):
    from dutycycle.trainer.parallel.apply import unshard_async_wanted

    assert all(all(r["stage3"]["unshard_async"]) and len(r["stage3"]["unshard_async"]) == 4 for r in ranks)
    assert unshard_async_wanted(torch.device("cpu"))
    assert not unshard_async_wanted(torch.device("cuda", 0)) and not unshard_async_wanted(torch.device("meta"))
