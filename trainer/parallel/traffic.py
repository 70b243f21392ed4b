"""Logical traffic accounting: the bytes a collective moves from this rank, whatever the backend does underneath.

gloo implements reduce-scatter as an all-reduce, NCCL picks rings or trees; timings on one backend say little
about another. So collectives are counted by what an ideal direct exchange moves: a rank sends each peer the part
that peer needs, once. For a group of ``W`` ranks and ``N`` bytes of full (unsharded) payload:

=================  ===========================  =======================================================
collective         bytes this rank sends        why
=================  ===========================  =======================================================
all-gather         N/W to each of W-1 peers      its shard goes to everyone else
reduce-scatter     N/W to each of W-1 peers      every peer's shard of this rank's contribution
all-reduce         2 * N/W to each of W-1 peers  a reduce-scatter then an all-gather (what a ring does)
all-to-all         N/W to each of W-1 peers      the generic exchange behind quantized reduce-scatter
=================  ===========================  =======================================================

So DDP's all-reduce is 2N(W-1)/W per step and ZeRO-3's two all-gathers plus one reduce-scatter are 3N(W-1)/W:
the 2 Psi vs 3 Psi of the ZeRO paper. Each peer's bytes count as *intra-node* when the peer is on this rank's
node and *inter-node* otherwise, so hierarchical schemes (hpZ, two-hop qgZ) show what they keep off the slow
links. Node membership is a node id per rank: in a run, what each rank reported (trainer/cluster/topology.py);
``Topology.uniform`` stands for ``node_size`` consecutive ranks per node (tests that simulate nodes).

Each kind also records the dtypes it put on the wire (``Traffic.dtypes``): a plain tensor's own (``"float32"``,
``"float64"``, ``"bfloat16"``), or a quantized format's (``"int8+fp32 scales"``: quant.wire_dtype). A float64
run whose reduce-scatter shows ``float32`` is not a float64 run; the bytes alone cannot tell.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@dataclass
class Topology:
    """Which node each global rank lives on. ``node_ids[r]`` is rank r's node (any hashable label)."""

    node_ids: tuple

    @classmethod
    def uniform(cls, world_size: int, node_size: int) -> Topology:
        """``node_size`` consecutive ranks per node (node_size = world_size: one node)."""
        assert node_size > 0 and world_size % node_size == 0, (world_size, node_size)
        return cls(tuple(r // node_size for r in range(world_size)))

    @property
    def world_size(self) -> int:
        return len(self.node_ids)

    def same_node(self, a: int, b: int) -> bool:
        return self.node_ids[a] == self.node_ids[b]


@dataclass
class Traffic:
    """Per-rank counters: calls and logical bytes sent, per collective kind (and optional label such as
    ``"fwd"``/``"bwd"``), split intra-/inter-node, and the dtypes each kind sent (``dtypes[kind]``: a set of
    names, filled where the bytes are counted; read it through ``wire()``)."""

    calls: dict[str, int] = field(default_factory=dict)
    intra: dict[str, int] = field(default_factory=dict)
    inter: dict[str, int] = field(default_factory=dict)
    dtypes: dict[str, set[str]] = field(default_factory=dict)

    def add(self, kind: str, intra: int, inter: int, calls: int = 1, dtype: str | None = None) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + calls
        self.intra[kind] = self.intra.get(kind, 0) + int(intra)
        self.inter[kind] = self.inter.get(kind, 0) + int(inter)
        if dtype is not None:
            self.dtypes.setdefault(kind, set()).add(dtype)

    def count(self, kind: str, per_peer_bytes: int, rank: int, group_ranks: Sequence[int], topology: Topology,
              factor: int = 1, calls: int = 1, dtype: str | None = None) -> None:
        """Count one collective in which this global ``rank`` sends ``per_peer_bytes`` (times ``factor``) to
        every other member of ``group_ranks`` (global ranks), in wire dtype ``dtype`` (a name: ``"float32"``,
        ``"int8+fp32 scales"``, ...). A collective made of several exchanges (the two hops of a hierarchical
        reduce-scatter) counts its later hops with ``calls=0``."""
        intra = inter = 0
        for peer in group_ranks:
            if peer == rank:
                continue
            if topology.same_node(rank, peer):
                intra += per_peer_bytes * factor
            else:
                inter += per_peer_bytes * factor
        self.add(kind, intra, inter, calls=calls, dtype=dtype)

    def merge(self, other: Traffic) -> None:
        for kind in other.calls:
            self.add(kind, other.intra.get(kind, 0), other.inter.get(kind, 0), calls=other.calls[kind])
            for dtype in other.dtypes.get(kind, ()):
                self.add(kind, 0, 0, calls=0, dtype=dtype)

    def wire(self) -> dict[str, dict]:
        """Per collective kind: ``{"dtypes": sorted names, "bytes", "intra_node_bytes", "inter_node_bytes",
        "calls"}``, a fresh copy (changing it changes no counter): what a report or a parity check shows for
        each collective."""
        return {k: {"dtypes": sorted(self.dtypes.get(k, ())), "bytes": self.intra.get(k, 0) + self.inter.get(k, 0),
                    "intra_node_bytes": self.intra.get(k, 0), "inter_node_bytes": self.inter.get(k, 0),
                    "calls": self.calls[k]} for k in sorted(self.calls)}

    def per_kind_bytes(self) -> dict[str, int]:
        """Bytes sent per collective kind, intra- and inter-node together."""
        return {k: self.intra.get(k, 0) + self.inter.get(k, 0) for k in self.calls}

    @property
    def total(self) -> int:
        return sum(self.intra.values()) + sum(self.inter.values())

    @property
    def total_inter(self) -> int:
        return sum(self.inter.values())

    def to_dict(self) -> dict:
        kinds = sorted(self.calls)
        return {
            "bytes": self.total,
            "inter_node_bytes": self.total_inter,
            "per_kind": {k: {"calls": self.calls[k], "intra_node_bytes": self.intra.get(k, 0),
                             "inter_node_bytes": self.inter.get(k, 0),
                             "wire_dtypes": sorted(self.dtypes.get(k, ()))} for k in kinds},
        }


def ring_bytes(kind: str, total_bytes: int, world_size: int) -> int:
    """Bytes one rank sends for ``kind`` over ``total_bytes`` of full payload in a group of ``world_size``
    (the table above, summed over peers): the formula the counters must agree with."""
    if world_size <= 1:
        return 0
    per_peer = total_bytes // world_size
    factor = 2 if kind == "all_reduce" else 1
    return per_peer * (world_size - 1) * factor
