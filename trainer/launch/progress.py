"""Live progress from rank 0 to the driver: one stream of rows, handed to several listeners.

Rank 0 emits small rows (step/steplog.py and the trainer's events) through a *sink*, a callable that takes a list
of rows and never blocks the step loop. They reach the driver

- in-process (``--local``): the sink is the driver's ``ProgressStream.put``, a queue;
- on Ray, on one node or many: through ``Mailbox``, a 0-CPU actor the driver creates on its own node and hands
  to the workers. Rank 0 submits ``put`` and does not wait for it (``RaySink``); the driver's relay thread takes
  what arrived every ``POLL_S`` seconds. An actor, not a socket: it works wherever a Ray driver works (across
  nodes, through Ray Client), and every run of one driver process's Ray session uses the same one.

On the driver a ``ProgressStream`` hands each row, in order, to each of its listeners on a thread of the
listener's own (a slow one delays neither a step nor the other listeners): the ``ProgressDisplay`` (a tqdm bar
when stdout is a terminal, plain lines otherwise) and the MLflow run (tracking.py). A listener that raises is
dropped with one warning; the training goes on.

Rows are dicts; ``event`` names the kind:

    start  an attempt's loop begins: step (0, or the step it resumed from), epoch, total, world_size,
           global_batch, resumed, data (the cache's fingerprint and lineage: its table, the table's version)
    tick   the step reached between two flushes (no loss yet): step, epoch
    step   one optimizer step: step, epoch, loss, lr, samples (this attempt's global samples so far), step_s,
           grad_norm, data_wait; the last row of a flush carries samples_per_s (the interval's training rate)
    eval   a validation pass: step, val_accuracy, val_loss, val_samples, eval_s
    parity_check  parallel.check_every's check (trainer/parallel/check.py): step, passed, max_rel_error, bound,
           seconds
    end    the loop is done: step

Every row carries ``time`` (rank 0's wall clock).
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable

POLL_S = 0.25  # the driver collects rows from the mailbox this often
LINE_S = 15.0  # plain lines: at least one this often while steps advance, whatever run.log_every says
MAILBOX_ROWS = 100_000  # rows a mailbox holds for a driver that stopped collecting (the oldest go first)
SINK_CLOSE_S = 5.0  # how long rank 0 waits at the end for its last rows to reach the mailbox


# ---------------------------------------------------------------------------------------------- the stream


class ProgressStream:
    """Rows in from any thread (``put`` never blocks), out to every listener in order, each listener on a thread
    of its own: a slow one (an MLflow store opening) holds back neither the steps nor the other listeners.

    A listener is a callable taking one row; if it has ``close()``, that is called when the stream closes."""

    def __init__(self, listeners: Iterable[Callable[[dict], None]] = ()):
        self.listeners = [_Listening(x) for x in listeners if x is not None]

    def put(self, rows: list[dict]) -> None:
        rows = list(rows)
        for x in self.listeners:
            x.put(rows)

    def close(self, timeout: float = 120.0) -> None:
        """Deliver every row put so far, then close the listeners. Safe to repeat."""
        for x in self.listeners:
            x.close(timeout)


class _Listening:
    """One listener, its queue and its thread. A listener that raises is dropped with one warning."""

    def __init__(self, listener: Callable[[dict], None]):
        self.listener, self.failed = listener, False
        self._queue: collections.deque = collections.deque()
        self._ready = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"dutycycle-progress-{_name(listener)}",
                                        daemon=True)
        self._thread.start()

    def put(self, rows: list[dict]) -> None:
        with self._ready:
            if not self._closed:
                self._queue.append(rows)
                self._ready.notify()

    def _next(self) -> list[dict] | None:
        with self._ready:
            while not self._queue and not self._closed:
                self._ready.wait()
            return self._queue.popleft() if self._queue else None

    def _run(self) -> None:
        while (rows := self._next()) is not None:
            for row in rows:
                if self.failed:
                    continue
                try:
                    self.listener(row)
                except Exception as e:  # noqa: BLE001 - a broken listener must not end the training
                    self.failed = True
                    warnings.warn(f"progress: {_name(self.listener)} failed and is off for this run: "
                                  f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=1)

    def close(self, timeout: float) -> None:
        with self._ready:
            if self._closed:
                return
            self._closed = True
            self._ready.notify()
        self._thread.join(timeout)
        close = getattr(self.listener, "close", None)
        if callable(close) and not self.failed:
            try:
                close()
            except Exception as e:  # noqa: BLE001 - closing one listener must not skip the others
                warnings.warn(f"progress: closing {_name(self.listener)} failed: {type(e).__name__}: {e}",
                              RuntimeWarning, stacklevel=1)


def _name(listener) -> str:
    return getattr(listener, "name", None) or type(listener).__name__


# --------------------------------------------------------------------------------------- across Ray


class Mailbox:
    """The Ray actor between rank 0 and the driver: rows in by ``put`` (rank 0, never awaited), out by ``take``
    (the driver). Rows are kept per run token, so a driver process reusing its mailbox never sees an earlier
    run's rows; at most ``limit`` rows per run are held (the oldest dropped, counted)."""

    def __init__(self, limit: int = MAILBOX_ROWS):
        self.limit = limit
        self.rows: dict[str, collections.deque] = {}
        self.dropped: dict[str, int] = {}

    def put(self, token: str, rows: list[dict]) -> None:
        box = self.rows.setdefault(token, collections.deque(maxlen=self.limit))
        over = len(box) + len(rows) - self.limit
        if over > 0:
            self.dropped[token] = self.dropped.get(token, 0) + over
        box.extend(rows)

    def take(self, token: str) -> tuple[list[dict], int]:
        """The rows of run ``token`` that arrived since the last take, and how many were dropped so far."""
        box = self.rows.get(token)
        rows = list(box) if box else []
        if box:
            box.clear()
        return rows, self.dropped.get(token, 0)

    def forget(self, token: str) -> None:
        self.rows.pop(token, None)
        self.dropped.pop(token, None)


