"""The planned selection (``engine.cache.selection``): one pass of buckets, then numbering and digests bucket by
bucket, against the definitions written row by row in Python (``plan.rows_digest``, ``udf.ids_digest``) over a
real committed table with errors, duplicates, rows outside the roots, unknown labels, null splits and ids of
several alphabets and lengths."""

from __future__ import annotations

import hashlib
import os
import tempfile

import pyarrow.parquet as pq
import pytest
from dutycycle.engine.cache import plan as mp
from dutycycle.engine.cache import selection
from dutycycle.engine.cache.udf import ids_digest
from dutycycle.engine.errors import CorruptArtifactError
from dutycycle.engine.roots import table_roots
from dutycycle.engine.table import format as tf

from ..support.tablemaker import CLASSES, write_table


def _rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        sid = hashlib.sha256(str(i % (n - 7)).encode()).hexdigest()[:32]  # 7 contents appear twice
        rows.append({"sample_id": sid, "uri": f"/data/{i % 5}/{i:06d}.jpg", "label": CLASSES[i % len(CLASSES)],
                     "split": ("train", "val", None)[i % 3], "error": "corrupt: x" if i % 97 == 5 else None})
    rows[3]["label"] = "not-a-class"  # label index -1
    rows[4]["uri"] = "/elsewhere/x.jpg"  # outside the roots: counted, never selected
    # ids of other alphabets and lengths still sort and bucket correctly (one byte, multi-byte UTF-8)
    rows += [{"sample_id": s, "uri": f"/data/odd/{k}.jpg", "label": CLASSES[0], "split": "train"}
             for k, s in enumerate(["z", "Zz", "é1", "日本", "0"])]
    return rows


def _expected(rows: list[dict], rows_per_shard: int, block: int):
    ok = [r for r in rows if r.get("error") is None and r["uri"].startswith("/data/")]
    first: dict[str, dict] = {}
    for r in sorted(ok, key=lambda r: (r["sample_id"].encode(), r["uri"])):
        first.setdefault(r["sample_id"], r)
    sel = [first[s] for s in sorted(first, key=str.encode)]
    index = mp.label_index(CLASSES)
    lines = [(r["sample_id"], index.get(r["label"], -1), r["split"] or "") for r in sel]
    blocks = [mp.rows_digest(lines[lo:lo + block]) for lo in range(0, len(lines), block)]
    shards = {i: ids_digest([r["sample_id"] for r in sel[lo:lo + rows_per_shard]])
              for i, lo in enumerate(range(0, len(sel), rows_per_shard))}
    return sel, blocks, shards


@pytest.mark.parametrize(("max_open", "hint"), [(selection.MAX_OPEN, None), (3, None), (selection.MAX_OPEN, 705)])
def test_the_selection_matches_the_row_by_row_definitions(tmp_path, monkeypatch, max_open, hint):
    # rows=None: buckets by two bytes of the id (256 for hex ids); a known small table: by one (16)
    # 3 open bucket files at most: buckets are closed and reopened as new parts, and read back whole
    monkeypatch.setattr(selection, "MAX_OPEN", max_open)
    # blocks of 50 rows (the real 65,536 would need a table that large): block and shard boundaries then fall
    # inside buckets and across them
    monkeypatch.setattr(mp, "FINGERPRINT_BLOCK", 50)
    rows = _rows(700)
    table = write_table(str(tmp_path / "t"), rows, roots=["/data"])
    tm = tf.read_manifest(table)
    want, blocks, shards = _expected(rows, 13, 50)
    with selection.selected(mp.table_frame(table, tm, None), roots=table_roots(tm), classes=CLASSES, rows_per_shard=13, runner="native",
                            staging=None, table_uri=table, where=None, rows=hint) as sel:
        got = sel.table()
        staged = sel.staging
        assert os.path.isdir(staged)
        assert got.column("sample_id").to_pylist() == [r["sample_id"] for r in want]
        assert got.column("uri").to_pylist() == [r["uri"] for r in want]  # the smallest URI of repeated content
        assert got.column("row").to_pylist() == list(range(len(want)))
        assert [b[2] for b in sel.blocks] == blocks and [b[1] for b in sel.blocks][:-1] == [50] * (len(blocks) - 1)
        assert sel.shard_digests == shards and sel.selected == len(want)
        errors = sum(r.get("error") is not None for r in rows)
        assert sel.counts == {"rows": len(rows), "errors": errors, "outside": 1, "memory": 0,
                              "outside_example": "/elsewhere/x.jpg"}
        assert sel.frame().to_arrow().column("row").to_pylist() == list(range(len(want)))
    assert not os.path.exists(staged)  # the staged buckets and files are gone with the plan


def test_bucket_order_is_byte_order():
    import pyarrow as pa

    ids = ["", "0", "00", "0a", "a", "b0", "z", "é", "日本", None]
    for width in (1, 2):
        keys = selection.bucket_of(pa.array(ids, pa.string()), width)
        present = [(k, s) for k, s in zip(keys.tolist(), ids, strict=True) if s is not None]
        # sorting by bucket (stable) then by id within a bucket is the ids' byte order
        ordered = sorted(present, key=lambda p: (p[0], p[1].encode()))
        assert [s for _, s in ordered] == sorted((s for s in ids if s is not None), key=str.encode)
        assert keys[-1] == 0  # a null id (an error row) lands in bucket 0


def test_a_data_file_replaced_after_the_commit_is_named_not_planned(tmp_path):
    # a valid Parquet file of fewer rows under a committed name: every read succeeds, the count does not
    table = write_table(str(tmp_path / "t"), _rows(20), roots=["/data"])
    tm = tf.read_manifest(table)
    uri = tf.file_uris(table, tm)[0]
    t = pq.read_table(uri)
    pq.write_table(t.slice(0, len(t) - 3), uri)
    with pytest.raises(CorruptArtifactError, match=f"records {tm.num_rows} rows.*gave {tm.num_rows - 3}"):
        selection.select(mp.table_frame(table, tm, None), roots=table_roots(tm), classes=CLASSES, rows_per_shard=4,
                         runner="native", staging=None, table_uri=table, where=None, rows=tm.num_rows)


def test_a_plan_that_fails_leaves_nothing_behind(tmp_path):
    table = write_table(str(tmp_path / "t"), _rows(20), roots=["/data"])
    tm = tf.read_manifest(table)
    df = mp.table_frame(table, tm, None)
    for uri in tf.file_uris(table, tm):  # torn after the plan was made: the read fails midway through bucketing
        with open(uri, "r+b") as f:
            f.truncate(os.path.getsize(uri) // 2)
    temp = tempfile.gettempdir()
    before = set(os.listdir(temp))
    with pytest.raises(Exception) as e:
        selection.select(df, roots=table_roots(tm), classes=CLASSES, rows_per_shard=4, runner="native", staging=None, table_uri=table,
                         where=None)
    assert not isinstance(e.value, AssertionError)
    assert not [n for n in set(os.listdir(temp)) - before if n.startswith("dutycycle-plan-")]
