"""Activation checkpointing per block (``parallel.activation_checkpointing``, trainer/parallel/activation.py):
composed with every ZeRO stage it trains the same weights as without, it really recomputes, and saved names are
the plain model's.

Parity is exact (``torch.equal``), in float64, on 2 gloo ranks: non-reentrant recomputation runs the same ops
on the same inputs in the same order, dropout draws the same masks (the RNG state is restored for it), and the
gradients reach DDP / FSDP2 as the same values; nothing is summed in another order, so no tolerance is needed.
A control with the RNG not preserved shows dropout really exercises that.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ..support.harness import run_distributed

STEPS, MICRO = 3, 2
CALLS: dict[int, int] = {}  # block index -> forward calls, counted by a hook on each of the user's blocks


class DropBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.conv(x)))


class DropNet(nn.Module):
    """Blocks with dropout: recomputation must draw the masks forward drew."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.blocks = nn.Sequential(DropBlock(6), DropBlock(6))
        self.head = nn.Linear(6, 4)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def counted_dropnet():
    model = DropNet()
    CALLS.clear()
    for i, block in enumerate(model.blocks):
        CALLS[i] = 0
        # a pre-hook: recomputation stops once backward has what it needs (torch's early stop), so the block's
        # forward may not return there and a post-hook would miss it
        block.register_forward_pre_hook(lambda *_, i=i: CALLS.__setitem__(i, CALLS[i] + 1))
    return model


def _keys(strategy, optimizer) -> dict:
    from dutycycle.trainer.parallel.state import sharded_state_dict

    model_sd, optim_sd = sharded_state_dict(strategy, optimizer)
    return {"model": sorted(model_sd), "optim": sorted(optim_sd["state"]),
            "groups": [sorted(g["params"]) for g in optim_sd["param_groups"]]}


def _parity_worker(rank, world):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from ..support.zero_worker import Quirky, full_params, train

    def run(stage, ac, model_fn=counted_dropnet, steps=STEPS):
        strategy, optimizer, _, norms = train(rank, world, stage=stage, micro_batches=MICRO, model_fn=model_fn,
                                              find_unused=stage == 0, steps=steps, activation_checkpointing=ac)
        return strategy, optimizer, norms, dict(CALLS)

    out = {}
    for stage in (0, 1, 2, 3):
        plain_s, plain_o, plain_norms, plain_calls = run(stage, False)
        ac_s, ac_o, ac_norms, ac_calls = run(stage, True)
        plain, ac = full_params(plain_s), full_params(ac_s)
        # Quirky: tied weights (blocks.1 stays in the root unit), a frozen and a sometimes-unused layer
        q_plain = full_params(run(stage, False, Quirky)[0])
        q_ac = full_params(run(stage, True, Quirky)[0])
        # DCP across the switch: the plain run's sharded model state loads into a fresh checkpointed model
        fresh = run(stage, True, steps=0)[0]
        set_model_state_dict(fresh.module, get_model_state_dict(plain_s.module))
        loaded = full_params(fresh)
        out[stage] = {
            "equal": rank != 0 or (plain.keys() == ac.keys() and all(torch.equal(plain[k], ac[k]) for k in plain)),
            "quirky_equal": rank != 0 or all(torch.equal(q_plain[k], q_ac[k]) for k in q_plain),
            "loaded_equal": rank != 0 or all(torch.equal(plain[k], loaded[k]) for k in plain),
            "norms": [plain_norms, ac_norms], "calls": [plain_calls, ac_calls],
            "keys": [_keys(plain_s, plain_o), _keys(ac_s, ac_o)], "full_keys": sorted(ac),
            "wrapped": type(ac_s.module.blocks[0]).__name__, "units": ac_s.units,
        }
    # the control: recomputation that does not restore the RNG draws other dropout masks
    # (activation.py's own name for torch's wrapper, which it takes from fsdp_api.py)
    from dutycycle.trainer.parallel import activation as cw

    original = cw.checkpoint_wrapper
    cw.checkpoint_wrapper = lambda m, **kw: original(m, **{**kw, "preserve_rng_state": False})
    try:
        unpreserved = full_params(run(0, True)[0])
    finally:
        cw.checkpoint_wrapper = original
    plain = full_params(run(0, False)[0])
    out["rng_control_diff"] = max(float((plain[k] - unpreserved[k]).abs().max()) for k in plain) if rank == 0 \
        else None
    return out


