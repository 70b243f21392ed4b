"""Quantized collectives over flat 1-D tensors, shaped for FSDP2's custom all-gather / reduce-scatter seams.

ZeRO++ (arXiv 2306.10209) in three functions:

- ``quantized_all_gather`` (qwZ): each rank quantizes its shard, the packed buffers (codes and scales together)
  are all-gathered, and every rank dequantizes every slot, its own included, so all ranks compute with the
  same weights. The caller's shard (FSDP2's fp32 master weights) is only read: quantization error never
  accumulates in the weights.
- ``quantized_reduce_scatter`` (qgZ): the input is W equal chunks, chunk i for group rank i. Chunks are
  quantized, exchanged with one ``all_to_all_single`` and summed in fp32 on arrival. With a ``Hierarchy`` the
  exchange takes two hops: inside the node first (each rank sends a local peer the chunks of every rank that
  shares that peer's local index, and sums what it receives), then across nodes among ranks with the same local
  index, re-quantizing the partial sums between hops. A rank then sends ``(num_nodes - 1)`` chunks across nodes
  instead of ``(world - node_size)``: 1/node_size of the flat path's inter-node bytes.
- ``make_hierarchy``: the intra-node and inter-node process groups, created once.

``bits`` picks the wire format (``quant.encode``): 8 or 4 are blockwise int8/int4, 16 is bf16, 64 is float64,
and 32 means *unquantized*: the input's own dtype, uncast (fp32 as fp32, float64 as float64, bf16 as bf16:
``quant.unquantized_bits``), so a float64 reduction configured unquantized is float64 on the wire and in the sum.
The unquantized forms run the very same algorithm: the fair baseline for the quantized ones. Every function
counts the bytes it puts on the wire (packed codes and scales, nothing sent to itself) and their dtype
(``quant.wire_dtype``) into an optional ``Traffic``, split intra/inter-node by the global ranks of the peers and
the given ``Topology``. ``quantized_all_gather`` and ``quantized_reduce_scatter`` are synchronous (FSDP2 accepts a
``None`` work handle); their ``start_`` forms start the transfer and return ``(work, finish)`` for overlap. They
run on any backend with ``all_to_all_single`` and ``all_gather_single`` (gloo on CPU, NCCL on GPU).

Error bounds, per output element, with ``A`` the largest magnitude in that element's block over the ranks'
inputs and ``e = 1/(2*qmax)`` (1/254 for int8, 1/14 for int4; see ``quant``):

- all-gather: ``|out - shard| <= e * A_shard`` (one quantization).
- flat reduce-scatter, SUM: ``|out - sum| <= W * e * A`` (one quantization per contribution).
- two-hop reduce-scatter, SUM: ``<= W * e * A * (2 + e)``: hop 1 as above, then each node's partial sum
  (``|p| <= L * A * (1 + e)``) is quantized once more, ``N`` of them.
- AVG divides the sum (fp32; float64 for a float64 wire) by the group size, explicitly, after the exchange: the
  bounds divide by W too.

Error feedback (``residual``): the residual (one per rank, the input's size, zero at first) is added to the
input before quantizing, and afterwards holds what this rank's quantization lost, so the next call sends it
again. Over T calls the output sums to T times the exact sum minus the final residuals: the accumulated error
stays bounded instead of growing with T. In two-hop mode the hop-2 error of a partial sum is folded into the
residual slots of the chunks this rank forwarded in hop 2 (which it sends to itself in hop 1), so the same
telescoping holds. A block that held a NaN or an infinity contributes nothing to the residual (its error is
not a number): one bad gradient poisons one call's output, never the calls after it.

The residual is training state like the optimizer's: ``comm.QuantReduceScatter`` keeps it per parameter (the
``residual`` passed here is the carried parameters' blocks, in the input's layout) and
``trainer/parallel/residuals.py`` saves it by parameter name, restores it on resume and rollback, and
redistributes it on a world-size change.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from dutycycle.engine.errors import ConfigError

from .quant import (
    DEFAULT_BLOCK,
    check_format,
    decode,
    decode_sum,
    encode,
    sum_dtype,
    unquantized_bits,
    wire_dtype,
)
from .traffic import Topology, Traffic


@dataclass
class _Meter:
    """Counts wire bytes into ``traffic`` (if any) for this global ``rank``."""

    traffic: Traffic | None
    topology: Topology | None
    kind: str
    rank: int

    def __post_init__(self):
        if self.traffic is not None and self.topology is None:
            raise ValueError("counting traffic needs the node layout: pass topology=Topology.uniform(world, "
                             "node_size) (or the Hierarchy's) along with traffic=")

    def hop(self, per_peer_bytes: int, group_ranks: Sequence[int], bits: int) -> None:
        if self.traffic is not None:
            self.traffic.count(self.kind, per_peer_bytes, self.rank, group_ranks, self.topology, calls=0,
                               dtype=wire_dtype(bits))

    def call(self) -> None:
        if self.traffic is not None:
            self.traffic.add(self.kind, 0, 0, calls=1)


_RANKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # process group -> its global ranks


def _group_ranks(group) -> tuple[int, ...]:
    """The group's global ranks in group-rank order, looked up once per group (not once per FSDP module per
    step)."""
    group = group if group is not None else dist.group.WORLD
    if group not in _RANKS:  # (no process group yet: get_process_group_ranks raises torch's own error)
        _RANKS[group] = tuple(dist.get_process_group_ranks(group))
    return _RANKS[group]


# ----------------------------------------------------------------------------------------------- hierarchy


def node_layout(topology: Topology) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """``(node_ranks, peers)``: each node's global ranks (ascending; nodes in order of their lowest rank) and,
    for each local index j, the ranks holding that index on every node (ascending). Nodes must be equal."""

    nodes: dict = {}
    for r, node in enumerate(topology.node_ids):
        nodes.setdefault(node, []).append(r)
    node_ranks = tuple(tuple(m) for m in nodes.values())
    sizes = sorted({len(m) for m in node_ranks})
    if len(sizes) != 1:
        raise ConfigError(f"hierarchical collectives need the same number of ranks on every node, got node sizes "
                          f"{sizes} from node ids {topology.node_ids}; place the workers evenly or set "
                          "parallel.hierarchical = false")
    peers = tuple(tuple(sorted(m[j] for m in node_ranks)) for j in range(sizes[0]))
    return node_ranks, peers


@dataclass(frozen=True)
class Hierarchy:
    """This rank's place in a two-level (node, local index) layout and the process groups of both hops."""

    topology: Topology
    rank: int
    node_ranks: tuple[tuple[int, ...], ...]
    peers: tuple[tuple[int, ...], ...]
    intra: dist.ProcessGroup  # this rank's node
    inter: dist.ProcessGroup  # the ranks with this rank's local index, one per node
    order: torch.Tensor  # hop 1's row order: the ranks of local index 0 on every node, then of index 1, ...
    inter_index: torch.Tensor  # ``inter_ranks`` as an index (the rows hop 2's error folds into)

    @property
    def node_size(self) -> int:
        return len(self.peers)

    @property
    def num_nodes(self) -> int:
        return len(self.node_ranks)

    @cached_property
    def intra_ranks(self) -> tuple[int, ...]:
        return next(m for m in self.node_ranks if self.rank in m)

    @cached_property
    def local_index(self) -> int:
        return self.intra_ranks.index(self.rank)

    @cached_property
    def inter_ranks(self) -> tuple[int, ...]:
        return self.peers[self.local_index]


