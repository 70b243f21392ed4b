"""Error feedback's residuals per parameter (trainer/parallel/residuals.py): a residual always goes back into its
own parameter's gradient, whichever parameters a step uses, and survives a checkpoint by parameter name, bit for
bit at the same world size and redistributed (its pending correction kept) at another.

The multi-process test runs 2 real gloo ranks (tests/support/ef_param_worker.py): float64 models, stage 3, int4
gradient exchange, fixed weights, a block with two branches of one shape taking turns and a layer frozen for the
first half of the run (error feedback with parameters that get no gradient)."""

from __future__ import annotations

import pytest
import torch
from dutycycle.trainer.parallel import residuals

from ..support import ef_param_worker as w
from ..support.harness import run_distributed


@pytest.fixture(scope="module")
def changing(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ef-param") / "residuals")
    return run_distributed(w.changing_params, 2, ckpt, timeout=240)


@pytest.mark.timeout(300)
def test_error_feedback_never_raises_the_accumulated_error_when_the_used_parameters_change(changing):
    """Over 8 steps the exchanged gradients summed minus the exact ones summed, per parameter: with error feedback
    it is never larger than without. (Keyed by flat position in the unit's input, branch a's residual was sent
    with branch b's 50x smaller gradient: b's accumulated error was 45x the one without error feedback.)"""
    for rank_out in changing:
        params = rank_out["params"]
        assert set(params) == {"stem.weight", "stem.bias", "blocks.0.a.weight", "blocks.0.a.bias",
                               "blocks.0.b.weight", "blocks.0.b.bias", "blocks.1.0.weight", "blocks.1.0.bias",
                               "late.weight", "late.bias", "head.weight", "head.bias"}
        for name, p in params.items():
            assert p["norm"] > 0 and p["err_plain"] > 0, (name, p)  # every parameter trained and lost something
            assert p["err_ef"] <= p["err_plain"], (name, p)
        assert sum(p["err_ef"] for p in params.values()) < 0.5 * sum(p["err_plain"] for p in params.values())


@pytest.mark.timeout(300)
def test_the_accumulated_error_is_exactly_the_pending_correction_of_each_parameter(changing):
    """Error feedback's telescoping, per parameter: sum of exchanged gradients + the correction still owed (f/W
    times the sum over ranks of the parameter's residual) = sum of exact gradients. The exchange adds and sums in
    fp32: the fp64 gradient rounded to fp32, the residual's add, the decode and the sum of W = 2 contributions,
    each at most 2^-24 relative, a handful per element and step; 2^-20 (16 roundings) times the sum over the steps
    of the gradient's and the residual's largest magnitudes bounds them. A residual sent with another parameter
    misses this by the size of the residual itself (1e-3 to 2e-2 here)."""
    for rank_out in changing:
        for name, p in rank_out["params"].items():
            tol = 2.0 ** -20 * (p["scale"] + w.STEPS * p["pending"])
            assert p["telescoping"] <= tol, (name, p, tol)
            assert p["pending"] > 0, name
    # the frozen layer is out of the reduce-scatter while frozen: its residual stays zero until it trains
    assert changing[0]["late_residual_while_frozen"] == [0.0, 0.0]
    # a root unit without parameters of its own holds no residual (and error feedback still builds)
    assert changing[0]["blocks_only"] == ["blocks.0.bias", "blocks.0.weight", "blocks.1.bias", "blocks.1.weight"]


@pytest.mark.timeout(300)
def test_residuals_are_restored_bit_for_bit_and_redistributed_at_another_world_size(changing):
    """Saved by parameter name with DCP: read back at 2 ranks, every rank's buffer is bit-identical; read at 1
    rank, the one rank takes both old ranks' residuals (0 and 1, congruent to 0 mod 1) and the correction still owed
    to each parameter is the same (f/W * sum over ranks: 2/2 * (R0 + R1) before, 1/1 * R' after)."""
    for rank_out in changing:
        assert rank_out["same_world"] == {"why": "", "equal": True, "nonzero": rank_out["same_world"]["nonzero"]}
        assert rank_out["same_world"]["nonzero"] > 0
    before, one = changing[0]["pending"], changing[0]["one_rank"]
    assert one["why"] == "" and one["sources"] == [0, 1]
    assert set(one["pending"]) == set(before)
    for name, value in before.items():
        a, b = torch.tensor(value), torch.tensor(one["pending"][name])
        # R0 + R1 summed once in fp32 on the one rank, in fp64 by the all-reduce before: one fp32 rounding
        assert torch.allclose(a, b, rtol=0, atol=2.0 ** -23 * float(a.abs().max())), name
        assert float(a.abs().max()) > 0


# dims > 0 are sharded evenly only (FSDP2 refuses the rest)
LAYOUTS = [(shape, dim, world) for shape, dim in [((5, 3), 0), ((1,), 0), ((7,), 0), ((4, 6), 1), ((2, 4, 3), 1)]
           for world in (1, 2, 3, 4) if dim == 0 or shape[dim] % world == 0]


@pytest.mark.parametrize("shape,dim,world", LAYOUTS)
def test_a_residual_block_round_trips_through_the_parameters_shape(shape, dim, world):
    """FSDP2's reduce-scatter layout of one parameter (fsdp_api.GradSlot): dim-0 chunks padded to ceil(rows / W)
    rows; Shard(k) chunks along k stacked along dim 0. Element (i, j) of the parameter sits where FSDP2's
    chunk-and-pad puts it, and the padding comes back zero."""
    full = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    chunks = list(torch.chunk(full, world, dim=dim))
    if dim == 0:
        rows = -(-shape[0] // world)
        padded = [torch.cat([c, torch.zeros(rows - c.shape[0], *shape[1:])]) for c in chunks]
        padded += [torch.zeros(rows, *shape[1:])] * (world - len(padded))
    else:
        padded = chunks
    fsdp_layout = torch.stack([c.reshape(-1) for c in padded])
    assert torch.equal(residuals.to_param(fsdp_layout, shape, dim), full)
    block = torch.full_like(fsdp_layout, float("nan"))
    residuals.from_param(full, block, dim)
    assert torch.equal(block, fsdp_layout)


@pytest.mark.parametrize("old_dp,new_dp,tensor", [(4, 2, 1), (2, 4, 1), (4, 3, 1), (3, 2, 2), (2, 1, 2)])
def test_redistribution_keeps_the_pending_correction_of_every_tensor_index(old_dp, new_dp, tensor):
    """Each new rank takes the old ranks of its tensor index congruent to it modulo the new data-parallel size,
    scaled by (D'/D)(f/f'); per tensor index, f'/D' * sum R' = f/D * sum R (fp64 here: exact up to rounding), and
    every old rank is taken exactly once."""
    g = torch.Generator().manual_seed(0)
    old_ranks = [[d, t] for d in range(old_dp) for t in range(tensor)]
    rows = [torch.randn(6, generator=g, dtype=torch.float64) for _ in old_ranks]
    f_old, f_new = 2.0, 1.0  # fp64 at 4 ranks pre-divides by 2; fp32 never does
    new_ranks = [[d, t] for d in range(new_dp) for t in range(tensor)]
    scale = residuals.redistribution_scale(old_dp, new_dp, f_old, f_new)
    taken = []
    for t in range(tensor):
        new = []
        for here in (r for r in new_ranks if r[1] == t):
            src = residuals.sources(old_ranks, here, new_dp)
            taken += src
            new.append(scale * sum((rows[q] for q in src), torch.zeros(6, dtype=torch.float64)))
        before = f_old / old_dp * sum(rows[q] for q, r in enumerate(old_ranks) if r[1] == t)
        after = f_new / new_dp * sum(new)
        assert torch.allclose(before, after, rtol=1e-15, atol=1e-15)
    assert sorted(taken) == list(range(len(old_ranks)))
