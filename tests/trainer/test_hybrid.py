"""Hybrid sharding (``parallel.replicate``, FSDP2's HSDP on a 2-D mesh) on real gloo ranks: the same weights as one
process in float64, its groups taken from the observed node placement, bytes per step and memory against the
formulas, the all-reduce counted across nodes and the rest inside, and DCP checkpoints across a change of layout.

Tolerance 1e-10 as in test_zero.py (sums reordered across ranks: ~1e-16 relative per operation in float64).
"""

from __future__ import annotations

import math

import pytest
import torch
from dutycycle.engine.errors import ConfigError
from dutycycle.trainer.checkpoint.weights import model_state_dict, select_commit

from ..support import ckpt_worker as cw

TOLERANCE = 1e-10
STRIDED = ("a", "b", "a", "b")  # PACK-like placement where a node's ranks are not consecutive
# name -> (stage, micro_batches, offload, reduce_every_micro_step, replicate, node ids); 4 ranks
CONFIGS = {
    "stage3 two nodes": (3, 1, False, False, 2, ("a", "a", "b", "b")),
    "stage2 strided, accumulation": (2, 2, False, False, 0, STRIDED),
    "stage1 offload, strided": (1, 2, True, False, 0, STRIDED),
    "stage3 every micro-batch, one node": (3, 2, False, True, 2, ()),
}


def _cnn():
    from dutycycle.trainer.step.models import SmallCNN

    return SmallCNN(3, 4, width=8, depth=3, groups=2)  # rows divisible by 2: no FSDP2 padding


def _worker(rank, world):
    from dutycycle.trainer.cluster.world import World
    from dutycycle.trainer.parallel.apply import root_parameters
    from dutycycle.trainer.parallel.plan import expected_held, expected_traffic

    from ..support.zero_worker import STEPS, full_params, train

    ref = full_params(train(0, 1, stage=0)[0])
    out = {"configs": {}}
    for name, (stage, micro, offload, every, replicate, nodes) in CONFIGS.items():
        strategy, _, _, norms = train(rank, world, stage=stage, micro_batches=micro, offload=offload,
                                      reduce_every=every, replicate=replicate, node_ids=nodes)
        got = full_params(strategy)
        groups = [torch.distributed.get_process_group_ranks(g) for g in _groups(strategy)]
        out["configs"][name] = {"diff": max(float((got[k] - ref[k]).abs().max()) for k in ref) if rank == 0
                                else None, "groups": groups, "shard_size": strategy.plan.shard_size}
        # accounting on a model without padding, fp32 (what the formulas count)
        model_strategy, _, sampler, _ = train(rank, world, stage=stage, micro_batches=micro, offload=offload,
                                              reduce_every=every, replicate=replicate, node_ids=nodes,
                                              model_fn=_cnn, grad_clip=0.0, dtype=torch.float32)
        plan = model_strategy.plan
        numel = sum(p.numel() for p in _cnn().parameters())
        root = sum(p.numel() for p in root_parameters(_cnn()))  # the root unit: not resharded after forward
        traffic = model_strategy.meter.traffic["train"]
        out["configs"][name].update(
            numel=numel, root_numel=root, traffic=traffic.to_dict(), steps=STEPS,
            expected_sent=expected_traffic(plan, numel * 4, numel * 4, root * 4), held=sampler.peak,
            expected_held=expected_held(plan, numel, 4, 4, 4, 8, root_numel=root),
            world_nodes=World(rank, world, node_ids=nodes).nodes if nodes else [list(range(world))])
    out["observed"] = _through_the_loop(rank, world)
    return out


def _through_the_loop(rank, world):
    """The trainer's own path: every rank reports its node (here by DUTYCYCLE_NODE_ID, as the network-namespace
    benchmarks do), ``parallel.replicate = 0`` takes one group per observed node."""
    import os

    from dutycycle.trainer.config import load_config
    from dutycycle.trainer.step.loop import WorkerContext
    from dutycycle.trainer.step.trainer import Trainer

    os.environ["DUTYCYCLE_NODE_ID"] = "node-" + "ab"[rank % 2]
    cfg = load_config(None, ["data.source=synthetic", "data.size=16", "data.global_batch_size=32",
                             "data.synthetic_samples=64", "model.width=8", "run.max_steps=2", "run.eval_every=0",
                             "run.log_every=0", "run.precision=fp64", f"parallel.num_workers={world}",
                             "parallel.zero_stage=3", "parallel.replicate=0"])
    with Trainer(cfg, WorkerContext(rank=rank, world_size=world)) as trainer:
        summary = trainer.train()
    return {k: summary["parallel"][k] for k in ("replicate", "shard_size", "node_ids", "traffic", "strategy")}


