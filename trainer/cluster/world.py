"""Who is training: this rank, the world size, and which node each rank runs on; plus the two object collectives
(broadcast from rank 0, gather to every rank) that the health check, resume and the saver use.

A ``World`` is one value that travels instead of loose ``rank`` / ``world_size`` / ``node_size`` ints, so a
function that needs the node layout cannot be handed a rank from one run and a node size from another. The
layout is ``node_ids``: each rank's node label, in rank order, as the ranks reported it (topology.py observes
it); a ``World`` built from a ``node_size`` alone stands for ``node_size`` consecutive ranks per node (tests and
tools that simulate nodes on one machine).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    node_size: int = 0  # ranks per node when every node has as many (0: all on one node); derived from node_ids
    node_ids: tuple = ()  # each rank's node label, in rank order ((): node_size consecutive ranks per node)

    def __post_init__(self):
        assert 0 <= self.rank < self.size, (self.rank, self.size)
        if not self.node_ids:
            assert self.node_size == 0 or self.size % self.node_size == 0, (self.size, self.node_size)
            per = self.node_size or self.size
            object.__setattr__(self, "node_ids", tuple(r // per for r in range(self.size)))
        assert len(self.node_ids) == self.size, (self.node_ids, self.size)
        sizes = {len(m) for m in self.nodes}
        # one common size (the whole world for one node); 0 when nodes hold different numbers of ranks
        object.__setattr__(self, "node_size", sizes.pop() if len(sizes) == 1 else 0)

    @property
    def nodes(self) -> list[list[int]]:
        """The ranks of each node, nodes in order of their lowest rank."""
        out: dict = {}
        for r, node in enumerate(self.node_ids):
            out.setdefault(node, []).append(r)
        return list(out.values())

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_ids))

    @property
    def even(self) -> bool:
        """Every node runs the same number of ranks."""
        return self.node_size > 0

    @property
    def consecutive(self) -> bool:
        """Every node's ranks are consecutive (what FSDP2's hpZ groups assume: ranks r*k .. r*k+k-1)."""
        return all(m == list(range(m[0], m[0] + len(m))) for m in self.nodes)

    def placement(self) -> str:
        """The layout in words, for errors: ``node 'a': ranks 0-2; node 'b': rank 3``."""
        parts = []
        for m in self.nodes:
            ranks = f"ranks {m[0]}-{m[-1]}" if len(m) > 1 and self.consecutive else \
                ("rank " if len(m) == 1 else "ranks ") + ", ".join(map(str, m))
            parts.append(f"node {self.node_ids[m[0]]!r}: {ranks}")
        return "; ".join(parts)


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
