"""Who is training: this rank, the world size, and which ranks share a node; plus the two object collectives
(broadcast from rank 0, gather to every rank) that the health check, resume and the saver use.

A ``World`` is one value that travels instead of loose ``rank`` / ``world_size`` / ``node_size`` ints, so a
function that needs the node layout cannot be handed a rank from one run and a node size from another.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    node_size: int = 0  # ranks per node (consecutive ranks share a node); 0 = all ranks on one node

    def __post_init__(self):
        assert 0 <= self.rank < self.size, (self.rank, self.size)
        assert self.node_size == 0 or self.size % self.node_size == 0, (self.size, self.node_size)

    @property
    def ranks_per_node(self) -> int:
        return self.node_size or self.size

    @property
    def node(self) -> int:
        """The index of this rank's node."""
        return self.rank // self.ranks_per_node

    def node_ranks(self, node: int | None = None) -> list[int]:
        """The ranks on ``node`` (default: this rank's node)."""
        n = self.node if node is None else node
        k = self.ranks_per_node
        return list(range(n * k, (n + 1) * k))


def collectives_active(world: int) -> bool:
    import torch.distributed as dist

    return world > 1 and dist.is_available() and dist.is_initialized()


def broadcast(obj, world: int, group=None):
    """Rank 0's ``obj`` on every rank (``group``: the default group unless given; the saver passes its own)."""
    if not collectives_active(world):
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def all_gather(obj, world: int) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not collectives_active(world):
        return [obj]
    import torch.distributed as dist

    out = [None] * world
    dist.all_gather_object(out, obj)
    return out
