"""An elastic run on a local 3-node Ray cluster, for tests/trainer/test_elastic_ray.py (run as a script in its own
process: the session's ``ray_cluster`` fixture owns the test process's Ray, and ``Cluster.add_node`` works only
from the main thread).

The cluster and the moves are the product's, those of ``dutycycle demo --elastic`` (trainer/app/elastic.py): a
head with 0 CPUs (the driver and Ray Train's controller run there, and it is never removed) and three 1-CPU nodes,
one worker each. For each configuration in ``argv[2]`` (a JSON list of ``[name, overrides]``), ``train`` runs on a
thread at ``parallel.num_workers = [2, 3]`` while the main thread kills one worker node (its raylet and workers, no
drain, as a machine is lost) once the run has committed and logged step ``argv[3]``, waits until training goes on
at 2 workers and two more steps are logged, adds a node back and lets the run grow to 3 again. Prints one
``RESULT {json}`` line: per run its summary's figures, its metrics rows, its per-sample log (``run.
record_sample_loss``: the sample ids each step trained) and the wall-clock times of the node's removal and return.
"""

from __future__ import annotations

import json
import os
import sys
import time

from dutycycle.trainer.app.elastic import ElasticPlan, LocalCluster, run_elastic
from dutycycle.trainer.checkpoint import checkpoint_root
from dutycycle.trainer.config import load_config
from dutycycle.trainer.launch.train import train
from dutycycle.trainer.step.metrics import read_metrics
from dutycycle.trainer.trace.losses import read_sample_losses


def one_run(cluster: LocalCluster, run_dir: str, overrides: list[str], remove_after: int) -> dict:
    cfg = load_config(None, [*overrides, f"run.dir={run_dir}", "run.record_sample_loss=true"])
    cfg.ray.address = cluster.address
    out: dict = {}
    t0 = time.time()
    try:
        summary, report = run_elastic(lambda: train(cfg, quiet=True), run_dir, checkpoint_root(cfg, run_dir),
                                      cluster, ElasticPlan(remove_after_step=remove_after, regrow_after_steps=2,
                                                           timeout_s=300), say=lambda _: None)
    except BaseException as e:  # noqa: BLE001 - reported in the result
        return {"error": f"{type(e).__name__}: {e}", "rows": read_metrics(run_dir)}
    # run_elastic's clock starts as it is called: t0 is that launch to within microseconds
    out["events"] = {k: t0 + v for k, v in (("removed", report.removed_at_s), ("shrunk_seen",
                     report.first_step_smaller_s), ("added", report.added_at_s)) if v is not None}
    out["report_error"] = report.error
    out["rows"] = read_metrics(run_dir)
    samples = read_sample_losses(run_dir).to_pydict()
    out["samples"] = {"step": samples["step"], "epoch": samples["epoch"], "sample_id": samples["sample_id"],
                      "rank": samples["rank"], "position": samples["position"]}
    out["summary"] = {"steps": summary["steps"], "world_size": summary["world_size"],
                      "launch": summary.get("launch"), "final_loss": summary["final_loss"]}
    return out


def main() -> None:
    root, runs = sys.argv[1], json.loads(sys.argv[2])
    remove_after = int(sys.argv[3])
    cluster = LocalCluster(nodes=3).start()
    try:  # never leave a cluster (or its address file) behind for later tests
        result = {name: one_run(cluster, os.path.join(root, name), overrides, remove_after)
                  for name, overrides in runs}
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
