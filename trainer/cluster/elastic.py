"""Elastic runs on Ray Train: what the driver watches while the worker group changes size, so that a lost node is
noticed at once, Ray Train decides on the nodes really present, and every resize is accounted part by part.

Ray Train 2.59's elastic mode (``ScalingConfig(num_workers=(min, max))``) sizes each worker group from the
cluster resources that Ray Data's ``AutoscalingCoordinator`` actor has reserved for it, and that actor re-reads
the cluster's nodes every 20 s (its ``TICK_INTERVAL_S``). After a node dies the controller sees the dead worker
within one poll (``ray.health_check_interval_s``), but then asks for the old size on the coordinator's stale
view, waits out the whole worker-group start timeout and counts it as a controller failure; a node that returns
waits for the next tick and the next resize check (``elastic_resize_monitor_interval_s``, 60 s by default).

``NodeWatch`` is dutycycle's own health signal: a driver thread that polls Ray's node table
(``ray.elastic_node_poll_s``), records when each node is seen dead or alive, and on every change makes the
coordinator re-read the nodes at once (its ``_tick``), so Ray Train's next decision is taken on the nodes present.
``ControllerLog`` is a Ray Train controller callback that records each change of the controller's state with its
wall-clock time (and the size a scheduling decision chose) in the launch's attempt folder
(``ray_controller.json``); the job's time account (launch/account.py) splits every resize at those boundaries. It
also closes the race the node watch can lose: the controller sees a dead worker before Ray's node table marks its
node dead, so on a restart after workers died with their node it waits (briefly, ``ray.elastic_start_timeout_s``
at most) for the table to show the node dead and pokes the coordinator before the controller decides.
"""

from __future__ import annotations

import threading
import time

from dutycycle.engine import formats, io

CONTROLLER_LOG = "ray_controller.json"
COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")  # Ray Data's actor: (name, namespace)


def controller_log(uri: str, settle_s: float = 5.0):
    """A ``ControllerLog`` writing to ``uri`` (see ``_ControllerLog``)."""
    return _controller_log_class()(uri, settle_s)


_CLASS: type | None = None


def _controller_log_class() -> type:
    """``ControllerLog``: ``_ControllerLog`` on Ray Train's controller-callback interface. Made at first use,
    because the interface is in Ray Train (seconds to import, which ``dutycycle train``'s start-up does without
    until it launches); the controller unpickles it by name through the module's ``__getattr__``."""
    global _CLASS
    if _CLASS is None:
        # a private module of Ray Train V2: the one import to update on an upgrade
        from ray.train.v2._internal.execution.callback import ControllerCallback

        _CLASS = type("ControllerLog", (_ControllerLog, ControllerCallback), {"__module__": __name__})
    return _CLASS


def __getattr__(name: str):
    if name == "ControllerLog":
        return _controller_log_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _ControllerLog:
    """Runs inside Ray Train's controller (an actor on the driver's node). Each change of state is one event
    ``{"time", "state", "from"}`` plus ``num_workers`` when the state carries a scaling decision and ``error``
    (the failure's type, and its cause's) when it carries a failure; the list is rewritten atomically at each
    change (a few dozen events per run).

    The driver's node watch can lose the race: the controller sees the dead worker (one poll) before Ray's node
    table marks its node dead, and decides at once, on the stale view. So when the controller enters RESTARTING
    because workers died with their node (Ray's message says so), this callback (which runs before the
    controller's next decision) waits up to ``settle_s`` for Ray's node table to show a node of the group dead,
    then makes the coordinator re-read the nodes (the wait is the event's ``settled_s``): the decision is then
    taken on the nodes present. Any other failure restarts without a wait."""

    def __init__(self, uri: str, settle_s: float = 5.0):
        self.uri, self.settle_s = uri, settle_s
        self.events: list[dict] = []
        self._alive: set[str] = set()  # the nodes alive when the group was last running

    def after_controller_state_update(self, previous_state, current_state) -> None:
        before, now = previous_state._state_type.state_name, current_state._state_type.state_name
        if before == now:  # RUNNING -> RUNNING at every poll
            return
        if now == "RUNNING":
            self._alive = {n["node_id"] for n in _nodes() if n["alive"]}
        event = {"time": time.time(), "state": now, "from": before}
        err = getattr(current_state, "training_failed_error", None)
        if now == "RESTARTING" and err is not None and self.settle_s > 0:
            # up to settle_s when Ray says a worker's node died; a second otherwise (the message may not say it)
            event["settled_s"] = self._settle(self.settle_s if _node_died(err) else min(1.0, self.settle_s))
        decision = getattr(current_state, "scaling_decision", None)
        if decision is not None and hasattr(decision, "num_workers"):
            event["num_workers"] = int(decision.num_workers)
        if err is not None:
            cause = getattr(err, "controller_failure", None)
            event["error"] = type(err).__name__ + (f": {type(cause).__name__}" if cause is not None else "")
        self.events.append(event)
        try:
            io.write_json_atomic(self.uri, formats.stamp({"events": self.events}))
        except OSError:  # the record is for the account; a full disk must not stop the controller
            pass


    def _settle(self, limit: float) -> float:
        """Wait (up to ``limit`` seconds) until a node that was alive is dead in Ray's node table, then poke the
        coordinator; the seconds waited."""
        t0 = time.time()
        while time.time() - t0 < limit:
            if self._alive - {n["node_id"] for n in _nodes() if n["alive"]}:
                break
            time.sleep(0.05)
        poke_coordinator()
        return time.time() - t0


