"""Tensor parallelism (``parallel.tensor``) composed with FSDP2 on a (data, tensor) mesh, on real gloo ranks: the
same weights as one process in float64 at 2 and 4 ranks, with and without sequence parallelism; the activation
exchanges and FSDP2's bytes per step and the memory held against their formulas; the groups taken from the
observed node placement; DCP checkpoints across a change of layout (tensor 2 x data 2 -> data 4 -> back).

Tolerance 1e-10 as in test_zero.py (sums reordered across ranks: ~1e-16 relative per operation in float64,
amplified by Adam's division by sqrt(v) where gradients are small; measured here: ~2e-11 after 4 steps).
"""

from __future__ import annotations

import pytest
import torch
from dutycycle.engine.errors import ConfigError
from dutycycle.trainer.checkpoint.weights import model_state_dict, select_commit

from ..support import tensor_worker as tw
from ..support.harness import run_calls

TOLERANCE = 1e-10
# name -> (stage, micro_batches, parallel keys); the ViT's 17 tokens split 9 + 8 over a group of 2
CONFIGS = {
    "stage3 sequence parallel": (3, 1, {"tensor": 2}),
    "stage2 accumulation, no sequence parallel": (2, 2, {"tensor": 2, "sequence_parallel": False}),
    "stage1 accumulation": (1, 2, {"tensor": 2}),
}


def _worker(rank, world, configs=None):
    from dutycycle.trainer.parallel.plan import expected_traffic
    from dutycycle.trainer.parallel.tensor import expected_traffic as tensor_traffic
    from dutycycle.trainer.parallel.tensor import tensor_share

    from ..support.zero_worker import GLOBAL_BATCH, STEPS, full_params, train

    ref = full_params(train(0, 1, stage=0, model_fn=tw.vit)[0])
    out = {}
    for name in configs or CONFIGS:
        stage, micro, keys = CONFIGS[name]
        strategy, _, sampler, _ = train(rank, world, stage=stage, micro_batches=micro, model_fn=tw.vit, **keys)
        got = full_params(strategy)
        plan, numel, padded = strategy.plan, strategy.tensor_numel, _padded_numel(strategy)
        mesh = strategy.model.blocks[0].attn.q.weight.device_mesh  # (data, tensor)
        out[name] = {
            "diff": max(float((got[k] - ref[k]).abs().max()) for k in ref) if rank == 0 else None,
            "groups": [torch.distributed.get_process_group_ranks(mesh.get_group(d)) for d in ("data", "tensor")],
            "numel": numel, "full_numel": sum(v.numel() for v in ref.values()), "steps": STEPS,
            "traffic": strategy.meter.traffic["train"].to_dict(),
            "padded": padded,
            "expected_sent": expected_traffic(plan, padded * 8, padded * 8, _padded_numel(strategy, root=True) * 8),
            "tensor_sent": dict(strategy.tensor_traffic.bytes),
            "expected_tensor": tensor_traffic(blocks=2, batch=GLOBAL_BATCH // plan.shard_size, tokens=17, width=16,
                                              tensor=2, elem_bytes=8, syncs=1,
                                              sequence_parallel=keys.get("sequence_parallel", True)),
            "held": sampler.peak,
            "expected_held": _held_formula(plan, numel, padded, _padded_numel(strategy, root=True)),
            "local": sum(p.to_local().numel() for p in strategy.module.parameters()),
            "share": tensor_share(tw.vit(), 2, keys.get("sequence_parallel", True)),  # from the plan alone
        }
    return out


def _held_formula(plan, numel: int, padded: int, root_padded: int) -> dict:
    """plan.expected_held in float64 over the padded elements FSDP2 holds (its shards, and the all-gather output
    stages 1-2 keep), except gradients accumulated across micro-batches: those are the parameters' own unsharded
    gradients, without padding. (AdamW's state is the unpadded shard's: the test counts it exactly.)"""
    from dutycycle.trainer.parallel.plan import expected_held

    sharded = expected_held(plan, padded, 8, 8, 8, 16, root_numel=root_padded)
    accumulates = plan.micro_batches > 1 and not plan.reduce_every_micro_step
    grads = numel * 8 if accumulates else sharded["grads"]
    return {"params": sharded["params"], "grads": grads}


