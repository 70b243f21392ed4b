"""What a Trainer start records for ``dutycycle trace`` (trainer/trace/, the reading side): its plan record, and the
per-sample loss log.

**The start record** (``start_record``) goes into the ``attempt`` row each Trainer start writes into ``metrics.jsonl``
(under ``"trace"``): the loader's state right after the restore (its position and every input of the plan), the
world size, the data-parallel ranks, the micro-batches, the launch (attempt) number and where the data came from.
trainer/trace/record.py reads it back.

**The per-sample loss log** (``run.record_sample_loss = true``): each sample's loss at each step, in Parquet.

Rank 0 writes them, ``RUN_DIR/sample_loss/a<attempt>-<start>-<part>.parquet``, every rank's rows gathered at each
flush (one small object gather; so a run directory on one node's disk or on an object store holds them all),
each part written whole and renamed into place (``io.write_bytes_atomic``), so a reader never sees half a file. Columns: ``sample_id`` (the table's row id), ``step``, ``epoch``, ``batch`` (the
global batch in its epoch), ``rank`` (data-parallel), ``micro_batch``, ``position`` (the sample's place in its
rank's share), ``loss`` (float64: the sample's cross-entropy at the step's forward, before the update), ``attempt``, ``start`` (the Trainer start's wall clock),
``world_size`` and ``part`` (the part's number in its start).

The losses stay on the device until a part is written: at each ``run.log_every`` step (when the step log
flushes too), before each checkpoint save (so a commit's steps are on disk before it) and at the end; one
device-to-host copy and one gather per part. A step trained again after a failure (a later start from an older
commit, or a rollback after a non-finite loss within the same start) is written again: ``read_sample_losses``
keeps, for every step, the rows of the newest start and, within it, the newest part, so the log holds each step
once per sample, as the run kept it.
"""

from __future__ import annotations

import io as _pyio
import posixpath

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from dutycycle.engine import io
from dutycycle.trainer.cluster.world import all_gather

RECORD_VERSION = 1  # the record's own layout; a reader refuses another


def attempt_number(attempt_dir: str) -> int:
    """The launch's number from its folder (``RUN_DIR/attempts/<k>``); 0 for a start outside any launch (a
    Trainer built directly, as tests and benchmarks do)."""
    name = posixpath.basename(str(attempt_dir).rstrip("/"))
    return int(name) if name.isdigit() else 0


def start_record(*, loader_state: dict, world_size: int, data_world: int, data_groups: list | None,
                 micro_batches: int, attempt_dir: str, data: dict) -> dict:
    """The ``trace`` field of a start's ``attempt`` row (see the module doc)."""
    return {"version": RECORD_VERSION, "attempt": attempt_number(attempt_dir), "world_size": int(world_size),
            "data_world": int(data_world), "data_groups": data_groups, "micro_batches": int(micro_batches),
            "loader": dict(loader_state), "data": data}


FOLDER = "sample_loss"
SCHEMA = pa.schema([("sample_id", pa.string()), ("step", pa.int64()), ("epoch", pa.int64()), ("batch", pa.int64()),
                    ("rank", pa.int32()), ("micro_batch", pa.int32()), ("position", pa.int32()),
                    ("loss", pa.float64()), ("attempt", pa.int32()), ("start", pa.float64()), ("world_size", pa.int32()),
                    ("part", pa.int32())])


class SampleLosses:
    """One rank's recorder; every rank has one (``flush`` is a collective). ``add`` after each optimizer step (the
    per-micro-batch loss tensors the step computed, in order); ``flush`` gathers every rank's pending rows to
    rank 0 (``writer``), which writes them as one part. ``records``: whether this rank's samples are its own
    (under tensor parallelism a group's ranks train the same samples: its first rank's rows are kept)."""

    def __init__(self, run_dir: str, *, rank: int, world_size: int, attempt: int, start: float, log_every: int,
                 records: bool = True, writer: bool = True):
        self.folder = io.join(run_dir, FOLDER)
        self.rank, self.world_size, self.attempt, self.start = rank, world_size, attempt, start
        self.records, self.writer = records, writer
        self.log_every = max(1, int(log_every or 1))
        self.pending: list[tuple[int, int, int, list, list]] = []  # (step, epoch, batch, ids, [micro losses])
        self.part = 0
        self.rows_written = 0

    def add(self, step: int, epoch: int, batch: int, sample_ids, micro_losses: list) -> None:
        self.pending.append((step, epoch, batch, list(sample_ids or []), micro_losses))
        if step == 1 or step % self.log_every == 0:
            self.flush()

    def _columns(self) -> dict[str, list]:
        """This rank's pending rows as columns (none when it does not record)."""
        cols: dict[str, list] = {k: [] for k in SCHEMA.names}
        if not self.records or not self.pending:
            return cols
        import torch

        flat = [t.detach().reshape(-1).double() for *_, losses in self.pending for t in losses]
        values = torch.cat(flat).cpu().numpy() if flat else np.zeros(0)  # one device-to-host copy per part
        for step, epoch, batch, ids, losses in self.pending:
            micro = np.repeat(np.arange(len(losses)), [int(t.numel()) for t in losses])
            if len(micro) != len(ids):  # the loop and the loader disagree on the share: an invariant
                raise AssertionError(f"step {step}: {len(ids)} sample ids but {len(micro)} per-sample losses")
            cols["sample_id"] += [str(s) for s in ids]
            cols["micro_batch"] += micro.tolist()
            cols["position"] += list(range(len(ids)))
            for name, value in (("step", step), ("epoch", epoch), ("batch", batch)):
                cols[name] += [value] * len(ids)
        n = len(cols["sample_id"])
        cols["loss"] = values[:n].tolist()
        cols["rank"] = [self.rank] * n
        return cols

    def flush(self) -> None:
        """Every rank calls it at the same points (the loop's): a gather of the pending rows, one part on rank 0."""
        gathered = all_gather(self._columns(), self.world_size)
        self.pending.clear()
        if not self.writer:
            return
        cols = {k: [v for c in gathered for v in c[k]] for k in SCHEMA.names if k not in _RUN_FIELDS}
        n = len(cols["sample_id"])
        if n == 0:
            return
        for name, value in (("attempt", self.attempt), ("start", self.start), ("world_size", self.world_size),
                            ("part", self.part)):
            cols[name] = [value] * n
        buf = _pyio.BytesIO()
        pq.write_table(pa.table(cols, schema=SCHEMA), buf)
        name = f"a{self.attempt:04d}-{int(self.start * 1000):d}-{self.part:06d}.parquet"
        io.write_bytes_atomic(io.join(self.folder, name), buf.getvalue())
        self.part += 1
        self.rows_written += n


_RUN_FIELDS = ("attempt", "start", "world_size", "part")  # the same for every row of a part: rank 0's
