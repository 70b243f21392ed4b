"""From a step to its samples' places, and back, over a run's starts (record.py): pure functions of the records.

Steps are numbered as ``metrics.jsonl`` numbers them: step N is the N-th optimizer step (1-based). A start that
restored step ``s`` at loader position (epoch ``e``, next global batch ``b``) trains step ``s + 1`` on the first
global batch at or after ``(e, b)`` that was never skipped, and each step after it on the next one, epoch after
epoch (an epoch has ``num_steps(num_samples, global_batch_size, drop_last)`` global batches).

Inside a step: rank ``r`` of the start's ``data_world`` data-parallel ranks takes the contiguous slice
``plan.rank_bounds(len(batch), r, data_world)`` of the global batch, and cuts it into ``micro_batches`` chunks as
``torch.chunk`` does (step/loop.py ``forward_backward``): ``ceil(n / micro_batches)`` samples each, the last
shorter (fewer chunks when the slice is short).
"""

from __future__ import annotations

from dataclasses import dataclass

from dutycycle.engine.errors import ConfigError
from dutycycle.loader import plan

from .record import RunRecord, Start


def steps_per_epoch(start: Start) -> int:
    p = start.loader
    return plan.num_steps(int(p["num_samples"]), int(p["global_batch_size"]), bool(p["drop_last"]))


def find_start(run: RunRecord, step: int) -> Start:
    """The start that trained ``step`` (and whose update the run kept)."""
    for s in run.starts:
        if s.first < step <= s.last:
            return s
    raise ConfigError(f"step {step} is outside the steps run {run.run_dir!r} trained (1..{run.last_step}); pass a "
                      "step in that range, as metrics.jsonl numbers them")


def _trainable(epoch: int, lo: int, hi: int, skipped: set) -> int:
    """Global batches of ``epoch`` in ``[lo, hi)`` that were not skipped."""
    return (hi - lo) - sum(1 for e, b in skipped if e == epoch and lo <= b < hi)


def locate(run: RunRecord, step: int) -> tuple[Start, int, int]:
    """``(start, epoch, global batch)`` of ``step``."""
    start = find_start(run, step)
    per = steps_per_epoch(start)
    if per <= 0:
        raise ConfigError(f"run {run.run_dir!r}: an epoch of its plan has no global batch")
    left = step - start.first  # the left-th trainable batch from the start's position (1-based)
    epoch, batch = start.epoch, start.batch
    if batch >= per:
        epoch, batch = epoch + 1, 0
    skipped = {s for s in run.skipped if s[0] >= epoch}
    if not skipped:  # the common case: arithmetic
        offset = batch + left - 1
        return start, epoch + offset // per, offset % per
    while True:
        here = _trainable(epoch, batch, per, skipped)
        if left <= here:
            for b in range(batch, per):
                if (epoch, b) not in skipped:
                    left -= 1
                    if left == 0:
                        return start, epoch, b
        left -= here
        epoch, batch = epoch + 1, 0


def step_of(run: RunRecord, start: Start, epoch: int, batch: int) -> int | None:
    """The step at which ``start`` trained global batch ``batch`` of ``epoch``, or None when it did not (before its
    position, after its last step, or skipped)."""
    per = steps_per_epoch(start)
    e0, b0 = start.epoch, start.batch
    if b0 >= per:
        e0, b0 = e0 + 1, 0
    if (epoch, batch) < (e0, b0) or (epoch, batch) in run.skipped or batch >= per:
        return None
    if epoch == e0:
        n = _trainable(e0, b0, batch, run.skipped)
    else:
        n = _trainable(e0, b0, per, run.skipped) + sum(_trainable(e, 0, per, run.skipped) for e in range(e0 + 1, epoch))
        n += _trainable(epoch, 0, batch, run.skipped)
    step = start.first + n + 1
    return step if step <= start.last else None


def last_epoch(run: RunRecord, start: Start) -> int:
    """The epoch of ``start``'s last step (its first epoch when it trained none)."""
    if start.last <= start.first:
        return start.epoch
    return locate(run, start.last)[1]


@dataclass(frozen=True)
class Place:
    rank: int  # the data-parallel rank
    micro_batch: int
    index_in_rank: int  # the sample's place in its rank's share


def micro_sizes(n: int, micro_batches: int) -> list[int]:
    """The chunks ``torch.chunk`` cuts ``n`` samples into for ``micro_batches`` (step/loop.py)."""
    if n == 0:
        return []
    c = -(-n // micro_batches)
    return [min(c, n - i) for i in range(0, n, c)]


def micro_of(j: int, n: int, micro_batches: int) -> int:
    """The micro-batch of place ``j`` in a rank's ``n`` samples cut as the step loop cuts them
    (``tensor_split``: ``micro_batches`` pieces as even as they go, the first ``n % micro_batches`` one larger)."""
    q, r = divmod(n, micro_batches)
    return j // (q + 1) if j < r * (q + 1) else r + (j - r * (q + 1)) // q


def place(position: int, batch_len: int, data_world: int, micro_batches: int) -> Place:
    """Where position ``position`` of a global batch of ``batch_len`` samples trained."""
    for r in range(data_world):
        lo, hi = plan.rank_bounds(batch_len, r, data_world)
        if lo <= position < hi:
            j = position - lo
            return Place(r, micro_of(j, hi - lo, micro_batches), j)
    raise AssertionError(f"position {position} outside a batch of {batch_len}")
