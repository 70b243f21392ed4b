"""Where the ranks run, observed rather than assumed, and what the run may do with that layout.

Every rank reports its node at start (one ``all_gather_object``); the layout the collectives use (the intra/inter-
node split of the byte counts, hpZ's secondary-shard groups, two-hop qgZ's groups) and the checkpoint-storage
check are built from those reports. Ray's ``PACK`` placement can put 3 workers on one node and 1 on another; a
declared ``node_size`` would then count hpZ's cross-node gathers as intra-node.

A rank's node label: ``DUTYCYCLE_NODE_ID`` when set (containers that share a hostname, or the network namespaces
the benchmarks use as nodes), the Ray node id inside a Ray worker, the hostname otherwise (torchrun).

``parallel.node_size``: 0 (the default) takes the observed layout; a positive value asserts it, and a layout
that disagrees is an error naming both.
"""

from __future__ import annotations

import os
import socket

from dutycycle.engine.errors import ConfigError

from .world import World, all_gather

ENV = "DUTYCYCLE_NODE_ID"


def node_label() -> str:
    """This process's node (see the module docstring)."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    try:
        import ray

        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
            if node:
                return f"ray:{node[:12]}"
    except ImportError:  # a torchrun install without Ray
        pass
    return socket.gethostname()


def observe(rank: int, size: int, node_size: int = 0, labels: list[str] | None = None) -> World:
    """This rank's ``World`` with every rank's node, gathered from the ranks (a collective when there are several;
    ``labels`` given: no collective, as reported elsewhere). ``node_size`` > 0 is checked against the layout."""
    labels = labels if labels is not None else all_gather(node_label(), size)
    world = World(rank, size, node_ids=tuple(labels))
    if node_size and (not world.even or world.node_size != node_size or not world.consecutive):
        raise ConfigError(f"parallel.node_size = {node_size} says {node_size} consecutive ranks per node, but the "
                          f"workers run as {world.placement()}; set parallel.node_size = 0 to use the observed "
                          "layout")
    return world


def check_layout(world: World, parallel) -> None:
    """Refuse what the observed layout cannot do, naming the placement and the fixes: hpZ's secondary shard needs
    the same number of consecutive ranks on every node (FSDP2 reshards to groups of consecutive ranks) and more
    than one node; two-hop qgZ needs the same number of ranks on every node."""
    if parallel.hpz and parallel.zero_stage == 3:
        if world.num_nodes < 2 or not world.even or not world.consecutive:
            why = ("all workers run on one node, so the secondary shard would be the whole world"
                   if world.num_nodes < 2 else "hpZ's groups need the same number of consecutive ranks on every node")
            raise ConfigError(f"parallel.hpz = true cannot run on this placement ({world.placement()}): {why}; "
                              "set parallel.hpz = false, or place the workers evenly (ray.placement_strategy, "
                              "parallel.num_workers a multiple of the workers per node)")
    if parallel.hierarchical and parallel.grads_all_to_all and parallel.zero_stage > 0 and world.num_nodes > 1 \
            and not world.even:
        raise ConfigError(f"two-hop quantized gradients (parallel.hierarchical = true) need the same number of ranks "
                          f"on every node, and the workers run as {world.placement()}; set parallel.hierarchical = "
                          "false (one flat exchange), or place the workers evenly")


