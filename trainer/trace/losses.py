"""Reading the per-sample loss log (``run.record_sample_loss``; written by step/provenance.py ``SampleLosses``)."""

from __future__ import annotations

import pyarrow as pa
from dutycycle.engine import io
from dutycycle.trainer.step.provenance import FOLDER, SCHEMA


def read_sample_losses(run_dir: str, steps: list[int] | None = None) -> pa.Table:
    """The run's per-sample losses (``SCHEMA``), each step's rows from the newest start that trained it; only
    ``steps`` when given. An empty table when the run recorded none."""
    fs, path = io.filesystem(io.join(run_dir, FOLDER))
    try:
        names = sorted(p for p in fs.ls(path, detail=False) if p.endswith(".parquet"))
    except (FileNotFoundError, NotADirectoryError):
        names = []
    if not names:
        return SCHEMA.empty_table()
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    dataset = ds.dataset(names, schema=SCHEMA, format="parquet", filesystem=fs)
    table = dataset.to_table(filter=pc.field("step").isin(steps) if steps is not None else None)
    if table.num_rows == 0:
        return table
    # per step, the newest start's rows ((attempt, start) orders starts: a later launch, a later restart), then
    # within it the newest part (a rollback after a non-finite loss trains steps again in the same start)
    def start_key(t):
        return pc.add(pc.multiply(pc.cast(t["attempt"], pa.float64()), 1e12), t["start"])

    for name, values in (("_start", start_key), ("_part", lambda t: t["part"])):
        table = table.append_column(name, values(table))
        newest = table.group_by("step").aggregate([(name, "max")])
        table = table.join(newest, "step")
        table = table.filter(pc.equal(table[name], table[f"{name}_max"])).drop_columns([f"{name}_max"])
    out = table.select(SCHEMA.names)
    return out.sort_by([("step", "ascending"), ("rank", "ascending"), ("position", "ascending")])
