"""The data path on two nodes: a local Ray cluster of two nodes (each its own node folder) trains 2 ranks per
node from a cache with 2 canonical partitions. Each node's ranks open only the shards of their node's partition,
and the run is the one-node run's: the same 4 ranks on one node give the same losses and bit-identical weights,
which they can only do if every global batch is the same. The Ray run in a subprocess, because the session's
``ray_cluster`` fixture owns this process's Ray; the one-node run on 4 gloo ranks of this machine (a third
Ray node and a second Ray launch cost more than the whole run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from dutycycle.engine.cache.reader import CacheReader
from dutycycle.loader.plan import partition_bounds

from ..support.cachemaker import make_cache
from ..support.harness import run_distributed

pytestmark = [pytest.mark.ray, pytest.mark.long]

SAMPLES, SHARDS, BATCH = 1024, 16, 32

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import ray
    from ray.cluster_utils import Cluster
    from dutycycle.trainer.config import load_config
    from dutycycle.trainer.launch.train import train

    cache, root, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])


    def run(name, zone):
        cfg = load_config(None, [*settings, "ray.placement_strategy=SPREAD",
                                 f'ray.label_selector={{zone = "{zone}"}}', f"run.dir={root}/{name}"])
        try:
            s = train(cfg, quiet=True)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}
        return {"workers": s["workers"], "reads": s["data_reads"], "loss": s["final_loss"],
                "weights": s["weights_sha256"]}


    mem = 80 * 2**20
    # the driver and Ray Train's controller on the head (zone c); zone w: two nodes of 2 CPUs
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "labels": {"zone": "c"},
                                                            "object_store_memory": mem})
    try:  # never leave a cluster (or its address file) behind for later tests
        names = {}
        for name, cpus, zone in [("w1", 2, "w"), ("w2", 2, "w")]:
            node = cluster.add_node(num_cpus=cpus, labels={"zone": zone}, object_store_memory=mem,
                                    env_vars={"DUTYCYCLE_NODE_DIR": os.path.join(root, "node-" + name)})
            names[node.node_id] = name
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        out = {"two": run("two", "w"), "names": names}
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(out))
    """
)


def _settings(cache: str) -> list[str]:
    """Both runs' config, but where the Ray run is placed and its run directory."""
    return ["data.source=cache", f"data.cache={cache}", "data.partitions=2", "data.global_batch_size=32",
            "data.eval_batch_size=8", "model.width=8", "run.max_steps=6", "run.eval_every=0", "run.eval_max_batches=1",
            "run.log_every=0", "run.report=false", "parallel.num_workers=4", "checkpoint.every=0",
            "checkpoint.shared_fs=true"]


def _one_node(rank, world, cache, run_dir):
    """A rank of the one-node run: the Trainer a Ray worker builds (launch/worker.py), with the intra-op threads
    it would set for 4 workers on a node, and a node folder of its own as each Ray node of the other run has."""
    from dutycycle.trainer.config import load_config
    from dutycycle.trainer.step.loop import set_threads
    from dutycycle.trainer.step.trainer import Trainer, WorkerContext

    os.environ["DUTYCYCLE_NODE_DIR"] = os.path.join(os.path.dirname(run_dir), "node-one")
    cfg = load_config(None, [*_settings(cache), f"run.dir={run_dir}"])
    set_threads(cfg, world)
    with Trainer(cfg, WorkerContext(rank=rank, world_size=world, run_dir=run_dir)) as trainer:
        s = trainer.train()
    return {"reads": s["data_reads"], "loss": s["final_loss"], "weights": s["weights_sha256"],
            "node_ids": s["parallel"]["node_ids"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two-nodes")
    cache = str(tmp / "cache")
    make_cache(cache, SAMPLES, shape=(8, 8, 3), shards=SHARDS, splits={"train": 0.75, "val": 0.25})
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", DAFT_ANALYTICS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    # its output to files: a pipe nobody reads while the one-node run goes on could fill and stall it
    with open(tmp / "ray.out", "w") as out, open(tmp / "ray.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", SCRIPT, cache, str(tmp), json.dumps(_settings(cache))],
                                stdout=out, stderr=err, text=True, env=env)
    try:  # the one-node run while the cluster starts (its raylets and Ray Train's group mostly wait meanwhile)
        one = run_distributed(_one_node, 4, cache, str(tmp / "one"), timeout=300)[0]
    finally:  # the script shuts its cluster down itself: let it, whatever happened here
        try:
            proc.wait(timeout=600)
        finally:
            proc.kill()
    stdout, stderr = (tmp / "ray.out").read_text(), (tmp / "ray.err").read_text()
    line = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, stdout[-3000:] + stderr[-5000:]
    return cache, {**json.loads(line[0][len("RESULT "):]), "one": one}


def partition_shards(cache: str) -> list[set[int]]:
    """The shards holding each canonical partition's training rows (what a node may open)."""
    reader = CacheReader(cache)
    from dutycycle.loader.source import split_rows

    rows = np.asarray(split_rows(reader, "train"))
    bounds = partition_bounds(len(rows), BATCH, 2)
    return [set(reader.locate(rows[bounds[p]:bounds[p + 1]])[0].tolist()) for p in range(2)]


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_each_node_reads_only_its_partition_and_the_run_is_the_one_node_run(runs):
    cache, out = runs
    two, one = out["two"], out["one"]
    assert "error" not in two and "error" not in one, (two, one)
    node_of = {w["rank"]: out["names"][w["node_id"]] for w in two["workers"]}
    assert sorted(node_of.values()) == ["w1", "w1", "w2", "w2"], node_of
    assert node_of[0] == node_of[1] and node_of[2] == node_of[3]  # ranks 2n, 2n+1 share a node
    assert len(set(one["node_ids"])) == 1 and len(one["node_ids"]) == 4  # the 4 ranks on one node
    allowed = partition_shards(cache)
    assert allowed[0].isdisjoint(allowed[1] - allowed[0]) and len(allowed[0] | allowed[1]) == SHARDS
    for run in (two, one):
        for rank, reads in enumerate(run["reads"]):
            opened = {i for a, b in reads["shard_runs"] for i in range(a, b + 1)}
            assert len(opened) == reads["shards"] > 0
            assert opened <= allowed[rank // 2], (rank, opened, allowed)  # counted: its node's partition only
            assert len(opened) <= len(allowed[rank // 2]) < SHARDS
    assert two["loss"] == one["loss"] and two["weights"] == one["weights"]
