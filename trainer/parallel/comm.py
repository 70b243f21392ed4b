"""The collectives the sharded trainer issues, wrapped at torch's supported seams so they can be counted, timed
and (ZeRO++: ``QuantAllGather``, ``QuantReduceScatter`` over qcollectives.py) replaced:

- FSDP2: ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` take objects implementing
  ``AllGather`` / ``ReduceScatter`` (fsdp_api.py). They are set on every FSDP module (the setters do not
  recurse).
- DDP: ``DistributedDataParallel.register_comm_hook`` takes a function of each gradient bucket.

Every call counts logical bytes and the dtype it puts on the wire into a ``Traffic`` (traffic.py; read them with
``CommMeter.wire``) and, when collectives block the calling thread (CPU/gloo: FSDP2 calls them from its hooks), the
seconds the thread was blocked. That blocked time is the
step's *exposed* communication: the loop moves it out of forward/backward into ``comm``.

Overlap. With ``parallel.overlap`` (apply.py) FSDP2 prefetches the next unit's all-gather and asks for it with
``async_op=True``: the all-gathers here then start the transfer and return a ``TimedWork`` at once (the quantized
one encodes first and decodes when FSDP2 waits), so the transfer runs on gloo's threads while this thread computes
the current unit; only the time FSDP2 later spends in ``wait()`` is exposed. FSDP2 (torch 2.13) issues its reduce-scatter
without ``async_op`` (on an accelerator it runs on a side stream; on CPU it blocks); a caller that passes
``async_op=True`` gets a ``TimedWork`` from the quantized reduce-scatter too (the all-to-all in flight, the decode
and sum when it is waited on), as the seam's contract says. DDP's all-reduce runs on gloo's own threads while backward goes on; its exposed part is the time from the moment the
last gradient bucket is handed over (all gradients computed) until backward returns. On GPU, collectives run on
side streams and the host does not wait for them, so host time cannot separate them from compute there:
``CommMeter.host_timing`` is off and the summary says so.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .fsdp_api import AllGather, GradSlot, ReduceScatter, grad_slots, reduce_scatter_world, reduced_now
from .qcollectives import start_quantized_all_gather, start_quantized_reduce_scatter
from .quant import dtype_name
from .traffic import Topology, Traffic


class CommMeter:
    """Bytes and blocked seconds of this rank's collectives. ``traffic[phase]`` holds a ``Traffic`` per phase
    (``"train"``, ``"eval"``); ``phase(name)`` selects which one counts."""

    def __init__(self, rank: int, topology: Topology, host_timing: bool = True):
        self.rank, self.topology, self.host_timing = rank, topology, host_timing
        self.traffic: dict[str, Traffic] = {"train": Traffic(), "eval": Traffic()}
        self._active = "train"
        self._blocked = 0.0
        self.last_ready: float | None = None  # DDP: when the last bucket of the step was handed to gloo
        self.async_started = 0  # collectives started asynchronously (overlapped with compute until waited on)
        self.reduce_done: float | None = None  # when the last reduce-scatter returned (HSDP's all-reduce follows)
        self._group_ranks: dict[int, list[int]] = {}

    @contextmanager
    def phase(self, name: str):
        prev, self._active = self._active, name
        self.traffic.setdefault(name, Traffic())
        try:
            yield
        finally:
            self._active = prev

    @property
    def active_traffic(self) -> Traffic:
        return self.traffic[self._active]

    def group_ranks(self, group) -> list[int]:
        key = id(group)
        if key not in self._group_ranks:
            self._group_ranks[key] = dist.get_process_group_ranks(group) if group is not None else \
                list(range(dist.get_world_size()))
        return self._group_ranks[key]

    def count(self, kind: str, full_bytes: int, group, factor: int = 1, dtype: torch.dtype | None = None) -> None:
        """One collective over ``full_bytes`` of full payload (an all-gather's output, a reduce-scatter's or
        all-to-all's input, an all-reduce's buffer): this rank sends ``full_bytes / W`` to each peer, in
        ``dtype`` (recorded as the kind's wire dtype)."""
        ranks = self.group_ranks(group)
        per_peer = full_bytes // len(ranks)
        self.traffic[self._active].count(kind, per_peer, self.rank, ranks, self.topology, factor=factor,
                                         dtype=dtype_name(dtype) if dtype is not None else None)

    def count_tensor(self, kind: str, full: torch.Tensor, group, factor: int = 1) -> None:
        """``count`` for a collective whose full payload is the tensor ``full``, sent in its own dtype."""
        self.count(kind, _nbytes(full), group, factor=factor, dtype=full.dtype)

    def wire(self, phase: str = "train") -> dict[str, dict]:
        """Per collective kind of ``phase``: the dtypes it sent (``"float64"``, ``"int8+fp32 scales"``, ...),
        bytes and calls; a fresh copy (``Traffic.wire``)."""
        return self.traffic[phase].wire()

    @contextmanager
    def blocking(self, enabled: bool = True):
        """Time a collective that blocks this thread (counted as exposed communication)."""
        if not (enabled and self.host_timing):
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._blocked += time.perf_counter() - t0

    def add_blocked(self, seconds: float) -> None:
        if self.host_timing:
            self._blocked += max(0.0, seconds)

    def take_blocked(self) -> float:
        """Exposed communication seconds since the last call."""
        out, self._blocked = self._blocked, 0.0
        return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TimedWork(dist.Work):
    """The work handle of a collective started with ``async_op=True``: ``wait()`` waits for the transfer (those
    seconds are exposed communication, counted in ``meter``), then runs ``finish`` (the quantized collectives'
    decode: compute, not communication). ``inner`` None: nothing in flight, ``wait`` only finishes. FSDP2 recognizes a handle as asynchronous by its type, ``dist.Work``."""

    def __init__(self, inner: dist.Work | None, meter: CommMeter, finish=None):
        super().__init__()
        self.inner, self.meter, self.finish = inner, meter, finish
        self._done = False
        meter.async_started += 1

    def wait(self, timeout=None) -> bool:
        if not self._done:
            if self.inner is not None:
                t0 = time.perf_counter()
                self.inner.wait()
                self.meter.add_blocked(time.perf_counter() - t0)
            if self.finish is not None:
                self.finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


class CountingAllGather(AllGather):
    """FSDP2's all-gather, unchanged (``all_gather_single``), counted and timed. With ``hpz``, a gather over a
    group smaller than the world is hpZ's backward gather (FSDP2 reshards to the node-sized group after forward):
    counted as ``all_gather_hpz``, which never crosses a node. (Under hybrid sharding every gather runs over the
    replica group: plain ``all_gather``.)"""

    def __init__(self, meter: CommMeter, hpz: bool = False):
        self.meter, self.hpz = meter, hpz

    def secondary(self, group) -> bool:
        return self.hpz and len(self.meter.group_ranks(group)) < self.meter.topology.world_size

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.meter.count_tensor("all_gather_hpz" if self.secondary(group) else "all_gather", output_tensor, group)
        if async_op:
            return TimedWork(dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=True),
                             self.meter)
        with self.meter.blocking():
            return dist.all_gather_single(output_tensor, input_tensor, group=group)


class CountingReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter, unchanged (``reduce_scatter_single`` with FSDP's ``op``), counted and timed."""

    def __init__(self, meter: CommMeter):
        self.meter = meter

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.meter.count_tensor("reduce_scatter", input_tensor, group)
        with self.meter.blocking(enabled=not async_op):
            out = dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        self.meter.reduce_done = time.perf_counter()
        return out


class QuantAllGather(CountingAllGather):
    """qwZ: parameter all-gathers in int8 (qcollectives.quantized_all_gather: every rank dequantizes every
    slot, its own included, so all compute with the same weights; the fp32 master shard is only read).

    hpZ's backward gathers (over the node-sized group FSDP2 reshards to after forward) move the secondary shard,
    already the dequantized weights of the forward gather: they stay exact (the plain counted gather)."""

    def __init__(self, meter: CommMeter, bits: int, block: int, hpz: bool = False):
        super().__init__(meter, hpz)
        self.bits, self.block = bits, block

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if self.secondary(group):
            return super().__call__(output_tensor, input_tensor, group, async_op)
        work, finish = start_quantized_all_gather(output_tensor, input_tensor, group, bits=self.bits,
                                                  block=self.block, traffic=self.meter.active_traffic,
                                                  topology=self.meter.topology)
        if async_op:
            return TimedWork(work, self.meter, finish)
        with self.meter.blocking():
            work.wait()
        finish()
        return None  # finished: FSDP2 takes None as "already done"


class QuantReduceScatter(CountingReduceScatter):
    """qgZ: gradient reduce-scatter as an int8/int4 all-to-all summed in fp32 (two hops over node subgroups when
    ``hierarchy`` is given), honouring FSDP2's ``op`` (AVG divides by the group size after the sum). One object
    per FSDP2 module, because error feedback keeps a residual per parameter of that module.

    Error feedback (``unit``: the FSDP module, ``root``: the model, to name its parameters): ``residual`` is one
    fp32 buffer laid out as the unit's whole reduce-scatter input, ``(W, sum of slots' numel)``, parameter by
    parameter (``slots``, fsdp_api.grad_slots); ``param_residual(i)`` is parameter i's ``(W, numel)`` block. A
    call whose input carries every parameter (the rule with ``set_reduce_scatter_unused_params``, which error
    feedback sets) passes the buffer as it is; one that carries fewer (a frozen parameter) gathers the carried
    parameters' blocks and writes them back, so a residual always returns to its own parameter's gradient."""

    def __init__(self, meter: CommMeter, bits: int, block: int, hierarchy=None, error_feedback: bool = False,
                 unit=None, root=None):
        super().__init__(meter)
        self.bits, self.block, self.hierarchy, self.error_feedback = bits, block, hierarchy, error_feedback
        self.unit = unit
        self.slots: list[GradSlot] = grad_slots(unit, root) if error_feedback else []
        self.offsets = [0]
        for s in self.slots:
            self.offsets.append(self.offsets[-1] + s.numel)
        self.residual: torch.Tensor | None = None  # (W * offsets[-1],) fp32, allocated at the first call or a load

    def new_residual(self, device=None) -> torch.Tensor:
        """A zero residual for this unit (``W`` rows of every slot)."""
        world = reduce_scatter_world(self.unit)
        return torch.zeros(world * self.offsets[-1], dtype=torch.float32, device=device)

    def param_residual(self, i: int) -> torch.Tensor:
        """Parameter i's block of ``residual``: ``(W, slots[i].numel)``, a view (row r: what this rank's sends of
        rank r's chunk lost)."""
        rows = self.residual.view(-1, self.offsets[-1])
        return rows[:, self.offsets[i]:self.offsets[i + 1]]

    def _carried(self, input_tensor: torch.Tensor) -> list[int]:
        carried = [i for i, on in enumerate(reduced_now(self.unit)) if on]
        world = self.residual.numel() // self.offsets[-1]
        n = sum(self.slots[i].numel for i in carried)
        if input_tensor.numel() != world * n:  # never guess which residual belongs to which gradient
            raise RuntimeError(f"error feedback: the reduce-scatter input has {input_tensor.numel()} elements but the "
                               f"parameters it should carry ({[self.slots[i].fqn for i in carried]}) make "
                               f"{world} x {n}; FSDP2's rule for which parameters it reduces differs from "
                               "fsdp_api.reduced_now (torch upgraded, or a parameter frozen mid-accumulation)")
        return carried

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        residual = None
        carried = []
        if self.error_feedback:
            if self.residual is None:
                self.residual = self.new_residual(input_tensor.device)
            carried = self._carried(input_tensor)
            if len(carried) == len(self.slots):
                residual = self.residual
            else:  # a subset: its parameters' blocks, in input order, written back below
                W = self.residual.numel() // self.offsets[-1]
                residual = torch.cat([self.param_residual(i) for i in carried], dim=1).reshape(-1) if carried \
                    else torch.zeros(0, dtype=torch.float32, device=input_tensor.device)
                assert residual.numel() == W * sum(self.slots[i].numel for i in carried)
        # encode and start the all-to-all (blocking only while encoding), then, now or when waited on, the decode
        # and sum (with two hops: hop 2, which sends hop 1's sums, and so blocks) and the residual's write-back
        with self.meter.blocking(enabled=not async_op):
            work, finish = start_quantized_reduce_scatter(
                output_tensor, input_tensor, group, op, bits=self.bits, block=self.block, hierarchy=self.hierarchy,
                residual=residual, traffic=self.meter.active_traffic, topology=self.meter.topology)

        def done():
            finish()  # the residual is complete only now (two hops fold hop 2's error in here)
            if residual is not None and residual is not self.residual:
                W, start = self.residual.numel() // self.offsets[-1], 0
                rows = residual.view(W, -1)
                for i in carried:
                    n = self.slots[i].numel
                    self.param_residual(i).copy_(rows[:, start:start + n])
                    start += n

        if async_op:
            return TimedWork(work, self.meter, self._blocking(done) if self.hierarchy is not None else done)
        with self.meter.blocking():
            if work is not None:
                work.wait()
            done()
        self.meter.reduce_done = time.perf_counter()
        return None

    def _blocking(self, finish):
        """``finish`` timed as exposed communication (two hops: it sends hop 2)."""
        def run():
            with self.meter.blocking():
                finish()
        return run


def counting_hsdp_hook(meter: CommMeter, replicate_group):
    """Hybrid sharding's gradient all-reduce, counted and timed. FSDP2 issues it itself (``dist.all_reduce`` over
    the mesh's ``replicate`` dimension, right after the reduce-scatter) and offers no seam to replace it; the
    hook it calls next (``set_all_reduce_hook``) gets the all-reduced shard. Its bytes are that shard's, times 2
    (an all-reduce sends and receives each byte twice, as DDP's); its blocked time is from the reduce-scatter's
    return to this call, which on CPU is the all-reduce alone."""

    def hook(reduce_output: torch.Tensor) -> None:
        meter.count_tensor("all_reduce", reduce_output, replicate_group, factor=2)
        if meter.reduce_done is not None:
            meter.add_blocked(time.perf_counter() - meter.reduce_done)
            meter.reduce_done = None

    return hook


def counting_allreduce_hook(meter: CommMeter):
    """A DDP comm hook that does what DDP does without one (scale the bucket by 1/W, all-reduce SUM), counted.
    Scaling by 1/W happens before the sum, as in DDP's reducer, so stage 0 matches plain DDP bit for bit for
    power-of-two world sizes (where x/W and x*(1/W) are the same float)."""

    # no annotations here: DDP checks them at registration, and this module's are strings (future annotations)
    def hook(group, bucket):
        buf = bucket.buffer()
        world = dist.get_world_size(group)
        meter.last_ready = time.perf_counter()
        meter.count_tensor("all_reduce", buf, group, factor=2)
        buf.div_(world)
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    return hook