@pytest.fixture(scope="module")
def parity():
    return run_distributed(_parity_worker, 2, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpointing_trains_the_same_weights_at_every_stage(parity, stage):
    for r in parity:
        s = r[str(stage)]
        assert s["equal"] and s["quirky_equal"], stage
        assert s["norms"][0] == s["norms"][1]
        assert s["wrapped"].endswith("CheckpointWrapper")
        if stage:
            assert s["units"] == ["blocks.0", "blocks.1"]  # FSDP2 shards each wrapped block as its own unit


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_blocks_are_recomputed_in_backward(parity, stage):
    """One forward per micro-batch without checkpointing; forward plus recomputation with it."""
    for r in parity:
        plain, ac = r[str(stage)]["calls"]
        assert plain == {"0": STEPS * MICRO, "1": STEPS * MICRO}
        assert ac == {"0": 2 * STEPS * MICRO, "1": 2 * STEPS * MICRO}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_saved_names_are_the_plain_models(parity, stage):
    """DCP's model and optimizer keys and the consolidated (safetensors) keys carry no wrapper segment, and the
    plain run's DCP state loads into a checkpointed model."""
    for r in parity:
        s = r[str(stage)]
        assert s["keys"][0] == s["keys"][1]
        assert not any("_checkpoint_wrapped_module" in k for k in s["keys"][1]["model"] + s["keys"][1]["optim"])
        assert s["loaded_equal"]
    assert parity[0][str(stage)]["full_keys"] == sorted(DropNet().state_dict())


@pytest.mark.slow
def test_dropout_needs_the_rng_restored(parity):
    assert parity[0]["rng_control_diff"] > 1e-6


def test_state_dict_loads_across_the_switch():
    """A model saved with checkpointing loads into one without, and back (strict names both ways)."""
    from dutycycle.trainer.cluster.world import World
    from dutycycle.trainer.config import ParallelSection
    from dutycycle.trainer.parallel.apply import parallelize

    torch.manual_seed(0)
    plain = DropNet()
    torch.manual_seed(1)
    model = DropNet()
    strategy = parallelize(model, ParallelSection(activation_checkpointing=True), World(),
                           device=torch.device("cpu"))
    assert type(strategy.module.blocks[1]).__name__ == "CheckpointWrapper"
    assert list(model.state_dict()) == list(plain.state_dict())
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_modules())  # really wrapped
    model.load_state_dict(plain.state_dict())  # strict: plain names into the checkpointed model
    torch.manual_seed(2)
    other = DropNet()
    other.load_state_dict(model.state_dict())  # and the checkpointed model's names into a plain one
    for k, v in plain.state_dict().items():
        assert torch.equal(model.state_dict()[k], v) and torch.equal(other.state_dict()[k], v), k


def test_a_model_without_blocks_is_refused_naming_the_key():
    from dutycycle.engine.errors import ConfigError
    from dutycycle.trainer.cluster.world import World
    from dutycycle.trainer.config import ParallelSection
    from dutycycle.trainer.parallel.apply import parallelize

    with pytest.raises(ConfigError, match=r"parallel.activation_checkpointing = true .*Linear has none"):
        parallelize(nn.Linear(2, 2), ParallelSection(activation_checkpointing=True), World(),
                    device=torch.device("cpu"))
    parallelize(nn.Linear(2, 2), ParallelSection(), World(), device=torch.device("cpu"))  # off: no complaint
