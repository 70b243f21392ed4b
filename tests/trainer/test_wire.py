"""What each collective puts on the wire, on 2 real gloo ranks in one spawn: the dtype every collective records
(``CommMeter.wire``) for each precision (fp64, fp32, bf16) and quantization (none, qwZ int8, qgZ int8/int4, the
unquantized all-to-all reduce-scatter, hpZ's secondary gathers, hybrid sharding's all-reduce, DDP's all-reduce,
tensor parallelism's DTensor collectives); float64 parity of the all-to-all reduce-scatter (float64 on the wire,
so float64 agreement); and the quantized reduce-scatter's ``async_op``: a work handle whose ``wait`` gives exactly
the synchronous result. The collectives' own numbers are in test_qcollectives.py."""

from __future__ import annotations

import pytest
import torch

from ..support.harness import run_distributed

I8, I4 = "int8+fp32 scales", "int4+fp32 scales"
# name -> (precision, zero stage, parallel keys, the dtype each collective kind must send). bf16 under FSDP2 is
# MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): bf16 gathers, fp32 gradient reduction
CONFIGS = {
    "fp64": ("fp64", 3, {}, {"all_gather": "float64", "reduce_scatter": "float64"}),
    "fp32": ("fp32", 3, {}, {"all_gather": "float32", "reduce_scatter": "float32"}),
    "bf16": ("bf16", 3, {}, {"all_gather": "bfloat16", "reduce_scatter": "float32"}),
    "fp64-ddp": ("fp64", 0, {}, {"all_reduce": "float64"}),
    "fp32-ddp": ("fp32", 0, {}, {"all_reduce": "float32"}),
    "fp32-qwz": ("fp32", 3, {"quant_weights": "int8"}, {"all_gather": I8, "reduce_scatter": "float32"}),
    "bf16-qwz": ("bf16", 3, {"quant_weights": "int8"}, {"all_gather": I8, "reduce_scatter": "float32"}),
    "fp32-qgz-int8": ("fp32", 3, {"quant_grads": "int8"}, {"all_gather": "float32", "reduce_scatter": I8}),
    "fp64-qgz-int4": ("fp64", 3, {"quant_grads": "int4"}, {"all_gather": "float64", "reduce_scatter": I4}),
    "fp32-a2a": ("fp32", 3, {"reduce_scatter": "all_to_all"}, {"all_gather": "float32", "reduce_scatter": "float32"}),
    "fp64-a2a": ("fp64", 3, {"reduce_scatter": "all_to_all"}, {"all_gather": "float64", "reduce_scatter": "float64"}),
    "bf16-a2a": ("bf16", 3, {"reduce_scatter": "all_to_all"},
                 {"all_gather": "bfloat16", "reduce_scatter": "float32"}),
}
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
N = 300  # elements per rank's reduce-scatter output in the direct checks (not a multiple of the block)


def _worker(rank, world):
    import torch.distributed as dist

    from ..support.zero_worker import full_params, train

    torch.set_num_threads(1)
    out = {"configs": {}}
    for name, (precision, stage, keys, _) in CONFIGS.items():
        # one SGD step (no momentum, decay or clipping): the weight change is -lr times the exchanged gradient
        strategy, _, _, _ = train(rank, world, stage=stage, dtype=torch.float64 if precision == "fp64" else
                                  torch.float32, precision=precision, grad_clip=0.0, find_unused=stage == 0,
                                  optim_name="sgd", optim_kwargs={"lr": 0.5, "momentum": 0.0, "weight_decay": 0.0},
                                  steps=1, **keys)
        wire = strategy.meter.wire("train")
        out["configs"][name] = {"wire": wire, "params": None}
        if name in ("fp64", "fp64-a2a"):
            out["configs"][name]["params"] = {k: v.tolist() for k, v in full_params(strategy).items()}
    out["hpz"] = _hpz_gathers(rank, world)
    out["tensor"] = _tensor_parallel(world)
    out["async"] = _async_reduce_scatter(rank, world)
    dist.barrier()
    return out