def _groups(strategy):
    """(shard group, replicate group) of the FSDP2 mesh behind the root's parameters."""
    mesh = next(p for p in strategy.model.parameters()).device_mesh
    return mesh.get_group("shard"), mesh.get_group("replicate")


@pytest.fixture(scope="module")
def four_ranks(four_ranks_shared):
    """``_worker`` at 4 ranks (in the session's shared spawn: tests/trainer/conftest.py)."""
    return four_ranks_shared[1]["hybrid"]


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first to ask sets up the shared 4-rank spawn
def test_hybrid_sharding_equals_one_process_in_float64(four_ranks):
    for name, c in four_ranks[0]["configs"].items():
        assert c["diff"] <= TOLERANCE, f"{name}: max |w - w_ref| = {c['diff']:.3g}"
        assert c["shard_size"] == 2, name


@pytest.mark.slow
def test_groups_follow_the_observed_placement(four_ranks):
    """A replica group is one node's ranks, whatever their numbers: with nodes a, b, a, b the shard groups are
    {0, 2} and {1, 3} and the all-reduce pairs 0 with 1 (same shard, other node)."""
    by_rank = {r: res["configs"] for r, res in enumerate(four_ranks)}
    strided = [by_rank[r]["stage2 strided, accumulation"]["groups"] for r in range(4)]
    assert [g[0] for g in strided] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g[1] for g in strided] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    consecutive = [by_rank[r]["stage3 two nodes"]["groups"] for r in range(4)]
    assert [g[0] for g in consecutive] == [[0, 1], [0, 1], [2, 3], [2, 3]]


@pytest.mark.slow
def test_the_trainer_builds_the_groups_from_the_nodes_its_ranks_report(four_ranks):
    got = four_ranks[0]["observed"]
    assert got["node_ids"] == ["node-a", "node-b", "node-a", "node-b"]
    assert (got["strategy"], got["replicate"], got["shard_size"]) == ("fsdp2", 2, 2)
    kinds = got["traffic"]["per_kind"]
    assert got["traffic"]["inter_node_bytes"] == kinds["all_reduce"]["inter_node_bytes"] > 0


@pytest.mark.slow
def test_bytes_per_step_match_the_formula_and_only_the_all_reduce_crosses_nodes(four_ranks):
    for r in four_ranks:
        for name, c in r["configs"].items():
            kinds = c["traffic"]["per_kind"]
            sent = {k: (v["intra_node_bytes"] + v["inter_node_bytes"]) / c["steps"] for k, v in kinds.items()}
            assert sent.keys() == c["expected_sent"].keys() == {"all_gather", "reduce_scatter", "all_reduce"}, name
            for kind, expected in c["expected_sent"].items():
                assert sent[kind] == pytest.approx(expected, rel=1e-12), (name, kind)
            if c["world_nodes"] != [[0, 1, 2, 3]]:  # two nodes: gathers and reduce-scatter stay inside
                assert kinds["all_gather"]["inter_node_bytes"] == kinds["reduce_scatter"]["inter_node_bytes"] == 0
                assert kinds["all_reduce"]["intra_node_bytes"] == 0 and kinds["all_reduce"]["inter_node_bytes"] > 0
    # the formula itself: stage 3, one micro-batch, 2 x 2: the all-reduce carries half a gradient shard's worth;
    # the blocks are gathered twice, the root unit once (not resharded after forward)
    c = four_ranks[0]["configs"]["stage3 two nodes"]
    grads, root = c["numel"] * 4, c["root_numel"] * 4
    assert c["expected_sent"] == {"reduce_scatter": grads / 2, "all_gather": (2 * grads - root) / 2,
                                  "all_reduce": grads / 2}


@pytest.mark.slow
def test_memory_held_matches_the_formula_over_the_replica_group(four_ranks):
    """Within 1% plus the optimizer's step counters: state divided by the group's 2 ranks, not the world's 4."""
    for r in four_ranks:
        for name, c in r["configs"].items():
            for cat in ("params", "grads", "optimizer"):
                expected, held = c["expected_held"][cat], c["held"][cat]
                assert abs(held - expected) <= 0.01 * expected + 8 * 16, (name, cat, held, expected)
            assert c["expected_held"]["optimizer"] == pytest.approx(c["numel"] * 8 / 2)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first to ask sets up the shared 4-rank spawn
