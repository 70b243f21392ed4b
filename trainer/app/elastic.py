"""The elastic part of ``dutycycle demo --elastic``: a local multi-node Ray cluster that loses a node mid-run and
gets it back, with an elastic run (``parallel.num_workers = [min, max]``) training through both.

``LocalCluster`` is ``ray.cluster_utils.Cluster`` on this machine: a head node with no CPUs (the driver and Ray
Train's controller, which lives on the driver's node, so it is never removed) and ``nodes`` worker nodes of one
CPU each, one training worker per node. Each node is its own raylet: removing one kills its worker processes the
way a lost machine does, and its memory (object store, a per-node peer store) with them.

``run_elastic`` trains in a thread (``launch/train.py``'s ``train``: the product path, on this cluster's
address) while this, the main thread, changes the cluster: Ray's ``Cluster.add_node`` works only from the main
thread. Once a commit exists and training logged ``remove_after_step``, a worker node is removed (not
gracefully: its raylet and workers are killed); once the run trains at the smaller size and logged
``regrow_after_steps`` more steps, a node is added back; then the run grows by itself, when Ray Train's resize
monitor sees the free node. What the demo measures is read from the run's own rows (``metrics.jsonl``: each
attempt's ``world_size``, step/sizes.py), timed on this process's wall clock: from the node's loss to the first
step trained at the smaller size, and from its return to the first step at the larger size.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from dutycycle.trainer.checkpoint import manifest as mf
from dutycycle.trainer.step import sizes as S
from dutycycle.trainer.step.metrics import read_metrics

MIB = 2**20
# A node that dies without a word (its raylet killed) leaves Ray's node table when the control store's health
# checks give up on it: Ray's defaults (every 3 s, 5 misses) took 15.9 s here, a probe every 0.5 s with 4 misses
# 6.1 s. Until then Ray Train cannot place the smaller group (the run's node watch waits for the table): the
# shrink's "decide" part. A cluster's operator sets the same (``ray start --system-config``) on a real cluster.
FAST_NODE_DEATH = {"health_check_period_ms": 500, "health_check_timeout_ms": 500, "health_check_failure_threshold": 4}


class LocalCluster:
    """A ``ray.cluster_utils.Cluster`` of a 0-CPU head and ``nodes`` worker nodes of ``cpus`` CPUs each, on this
    machine. ``start()`` brings it up and waits for every node; ``shutdown()`` removes every node (and the address
    file Ray writes for ``ray.init(address="auto")``). Each node's object store is ``object_store_bytes``: small,
    since a node here shares this machine's memory with the others."""

    def __init__(self, nodes: int = 3, cpus: int = 1, object_store_bytes: int = 96 * MIB):
        self.nodes, self.cpus, self.object_store_bytes = nodes, cpus, object_store_bytes
        self.cluster = None
        self.workers: list = []  # the worker nodes now in the cluster, oldest first

    @property
    def address(self) -> str:
        return self.cluster.address

    def start(self) -> LocalCluster:
        from ray.cluster_utils import Cluster  # heavy: Ray, only where a cluster is made

        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "object_store_memory": self.object_store_bytes, "_system_config": FAST_NODE_DEATH})
        try:
            for _ in range(self.nodes):
                self.add_node(wait=False)
            self.cluster.wait_for_nodes()
        except BaseException:
            self.shutdown()
            raise
        return self

    def add_node(self, wait: bool = True):
        """A worker node more (main thread only: Ray's ``Cluster`` starts its processes from it)."""
        node = self.cluster.add_node(wait=wait, num_cpus=self.cpus, object_store_memory=self.object_store_bytes)
        self.workers.append(node)
        return node

    def remove_node(self):
        """The newest worker node, removed as a machine is lost: its raylet and every process on it killed, no
        graceful drain. Returns its node id."""
        node = self.workers.pop()
        self.cluster.remove_node(node, allow_graceful=False)
        return node.node_id

    def shutdown(self) -> None:
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster, self.workers = None, []


@dataclass
class ElasticPlan:
    remove_after_step: int  # a node is lost once a commit exists and this step is logged
    regrow_after_steps: int  # it comes back once the run trained this many steps at the smaller size
    timeout_s: float = 600.0  # the longest wait for any one of those moments


@dataclass
class ElasticReport:
    """What happened to the cluster and when (seconds from the launch), and what the run did about it."""

    removed_node: str | None = None
    removed_at_s: float | None = None
    removed_at_step: int | None = None  # the newest step logged when the node was lost
    shrunk_to: int | None = None
    shrunk_at_step: int | None = None  # the step the smaller group continued from (its commit)
    first_step_smaller_s: float | None = None  # when it logged its first step
    loss_to_step_s: float | None = None  # node lost -> first step trained at the smaller size
    added_at_s: float | None = None
    added_at_step: int | None = None
    grown_to: int | None = None
    grown_at_step: int | None = None
    first_step_larger_s: float | None = None
    add_to_step_s: float | None = None  # node back -> first step trained at the larger size
    sizes: list[int] = field(default_factory=list)  # every size the run trained at, in order (3, 2, 3)
    resizes: list[dict] = field(default_factory=list)  # step/sizes.changes: each change with its parts
    error: str | None = None  # why the demo's cluster changes stopped short (the run went on)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def run_elastic(train_fn, run_dir: str, checkpoint_dir: str, cluster: LocalCluster, plan: ElasticPlan,
                say=print) -> tuple[dict, ElasticReport]:
    """Run ``train_fn()`` (the demo's ``train(cfg, ...)``, returning its summary) in a thread while this thread
    removes a node and adds it back as ``plan`` says. Returns the summary and what happened; a run that failed
    raises its error here, after the thread ended."""
    report = ElasticReport()
    out: dict = {}

    def target() -> None:
        try:
            out["summary"] = train_fn()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            out["error"] = e

    launched = time.time()
    fit = threading.Thread(target=target, name="dutycycle-elastic-fit", daemon=True)
    fit.start()
    watch = _Watch(run_dir, launched, fit, plan.timeout_s)
    try:
        _drive(watch, cluster, checkpoint_dir, plan, report, say)
    except _Stopped as why:
        report.error = str(why)
    fit.join()
    if "error" in out:
        raise out["error"]
    rows = read_metrics(run_dir)
    report.sizes, report.resizes = S.path(rows), S.changes(rows)
    return out["summary"], report


