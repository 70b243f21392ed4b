"""The trace of a run: the rows of a step, and the steps of a row (``dutycycle trace``, ``dutycycle.trace``).

``Tracer(run_dir)`` reads the run's records once (record.py) and opens each start's data once (rows.py);
``step_rows(N)`` recomputes step N's global batch from the plan (``loader.plan.global_batch``: only the windows
the batch touches), places every sample on its rank and micro-batch (steps.py) and joins the table's rows;
``sample_steps(ID or URI)`` finds the sample's place in every epoch each start trained (``plan.sample_place``)
and keeps the places a step of that start trained. Nothing comes from a per-step log: the per-sample losses,
when the run recorded them (``run.record_sample_loss``), are joined in as a column and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from dutycycle.engine.errors import ConfigError
from dutycycle.loader import plan

from . import steps as st
from .losses import read_sample_losses
from .record import RunRecord, Start, read_run
from .rows import SplitData, curation_json

# the columns of a step's trace, in order (``dutycycle.trace`` returns them as a Daft dataframe)
STEP_COLUMNS = ("step", "epoch", "batch", "rank", "micro_batch", "position", "sample_id", "content_hash", "label",
                "uri", "split", "table", "table_version", "curation", "attempt", "world_size", "ranks", "loss")


def _plan_kwargs(start: Start, data: SplitData) -> dict:
    p = start.loader
    return {"num_samples": int(p["num_samples"]), "seed": int(p["seed"]), "fingerprint": str(p["fingerprint"]),
            "global_batch_size": int(p["global_batch_size"]), "drop_last": bool(p["drop_last"]),
            "shuffle": bool(p["shuffle"]), "block_size": int(p["block_size"]), "window": int(p["window"]),
            "partitions": int(p["partitions"]), "block_starts": data.block_starts}


@dataclass
class SampleTrace:
    """Where one sample went: its table row, whether the run's data held it and in which split, and every
    step that trained on it (``steps``: dicts of step, epoch, batch, rank, micro_batch, position, attempt,
    world_size)."""

    sample_id: str
    uri: str | None
    split: str | None  # the split the run's data holds it in (None: not in the run's data at all)
    evaluation: bool  # it is in the validation split the run evaluated on
    steps: list[dict] = field(default_factory=list)
    row: dict = field(default_factory=dict)  # the table's row
    note: str = ""

    def to_dict(self) -> dict:
        return {"sample_id": self.sample_id, "uri": self.uri, "split": self.split, "evaluation": self.evaluation,
                "steps": self.steps, "note": self.note, "label": self.row.get("label")}


class Tracer:
    def __init__(self, run_dir: str, run: RunRecord | None = None):
        self.run_dir = run_dir
        self.run = run if run is not None else read_run(run_dir)
        self._data: dict[tuple, SplitData] = {}

    def data(self, start: Start) -> SplitData:
        key = (start.data.get("source"), start.data.get("cache"), start.data.get("table"), start.loader["split"],
               start.loader["fingerprint"])
        if key not in self._data:
            self._data[key] = SplitData(start.data, start.loader)
        return self._data[key]

    # ---------------------------------------------------------------------------------------- one step

    def batch(self, step: int) -> tuple[Start, int, int, np.ndarray]:
        """``(start, epoch, global batch, split indices)`` of ``step``."""
        start, epoch, batch = st.locate(self.run, step)
        data = self.data(start)
        return start, epoch, batch, plan.global_batch(epoch=epoch, step=batch, **_plan_kwargs(start, data))

    def step_rows(self, step: int, *, table: bool = True, losses: bool = True) -> list[dict]:
        """The rows of ``step`` (``STEP_COLUMNS``), by rank, micro-batch and place. ``table``: join the table's
        columns (uri, split); ``losses``: the recorded per-sample loss (None when not recorded)."""
        start, epoch, batch, indices = self.batch(step)
        data = self.data(start)
        ids, labels = data.ids(indices)
        found = data.table_rows(ids) if table else {}
        curation = curation_json(data.curation()) if table else ""
        loss = _losses(self.run_dir, step) if losses else {}
        out = []
        for pos, (sid, label) in enumerate(zip(ids, labels, strict=True)):
            where = st.place(pos, len(indices), start.data_world, start.micro_batches)
            row = found.get(sid, {})
            out.append({"step": step, "epoch": epoch, "batch": batch, "rank": where.rank,
                        "micro_batch": where.micro_batch, "position": where.index_in_rank, "sample_id": sid,
                        "content_hash": sid, "label": label, "uri": row.get("uri"), "split": row.get("split"),
                        "table": data.table_uri, "table_version": data.table_version, "curation": curation,
                        "attempt": start.attempt, "world_size": start.world_size,
                        "ranks": start.ranks_of(where.rank), "loss": loss.get((where.rank, sid)),
                        "uri_bytes": row.get("uri_bytes")})
        return out

    # -------------------------------------------------------------------------------------- one sample

    def sample(self, sample: str) -> SampleTrace:
        """Every step that trained ``sample`` (a sample id, or a URI as the table records it)."""
        start = self.run.starts[-1]
        data = self.data(start)
        sid = sample if _looks_like_id(sample) else (data.find_uri(sample) or sample)
        row = data.table_rows([sid]).get(sid, {})
        index, other = data.find(sid)
        if index is None and other is None:
            hint = ("no row of the run's table has that URI or id" if not row else
                    f"the table holds it (split {row.get('split')!r}) but the run's data does not: the curation "
                    f"left it out ({curation_json(data.curation())})")
            return SampleTrace(sid, row.get("uri"), None, False, [], row, note=hint)
        if index is None:
            return SampleTrace(sid, row.get("uri"), other, other == "val", [], row,
                               note=f"in the {other!r} split, which the run " +
                               ("evaluated on and never trained on" if other == "val" else "never trained on"))
        found = []
        for s in self.run.starts:
            if s.last <= s.first:
                continue
            d = self.data(s)
            idx = index if d is data else d.find(sid)[0]
            if idx is None:
                continue
            for epoch in range(s.epoch, st.last_epoch(self.run, s) + 1):
                place = plan.sample_place(epoch=epoch, index=idx, **_plan_kwargs(s, d))
                if place is None:
                    continue
                batch, pos = place
                step = st.step_of(self.run, s, epoch, batch)
                if step is None:
                    continue
                n, gbs = int(s.loader["num_samples"]), int(s.loader["global_batch_size"])
                length = gbs if batch < n // gbs else n - (n // gbs) * gbs  # the short last batch
                where = st.place(pos, length, s.data_world, s.micro_batches)
                found.append({"step": step, "epoch": epoch, "batch": batch, "rank": where.rank,
                              "micro_batch": where.micro_batch, "position": where.index_in_rank,
                              "attempt": s.attempt, "world_size": s.world_size})
        found.sort(key=lambda r: r["step"])
        return SampleTrace(sid, row.get("uri"), data.split, False, found, row)


def _looks_like_id(text: str) -> bool:
    """A sample id is hex digits (a content hash); anything else is looked up as a URI."""
    return bool(text) and all(c in "0123456789abcdef" for c in text.lower())


def _losses(run_dir: str, step: int) -> dict:
    table = read_sample_losses(run_dir, [step])
    if table.num_rows == 0:
        return {}
    return {(r, s): v for r, s, v in zip(table["rank"].to_pylist(), table["sample_id"].to_pylist(),
                                         table["loss"].to_pylist(), strict=True)}


# ----------------------------------------------------------------------------------------------- public


def trace(run_dir: str, step: int | None = None, sample: str | None = None):
    """A Daft dataframe of a run's trace: ``step=N``, the rows of step N (``STEP_COLUMNS``), joinable with the
    table on ``sample_id``; ``sample=ID or URI``, one row per step that trained on it (step, epoch, batch, rank,
    micro_batch, position, attempt, world_size, sample_id, uri, split, evaluation)."""
    import daft

    if (step is None) == (sample is None):
        raise ConfigError(f"trace needs exactly one of step or sample (got step={step!r}, sample={sample!r})")
    tracer = Tracer(run_dir)
    if step is not None:
        rows = [{k: r[k] for k in STEP_COLUMNS} for r in tracer.step_rows(int(step))]
        return daft.from_pylist(rows)
    got = tracer.sample(str(sample))
    rows = [{**s, "sample_id": got.sample_id, "uri": got.uri, "split": got.split, "evaluation": got.evaluation}
            for s in got.steps]
    if not rows:
        return daft.from_pydict({k: [] for k in ("step", "epoch", "batch", "rank", "micro_batch", "position",
                                                 "attempt", "world_size", "sample_id", "uri", "split", "evaluation")})
    return daft.from_pylist(rows)


def sample_losses(run_dir: str):
    """The run's per-sample losses (``run.record_sample_loss``) as a Daft dataframe: sample_id (the table's row
    id: join on it), step, epoch, batch, rank, micro_batch, position, loss, attempt, start, world_size; each step
    once, as the run kept it (losses.py). Empty when the run recorded none."""
    import daft

    return daft.from_arrow(read_sample_losses(run_dir))
