"""Per-step records, gathered across ranks once per logging interval.

Reading a loss or a phase time on the host forces the device to catch up, and gathering them from every rank
is a collective: doing either every step would serialize the very overlap the trainer tries to get. So each step
leaves a record (its loss as a device tensor, its phase timer record), and every ``log_every`` steps (and before
each evaluation and at the end) ``flush`` resolves them all at once: one device synchronize, one small
all-gather, one row per step in ``metrics.jsonl``. A non-finite global loss or gradient norm (computed with or
without clipping) is caught at the flush and named by its step and global batch; the checkpointer decides what
happens next (``checkpoint.on_nonfinite``).

Progress: rank 0 prints nothing itself. Given a ``progress`` callable (the launcher's: launch/progress.py), it
hands over a list of small rows at each flush (each step's loss, learning rate, samples), a ``tick`` between
flushes at most every ``TICK_S`` seconds (the step reached, so a bar moves while losses wait on the device), and
the run's events (``start``, ``eval``, ``end``, through ``event``). The callable must not block: it is called
from the step loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from dutycycle.engine.errors import TrainingDiverged

from .timing import PHASES, gather_stats

TICK_S = 0.5  # at most this often a tick between flushes: a progress bar moves about twice a second


@dataclass
class _Pending:
    step: int
    epoch: int
    lr: float
    loss: object  # a 0-d tensor on the device: the rank's mean loss of this step
    samples: int  # this rank's samples in the step
    record: dict  # StepTimer.end_step()
    grad_norm: object = None  # the global gradient norm before clipping (0-d device tensor)
    batch: int = -1  # the global batch's index in its epoch (the plan's position)
    sample_ids: object = None  # this rank's sample ids of the batch


class StepLog:
    def __init__(self, timer, writer, *, log_every: int, base_lr: float = 0.0,
                 progress: Callable[[list[dict]], None] | None = None):
        self.timer, self.writer = timer, writer
        self.log_every = log_every
        self.progress = progress  # rank 0's: takes a list of rows, never blocks (launch/progress.py)
        self._ticked = 0.0
        self.pending: list[_Pending] = []
        self.samples = 0  # global samples over flushed steps
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.base_lr = base_lr

    def add(self, step: int, epoch: int, lr: float, loss, samples: int, record: dict, grad_norm=None,
            batch: int = -1, sample_ids=None) -> None:
        self.pending.append(_Pending(step, epoch, lr, loss, samples, record, grad_norm, batch, sample_ids))
        if step == 1 or (self.log_every and step % self.log_every == 0):
            self.flush()
        elif self.progress is not None and time.monotonic() - self._ticked >= TICK_S:
            self._ticked = time.monotonic()
            self.progress([{"event": "tick", "step": step, "epoch": epoch, "time": time.time()}])

    def event(self, name: str, **fields) -> None:
        """A run event for the progress rows (``start``, ``eval``, ``end``); nothing without a progress sink."""
        if self.progress is not None:
            self.progress([{"event": name, **fields, "time": time.time()}])

    def flush(self) -> None:
        if not self.pending:
            return
        import torch

        phases = self.timer.resolve([p.record for p in self.pending])
        # one device-to-host copy for every step's loss and gradient norm (the norm is the same on every rank)
        pairs = []
        for p in self.pending:
            loss = p.loss.detach().double().reshape(())
            norm = loss.new_tensor(float("nan")) if p.grad_norm is None else p.grad_norm.detach().double().reshape(())
            pairs.append(torch.stack([loss, norm.to(loss.device)]))
        host = torch.stack(pairs).cpu().tolist()
        losses = [h[0] for h in host]
        table = [[loss, float(p.samples)] + [ph[k] for k in PHASES] + [ph["step"]]
                 for loss, p, ph in zip(losses, self.pending, phases, strict=True)]
        stats = gather_stats(table)  # [world, steps, fields]
        shown: list[dict] = []  # the progress rows
        flushed = 0  # global samples of these steps
        for j, p in enumerate(self.pending):
            s = stats[:, j]
            n = float(s[:, 1].sum())
            global_loss = float((s[:, 0] * s[:, 1]).sum() / n)
            bad = None if math.isfinite(global_loss) else f"loss became {global_loss}"
            if bad is None and p.grad_norm is not None and not math.isfinite(host[j][1]):
                bad = f"gradient norm became {host[j][1]}"
            if bad:
                self.pending.clear()
                self._show(shown, flushed)  # the steps before it were good (and are in metrics.jsonl)
                raise TrainingDiverged(
                    f"{bad} at step {p.step} (epoch {p.epoch}); lower optim.lr (now {self.base_lr:g}) or set "
                    "optim.grad_clip", step=p.step, epoch=p.epoch, batch=p.batch, sample_ids=p.sample_ids)
            self.samples += int(n)
            self.first_loss = global_loss if self.first_loss is None else self.first_loss
            self.last_loss = global_loss
            row = {"step": p.step, "epoch": p.epoch, "loss": global_loss, "lr": p.lr, "samples": self.samples,
                   "step_s": float(s[:, 2 + len(PHASES)].max())}
            if p.grad_norm is not None:
                row["grad_norm"] = host[j][1]
            for i, k in enumerate(PHASES):
                row[k] = float(s[:, 2 + i].mean())
                row[k + "_max"] = float(s[:, 2 + i].max())
            self.writer.log(row)
            shown.append({"event": "step", "step": p.step, "epoch": p.epoch, "loss": global_loss, "lr": p.lr,
                          "samples": self.samples, "step_s": row["step_s"], "grad_norm": row.get("grad_norm"),
                          "data_wait": row["data_wait"]})
            flushed += int(n)
        self.pending.clear()
        self._show(shown, flushed)

    def _show(self, shown: list[dict], flushed: int) -> None:
        """Hand a flush's rows to the progress sink; the last carries the interval's samples/s."""
        if self.progress is not None and shown:
            now, step_s = time.time(), sum(r["step_s"] for r in shown)
            for r in shown:
                r["time"] = now
            if step_s > 0:  # the interval's training rate (evaluations and saves between steps are not in it)
                shown[-1]["samples_per_s"] = flushed / step_s
            self._ticked = time.monotonic()
            self.progress(shown)
