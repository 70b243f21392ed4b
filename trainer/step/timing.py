"""Per-step time accounting: where did each second of a step go?

Phases (seconds per step, per rank):
  data_wait         blocked on the loader for the next batch
  h2d               host-to-device copy
  forward_backward  forward, loss and backward of every micro-batch
  comm              exposed communication: gradient exchange and parameter gathers not hidden by compute
  optimizer         clipping, optimizer step, zero_grad, schedule
  checkpoint        time the loop stalled for the checkpointer
  eval              validation passes
  other             the rest of the step's wall time (logging, metric reduction, Python)

and once per run, outside the steps (``ONE_TIME``): ``restore`` (resuming from a commit, and rollbacks),
``loader_start`` (each epoch's loader start: its plan, its first reads), ``final_save`` (the last save and the
wait for a background write to commit).

On CPU each phase is a monotonic-clock interval; every phase boundary is a synchronous point (CPU kernels and
gloo collectives return when done), so the intervals are honest. ``comm`` is *exposed* communication: the time
the step waited on collectives that computation did not hide (parallel/comm.py measures it and the loop moves
it out of forward_backward). On GPU, kernels are asynchronous: phases are recorded with CUDA events and resolved
once per logging interval after a single synchronize, so timing does not itself serialize the GPU.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

PHASES = ("data_wait", "h2d", "forward_backward", "comm", "optimizer", "checkpoint", "eval")
ALL_PHASES = (*PHASES, "other")
# Once per run (or per epoch), outside any step: what a short run pays and a long one amortizes. Named so that
# "other" holds only what is left (logging, metric reduction, Python between the phases).
ONE_TIME = ("restore", "loader_start", "final_save")
ACCOUNT = (*PHASES, *ONE_TIME, "other")  # the run's whole wall time, every second under one name
# The job's one-time phases around the loop, from launch to exit, in the order they happen (launch/account.py)
JOB_ONE_TIME = ("ray_start", "worker_start", "health_check", "data_open", "model_build", "warmup", *ONE_TIME,
                "failures", "results", "teardown")
# Phases that do the model's useful work: goodput is their share of wall time.
USEFUL = ("forward_backward", "optimizer")


class StepTimer:
    """Times the phases of one step at a time. ``phase(name)`` is a context manager; ``end_step()`` returns the
    step's record, and ``resolve(records)`` turns records into ``{phase: seconds}`` dicts (with ``other`` and
    ``step``, the step's wall time) and adds them to ``totals``.

    Resolution is deferred so the loop synchronizes with the device once per logging interval, not once per
    step: on GPU each phase is a pair of CUDA events, read after a single ``synchronize()`` in ``resolve``."""

    def __init__(self, device=None):
        import torch

        self.cuda = device is not None and getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available()
        self.totals: dict[str, float] = dict.fromkeys((*ALL_PHASES, "step"), 0.0)
        self.steps = 0
        self._carried = dict.fromkeys(PHASES, 0.0)
        self.start_step()

    def start_step(self) -> None:
        self._events: list[tuple[str, object, object]] = []
        self._cpu, self._carried = self._carried, dict.fromkeys(PHASES, 0.0)
        # time spent between two steps (``between``) belongs to the next one: its wall starts that much earlier
        self._start = time.perf_counter() - sum(self._cpu.values())

    @contextmanager
    def between(self, name: str):
        """Time host work done after a step closed and before the next starts (a checkpoint saved once its step's
        row is written); it counts in the next step's record, or in ``totals`` through ``close``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._carried[name] += time.perf_counter() - t0

    def close(self) -> None:
        """At the end of the loop: time carried past the last step goes straight into ``totals``."""
        for name, seconds in self._carried.items():
            self.totals[name] += seconds
        self._carried = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str, host: bool = False):
        """Time a phase. ``host=True`` forces the wall clock even on GPU (e.g. waiting for the loader, which is
        host work that does not enqueue kernels)."""
        assert name in PHASES, name
        if self.cuda and not host:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((name, start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._cpu[name] += time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        """Attribute time measured elsewhere (e.g. the loader's own wait counter) to a phase."""
        self._cpu[name] += seconds

    def move(self, src: str, dst: str, seconds: float) -> None:
        """Re-attribute ``seconds`` measured inside phase ``src`` to ``dst`` (host-timed phases only): e.g.
        collectives that blocked inside forward/backward are communication, not compute."""
        if seconds <= 0:
            return
        seconds = min(seconds, self._cpu[src]) if not self.cuda else seconds
        self._cpu[src] -= seconds
        self._cpu[dst] += seconds

    def end_step(self) -> dict:
        """Close the step; returns its unresolved record."""
        self.steps += 1
        return {"cpu": dict(self._cpu), "events": list(self._events), "wall": time.perf_counter() - self._start}

    def resolve(self, records: list[dict]) -> list[dict[str, float]]:
        """Phase seconds per record (one device synchronize for all of them); adds them to ``totals``."""
        if self.cuda and any(r["events"] for r in records):
            import torch

            torch.cuda.synchronize()
        out = []
        for r in records:
            secs = dict(r["cpu"])
            for name, start, end in r["events"]:
                secs[name] += start.elapsed_time(end) / 1000.0
            secs["other"] = max(0.0, r["wall"] - sum(secs.values()))
            secs["step"] = r["wall"]
            for k, v in secs.items():
                self.totals[k] += v
            out.append(secs)
        return out


# Spans that fold into another name: a rollback's restore is counted with the resume's
SPAN_INTO = {"rollback": "restore"}


@dataclass
class Span:
    """One finished span: its name and how long it took (set when the span closes)."""

    name: str
    seconds: float = 0.0


class TimeAccount:
    """Every clock read of a worker's run, and every sum over them. The trainer sends events; this adds them up.

    Events, in the order a run sends them:

    - ``setup_done(name)``: a setup phase (``health_check``, ``data_open``, ``model_build``) ended; it began
      where the last one ended (the first where the account was made). ``worker_init`` is the launcher's part,
      from ``started`` (the wall clock when the launcher entered the worker) to the account's creation;
    - ``loop_started()``: setup is over; returns the attempt record (``started``, ``setup``, ``loop_started``);
    - ``span(name)`` / ``begin(name)`` and ``end(name)``: one-time spans outside the steps (``ONE_TIME``:
      restore, loader_start, final_save; ``rollback``, counted as restore), ``eval`` passes, and
      ``memory_probe`` (a result of the run: its time moves from the loop to the results);
    - ``start_step()``, ``phase(name)``, ``between(name)``, ``end_step()``: a step's phases (``StepTimer``);
      ``close_steps()`` at the end of the steps;
    - ``loop_ended()`` after the final save, ``attempt()`` once the results are gathered: the attempt record
      with ``loop_s`` (the loop's wall time, the memory probe left out) and ``results_s`` (after it).
    """

    def __init__(self, device=None, started: float | None = None):
        now = time.time()
        self.started = started if started is not None else now
        self.setup = {"worker_init": max(0.0, now - self.started)}
        self.spans: dict[str, float] = dict.fromkeys((*ONE_TIME, "eval", "memory_probe"), 0.0)
        self.timer = StepTimer(device)
        self._mark = time.perf_counter()
        self._open: dict[str, float] = {}
        self._record: dict = {}
        self.loop_s = 0.0

    # ------------------------------------------------------------------------------ setup and the loop

    def setup_done(self, name: str) -> None:
        now = time.perf_counter()
        self.setup[name] = now - self._mark
        self._mark = now

    def loop_started(self) -> dict:
        self.setup_done("model_build")
        self._loop_t0 = self._mark
        self._record = {"started": self.started, "setup": self.setup, "loop_started": time.time()}
        return self._record

    def loop_ended(self) -> None:
        self.loop_s = time.perf_counter() - self._loop_t0 - self.spans["memory_probe"]

    def attempt(self) -> dict:
        """The attempt's record as the job's account reads it (launch/account.py)."""
        results_s = time.perf_counter() - self._loop_t0 - self.loop_s
        return {**self._record, "loop_s": self.loop_s, "results_s": results_s}

    # ---------------------------------------------------------------------------------------- spans

    def begin(self, name: str) -> None:
        self._open[name] = time.perf_counter()

    def end(self, name: str) -> float:
        seconds = time.perf_counter() - self._open.pop(name)
        key = SPAN_INTO.get(name, name)
        self.spans[key] += seconds
        return seconds

    @contextmanager
    def span(self, name: str):
        """A span around a block; the yielded ``Span`` holds its seconds once the block is done."""
        record = Span(name)
        self.begin(name)
        yield record
        record.seconds = self.end(name)

    @property
    def once(self) -> dict[str, float]:
        return {k: self.spans[k] for k in ONE_TIME}

    # ---------------------------------------------------------------------------------------- steps

    def start_step(self) -> None:
        self.timer.start_step()

    def phase(self, name: str, host: bool = False):
        return self.timer.phase(name, host=host)

    def between(self, name: str):
        return self.timer.between(name)

    def end_step(self) -> dict:
        return self.timer.end_step()

    def close_steps(self) -> None:
        self.timer.close()


def gather_stats(values):
    """All-gather a small table of floats from every rank. ``values`` is a list (one row) or a list of rows;
    returns a float64 tensor ``[world, len]`` for a list and ``[world, rows, len]`` for rows.

    Works without an initialized process group (local mode): the single row is this process's values."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t.unsqueeze(0)
    backend = dist.get_backend()
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    flat = t.reshape(-1).to(dev)
    out = torch.empty(dist.get_world_size() * flat.numel(), dtype=torch.float64, device=dev)
    dist.all_gather_single(out, flat)
    return out.view(-1, *t.shape).cpu()


def breakdown(totals: dict[str, float], wall: float, names=ALL_PHASES) -> dict[str, dict[str, float]]:
    """Seconds and fractions of ``wall`` per phase (``names``)."""
    seconds = {k: float(totals.get(k, 0.0)) for k in names}
    fractions = {k: (v / wall if wall > 0 else 0.0) for k, v in seconds.items()}
    return {"seconds": seconds, "fractions": fractions}
