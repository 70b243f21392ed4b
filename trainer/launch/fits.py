"""Whether a worker group can be placed at all, checked before Ray Train waits for it.

Ray Train places the whole group at once (a placement group of one bundle per worker). A request no node
combination can satisfy (2 workers of 8 CPUs on a 2-CPU machine) would wait for resources that never come: Ray
Train times the wait out and, by default, tries again forever. On a cluster that cannot grow (one this process
started) such a request is refused here, naming the setting and the cluster's nodes. On a cluster that may
autoscale it is left to ``ray.start_timeout_s``, after which the start fails with the same kind of message.
"""

from __future__ import annotations

from dutycycle.engine.errors import ConfigError


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
    return (f"parallel.num_workers = {p.num_workers} workers of parallel.cpus_per_worker = {p.cpus_per_worker:g} "
            f"CPU{'s' if p.cpus_per_worker != 1 else ''}{gpu} each (placement {cfg.ray.placement_strategy})")


def check_fits(cfg, nodes: list[dict[str, float]], per_worker: dict[str, float]) -> None:
    """Raise ``ConfigError`` when ``cfg``'s worker group can never be placed on ``nodes``."""
    fit = workers_that_fit(nodes, per_worker, cfg.ray.placement_strategy)
    if fit >= cfg.parallel.num_workers:
        return
    raise ConfigError(
        f"{request_text(cfg, per_worker)} cannot be placed: the cluster has {describe_nodes(nodes)}, room for "
        f"{fit} such worker{'s' if fit != 1 else ''}; lower parallel.cpus_per_worker or parallel.num_workers, "
        "or add nodes (ray.address of a larger cluster)")


def alive_nodes() -> list[dict[str, float]]:
    """The total resources of every alive node of the connected Ray cluster."""
    import ray

    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