def _node_died(err: BaseException) -> bool:
    """Whether Ray's account of a worker group's failure says a worker died with its node."""
    seen: list[BaseException] = [err, *getattr(err, "worker_failures", {}).values()]
    for exc in seen[:50]:
        if "node has died" in str(exc) or "node was terminated" in str(exc):
            return True
        if exc.__cause__ is not None:
            seen.append(exc.__cause__)
    return False


def poke_coordinator() -> bool:
    """Make Ray Data's autoscaling coordinator re-read the cluster's nodes and re-reserve resources now (the work
    of its 20 s tick); False when there is none (a run that is not elastic) or Ray moved it."""
    import ray

    try:
        actor = ray.get_actor(COORDINATOR[0], namespace=COORDINATOR[1])
        ray.get(actor._tick.remote(), timeout=10)
    except Exception:  # noqa: BLE001 - no coordinator yet, or another Ray: the tick comes anyway
        return False
    return True


def read_controller_log(attempt_dir: str) -> list[dict]:
    """The controller's events of the launch whose attempt folder is ``attempt_dir`` ([] when it wrote none)."""
    uri = io.join(attempt_dir, CONTROLLER_LOG)
    if not io.exists(uri):
        return []
    import json

    data = json.loads(io.read_capped(uri, 16 << 20).decode("utf-8"))
    formats.check(data, uri)
    return list(data.get("events", []))


class NodeWatch:
    """A driver thread that polls Ray's node table every ``interval_s``; ``events`` lists every node seen going
    dead or coming alive, ``{"time", "node_id", "alive", "cpus", "gpus"}``, and each change makes Ray Data's
    autoscaling coordinator re-read the nodes (``poke``) so Ray Train's elastic policy decides on them now.
    Use as a context manager around ``TorchTrainer.fit``; ``interval_s`` = 0 watches nothing."""

    def __init__(self, interval_s: float = 0.5, poke: bool = True):
        self.interval_s, self.poke_coordinator = interval_s, poke
        self.events: list[dict] = []
        self.pokes = 0
        self._alive: dict[str, bool] = {}
        self._cpus: dict[str, tuple[float, float]] = {}  # each node's CPUs and GPUs when last seen alive
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> NodeWatch:
        if self.interval_s <= 0:  # off: Ray Train's own view alone
            return self
        nodes = _nodes()
        self._alive = {n["node_id"]: n["alive"] for n in nodes}
        self._cpus = {n["node_id"]: (n["cpus"], n["gpus"]) for n in nodes if n["alive"]}
        self._thread = threading.Thread(target=self._run, name="dutycycle-node-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.look()
            except Exception:  # noqa: BLE001, S112 - a GCS hiccup: look again at the next interval
                continue

    def look(self) -> list[dict]:
        """One poll: the changes since the last, recorded (and the coordinator poked when there were any)."""
        now = time.time()
        changes = []
        for n in _nodes():
            if n["alive"]:  # a dead node's table entry has no resources left: keep what it had
                self._cpus[n["node_id"]] = (n["cpus"], n["gpus"])
            if self._alive.get(n["node_id"]) != n["alive"]:
                self._alive[n["node_id"]] = n["alive"]
                cpus, gpus = self._cpus.get(n["node_id"], (n["cpus"], n["gpus"]))
                changes.append({"time": now, "node_id": n["node_id"], "alive": n["alive"], "cpus": cpus,
                                "gpus": gpus})
        self.events.extend(changes)
        if changes and self.poke_coordinator:
            self.poke()
        return changes

    def poke(self) -> bool:
        """``poke_coordinator``, counted."""
        done = poke_coordinator()
        self.pokes += done
        return done

    def lost(self) -> list[dict]:
        """The nodes seen dead during the watch."""
        return [e for e in self.events if not e["alive"]]


def _nodes() -> list[dict]:
    import ray

    return [{"node_id": n["NodeID"], "alive": bool(n.get("Alive")), "cpus": float(n.get("Resources", {}).get("CPU", 0)),
             "gpus": float(n.get("Resources", {}).get("GPU", 0))} for n in ray.nodes()]
