"""Placement on a multi-node local cluster: workers land on the nodes carrying the requested label (a zone),
packed onto as few nodes as possible. Runs in a subprocess because the session's ``ray_cluster`` fixture owns
this process's Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.ray

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import ray
    from ray.cluster_utils import Cluster
    from dutycycle.trainer.config import load_config
    from dutycycle.trainer.launch.train import train


    def run(run_root, nodes, zone):
        cfg = load_config(None, ["data.source=synthetic", "data.size=16", "data.synthetic_samples=64",
                                 "data.global_batch_size=16", "model.width=8", "run.max_steps=2",
                                 "run.eval_every=0", "run.eval_max_batches=1", "run.log_every=0",
                                 "run.report=false", "parallel.num_workers=2", "ray.placement_strategy=PACK",
                                 f'ray.label_selector={{zone = "{zone}"}}', f"run.dir={run_root}/{zone}"])
        summary = train(cfg, quiet=True)
        return [dict(w, node=nodes.get(w["node_id"], "?")) for w in summary["workers"]]


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
        out = {"b": run(run_root, nodes, "b")}
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(out))
    """
)


def test_workers_stay_in_the_requested_zone_and_pack(tmp_path):
    """Two workers asked for zone b: none lands in zone a (the head, which has free CPUs and runs the driver),
    and PACK puts both on b2, the one zone-b node that fits them both, rather than splitting over b1 and b2."""
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", DAFT_ANALYTICS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=420, env=env)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(line[0][len("RESULT "):])
    workers = out["b"]
    assert sorted(w["rank"] for w in workers) == [0, 1]
    assert all(w["labels"]["zone"] == "b" for w in workers), workers
    assert {w["node"] for w in workers} == {"b2"}, workers