def _hpz_gathers(rank, world) -> dict:
    """hpZ's backward gathers run over a group smaller than the world (here one rank: a secondary group) and
    stay unquantized even under qwZ; the world gather is quantized. Hybrid sharding's all-reduce (FSDP2 issues
    it; the hook it calls next counts it: 2 ranks cannot form two replica groups of 2) records the reduced
    shard's dtype. Per parameter dtype, what each records."""
    import torch.distributed as dist
    from dutycycle.trainer.parallel.comm import (
        CommMeter,
        CountingAllGather,
        QuantAllGather,
        counting_hsdp_hook,
    )
    from dutycycle.trainer.parallel.traffic import Topology

    groups = [dist.new_group([r]) for r in range(world)]  # collective: every rank creates every group
    out = {}
    for name, dtype in DTYPES.items():
        meter = CommMeter(rank, Topology.uniform(world, 1))
        shard = torch.arange(5, dtype=dtype)
        CountingAllGather(meter, hpz=True)(torch.empty(5, dtype=dtype), shard, groups[rank])
        QuantAllGather(meter, 8, 256, hpz=True)(torch.empty(5, dtype=dtype), shard, groups[rank])
        QuantAllGather(meter, 8, 256, hpz=True)(torch.empty(5 * world, dtype=dtype), shard, None)
        counting_hsdp_hook(meter, None)(shard)
        out[name] = {k: v["dtypes"] for k, v in meter.wire().items()}
    return out


def _tensor_parallel(world) -> dict:
    """DTensor's collectives (tensor parallelism's activation exchanges) as TensorTraffic records them."""
    from dutycycle.trainer.parallel.tensor import TensorTraffic
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, dtype in DTYPES.items():
        sharded = distribute_tensor(torch.ones(2 * world, 3, dtype=dtype), mesh, [Shard(0)])
        partial = DTensor.from_local(torch.ones(4, dtype=dtype), mesh, [Partial()])
        with TensorTraffic() as traffic:
            sharded.redistribute(mesh, [Replicate()]).to_local()  # an all-gather
            partial.redistribute(mesh, [Replicate()]).to_local()  # an all-reduce
        out[name] = {k: v["dtypes"] for k, v in traffic.wire().items()}
    return out


def _async_reduce_scatter(rank, world) -> dict:
    """QuantReduceScatter called with and without ``async_op`` on the same input: flat (int8, int4, float64
    unquantized) and in two hops (one node of two: hop 1 in flight; two nodes of one: nothing in flight until
    hop 2, which ``wait`` runs)."""
    import torch.distributed as dist
    from dutycycle.trainer.parallel.comm import CommMeter, QuantReduceScatter
    from dutycycle.trainer.parallel.qcollectives import make_hierarchy
    from dutycycle.trainer.parallel.traffic import Topology

    one_node, two_nodes = make_hierarchy(Topology.uniform(world, world)), make_hierarchy(Topology.uniform(world, 1))
    gen = torch.Generator().manual_seed(rank)
    out = {}
    for name, bits, dtype, hierarchy in (("int8", 8, torch.float32, None), ("int4", 4, torch.float32, None),
                                         ("fp64", 32, torch.float64, None),
                                         ("int8-two-hop-one-node", 8, torch.float32, one_node),
                                         ("fp64-two-hop-two-nodes", 32, torch.float64, two_nodes)):
        x = torch.randn(world * N, generator=gen, dtype=torch.float64).to(dtype)
        meter = CommMeter(rank, hierarchy.topology if hierarchy else Topology.uniform(world, world))
        rs = QuantReduceScatter(meter, bits, 256, hierarchy)
        sync = torch.empty(N, dtype=dtype)
        returned = rs(sync, x, None, dist.ReduceOp.AVG)
        result = torch.full((N,), 7.0, dtype=dtype)
        work = rs(result, x, None, dist.ReduceOp.AVG, async_op=True)
        pending = bool((result == 7.0).all())  # written by wait(), not before
        is_work = isinstance(work, dist.Work)
        if is_work:
            work.wait()
        out[name] = {"sync_returned_none": returned is None, "is_work": is_work, "pending_before_wait": pending,
                     "completed": is_work and work.is_completed(), "identical": bool(torch.equal(result, sync)),
                     "async_started": meter.async_started,
                     "calls": meter.traffic["train"].calls.get("reduce_scatter", 0)}
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_worker, 2, timeout=240)


