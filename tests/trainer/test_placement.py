"""Placement on a multi-node local cluster: workers land on the nodes carrying the requested label (a zone),
packed onto as few nodes as possible; an uneven placement (2 + 1) is observed, accounted and checkpointed, and
what it cannot do (hpZ, node-local checkpoints) is refused before training. One cluster, in a subprocess because
the session's ``ray_cluster`` fixture owns this process's Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.long]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import ray
    from ray.cluster_utils import Cluster
    from dutycycle.trainer.config import load_config
    from dutycycle.trainer.launch.train import train


    def run(run_root, nodes, zone, name, workers=2, extra=()):
        cfg = load_config(None, ["data.source=synthetic", "data.size=16", "data.synthetic_samples=96",
                                 "data.global_batch_size=24", "model.width=8", "run.max_steps=3",
                                 "run.eval_every=0", "run.eval_max_batches=1", "run.log_every=0",
                                 "run.report=false", f"parallel.num_workers={workers}",
                                 "ray.placement_strategy=PACK", f'ray.label_selector={{zone = "{zone}"}}',
                                 f"run.dir={run_root}/{name}", *extra])
        try:
            summary = train(cfg, quiet=True)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}
        ck = os.path.join(run_root, name, "checkpoints")
        return {"workers": [dict(w, node=nodes.get(w["node_id"], "?")) for w in summary["workers"]],
                "node_ids": summary["parallel"]["node_ids"], "traffic": summary["parallel"]["traffic"],
                "checkpoints": {d: sorted(os.listdir(os.path.join(ck, d))) for d in sorted(os.listdir(ck))}
                               if os.path.isdir(ck) else {}}


    run_root = sys.argv[1]
    # three nodes: zone a is the head (2 CPUs, where the driver runs); zone b has b1 (1 CPU) and b2 (2 CPUs)
    mem = 80 * 2**20
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "labels": {"zone": "a"},
                                                            "object_store_memory": mem})
    try:  # never leave a cluster (or its address file) behind for later tests
        nodes = {cluster.head_node.node_id: "a1"}
        for name, cpus in [("b1", 1), ("b2", 2)]:
            node = cluster.add_node(num_cpus=cpus, labels={"zone": "b"}, object_store_memory=mem)
            nodes[node.node_id] = name
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        out = {"b": run(run_root, nodes, "b", "b")}
        # three workers in zone b: PACK puts two on b2 and one on b1, an uneven placement
        stage3 = ["parallel.zero_stage=3", "checkpoint.every=1", "checkpoint.keep=2"]
        out["uneven"] = run(run_root, nodes, "b", "uneven", 3, [*stage3, "checkpoint.shared_fs=true"])
        # refused by the launch on this placement; hpZ's refusal on it is checked in the test's own process (a
        # second refused launch cost as much as a run)
        out["local_checkpoints"] = run(run_root, nodes, "b", "local", 3, stage3)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("placement")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", DAFT_ANALYTICS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=600, env=env)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(line[0][len("RESULT "):])


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_workers_stay_in_the_requested_zone_and_pack(placed):
    """Two workers asked for zone b: none lands in zone a (the head, which has free CPUs and runs the driver),
    and PACK puts both on b2, the one zone-b node that fits them both, rather than splitting over b1 and b2."""
    out = placed
    workers = out["b"]["workers"]
    assert sorted(w["rank"] for w in workers) == [0, 1]
    assert all(w["labels"]["zone"] == "b" for w in workers), workers
    assert {w["node"] for w in workers} == {"b2"}, workers


@pytest.mark.slow
@pytest.mark.timeout(660)
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
@pytest.mark.timeout(660)
def test_what_an_uneven_placement_cannot_do_is_refused_before_training(placed, tmp_path):
    """Node-local checkpoints are refused by the launch on the 2 + 1 placement (the error reaches the caller as
    the ConfigError it is); hpZ is refused by the Trainer of each rank, given the node labels the ranks of the
    uneven run reported (what the Ray worker hands it: launch/worker.py), before it reads data or writes a file."""
    from dutycycle.engine.errors import ConfigError
    from dutycycle.trainer.config import load_config
    from dutycycle.trainer.step.trainer import Trainer, WorkerContext

    local = placed["local_checkpoints"]["error"]
    assert "ConfigError" in local and "is a local path and the workers run on 2 nodes" in local, local
    assert "checkpoint.shared_fs = true" in local
    labels = placed["uneven"]["node_ids"]
    assert len(set(labels)) == 2, labels  # the observed 2 + 1 placement
    run_dir = tmp_path / "hpz"
    cfg = load_config(None, ["data.source=synthetic", "data.size=16", "data.synthetic_samples=96",
                             "data.global_batch_size=24", "model.width=8", "run.max_steps=3", "run.report=false",
                             "parallel.num_workers=3", "parallel.zero_stage=3", "parallel.hpz=true",
                             "checkpoint.every=1", "checkpoint.keep=2", "checkpoint.shared_fs=true",
                             f"run.dir={run_dir}"])
    for rank in range(3):
        with pytest.raises(ConfigError, match=r"parallel.hpz = true cannot run on this placement") as e:
            Trainer(cfg, WorkerContext(rank=rank, world_size=3, run_dir=str(run_dir), node_labels=labels))
        assert "ranks" in str(e.value), str(e.value)
    assert not run_dir.exists() or not any(run_dir.iterdir())  # nothing written: refused before training
