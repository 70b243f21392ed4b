"""The data path on two nodes: a local Ray cluster of two nodes (each its own node folder) trains 2 ranks per
node from a cache with 2 canonical partitions. Each node's ranks open only the shards of their node's partition,
and the run is the one-node run's: the same 4 ranks on one node give the same losses and bit-identical weights,
which they can only do if every global batch is the same. On the session's multi-node cluster, shared with
test_placement.py (tests/support/multinode.py)."""

from __future__ import annotations

import numpy as np
import pytest
from dutycycle.engine.cache.reader import CacheReader
from dutycycle.loader.plan import partition_bounds

from ..support import multinode as mn

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def runs(multinode):
    """tests/support/multinode.py's ``two_nodes`` runs on the session's multi-node cluster: zone w's two nodes of 2
    CPUs (each its own node folder) against zone one's node of 4."""
    cache, out = multinode
    return cache, out["two_nodes"]


def partition_shards(cache: str) -> list[set[int]]:
    """The shards holding each canonical partition's training rows (what a node may open)."""
    reader = CacheReader(cache)
    from dutycycle.loader.source import split_rows

    rows = np.asarray(split_rows(reader, "train"))
    bounds = partition_bounds(len(rows), mn.BATCH, 2)
    return [set(reader.locate(rows[bounds[p]:bounds[p + 1]])[0].tolist()) for p in range(2)]


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first to ask starts the shared cluster
def test_each_node_reads_only_its_partition_and_the_run_is_the_one_node_run(runs):
    cache, out = runs
    two, one = out["two"], out["one"]
    assert "error" not in two and "error" not in one, (two, one)
    node_of = {w["rank"]: out["names"][w["node_id"]] for w in two["workers"]}
    assert sorted(node_of.values()) == ["w1", "w1", "w2", "w2"], node_of
    assert node_of[0] == node_of[1] and node_of[2] == node_of[3]  # ranks 2n, 2n+1 share a node
    assert {out["names"][w["node_id"]] for w in one["workers"]} == {"one"}
    allowed = partition_shards(cache)
    assert allowed[0].isdisjoint(allowed[1] - allowed[0]) and len(allowed[0] | allowed[1]) == mn.SHARDS
    for run in (two, one):
        for rank, reads in enumerate(run["reads"]):
            opened = {i for a, b in reads["shard_runs"] for i in range(a, b + 1)}
            assert len(opened) == reads["shards"] > 0
            assert opened <= allowed[rank // 2], (rank, opened, allowed)  # counted: its node's partition only
            assert len(opened) <= len(allowed[rank // 2]) < mn.SHARDS
    assert two["loss"] == one["loss"] and two["weights"] == one["weights"]
