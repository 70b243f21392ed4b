"""Whether a worker group can be placed at all, checked before Ray Train waits for it.

Ray Train places the whole group at once (a placement group of one bundle per worker). A request no node
combination can satisfy (2 workers of 8 CPUs on a 2-CPU machine) would wait for resources that never come: Ray
Train times the wait out and, by default, tries again forever. On a cluster that cannot grow (one this process
started) such a request is refused here, naming the setting and the cluster's nodes. On a cluster that may
autoscale it is left to ``ray.start_timeout_s``, after which the start fails with the same kind of message.

An elastic run (``parallel.num_workers = [min, max]``) needs room for ``min`` workers to start, and a layout that
forms at every size Ray Train may choose in the range (``check_sizes``): Ray Train sizes the group from the
resources present, any count from min to max, so a tensor-parallel degree or a replica count that does not
divide one of them (or a tensor-parallel group larger than the workers a node holds) is refused at launch,
naming the sizes that fail and the smallest ``min`` that avoids them, rather than failing after a resize.
"""

from __future__ import annotations

from dutycycle.engine.errors import ConfigError, DutycycleError


class NodeLostError(DutycycleError):
    """Nodes of the Ray cluster were lost and the run could not go on without them."""


def workers_that_fit(nodes: list[dict[str, float]], per_worker: dict[str, float], strategy: str) -> int:
    """How many workers of ``per_worker`` resources the ``nodes`` (each a dict of total resources) can hold at
    once; STRICT_SPREAD places at most one per node, STRICT_PACK all on one node."""
    counts = []
    for node in nodes:
        n = min((int(node.get(k, 0.0) // v) for k, v in per_worker.items() if v > 0), default=0)
        counts.append(min(n, 1) if strategy == "STRICT_SPREAD" else n)
    if strategy == "STRICT_PACK":
        return max(counts, default=0)
    return sum(counts)


def describe_nodes(nodes: list[dict[str, float]]) -> str:
    parts = [", ".join(f"{v:g} {k}" for k, v in sorted(n.items()) if k in ("CPU", "GPU")) or "no CPU"
             for n in nodes]
    return f"{len(nodes)} node{'s' if len(nodes) != 1 else ''} ({'; '.join(parts)})"


def request_text(cfg, per_worker: dict[str, float]) -> str:
    p = cfg.parallel
    gpu = " and 1 GPU" if per_worker.get("GPU") else ""
    workers = f"[{p.min_workers}, {p.num_workers}] (at least {p.min_workers})" if p.elastic else str(p.num_workers)
    return (f"parallel.num_workers = {workers} workers of parallel.cpus_per_worker = {p.cpus_per_worker:g} "
            f"CPU{'s' if p.cpus_per_worker != 1 else ''}{gpu} each (placement {cfg.ray.placement_strategy})")


def check_fits(cfg, nodes: list[dict[str, float]], per_worker: dict[str, float]) -> None:
    """Raise ``ConfigError`` when ``cfg``'s worker group can never be placed on ``nodes``."""
    fit = workers_that_fit(nodes, per_worker, cfg.ray.placement_strategy)
    # an elastic run starts at whatever size the cluster holds, down to min
    if fit >= (cfg.parallel.min_workers if cfg.parallel.elastic else cfg.parallel.num_workers):
        return
    raise ConfigError(
        f"{request_text(cfg, per_worker)} cannot be placed: the cluster has {describe_nodes(nodes)}, room for "
        f"{fit} such worker{'s' if fit != 1 else ''}; lower parallel.cpus_per_worker or parallel.num_workers, "
        "or add nodes (ray.address of a larger cluster)")


def alive_nodes() -> list[dict[str, float]]:
    """The total resources of every alive node of the connected Ray cluster."""
    import ray

    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]


def check_sizes(cfg, nodes: list[dict[str, float]] | None = None, per_worker: dict[str, float] | None = None) -> None:
    """Raise ``ConfigError`` when a tensor-parallel group cannot fit on one node of ``nodes`` (each worker
    ``per_worker``). Every size of an elastic range forming the layout is the config's own check
    (config_batch.check_layouts, when the config is loaded)."""
    p = cfg.parallel
    if p.tensor > 1 and nodes:
        per_node = max((workers_that_fit([n], per_worker or {"CPU": p.cpus_per_worker}, "PACK") for n in nodes),
                       default=0)
        if per_node < p.tensor:
            raise ConfigError(f"parallel.tensor = {p.tensor} needs {p.tensor} workers on one node (a tensor-parallel "
                              f"group never spans nodes), and the largest node holds {per_node} (the cluster: "
                              f"{describe_nodes(nodes)}); lower parallel.tensor to at most {max(per_node, 1)}, or "
                              "add larger nodes")
