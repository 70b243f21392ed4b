"""``dutycycle trace`` on a run that was SIGKILLed at 3 ranks and resumed at 2 (tests/support/trace_launch.py).

The per-sample loss log holds what the loader handed each rank at each step (the batch's ``sample_id`` list, cut
into micro-batches as the step cut them). The trace recomputes every step from the run's records and the plan
alone; both must agree on every step, rank, micro-batch and place, across the kill (steps 5 and 6 trained at 3
ranks, lost, trained again at 2) and the change of size, and ``--sample`` must invert it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict

import pyarrow.parquet as pq
import pytest
from dutycycle.trainer.trace import steps as st
from dutycycle.trainer.trace.record import RunRecord, Start
from dutycycle.trainer.trace.trace import Tracer

from ..support import REPO
from ..support.tablemaker import make_shapes_table
from ..support.trace_launch import EVERY, KILL_STEP, STEPS


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from dutycycle.engine.cache.materialize import materialize
    from dutycycle.engine.table.table import open_table
    from dutycycle.engine.transform import TransformSpec

    root = tmp_path_factory.mktemp("trace")
    table, _ = make_shapes_table(str(root / "data"), n=60, size=(20, 28))
    # a curated table (a filter, an exact dedupe, a resplit) whose test split the cache leaves out: the trace
    # names all of it
    curated = str(root / "data" / "curated")
    open_table(table).where("width >= 20").dedupe(exact=True, near=False).resplit("0.8,0.1,0.1", seed=1).save(curated)
    materialize(curated, str(root / "cache"), TransformSpec(size=16), where="split != 'test'", rows_per_shard=16)
    proc = subprocess.run([sys.executable, "-m", "tests.support.trace_launch", str(root), str(root / "cache")],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return root / "run"


def _logged(run_dir) -> dict[int, list[tuple]]:
    from dutycycle.trainer.trace.losses import read_sample_losses

    out = defaultdict(list)
    for r in read_sample_losses(str(run_dir)).to_pylist():
        out[r["step"]].append((r["rank"], r["micro_batch"], r["position"], r["sample_id"], r["world_size"]))
    return out


def test_every_step_traces_to_the_ids_the_loader_produced_across_a_kill_and_a_resize(run):
    summary = json.loads((run / "summary.json").read_text())
    assert summary["checkpoint"]["resumed"]["step"] == EVERY and summary["steps"] == STEPS
    tracer = Tracer(str(run))
    assert [(s.first, s.last, s.world_size, s.attempt) for s in tracer.run.starts] == [(0, EVERY, 3, 1),
                                                                                     (EVERY, STEPS, 2, 2)]
    assert 0 < tracer.run.starts[1].batch < st.steps_per_epoch(tracer.run.starts[1])  # resumed mid-epoch
    logged = _logged(run)
    assert sorted(logged) == list(range(1, STEPS + 1))
    per_epoch = defaultdict(list)
    for step in range(1, STEPS + 1):
        rows = tracer.step_rows(step, table=False)
        want = [x[:4] for x in logged[step]]
        assert [(r["rank"], r["micro_batch"], r["position"], r["sample_id"]) for r in rows] == want, step
        world = 3 if step <= EVERY else 2
        assert {x[4] for x in logged[step]} == {world} and {r["world_size"] for r in rows} == {world}
        assert {r["micro_batch"] for r in rows} == {0, 1} and len(rows) == 12  # 2 micro-batches on every rank
        per_epoch[rows[0]["epoch"]] += [r["sample_id"] for r in rows]
    # every sample at most once per epoch (drop_last leaves the remainder out), the same epochs as the log
    assert all(len(ids) == len(set(ids)) for ids in per_epoch.values())
    # the killed start trained steps 6 and 7 at 3 ranks before its rows were replaced: the same global batches
    lost = [r for f in (run / "sample_loss").glob("a0001-*.parquet") for r in pq.read_table(f).to_pylist()
            if r["step"] > EVERY]
    assert {r["step"] for r in lost} >= {EVERY + 1, KILL_STEP - 1}
    for step in {r["step"] for r in lost}:
        assert sorted(r["sample_id"] for r in lost if r["step"] == step) == sorted(x[3] for x in logged[step])
    # --sample inverts the trace: every sample's steps are exactly the steps (and places) that logged it
    by_sample = defaultdict(list)
    for step, rows in logged.items():
        for rank, micro, pos, sid, _ in rows:
            by_sample[sid].append((step, rank, micro, pos))
    for sid, places in by_sample.items():
        got = tracer.sample(sid)
        assert got.split == "train" and not got.evaluation
        assert [(s["step"], s["rank"], s["micro_batch"], s["position"]) for s in got.steps] == sorted(places), sid


def test_the_command_the_page_and_the_dataframe(run, capsys):
    import daft
    import dutycycle
    from dutycycle.engine.errors import ConfigError
    from dutycycle.engine.table.table import open_table
    from dutycycle.trainer.app.cli import main

    logged = _logged(run)
    assert main(["trace", str(run), "--step", "6", "--json", "--html"]) == 0
    out = capsys.readouterr().out
    got = json.loads(out[: out.rindex("}") + 1])["rows"]
    assert [r["sample_id"] for r in got] == [x[3] for x in logged[6]]
    first = got[0]
    assert first["content_hash"] == first["sample_id"] and first["uri"].endswith(".jpg") and first["split"] == "train"
    curation = json.loads(first["curation"])
    assert first["table_version"] == 1 and curation["table"].endswith("curated")
    assert curation["lineage"]["filter"] == "(width >= 20)" and curation["cache_where"] == "split != 'test'"
    assert [op.split("(")[0] for op in curation["lineage"]["operations"]] == ["where width >= 20", "dedupe", "resplit"]
    assert curation["split_assignment"]["by"] == "resplit"
    assert all(isinstance(r["loss"], float) for r in got) and {r["world_size"] for r in got} == {2}
    page = (run / "trace" / "step-6.html").read_text()
    assert page.count("data:image/jpeg;base64,") == 12 and "loss " in page and first["label"] in page
    # --sample by URI, as the table records it; the table's row and every step
    assert main(["trace", str(run), "--sample", first["uri"]]) == 0
    text = capsys.readouterr().out
    assert first["sample_id"] in text and " step       6 " in text
    # a validation sample: evaluated on, never trained on; a test sample: left out of the run's data by curation
    table = open_table(str(run.parent / "data" / "curated"))
    split_ids = {s: table.df.where(daft.col("split") == s).select("sample_id").limit(1).to_pylist()[0]["sample_id"]
                 for s in ("val", "test")}
    tracer = Tracer(str(run))
    got_val = tracer.sample(split_ids["val"])
    assert got_val.evaluation and got_val.split == "val" and got_val.steps == []
    got_test = tracer.sample(split_ids["test"])
    assert got_test.split is None and not got_test.steps and "curation left it out" in got_test.note
    assert main(["trace", str(run), "--step", str(STEPS + 1)]) == 2
    assert f"1..{STEPS}" in capsys.readouterr().err
    # the notebook's form: a Daft dataframe joinable with the table on the row id
    df = dutycycle.trace(str(run), step=3)
    joined = df.join(table.df.select("sample_id", "width", "height"), on="sample_id").to_pylist()
    assert len(joined) == 12 and all(r["width"] for r in joined)
    with pytest.raises(ConfigError, match="exactly one of step or sample"):
        dutycycle.trace(str(run))


def test_the_walk_from_steps_to_batches_skips_and_inverts():
    def start(first, last, epoch, batch):
        loader = {"epoch": epoch, "step": batch, "num_samples": 50, "global_batch_size": 10, "drop_last": True}
        return Start(first, last, 1, 2, 2, None, 1, loader, {})

    # 5 global batches per epoch; batch 1 of epoch 0 and batch 4 of epoch 1 were skipped (a non-finite loss); a
    # resume restored step 6 at epoch 1, batch 3: steps 1-6 took batches 0, 2, 3, 4 of epoch 0 and 0, 1 of epoch 1
    run = RunRecord("r", [start(0, 6, 0, 0), start(6, 12, 1, 3)], 12, {(0, 1), (1, 4)})
    got = [st.locate(run, s)[1:] for s in range(1, 13)]
    assert got == [(0, 0), (0, 2), (0, 3), (0, 4), (1, 0), (1, 1), (1, 3), (2, 0), (2, 1), (2, 2), (2, 3), (2, 4)]
    for s, (e, b) in enumerate(got, 1):
        assert st.step_of(run, st.find_start(run, s), e, b) == s
    assert st.step_of(run, run.starts[1], 1, 4) is None  # skipped
    assert st.micro_sizes(10, 4) == [3, 3, 3, 1] and st.place(9, 12, 2, 2).micro_batch == 1


def test_the_loss_log_keeps_each_steps_newest_rows(tmp_path):
    """A step written twice, by a rollback in one start (a later part) or by a later start (a resume), is read
    once: from the newest start, and within it the newest part."""
    import pyarrow as pa
    from dutycycle.trainer.step.provenance import FOLDER, SCHEMA
    from dutycycle.trainer.trace.losses import read_sample_losses

    (tmp_path / FOLDER).mkdir()
    for name, step, attempt, start, part, sid in [("a", 5, 1, 100.0, 0, "first"), ("b", 5, 1, 100.0, 3, "redone"),
                                                 ("c", 6, 1, 100.0, 3, "lost"), ("d", 6, 2, 50.0, 0, "resumed")]:
        row = {"sample_id": [sid], "step": [step], "epoch": [0], "batch": [step], "rank": [0], "micro_batch": [0],
               "position": [0], "loss": [1.0], "attempt": [attempt], "start": [start], "world_size": [1],
               "part": [part]}
        pq.write_table(pa.table(row, schema=SCHEMA), tmp_path / FOLDER / f"{name}.parquet")
    got = read_sample_losses(str(tmp_path)).to_pylist()
    assert [(r["step"], r["sample_id"]) for r in got] == [(5, "redone"), (6, "resumed")]
    assert read_sample_losses(str(tmp_path), [6]).to_pylist()[0]["sample_id"] == "resumed"