def _padded_numel(strategy, root: bool = False) -> int:
    """One tensor-parallel rank's parameter elements as FSDP2 shards them: each parameter's first dimension padded
    to a multiple of the data ranks (the ViT's class token and position table have a first dimension of 1). The
    formulas count elements; FSDP2 moves and holds the padded ones. ``root``: the root unit's parameters only."""
    import math

    from dutycycle.trainer.parallel.apply import root_parameters
    from torch.distributed.tensor import Shard

    dp, total = strategy.plan.shard_size, 0
    for p in root_parameters(strategy.module) if root else strategy.module.parameters():
        shape = list(p.shape)
        if p.device_mesh.ndim == 2 and isinstance(p.placements[1], Shard):  # split over the tensor dimension too
            shape[p.placements[1].dim] //= strategy.plan.tensor
        total += math.ceil(shape[0] / dp) * dp * math.prod(shape[1:])
    return total


@pytest.fixture(scope="module")
def four_ranks(four_ranks_shared):
    """``_worker`` over every config at 4 ranks (in the session's shared spawn: tests/trainer/conftest.py)."""
    return four_ranks_shared[1]["tensor"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The 2-rank workloads in one spawn: ``_worker`` on one config, and ``cw.resume_runs`` of the ViT at stage 3."""
    root = tmp_path_factory.mktemp("tensor-two")
    return run_calls(2, [("alone", "tests.trainer.test_tensor:_worker", (["stage3 sequence parallel"],)),
                         ("resume", "tests.support.ckpt_worker:resume_runs",
                          (str(root), [3], (*VIT, "parallel.tensor=2")))], timeout=500)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first to ask sets up the shared 4-rank spawn
def test_tensor_2_by_data_2_equals_one_process_in_float64(four_ranks):
    for name, c in four_ranks[0].items():
        assert c["diff"] <= TOLERANCE, f"{name}: max |w - w_ref| = {c['diff']:.3g}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tensor_2_alone_equals_one_process_at_2_ranks(two_ranks):
    """Two ranks, one tensor-parallel group: every layer split, no data parallelism left (FSDP2 over one rank)."""
    got = two_ranks["alone"]
    c = got[0]["stage3 sequence parallel"]
    assert c["diff"] <= TOLERANCE, c["diff"]
    assert [r["stage3 sequence parallel"]["groups"] for r in got] == [[[0], [0, 1]], [[1], [0, 1]]]


@pytest.mark.slow
def test_groups_are_consecutive_ranks_of_a_node_and_share_a_batch(four_ranks):
    groups = [r["stage3 sequence parallel"]["groups"] for r in four_ranks]
    assert [g[1] for g in groups] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # tensor groups
    assert [g[0] for g in groups] == [[0, 2], [1, 3], [0, 2], [1, 3]]  # data groups


@pytest.mark.slow
def test_activation_exchanges_match_the_formula(four_ranks):
    """Measured on the first step from DTensor's own collectives: all-gathers, reduce-scatters (sequence parallel)
    or all-reduces (without), byte for byte what parallel/tensor.py's formula says."""
    for r in four_ranks:
        for name, c in r.items():
            assert c["tensor_sent"].keys() == c["expected_tensor"].keys(), name
            for kind, expected in c["expected_tensor"].items():
                assert c["tensor_sent"][kind] == pytest.approx(expected, rel=1e-12), (name, kind)


@pytest.mark.slow
def test_fsdp_bytes_per_step_are_over_the_data_ranks_on_one_tensor_share(four_ranks):
    for r in four_ranks:
        for name, c in r.items():
            kinds = c["traffic"]["per_kind"]
            sent = {k: (v["intra_node_bytes"] + v["inter_node_bytes"]) / c["steps"] for k, v in kinds.items()}
            assert sent.keys() == c["expected_sent"].keys(), name
            for kind, expected in c["expected_sent"].items():
                assert sent[kind] == pytest.approx(expected, rel=1e-12), (name, kind)


@pytest.mark.slow
def test_memory_held_matches_the_formula_on_one_tensor_share(four_ranks):
    """Each rank holds its tensor share (the blocks' weights halved, the rest whole) divided by the 2 data ranks:
    parameters and gradients within 1% of the formula; AdamW's two state tensors exactly the rank's unsharded
    elements (an uneven split: the class token's one row lands on one data rank), plus the step counters; the
    data ranks' elements add up to one tensor share."""
    for name in four_ranks[0]:
        by_rank = [r[name] for r in four_ranks]
        assert by_rank[0]["local"] + by_rank[2]["local"] == by_rank[0]["numel"], name  # data group {0, 2}
        for c in by_rank:
            assert c["full_numel"] / 2 < c["numel"] == c["share"] < c["full_numel"], name
            for cat in ("params", "grads"):
                expected, held = c["expected_held"][cat], c["held"][cat]
                assert abs(held - expected) <= 0.01 * expected, (name, cat, held, expected)
            assert 0 <= c["held"]["optimizer"] - c["local"] * 16 <= 8 * 32, (name, c["held"]["optimizer"])


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first to ask sets up the shared 4-rank spawn
def test_checkpoints_load_across_tensor_and_data_layouts(four_ranks_shared):
    """Saved tensor 2 x data 2, loaded into data 4, saved there and loaded back: model and optimizer state
    bit-identical each time, and one more step matches within the float64 tolerance."""
    root, runs = four_ranks_shared
    r = runs["tensor round trip"][0]  # tw.round_trip at 4 ranks
    saved = r["saved"]
    # the tensor 2 x data 2 commit's model weights gathered into this one process, as `dutycycle evaluate` loads
    # them (checkpoint/weights.py)
    state = model_state_dict(select_commit(str(root / "tensor" / "tensor")))
    assert tw._digest(state) == saved["model_digest"]
    for name, tensor in (("tensor to data", 1), ("data back to tensor", 2)):
        got = r[name]
        assert got["step"] == 3 and got["tensor"] == tensor, name
        assert got["digest"] == saved["digest"], f"{name}: loaded state differs"
        worst = max(float((torch.tensor(got["after"][k]) - torch.tensor(saved["after"][k])).abs().max())
                    for k in saved["after"])
        assert worst < TOLERANCE, (name, worst)


VIT = ("model.name=tests.support.ckpt_models:risky_vit", "model.width=16", "model.heads=4", "model.depth=2",
       "model.patch=4")  # 16x16 images: 17 tokens


def _through_the_loop(rank, world):
    """The trainer's own path at 4 ranks on nodes a, b, a, b (reported by DUTYCYCLE_NODE_ID): tensor 2 x data 2,
    then data 4 on the same config, float64."""
    import os

    from ..support import ckpt_worker as cw

    os.environ["DUTYCYCLE_NODE_ID"] = "node-" + "ab"[rank % 2]
    out = {}
    for name, tensor in (("tensor", 2), ("data", 1)):
        # the plain ViT: the risky one's dropout draws masks per rank batch, which differ between the layouts
        cfg = cw.small_cfg("", *VIT, "model.name=vit", "run.max_steps=3", "run.log_every=0", "run.precision=fp64", "checkpoint.every=0",
                           f"parallel.num_workers={world}", "parallel.zero_stage=3", f"parallel.tensor={tensor}")
        s = cw.train(cfg, rank, world)
        out[name] = {"loss": s["final_loss"], "samples": s["samples"], "weights": s["weights_sha256"],
                     "val_samples": s["val_samples"], "val_loss": s["val_loss"],
                     **{k: s["parallel"][k] for k in ("tensor", "shard_size", "tensor_traffic_per_step",
                                                      "expected_tensor_traffic_per_step", "node_ids")}}
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first to ask sets up the shared 4-rank spawn
def test_the_trainer_runs_tensor_parallel_on_the_observed_nodes(four_ranks_shared):
    """Through the Trainer: the tensor-parallel groups are {0, 2} and {1, 3} (one per node), each group reads one
    batch (3 steps of 32 samples counted once), the loss matches data parallelism over 4 ranks in float64, and
    the summary's measured activation exchanges equal its formula."""
    r = four_ranks_shared[1]["tensor loop"][0]  # _through_the_loop at 4 ranks
    tp, dp = r["tensor"], r["data"]
    assert tp["node_ids"] == ["node-a", "node-b", "node-a", "node-b"]
    assert (tp["tensor"], tp["shard_size"], dp["tensor"], dp["shard_size"]) == (2, 2, 1, 4)
    assert tp["samples"] == dp["samples"] == 3 * 32
    # validation: every sample once (48 of the synthetic split), the same mean loss as data parallelism
    assert tp["val_samples"] == dp["val_samples"] == 48
    assert tp["val_loss"] == pytest.approx(dp["val_loss"], rel=1e-12)
    assert tp["loss"] == pytest.approx(dp["loss"], rel=1e-12, abs=TOLERANCE)
    assert tp["tensor_traffic_per_step"].keys() == tp["expected_tensor_traffic_per_step"].keys() != set()
    for kind, expected in tp["expected_tensor_traffic_per_step"].items():
        assert tp["tensor_traffic_per_step"][kind] == pytest.approx(expected, rel=1e-12), kind
    assert dp["tensor_traffic_per_step"] == dp["expected_tensor_traffic_per_step"] == {}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tensor_parallel_resume_after_a_crash_is_bit_identical(two_ranks):
    """Two ranks, one tensor-parallel group, stage 3: a run crashed at step 11 resumes from its step-8 commit (model,
    optimizer, RNG for the head's dropout, loader position) and ends with the uninterrupted run's weights."""
    r = two_ranks["resume"][0]["3"]  # cw.resume_runs
    assert r["crashed"] and r["resumed"]["step"] == 8, r
    assert r["b"] == r["a"] and r["loss_b"] == r["loss_a"]


# ------------------------------------------------------------------------------------ plans and refusals


def test_tensor_groups_cut_each_node_and_refuse_a_group_across_nodes():
    from dutycycle.trainer.cluster.topology import observe
    from dutycycle.trainer.parallel.dims import ParallelDims
    from dutycycle.trainer.parallel.plan import tensor_groups

    def data_ranks(world, tensor):
        return ParallelDims(world_size=4, zero_stage=1, tensor=tensor, world=world).data_ranks()

    assert tensor_groups(observe(0, 4, labels=["a", "b", "a", "b"]), 2) == [[0, 2], [1, 3]]
    assert [data_ranks(observe(r, 4, labels=["a", "b", "a", "b"]), 2) for r in range(4)] == [(0, 2), (1, 2)] * 2
    assert data_ranks(observe(3, 4, labels=list("aaaa")), 1) == (3, 4)
    with pytest.raises(ConfigError, match=r"parallel\.tensor = 2 .*node 'a': ranks 0-2; node 'b': rank 3"):
        tensor_groups(observe(0, 4, labels=["a", "a", "a", "b"]), 2)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tensor=3"], r"must divide parallel\.num_workers = 4"),
    (["parallel.tensor=2", "parallel.zero_stage=0"], r"zero_stage = 0 is DDP"),
    (["parallel.tensor=0"], r"parallel\.tensor"),
    (["parallel.tensor=2", "parallel.replicate=2"], r"replicate = 2"),
    (["parallel.tensor=2", "parallel.quant_grads=int8"], r"quant_grads = 'int8'"),
    (["parallel.tensor=2", "parallel.offload=optimizer"], r"offload = 'optimizer'"),
    (["parallel.tensor=2", "model.name=cnn"], r"model\.name = 'cnn' has none"),
    (["parallel.tensor=4", "model.name=vit", "model.heads=2", "model.width=8"], r"must divide model\.heads = 2"),
    (["parallel.tensor=2", "model.name=vit", "parallel.node_size=1"], r"must divide parallel\.node_size = 1"),
])
def test_bad_tensor_settings_name_the_key(overrides, message):
    from dutycycle.trainer.config import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, ["data.source=synthetic", "parallel.num_workers=4", "parallel.zero_stage=3", *overrides])