def make_hierarchy(topology: Topology, backend: str | None = None,
                   device: torch.device | None = None) -> Hierarchy:
    """Create the node groups and the same-local-index groups; call it once, on every rank, after
    ``init_process_group``. Every rank creates every group (``dist.new_group`` is collective over the world),
    in the same order: nodes first, then local indices. ``device``: where the collectives' tensors live (CPU
    if not given), so the two-hop index tensors are built there once."""

    world, rank = dist.get_world_size(), dist.get_rank()
    if topology.world_size != world:
        raise ConfigError(f"the topology covers {topology.world_size} ranks but the world has {world}; "
                          "build it with Topology.uniform(world_size, node_size)")
    node_ranks, peers = node_layout(topology)
    intra = inter = inter_ranks = None
    for members in node_ranks:
        group = dist.new_group(list(members), backend=backend)
        if rank in members:
            intra = group
    for members in peers:
        group = dist.new_group(list(members), backend=backend)
        if rank in members:
            inter, inter_ranks = group, members
    assert intra is not None and inter is not None, (rank, node_ranks, peers)
    return Hierarchy(topology, rank, node_ranks, peers, intra, inter,
                     order=torch.tensor([r for members in peers for r in members], device=device),
                     inter_index=torch.tensor(inter_ranks, device=device))


