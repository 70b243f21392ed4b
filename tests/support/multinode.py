"""One local multi-node Ray cluster (``ray.cluster_utils.Cluster``: a raylet per node, each with its own node id,
labels and resources) for the placement and two-node data tests, started once: each start of a cluster, its Ray
and its Python with torch cost tens of seconds of a 2-core CI run.

    python -m tests.support.multinode ROOT CACHE       prints one line: RESULT {"placement": ..., "two_nodes": ...}

Run in a child process, because the session's ``ray_cluster`` fixture owns the test process's Ray. Nodes:

- a1, the head (zone a, 2 CPUs): the driver and Ray Train's controllers; no test's workers ask for zone a;
- b1 (1 CPU) and b2 (2 CPUs), zone b: tests/trainer/test_placement.py (PACK, uneven placements, refusals);
- w1 and w2 (2 CPUs each, zone w) and one (4 CPUs, zone one), each with its own node folder
  (DUTYCYCLE_NODE_DIR): tests/trainer/test_two_nodes.py (4 ranks on two nodes against the same 4 on one).
"""

from __future__ import annotations

import json
import os
import sys

# the two-node test's cache: samples, shards, and the global batch its canonical partitions are cut by
SAMPLES, SHARDS, BATCH = 1024, 16, 32


def _train(cfg) -> dict:
    from dutycycle.trainer.launch.train import train

    try:
        return {"summary": train(cfg, quiet=True)}
    except Exception as e:  # noqa: BLE001 - a refusal is what some cases expect; the tests read it
        return {"error": f"{type(e).__name__}: {e}"}


def placement_run(run_root: str, nodes: dict, zone: str, name: str, workers: int = 2, extra=()) -> dict:
    from dutycycle.trainer.config import load_config

    cfg = load_config(None, ["data.source=synthetic", "data.size=16", "data.synthetic_samples=96",
                             "data.global_batch_size=24", "model.width=8", "run.max_steps=3",
                             "run.eval_every=0", "run.eval_max_batches=1", "run.log_every=0",
                             "run.report=false", f"parallel.num_workers={workers}",
                             "ray.placement_strategy=PACK", f'ray.label_selector={{zone = "{zone}"}}',
                             f"run.dir={run_root}/{name}", *extra])
    got = _train(cfg)
    if "error" in got:
        return got
    summary = got["summary"]
    ck = os.path.join(run_root, name, "checkpoints")
    return {"workers": [dict(w, node=nodes.get(w["node_id"], "?")) for w in summary["workers"]],
            "node_ids": summary["parallel"]["node_ids"], "traffic": summary["parallel"]["traffic"],
            "checkpoints": {d: sorted(os.listdir(os.path.join(ck, d))) for d in sorted(os.listdir(ck))}
                           if os.path.isdir(ck) else {}}


def placement(run_root: str, nodes: dict) -> dict:
    out = {"b": placement_run(run_root, nodes, "b", "b")}
    # three workers in zone b: PACK puts two on b2 and one on b1, an uneven placement
    stage3 = ["parallel.zero_stage=3", "checkpoint.every=1", "checkpoint.keep=2"]
    out["uneven"] = placement_run(run_root, nodes, "b", "uneven", 3, [*stage3, "checkpoint.shared_fs=true"])
    out["local_checkpoints"] = placement_run(run_root, nodes, "b", "local", 3, stage3)
    out["hpz"] = placement_run(run_root, nodes, "b", "hpz", 3,
                               [*stage3, "checkpoint.shared_fs=true", "parallel.hpz=true"])
    return out


def two_nodes_run(cache: str, root: str, name: str, zone: str) -> dict:
    from dutycycle.trainer.config import load_config

    cfg = load_config(None, ["data.source=cache", f"data.cache={cache}", "data.partitions=2",
                             f"data.global_batch_size={BATCH}", "data.eval_batch_size=8", "model.width=8",
                             "run.max_steps=6", "run.eval_every=0", "run.eval_max_batches=1", "run.log_every=0",
                             "run.report=false", "parallel.num_workers=4", "checkpoint.every=0",
                             "checkpoint.shared_fs=true", "ray.placement_strategy=SPREAD",
                             f'ray.label_selector={{zone = "{zone}"}}', f"run.dir={root}/{name}"])
    got = _train(cfg)
    if "error" in got:
        return got
    s = got["summary"]
    return {"workers": s["workers"], "reads": s["data_reads"], "loss": s["final_loss"], "weights": s["weights_sha256"]}


def main() -> int:
    import ray
    from ray.cluster_utils import Cluster

    root, cache = sys.argv[1], sys.argv[2]
    mem = 80 * 2**20
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "labels": {"zone": "a"},
                                                            "object_store_memory": mem})
    try:  # never leave a cluster (or its address file) behind for later tests
        names = {cluster.head_node.node_id: "a1"}
        for name, cpus, zone, node_dir in [("b1", 1, "b", False), ("b2", 2, "b", False), ("w1", 2, "w", True),
                                           ("w2", 2, "w", True), ("one", 4, "one", True)]:
            env = {"env_vars": {"DUTYCYCLE_NODE_DIR": os.path.join(root, "two-nodes", "node-" + name)}} if node_dir else {}
            node = cluster.add_node(num_cpus=cpus, labels={"zone": zone}, object_store_memory=mem, **env)
            names[node.node_id] = name
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        out = {"placement": placement(os.path.join(root, "placement"), names),
               "two_nodes": {"two": two_nodes_run(cache, os.path.join(root, "two-nodes"), "two", "w"),
                             "one": two_nodes_run(cache, os.path.join(root, "two-nodes"), "one", "one"),
                             "names": names}}
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
