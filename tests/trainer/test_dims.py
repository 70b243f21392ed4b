"""ParallelDims: the degrees resolved from the config section (before launch) and on the observed placement, the
questions the rest of the trainer asks, and each bad combination refused once, naming its keys."""

from __future__ import annotations

import pytest
from dutycycle.engine.errors import ConfigError
from dutycycle.trainer.cluster.topology import observe
from dutycycle.trainer.config import ParallelSection
from dutycycle.trainer.parallel.dims import ParallelDims


def test_degrees_from_the_config_section_alone():
    dims = ParallelDims.from_config(ParallelSection(num_workers=8, zero_stage=3, replicate=0, node_size=4))
    assert (dims.world_size, dims.replicate, dims.shard_size, dims.dp_size) == (8, 2, 4, 8)
    assert dims.hybrid_enabled and dims.fsdp_enabled and not dims.tp_enabled and not dims.offload_enabled
    # another world than the section's, as the layout search asks: one group per node of 2
    assert ParallelDims.from_config(ParallelSection(zero_stage=1, replicate=0), world_size=8, node_size=2).replicate == 4
    tp = ParallelDims.from_config(ParallelSection(num_workers=4, zero_stage=1, tensor=2))
    assert tp.tp_enabled and (tp.dp_size, tp.shard_size) == (2, 2)
    assert tp.data_ranks(3) == (1, 2)  # one node of 4 consecutive ranks: groups {0, 1}, {2, 3}
    nvme = ParallelDims.from_config(ParallelSection(num_workers=2, zero_stage=2, offload="nvme"))
    assert nvme.nvme and nvme.offload_enabled
    flat = ParallelDims.from_config(ParallelSection(num_workers=2))
    assert not (flat.fsdp_enabled or flat.hybrid_enabled or flat.nvme) and flat.data_ranks(1) == (1, 2)


def test_degrees_on_the_observed_placement():
    world = observe(2, 4, labels=["a", "b", "a", "b"])
    dims = ParallelDims.build(ParallelSection(num_workers=4, zero_stage=1, tensor=2), world)
    assert dims.tensor_groups() == [[0, 2], [1, 3]] and dims.data_ranks() == (0, 2)
    assert [dims.data_ranks(r) for r in range(4)] == [(0, 2), (1, 2)] * 2
    hybrid = ParallelDims.build(ParallelSection(num_workers=4, zero_stage=3, replicate=0), world)
    assert hybrid.replicate == 2 and hybrid.shard_groups() == [[0, 2], [1, 3]] and hybrid.shard_size == 2
    one_node = ParallelDims.build(ParallelSection(num_workers=4, zero_stage=3, replicate=0), observe(0, 4, labels=list("aaaa")))
    assert one_node.replicate == 1 and not one_node.hybrid_enabled and one_node.shard_groups() is None


@pytest.mark.parametrize("section, named", [
    (dict(num_workers=6, zero_stage=3, replicate=4), "parallel.replicate = 4 must divide parallel.num_workers = 6"),
    (dict(num_workers=4, zero_stage=0, replicate=2), "parallel.replicate = 2 shards inside each replica group"),
    (dict(num_workers=4, zero_stage=3, replicate=-1), "parallel.replicate = -1 must be >= 0"),
    (dict(num_workers=4, zero_stage=3, replicate=2, quant_grads="int8"), "does not combine with parallel.quant_grads"),
    (dict(num_workers=6, zero_stage=1, tensor=4), "parallel.tensor = 4 must divide parallel.num_workers = 6"),
    (dict(num_workers=4, zero_stage=0, tensor=2), "parallel.tensor = 2 composes with FSDP2"),
    (dict(num_workers=4, zero_stage=1, tensor=2, replicate=2), "parallel.tensor = 2 (tensor parallelism) does not"),
    (dict(num_workers=4, zero_stage=1, tensor=0), "parallel.tensor = 0 must be positive"),
    (dict(num_workers=2, zero_stage=0, offload="nvme"), "parallel.offload = 'nvme' needs sharded optimizer state"),
    (dict(num_workers=2, zero_stage=2, offload="nvme", offload_dir="s3://b/x"), "parallel.offload_dir = 's3://b/x' is remote"),
])
def test_bad_degrees_are_refused_naming_them(section, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        ParallelDims.from_config(ParallelSection(**section))
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        ParallelSection(**section).check("parallel")  # the config's own check is the same one


def test_a_group_that_would_span_nodes_is_refused_on_the_placement():
    uneven = observe(0, 4, labels=["a", "a", "a", "b"])
    with pytest.raises(ConfigError, match=r"parallel.tensor = 2 cannot run on this placement"):
        ParallelDims.build(ParallelSection(num_workers=4, zero_stage=1, tensor=2), uneven)
    with pytest.raises(ConfigError, match=r"parallel.replicate = 2 \(hybrid sharding: 2 replica groups\) cannot run"):
        ParallelDims.build(ParallelSection(num_workers=4, zero_stage=3, replicate=2), uneven)
    with pytest.raises(ConfigError, match=r"parallel.hpz = true cannot run on this placement"):
        ParallelDims.build(ParallelSection(num_workers=4, zero_stage=3, hpz=True), observe(0, 4, labels=list("aaaa")))