class _Stopped(Exception):
    """The cluster changes stop: the run ended, or a moment did not come in time."""


class _Watch:
    """The run's rows as they are written, and waiting for one of its moments."""

    def __init__(self, run_dir: str, since: float, fit: threading.Thread, timeout_s: float):
        self.run_dir, self.since, self.fit, self.timeout_s = run_dir, since, fit, timeout_s

    def rows(self) -> list[dict]:
        # only this launch's rows: the run directory may hold an earlier run's until the launch replaced it
        return [r for r in read_metrics(self.run_dir, live=True) if r.get("time", 0.0) >= self.since]

    def until(self, ready, what: str):
        deadline = time.monotonic() + self.timeout_s
        while True:
            found = ready(self.rows())
            if found:
                return found
            if not self.fit.is_alive():
                raise _Stopped(f"the run ended before {what}")
            if time.monotonic() > deadline:
                raise _Stopped(f"gave up waiting for {what} after {self.timeout_s:.0f} s")
            time.sleep(0.1)


def _newest_step(rows: list[dict]) -> int:
    return max((r["step"] for r in rows if "loss" in r), default=-1)


def _trained_at(rows: list[dict], after: float, compare) -> dict | None:
    """The first attempt begun after ``after`` whose size passes ``compare`` and that has logged a step, with
    when that step ended; None until there is one. Rank 0 writes its step rows every ``run.log_every`` steps,
    all stamped with the time of writing, so the first step ended before its row's time by the later steps of
    the same batch of rows (their ``step_s``)."""
    for a in S.attempts(rows):
        if a["started"] < after or a["world_size"] is None or not compare(a["world_size"]):
            continue
        mine = [r for r in rows if "loss" in r and r.get("time", 0.0) >= a["loop_started"]]
        if mine:
            first = min(mine, key=lambda r: (r["time"], r["step"]))
            later = sum(float(r.get("step_s", 0.0)) for r in mine if r["time"] == first["time"] and r["step"] > first["step"])
            return {**a, "first_step_time": max(a["loop_started"], first["time"] - later)}
    return None


def _drive(watch: _Watch, cluster: LocalCluster, checkpoint_dir: str, plan: ElasticPlan, r: ElasticReport,
           say) -> None:
    t0 = watch.since

    def committed() -> bool:
        # a manifest is the commit; verifying checksums here would only compete with training for the cores
        return any(mf.is_committed(uri) for _, uri in mf.list_steps(checkpoint_dir))

    def full(rows):  # training at full size, past the step and a commit
        runs = [a for a in S.attempts(rows) if a["world_size"] is not None]
        return bool(runs) and runs[-1]["world_size"] == cluster.nodes and \
            _newest_step(rows) >= plan.remove_after_step and committed()

    watch.until(full, f"step {plan.remove_after_step} and a commit at {cluster.nodes} workers")
    r.removed_at_step = _newest_step(watch.rows())
    lost = time.time()
    r.removed_node = cluster.remove_node()
    r.removed_at_s = lost - t0
    say(f"node {r.removed_node[:12]} removed (its raylet and training worker killed) at step {r.removed_at_step}, "
        f"{r.removed_at_s:.1f} s after launch; the run continues on the {len(cluster.workers)} nodes left")

    small = watch.until(lambda rows: _trained_at(rows, lost, lambda w: w < cluster.nodes),
                        "the run to train on fewer workers")
    r.shrunk_to, r.shrunk_at_step = small["world_size"], small["step"]
    r.first_step_smaller_s = small["first_step_time"] - t0
    r.loss_to_step_s = small["first_step_time"] - lost
    say(f"training at {r.shrunk_to} workers from step {r.shrunk_at_step}: its first step {r.loss_to_step_s:.1f} s "
        "after the node was lost")

    target = r.shrunk_at_step + plan.regrow_after_steps
    watch.until(lambda rows: _newest_step(rows) >= target, f"step {target} at {r.shrunk_to} workers")
    back = time.time()
    r.added_at_step = _newest_step(watch.rows())
    cluster.add_node()
    r.added_at_s = back - t0
    say(f"a node added back at step {r.added_at_step}, {r.added_at_s:.1f} s after launch")

    grown = watch.until(lambda rows: _trained_at(rows, back, lambda w: w > r.shrunk_to),
                        "the run to grow back")
    r.grown_to, r.grown_at_step = grown["world_size"], grown["step"]
    r.first_step_larger_s = grown["first_step_time"] - t0
    r.add_to_step_s = grown["first_step_time"] - back
    say(f"training at {r.grown_to} workers again from step {r.grown_at_step}: its first step "
        f"{r.add_to_step_s:.1f} s after the node came back")