_MAILBOXES: dict[tuple[str, str], object] = {}  # this driver's mailbox, per Ray session (node and job)


def mailbox():
    """This driver's mailbox actor: created on the driver's node at the first run of a Ray session (0 CPUs, so
    it never takes a worker's place), kept here for the session's later runs (an actor whose every handle is
    gone is destroyed by Ray, so this one holds it)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    rt = ray.get_runtime_context()
    key = (rt.get_node_id(), rt.get_job_id())
    if key not in _MAILBOXES:
        _MAILBOXES.clear()  # an earlier session's actor went with its session
        _MAILBOXES[key] = ray.remote(num_cpus=0, max_restarts=0)(Mailbox).options(
            # hard affinity: a soft one let Ray place it on a worker node when the driver's node has no CPUs,
            # and the rows stopped when that node was lost (an elastic run goes on without it)
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=rt.get_node_id(), soft=False),
        ).remote()
    return _MAILBOXES[key]


class RaySink:
    """Rank 0's sink on Ray: each call submits ``Mailbox.put`` and returns at once (the step never waits for the
    driver). ``close`` waits a few seconds for the last rows to land, so a worker that exits right after its
    last step does not take them with it."""

    def __init__(self, box, token: str):
        self.box, self.token = box, token
        self._last = None

    def __call__(self, rows: list[dict]) -> None:
        self._last = self.box.put.remote(self.token, rows)

    def close(self) -> None:
        import ray

        if self._last is not None:
            ray.wait([self._last], timeout=SINK_CLOSE_S)


class Relay:
    """The driver's side of a Ray run: a thread moving rows from the mailbox into the stream every ``POLL_S``
    seconds, until ``stop`` (which takes what is left)."""

    def __init__(self, box, token: str, stream: ProgressStream):
        self.box, self.token, self.stream = box, token, stream
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dutycycle-progress-relay", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        import ray

        rows, self.dropped = ray.get(self.box.take.remote(self.token), timeout=30)
        if rows:
            self.stream.put(rows)

    def _run(self) -> None:
        failed = False
        while not self._stop.wait(POLL_S):
            try:
                self._take()
                failed = False
            except Exception as e:  # noqa: BLE001 - progress is not worth a failed run; say it once
                if not failed:
                    print(f"progress: rows from the workers are late ({type(e).__name__}: {e})", file=sys.stderr)
                failed = True

    def stop(self) -> None:
        import ray

        self._stop.set()
        self._thread.join()
        try:
            self._take()
            ray.get(self.box.forget.remote(self.token), timeout=10)
        except Exception as e:  # noqa: BLE001 - the run itself is over and fine
            print(f"progress: the last rows from the workers were lost ({type(e).__name__}: {e})", file=sys.stderr)
        if self.dropped:
            print(f"progress: {self.dropped} rows were dropped while the driver did not collect them (the "
                  f"mailbox keeps the newest {MAILBOX_ROWS:,}); metrics.jsonl has every step", file=sys.stderr)


def run_token() -> str:
    return uuid.uuid4().hex


# --------------------------------------------------------------------------------------------- display


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Rate:
    """Steps per second over the last ``window_s`` seconds of rows (rank 0's clock), evaluations and saves
    included: what the remaining steps will take."""

    def __init__(self, window_s: float = 60.0):
        self.window_s = window_s
        self.points: collections.deque = collections.deque()

    def reset(self) -> None:
        self.points.clear()

    def add(self, t: float, step: int) -> None:
        if self.points and step <= self.points[-1][1]:
            return
        self.points.append((t, step))
        while len(self.points) > 2 and t - self.points[1][0] >= self.window_s:
            self.points.popleft()

    def steps_per_s(self) -> float | None:
        if len(self.points) < 2:
            return None
        (t0, s0), (t1, s1) = self.points[0], self.points[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None

    def eta(self, step: int, total: int) -> float | None:
        rate = self.steps_per_s()
        return (total - step) / rate if rate else None


class ProgressDisplay:
    """The driver's view of a run. ``bar=True``: a tqdm bar (step/total, loss, samples/s, ETA); ``False``:
    plain lines at step 1, every ``log_every`` steps, and at least every ``LINE_S`` seconds while the steps
    advance; ``None``: a bar when ``out`` is a terminal. Evaluations, resumes and restarts are lines of their
    own either way."""

    name = "progress display"

    def __init__(self, log_every: int, *, out=None, bar: bool | None = None, label: str = "train",
                 line_s: float = LINE_S):
        self.out = out or sys.stdout
        self.log_every, self.label, self.line_s = log_every, label, line_s
        self.use_bar = _is_terminal(self.out) if bar is None else bar
        self.rate = Rate()
        self.total = 0
        self.step = 0
        self.attempts = 0
        self.loss: float | None = None
        self.samples_per_s: float | None = None
        self._bar = None
        self._lined = 0.0  # when the last plain line was written (rank 0's clock)
        self._lined_step = -1

    # ------------------------------------------------------------------------------ rows

    def __call__(self, row: dict) -> None:
        kind = row.get("event")
        if kind == "start":
            self._start(row)
        elif kind in ("tick", "step"):
            self._advance(row)
        elif kind == "eval":
            self._write(f"step {row['step']}/{self.total}: val accuracy {row['val_accuracy']:.3f}, "
                        f"val loss {row['val_loss']:.4f} ({row.get('eval_s', 0.0):.1f} s)")
        elif kind == "parity_check":
            self._write(f"step {row['step']}/{self.total}: parity check {'passed' if row['passed'] else 'FAILED'}, "
                        f"largest error {row['max_rel_error']:.2e} of the gradient (bound {row['bound']:.2e}, "
                        f"{row.get('seconds', 0.0):.2f} s)")
        elif kind == "end":
            self._advance(row)
            self._close_bar()

    def _start(self, row: dict) -> None:
        self._close_bar()
        self.attempts += 1
        self.total, self.step = int(row["total"]), int(row["step"])
        self._lined, self._lined_step = row["time"], self.step  # an attempt's own lines: a restart's come again
        self.rate.reset()
        self.rate.add(row["time"], self.step)
        workers = row.get("world_size", 1)
        where = f"{workers} worker{'s' if workers != 1 else ''}, global batch {row.get('global_batch', '?')}"
        if row.get("resumed"):
            again = f"attempt {self.attempts}: " if self.attempts > 1 else ""
            self._write(f"{self.label}: {again}resumed at step {self.step}/{self.total} ({where})")
        elif self.attempts > 1:
            self._write(f"{self.label}: attempt {self.attempts}: started again at step {self.step} ({where})")
        else:
            self._write(f"{self.label}: {self.total} steps on {where}")
        if self.use_bar:
            from tqdm import tqdm  # only on a terminal

            self._bar = tqdm(total=self.total, initial=self.step, unit="step", file=self.out, desc=self.label,
                             dynamic_ncols=True, leave=True, mininterval=0.2,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                        "[{elapsed}<{remaining}{postfix}]")

    def _advance(self, row: dict) -> None:
        step = int(row.get("step", self.step))
        t = float(row.get("time", time.time()))
        if row.get("loss") is not None:
            self.loss = float(row["loss"])
        if row.get("samples_per_s") is not None:
            self.samples_per_s = float(row["samples_per_s"])
        self.rate.add(t, step)
        self.step = max(self.step, step) if self.total else step
        if self._bar is not None:
            self._bar.update(self.step - self._bar.n)
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            return
        kind = row.get("event")
        due = (kind == "end"
               or (kind == "step" and self.log_every and (step == 1 or step % self.log_every == 0))
               or (self.line_s and t - self._lined >= self.line_s))
        if due and step > self._lined_step:
            self._lined, self._lined_step = t, step
            self._write(self.line())

    def _postfix(self) -> str:
        parts = []
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.samples_per_s is not None:
            parts.append(f"{self.samples_per_s:,.0f} samples/s")
        return ", " + ", ".join(parts) if parts else ""

    def line(self) -> str:
        """The plain progress line: step/total, loss, samples/s, ETA."""
        pct = 100.0 * self.step / self.total if self.total else 0.0
        text = f"step {self.step}/{self.total} ({pct:.0f}%)"
        if self.loss is not None:
            text += f"  loss {self.loss:.4f}"
        if self.samples_per_s is not None:
            text += f"  {self.samples_per_s:,.0f} samples/s"
        eta = self.rate.eta(self.step, self.total)
        if self.step >= self.total:
            text += "  done"
        elif eta is not None:
            text += f"  eta {_clock(eta)}"
        return text

    # ------------------------------------------------------------------------------ output

    def _write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.out)
        else:
            print(text, file=self.out, flush=True)

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        self._close_bar()


def _is_terminal(out) -> bool:
    try:
        return bool(out.isatty())
    except (AttributeError, ValueError):
        return False