# --------------------------------------------------------------------------------------------- the exchange


def resolve_bits(bits: int, dtype: torch.dtype) -> int:
    """The wire format a collective of ``bits`` sends for an input of ``dtype``: 32 (unquantized) keeps the
    input's dtype (``quant.unquantized_bits``), every other format is what it says."""
    return unquantized_bits(dtype) if bits == 32 else bits


def _encode(x: torch.Tensor, bits: int, block: int, keep_error: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of ``x`` (``(R, n)``) in wire format ``bits`` and, if asked, what encoding lost (``(R, n)`` fp32)."""
    buf = encode(x, bits, block)
    return buf, (x.to(torch.float32) - decode(buf, x.shape[-1], bits, block) if keep_error else None)


def _start_all_to_all(buf: torch.Tensor, group, group_ranks: Sequence[int], meter: _Meter, bits: int):
    """Start sending ``buf[g]`` (``k`` encoded rows) to group rank g; returns ``(work, recv)``."""
    G, k, _ = buf.shape
    recv = torch.empty_like(buf)
    work = dist.all_to_all_single(recv.view(-1), buf.reshape(-1), group=group, async_op=True)
    meter.hop(k * buf.shape[-1], group_ranks, bits)
    return work, recv


def _all_to_all_sum(buf: torch.Tensor, group, group_ranks: Sequence[int], n: int, bits: int, block: int,
                    meter: _Meter) -> torch.Tensor:
    """Send ``buf[g]`` (``k`` encoded rows of ``n`` elements) to group rank g; return the sum (``sum_dtype``) of
    the k rows that arrived from every group rank (``(k, n)``)."""
    work, recv = _start_all_to_all(buf, group, group_ranks, meter, bits)
    work.wait()
    return decode_sum(recv, n, bits, block)


def _is_avg(op) -> bool:
    if op == dist.ReduceOp.AVG:
        return True
    if op == dist.ReduceOp.SUM:
        return False
    raise ConfigError(f"quantized reduce-scatter supports ReduceOp.SUM and ReduceOp.AVG, got {op}")


def quantized_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, op=dist.ReduceOp.AVG, *,
                             bits: int = 8, block: int = DEFAULT_BLOCK, hierarchy: Hierarchy | None = None,
                             residual: torch.Tensor | None = None, traffic: Traffic | None = None,
                             topology: Topology | None = None, kind: str = "reduce_scatter") -> None:
    """``output`` (n elements) = SUM or AVG over the group of each rank's chunk ``input[i*n:(i+1)*n]`` for
    group rank i, exchanged in wire format ``bits`` by all-to-all and summed in fp32 (float64 when the wire is
    float64: ``bits`` = 32 on a float64 input, or 64).

    ``hierarchy``: two hops (inside the node, then across nodes) instead of one; ``group`` must then be the
    whole world. ``residual``: an fp32 tensor of the input's size for error feedback (see the module
    docstring), updated in place. ``traffic``/``topology``: where to count the bytes sent, as ``kind``."""
    work, finish = start_quantized_reduce_scatter(output, input, group, op, bits=bits, block=block,
                                                  hierarchy=hierarchy, residual=residual, traffic=traffic,
                                                  topology=topology, kind=kind)
    if work is not None:
        work.wait()
    finish()


def start_quantized_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, op=dist.ReduceOp.AVG,
                                   *, bits: int = 8, block: int = DEFAULT_BLOCK, hierarchy: Hierarchy | None = None,
                                   residual: torch.Tensor | None = None, traffic: Traffic | None = None,
                                   topology: Topology | None = None, kind: str = "reduce_scatter"
                                   ) -> tuple[dist.Work | None, Callable[[], None]]:
    """``quantized_reduce_scatter`` in two halves, for overlap: encode and start the all-to-all now, return
    ``(work, finish)``; after ``work.wait()``, ``finish()`` decodes, sums and writes ``output`` (and the
    residual's hop-2 share). ``work`` is None when nothing is in flight (a group of one; two hops with one rank
    per node). With ``hierarchy`` only hop 1 is started here: hop 2 sends hop 1's sums, so ``finish`` runs it,
    blocking. Until ``finish`` returns, ``input`` must stay unchanged (an unquantized wire sends its bytes) and
    ``output`` is not written."""
    check_format(bits, block, wire=True)
    bits = resolve_bits(bits, input.dtype)
    ranks = _group_ranks(group)
    W, n = len(ranks), output.numel()
    avg = _is_avg(op)
    if input.numel() != W * n:
        raise ValueError(f"reduce-scatter input has {input.numel()} elements, expected {W} x {n} (group size x "
                         "output size)")
    if residual is not None and (residual.numel() != W * n or residual.dtype != torch.float32):
        raise ValueError(f"error-feedback residual must be fp32 with {W * n} elements, got {residual.dtype} "
                         f"with {residual.numel()}")
    meter = _Meter(traffic, topology or (hierarchy.topology if hierarchy else None), kind, dist.get_rank())
    meter.call()
    x = input.reshape(W, n)
    if residual is not None:
        x = x.to(torch.float32) + residual.view(W, n)
    keep = residual is not None

    def done(total: torch.Tensor) -> None:
        if keep:
            # a block holding a NaN or an infinity dequantizes to NaN (quant.py), so its error is NaN: kept, it
            # would be sent again at every later call and poison the sum long after the bad gradient was dealt
            # with (the step skipped or rolled back). What a non-finite block lost is dropped instead; the output
            # still carries the NaN this time, so the loop's non-finite check fires at the step that produced it.
            residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        if avg:
            total.div_(W)  # AVG is the sum divided by the group size, here and nowhere else
        output.copy_(total.view(output.shape))

    if hierarchy is not None:
        work, finish_two_hop = _start_two_hop(x, hierarchy, ranks, bits, block, residual, meter)
        return work, lambda: done(finish_two_hop())
    if W == 1:  # a group of one: nothing to send, nothing lost
        if keep:
            residual.zero_()
        total = x[0].clone()  # a copy in the input's own dtype: AVG divides it in place
        return None, lambda: done(total)
    buf, err = _encode(x, bits, block, keep)
    if keep:
        residual.view(W, n).copy_(err)
    work, recv = _start_all_to_all(buf.view(W, 1, -1), group, ranks, meter, bits)
    return work, lambda: done(decode_sum(recv, n, bits, block)[0])


def _start_two_hop(x: torch.Tensor, h: Hierarchy, ranks: Sequence[int], bits: int, block: int,
                   residual: torch.Tensor | None, meter: _Meter):
    """Two-hop reduce-scatter of ``x`` (``(W, n)``, row r for global rank r): start hop 1 and return ``(work,
    finish)``; ``finish()`` runs hop 2 and returns this rank's sum (``sum_dtype(bits)``)."""
    if list(ranks) != list(range(h.topology.world_size)):
        raise ValueError(f"hierarchical reduce-scatter runs over the whole world (ranks 0..{h.topology.world_size - 1}),"
                         f" got a group of ranks {list(ranks)}; pass hierarchy=None for a subgroup")
    W, n = x.shape
    L, N = h.node_size, h.num_nodes
    keep = residual is not None
    # hop 1, inside the node: local peer p gets the chunks of every rank with local index p (N of them), so
    # each rank ends with its node's partial sums of the chunks of h.inter_ranks (N, n), in that order
    order = h.order.to(x.device)  # built once by make_hierarchy; a no-op on its device
    work = recv = None
    if L == 1:  # one rank per node: hop 1 is a no-op
        partial = x.index_select(0, order).to(sum_dtype(bits))
        if keep:
            residual.zero_()
    else:  # encode in rank order, then reorder the (smaller) encoded rows
        buf, err1 = _encode(x, bits, block, keep)
        if keep:
            residual.view(W, n).copy_(err1)
        work, recv = _start_all_to_all(buf.index_select(0, order).view(L, N, -1), h.intra, h.intra_ranks, meter,
                                       bits)

    def finish() -> torch.Tensor:
        part = partial if recv is None else decode_sum(recv, n, bits, block)
        # hop 2, across nodes among ranks with this local index: re-quantize the partial sums
        if N == 1:
            return part[0]
        buf2, err2 = _encode(part, bits, block, keep)
        total = _all_to_all_sum(buf2.view(N, 1, -1), h.inter, h.inter_ranks, n, bits, block, meter)[0]
        if keep:  # this rank sends itself the chunks of h.inter_ranks in hop 1: fold hop 2's error in
            residual.view(W, n).index_add_(0, h.inter_index.to(x.device), err2)
        return total

    return work, finish