def test_checkpoints_load_across_hybrid_and_flat_layouts(four_ranks_shared):
    """Saved hybrid (2 groups of 2), loaded into flat stage 3 over 4 ranks, saved there and loaded hybrid again:
    model and optimizer state bit-identical each time, and one more step matches within the float64 tolerance."""
    root, runs = four_ranks_shared
    tmp_path = root / "hybrid"
    r = runs["hybrid round trip"][0]  # cw.hybrid_round_trip at 4 ranks under tmp_path
    saved = r["saved"]
    assert saved["shard_size"] == 2
    # the hybrid commit's model weights loaded unsharded into this one process, as `dutycycle evaluate` loads them
    # (checkpoint/weights.py; the rest of an evaluation does not depend on the layout: test_evaluate_layouts.py)
    state = model_state_dict(select_commit(str(tmp_path / "hybrid")))
    assert cw._digest(state) == saved["model_digest"]
    for name, shard_size in (("hybrid to flat", 4), ("flat back to hybrid", 2)):
        got = r[name]
        assert got["step"] == 4 and got["shard_size"] == shard_size, name
        assert got["digest"] == saved["digest"], f"{name}: loaded state differs"
        worst = max(float((torch.tensor(got["after"][k]) - torch.tensor(saved["after"][k])).abs().max())
                    for k in saved["after"])
        assert worst < TOLERANCE, (name, worst)


# ------------------------------------------------------------------------------------ plans and refusals


def test_hybrid_groups_cut_each_node_into_whole_groups():
    from dutycycle.trainer.cluster.topology import observe
    from dutycycle.trainer.parallel.plan import replica_groups

    assert replica_groups(observe(0, 4, labels=["a", "b", "a", "b"]), 0) == [[0, 2], [1, 3]]
    assert replica_groups(observe(0, 8, labels=list("aaaabbbb")), 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert replica_groups(observe(0, 4, labels=list("aaaa")), 2) == [[0, 1], [2, 3]]  # one node: allowed
    with pytest.raises(ConfigError, match=r"parallel\.replicate = 2 .*span nodes") as e:
        replica_groups(observe(0, 4, labels=["a", "a", "a", "b"]), 2)
    assert "node 'a': ranks 0-2; node 'b': rank 3" in str(e.value)
    with pytest.raises(ConfigError, match="groups of at least 2"):
        replica_groups(observe(0, 2, labels=["a", "b"]), 0)  # one rank per node: nothing to shard (that is DDP)


def test_the_formula_against_flat_stage3_across_nodes():
    """What hybrid buys: at 2 nodes of 8, flat stage 3 sends 15/16 of 3 model sizes from each rank, most of it
    across nodes; hybrid sends its gathers and reduce-scatter inside the node and 2 x (1/8) x (1/2) of a model
    size across."""
    from dutycycle.trainer.parallel.plan import expected_traffic, make_plan

    size = 1_000_000
    flat = expected_traffic(make_plan(3, 16), size, size)
    hybrid = expected_traffic(make_plan(3, 16, replicate=2), size, size)
    assert sum(flat.values()) == pytest.approx(3 * size * 15 / 16)
    assert hybrid["all_reduce"] == pytest.approx(size / 8)
    assert hybrid["all_gather"] + hybrid["reduce_scatter"] == pytest.approx(3 * size * 7 / 8)
    assert math.isclose(make_plan(3, 16, replicate=2).shard_size, 8)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.replicate=2", "parallel.zero_stage=0"], r"zero_stage = 0 shards nothing"),
    (["parallel.replicate=3"], r"must divide parallel\.num_workers = 4"),
    (["parallel.replicate=-1"], r"must be >= 0"),
    (["parallel.replicate=2", "parallel.quant_grads=int8"], r"quant_grads = 'int8'"),
    (["parallel.replicate=2", "parallel.quant_weights=int8"], r"quant_weights = 'int8'"),
    (["parallel.replicate=2", "parallel.hpz=true"], r"hpz = True"),
    (["parallel.replicate=2", "parallel.reduce_scatter=all_to_all"], r"reduce_scatter = 'all_to_all'"),
])
def test_bad_hybrid_settings_name_the_key(overrides, message):
    from dutycycle.trainer.config import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, ["data.source=synthetic", "parallel.num_workers=4", "parallel.zero_stage=3", *overrides])


def test_the_demo_config_accepts_hybrid_sharding():
    from dutycycle.trainer.config import load_config

    from ..support import REPO

    cfg = load_config(str(REPO / "configs" / "demo.toml"), ["parallel.num_workers=4", "parallel.replicate=0",
                                                            "parallel.quant_grads=none"])
    assert cfg.parallel.replicate == 0 and cfg.parallel.zero_stage == 2
