"""Placement on a multi-node local cluster: workers land on the nodes carrying the requested label (a zone),
packed onto as few nodes as possible; an uneven placement (2 + 1) is observed, accounted and checkpointed, and
what it cannot do (hpZ, node-local checkpoints) is refused before training. On the session's multi-node cluster,
shared with test_two_nodes.py (tests/support/multinode.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def placed(multinode):
    """The runs of tests/support/multinode.py's ``placement`` on the session's multi-node cluster: nodes a1 (zone a,
    the head: 2 CPUs, where the driver runs), b1 (zone b, 1 CPU) and b2 (zone b, 2 CPUs), and nodes in zones the
    runs here never ask for."""
    return multinode[1]["placement"]


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first to ask starts the shared cluster
def test_workers_stay_in_the_requested_zone_and_pack(placed):
    """Two workers asked for zone b: none lands in zone a (the head, which has free CPUs and runs the driver),
    and PACK puts both on b2, the one zone-b node that fits them both, rather than splitting over b1 and b2."""
    out = placed
    workers = out["b"]["workers"]
    assert sorted(w["rank"] for w in workers) == [0, 1]
    assert all(w["labels"]["zone"] == "b" for w in workers), workers
    assert {w["node"] for w in workers} == {"b2"}, workers


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first to ask starts the shared cluster
def test_an_uneven_placement_is_observed_and_accounted(placed):
    """Three workers in zone b: two on b2, one on b1. Each rank's node is what the ranks reported (not
    consecutive ranks of a declared size): rank 0's bytes to the peer on its own node count as intra-node, the rest
    as inter-node; the checkpoints (declared on a shared file system) hold every rank's files and retention keeps
    the newest two commits whole."""
    r = placed["uneven"]
    assert "error" not in r, r
    by_rank = {w["rank"]: w["node"] for w in r["workers"]}
    assert sorted(by_rank.values()) == ["b1", "b2", "b2"], r["workers"]
    ids = r["node_ids"]
    assert len(set(ids)) == 2 and sorted(ids.count(x) for x in set(ids)) == [1, 2], ids
    # the node ids agree with where Ray says each rank ran
    assert all((ids[a] == ids[b]) == (by_rank[a] == by_rank[b]) for a in range(3) for b in range(3))
    peers_here = sum(1 for p in (1, 2) if ids[p] == ids[0])
    t = r["traffic"]
    assert t["bytes"] > 0
    intra = t["bytes"] - t["inter_node_bytes"]
    assert intra * (2 - peers_here) == t["inter_node_bytes"] * peers_here, (ids, t)
    assert sorted(r["checkpoints"]) == ["step-00000002", "step-00000003"], r["checkpoints"]
    for files in r["checkpoints"].values():
        assert {f"__{rank}_0.distcp" for rank in range(3)} <= set(files) and "manifest.json" in files, files


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first to ask starts the shared cluster
def test_what_an_uneven_placement_cannot_do_is_refused_before_training(placed):
    local = placed["local_checkpoints"]["error"]
    assert "ConfigError" in local and "is a local path and the workers run on 2 nodes" in local, local
    assert "checkpoint.shared_fs = true" in local
    hpz = placed["hpz"]["error"]
    assert "parallel.hpz = true cannot run on this placement" in hpz and "ranks" in hpz, hpz
