"""The node layout is observed, not assumed (trainer/cluster/topology.py): what the ranks report becomes the
World the collectives, the byte accounting and the checkpoint-storage check use; a declared node_size that
disagrees, and what a layout cannot do, are refused naming the placement. The multi-node Ray run is in
test_placement.py."""

from __future__ import annotations

import pytest
from dutycycle.engine.errors import ConfigError
from dutycycle.trainer.checkpoint.manifest import check_shared
from dutycycle.trainer.cluster.topology import check_layout, node_label, observe
from dutycycle.trainer.config import ParallelSection, load_config

UNEVEN = ["n1", "n1", "n1", "n2"]  # Ray's PACK: 3 workers on one node, 1 on another


def test_the_observed_layout_becomes_the_world():
    w = observe(3, 4, labels=UNEVEN)
    assert w.nodes == [[0, 1, 2], [3]] and w.num_nodes == 2 and not w.even and w.node_size == 0
    assert w.placement() == "node 'n1': ranks 0-2; node 'n2': rank 3"
    even = observe(0, 4, node_size=2, labels=["a", "a", "b", "b"])  # a declared size that agrees is kept
    assert even.node_size == 2 and even.consecutive
    interleaved = observe(0, 4, labels=["a", "b", "a", "b"])
    assert interleaved.node_size == 2 and not interleaved.consecutive
    assert observe(0, 1).num_nodes == 1  # one process: no collective


@pytest.mark.parametrize("labels,node_size", [(UNEVEN, 2), (["a", "a", "b", "b"], 4), (["a", "b", "a", "b"], 2)])
def test_a_declared_node_size_that_disagrees_is_an_error(labels, node_size):
    with pytest.raises(ConfigError, match=rf"parallel.node_size = {node_size} says .* but the workers run as node"):
        observe(0, 4, node_size=node_size, labels=labels)


def test_the_node_label_can_be_named_and_defaults_to_the_host(monkeypatch):
    import socket

    monkeypatch.delenv("DUTYCYCLE_NODE_ID", raising=False)
    assert node_label() == socket.gethostname() or node_label().startswith("ray:")
    monkeypatch.setenv("DUTYCYCLE_NODE_ID", "netns-a")
    assert node_label() == "netns-a"


def test_uneven_nodes_split_the_bytes_by_the_observed_layout():
    from dutycycle.trainer.parallel.traffic import Topology, Traffic

    t = Traffic()
    t.count("all_gather", 100, 0, [0, 1, 2, 3], Topology(tuple(UNEVEN)))
    assert t.intra["all_gather"] == 200 and t.inter["all_gather"] == 100  # peers 1, 2 share rank 0's node
    t = Traffic()
    t.count("all_gather", 100, 3, [0, 1, 2, 3], Topology(tuple(UNEVEN)))
    assert t.intra["all_gather"] == 0 and t.inter["all_gather"] == 300


@pytest.mark.parametrize("labels,parallel,match", [
    (UNEVEN, dict(zero_stage=3, hpz=True), r"hpz = true cannot run on this placement \(node 'n1': ranks 0-2; node 'n2'"),
    (["a", "b", "a", "b"], dict(zero_stage=3, hpz=True), r"same number of consecutive ranks"),
    (["a"] * 4, dict(zero_stage=3, hpz=True), r"all workers run on one node"),
    (UNEVEN, dict(zero_stage=3, quant_grads="int8"), r"parallel.hierarchical = true\) need the same number"),
])
def test_what_a_layout_cannot_do_is_refused_naming_the_placement(labels, parallel, match):
    with pytest.raises(ConfigError, match=match):
        check_layout(observe(0, 4, labels=labels), ParallelSection(num_workers=4, **parallel))


def test_what_a_layout_can_do_passes():
    check_layout(observe(0, 4, labels=["a", "a", "b", "b"]), ParallelSection(num_workers=4, zero_stage=3, hpz=True,
                                                                              quant_grads="int8"))
    # flat quantized exchange on uneven nodes is fine
    check_layout(observe(0, 4, labels=UNEVEN), ParallelSection(num_workers=4, zero_stage=3, quant_grads="int8",
                                                               hierarchical=False))


def _cfg(*extra):
    return load_config(None, ["data.source=synthetic", "parallel.num_workers=4", "checkpoint.every=2", *extra])


def test_a_local_checkpoint_path_across_nodes_is_refused_before_training(tmp_path):
    from dutycycle.trainer.checkpoint import checkpoint_root

    two_nodes = observe(0, 4, labels=["a", "a", "b", "b"])
    cfg = _cfg()
    root = checkpoint_root(cfg, str(tmp_path))
    assert root == f"{tmp_path}/checkpoints"
    with pytest.raises(ConfigError, match=r"checkpoint.dir = '.*/checkpoints' is a local path and the workers run "
                                          r"on 2 nodes \(node 'a': ranks 0-1.*checkpoint.shared_fs = true"):
        check_shared(cfg, two_nodes, root)
    check_shared(cfg, observe(0, 4, labels=["a"] * 4), root)  # one node: its own disk is fine
    check_shared(_cfg("checkpoint.shared_fs=true"), two_nodes, root)  # the user vouches for it
    check_shared(_cfg("checkpoint.every=0"), two_nodes, root)  # no checkpoints
    s3 = _cfg("checkpoint.dir=s3://bucket/ck")
    check_shared(s3, two_nodes, checkpoint_root(s3, str(tmp_path)))
    # ray.storage_path (which Ray Train needs shared on a cluster) becomes the default place for checkpoints
    ray = _cfg(f"ray.storage_path={tmp_path}/shared", "run.name=exp")
    assert checkpoint_root(ray, str(tmp_path)) == f"{tmp_path}/shared/exp/checkpoints"
    check_shared(ray, two_nodes, checkpoint_root(ray, str(tmp_path)))
    explicit = _cfg(f"ray.storage_path={tmp_path}/shared", f"checkpoint.dir={tmp_path}/mine")
    with pytest.raises(ConfigError, match="is a local path"):  # a local dir of its own is not vouched for
        check_shared(explicit, two_nodes, checkpoint_root(explicit, str(tmp_path)))