def quantized_all_gather(output: torch.Tensor, input: torch.Tensor, group=None, *, bits: int = 8,
                         block: int = DEFAULT_BLOCK, traffic: Traffic | None = None,
                         topology: Topology | None = None, kind: str = "all_gather") -> None:
    """``output`` (W x n elements, flat) = every group rank's ``input`` (n elements) in group-rank order, sent in
    wire format ``bits`` (32: unquantized, the input's own dtype) and decoded on arrival, this rank's own slot
    included.

    ``input`` may be a view into ``output`` (FSDP2 gathers in place): it is encoded before ``output`` is written.
    ``input`` itself is never modified."""
    work, finish = start_quantized_all_gather(output, input, group, bits=bits, block=block, traffic=traffic,
                                              topology=topology, kind=kind)
    work.wait()
    finish()


def start_quantized_all_gather(output: torch.Tensor, input: torch.Tensor, group=None, *, bits: int = 8,
                               block: int = DEFAULT_BLOCK, traffic: Traffic | None = None,
                               topology: Topology | None = None, kind: str = "all_gather"):
    """``quantized_all_gather`` in two halves, for overlap: encode and start the transfer now, return ``(work,
    finish)``; after ``work.wait()``, ``finish()`` decodes into ``output``. The encoded copy is taken before this
    returns when the format changes the dtype (an unquantized wire sends ``input`` itself), and ``output`` is
    written only by ``finish``."""
    check_format(bits, block, wire=True)
    bits = resolve_bits(bits, input.dtype)
    ranks = _group_ranks(group)
    W, n = len(ranks), input.numel()
    if output.numel() != W * n:
        raise ValueError(f"all-gather output has {output.numel()} elements, expected {W} x {n} (group size x "
                         "input size)")
    meter = _Meter(traffic, topology, kind, dist.get_rank())
    meter.call()
    # a fresh buffer when the format changes the dtype; otherwise the input's own bytes, which is safe: the output
    # (holding the input, for FSDP2) is written only by finish(), after the transfer has been waited on
    buf = encode(input.reshape(n), bits, block)
    gathered = torch.empty(W * buf.numel(), dtype=torch.uint8, device=buf.device)
    work = dist.all_gather_single(gathered, buf, group=group, async_op=True)  # gloo wants flat 1-D tensors
    meter.hop(buf.numel(), ranks, bits)

    def finish() -> None:
        decode(gathered.view(W, -1), n, bits, block, out=output.view(W, n))

    return work, finish