def test_each_collective_records_the_dtype_it_sends(ranks):
    """For every precision and quantization, every collective kind of the step records exactly the dtype the
    configuration sends: float64 stays float64 on the plain, hybrid and all-to-all paths; the quantized formats
    and bf16 change it, as configured. Bytes agree with the dtype: float64's are twice fp32's for each kind."""
    for r in ranks:
        for name, (_, _, _, expected) in CONFIGS.items():
            wire = r["configs"][name]["wire"]
            assert {k: v["dtypes"] for k, v in wire.items()} == {k: [v] for k, v in expected.items()}, name
            assert all(v["bytes"] > 0 and v["calls"] > 0 for v in wire.values()), (name, wire)
        c = r["configs"]
        for kind in ("all_gather", "reduce_scatter"):
            assert c["fp64"]["wire"][kind]["bytes"] == 2 * c["fp32"]["wire"][kind]["bytes"], kind
        # the all-to-all moves what the backend's reduce-scatter does at 2 ranks, in the same dtype
        assert c["fp64-a2a"]["wire"]["reduce_scatter"]["bytes"] == c["fp64"]["wire"]["reduce_scatter"]["bytes"]
        assert c["bf16"]["wire"]["all_gather"]["bytes"] * 2 == c["fp32"]["wire"]["all_gather"]["bytes"]
        for name in DTYPES:  # hpZ's node gathers: the weights' own dtype even beside qwZ; hybrid's all-reduce too
            assert r["hpz"][name] == {"all_gather_hpz": [name], "all_gather": [I8], "all_reduce": [name]}, name
            assert r["tensor"][name] == {"tp_all_gather": [name], "tp_all_reduce": [name]}, name


def test_float64_all_to_all_reduce_scatter_is_float64(ranks):
    """``parallel.reduce_scatter = "all_to_all"`` in float64: one SGD step lands where FSDP2's own reduce-scatter
    puts it to float64 rounding, not fp32's.

    Bound: each path sums the 2 ranks' float64 gradients (a + b: one correctly rounded addition, in any order)
    and halves them (exact), so the gradients agree to within 2u of their magnitude (u = 2^-53, allowing for a
    backend that rounds differently); the update w - lr g rounds once more in each run, u |w| each. So
    ||w_a2a - w_native|| <= 2u lr ||g|| + 2u ||w|| <= 4u (||w|| + ||dw||), dw = lr g the step. An fp32 wire
    errs by about 2^-24 ||dw|| (3e-8 relative to the step): 10^8 times the bound at this model's ||w||/||dw||."""
    from ..support.zero_worker import Quirky

    u = 2.0**-53
    r = ranks[0]  # the consolidated weights are rank 0's
    native = {k: torch.tensor(v, dtype=torch.float64) for k, v in r["configs"]["fp64"]["params"].items()}
    a2a = {k: torch.tensor(v, dtype=torch.float64) for k, v in r["configs"]["fp64-a2a"]["params"].items()}
    torch.manual_seed(0)  # the initialization zero_worker.train starts from
    w0 = {k: v.double() for k, v in Quirky().state_dict().items()}
    assert native.keys() == a2a.keys() == w0.keys()

    def norm(d):
        return float(sum((v**2).sum() for v in d.values())) ** 0.5

    step = norm({k: native[k] - w0[k] for k in w0})
    diff = norm({k: a2a[k] - native[k] for k in w0})
    assert step > 1e-3  # the step moved the weights: equal untouched models would prove nothing
    assert diff <= 4 * u * (norm(native) + step), (diff, step, norm(native))


def test_quantized_reduce_scatter_honours_async_op(ranks):
    """``async_op=True`` returns a ``dist.Work`` at once (the output not yet written); its ``wait`` gives exactly
    the synchronous call's result, flat and in two hops; without it the call finishes and returns None."""
    for r in ranks:
        for name, c in r["async"].items():
            assert c == {"sync_returned_none": True, "is_work": True, "pending_before_wait": True,
                         "completed": True, "identical": True, "async_started": 1, "calls": 2}, (name, c)