def test_a_model_without_a_plan_or_with_indivisible_heads_is_refused():
    from dutycycle.trainer.parallel.apply import ensure_process_group
    from dutycycle.trainer.parallel.tensor import apply_tensor_parallel
    from dutycycle.trainer.step.models import SmallCNN, TinyViT
    from torch.distributed.device_mesh import init_device_mesh

    created = not torch.distributed.is_initialized()
    ensure_process_group(torch.device("cpu"))  # a one-process group in memory, as a local run makes
    try:
        mesh = init_device_mesh("cpu", (1,))
        with pytest.raises(ConfigError, match=r"SmallCNN has no tensor_parallel_plan.*model\.name = 'vit'"):
            apply_tensor_parallel(SmallCNN(3, 4), mesh, True)
    finally:
        if created:  # leave the test process as it was
            torch.distributed.destroy_process_group()
    with pytest.raises(ConfigError, match=r"parallel\.tensor = 2 must divide the ViT's heads \(model\.heads = 3\)"):
        TinyViT(3, 4, 8, dim=12, heads=3, patch=4).tensor_parallel_plan(2, True)


def test_the_demo_config_accepts_tensor_parallelism():
    from dutycycle.trainer.config import load_config

    from ..support import REPO

    cfg = load_config(str(REPO / "configs" / "demo.toml"), ["parallel.num_workers=4", "parallel.tensor=2",
                                                            "parallel.quant_grads=none", "model.name=vit"])
    assert cfg.parallel.tensor == 2 and cfg.parallel.sequence_parallel
