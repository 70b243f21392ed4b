"""Build the shards of a planned cache where Daft's runner runs work; returns one small record per shard.

Two runners, one result (the same bytes per shard):

- Ray (``build_on_ray``): one Daft row per shard, spread over the cluster's nodes; each Ray task builds whole
  shards (``udf.build_shard``: resume check, fetch, decode, write, record) and returns only their records.
- Native (``build_native``): one process holds the whole pipeline, so the unit of parallel work is a batch of
  files, not a shard: Daft decodes batches on all its threads (every CPU busy to the end, however unequal the
  shards), rows stream back in sample-id order, and this process writes each shard as soon as its rows are in
  (``udf.finish_shard``), holding at most about one shard of pixels. Shards with a verified record are left
  out of the query, so a rerun decodes only what is missing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import io
from ..transform import TransformSpec
from . import format as cf
from . import plan as mp
from . import udf
from .selection import Selection

Record = dict[str, Any]


def _log_record(log: Callable[[str], None], done: int, total: int, rec: Record) -> None:
    rows = rec["shard"]["rows"] if rec["shard"] else 0
    how = "already committed" if rec["status"] == "resumed" else "written"
    log(f"shard {done}/{total} (#{rec['index']}): {rows} samples, {how}")


def build_on_ray(sel: Selection, out: str, spec: TransformSpec, classes: list[str], cfg, num_shards: int,
                 log: Callable[[str], None]) -> dict[int, Record]:
    import ray
    from daft import col

    shards = mp.grouped(sel.frame(), cfg.rows_per_shard, "shard",
                         ("sample_id", "uri", "uri_bytes", "label", "split"))
    # A few partitions per CPU keeps every CPU busy to the end without a task per shard (~50k for 100M images).
    cpus = int(ray.cluster_resources().get("CPU", 1)) if ray.is_initialized() else 1
    shards = shards.repartition(min(num_shards, 4 * max(1, cpus)), col("shard")).into_batches(1)
    options = json.dumps({"cache": out, "spec": spec.to_dict(), "classes": classes, "batch_size": cfg.batch_size,
                          "max_bytes": cfg.max_file_bytes, "max_pixels": cfg.max_pixels})
    records: dict[int, Record] = {}
    for row in shards.select(udf.shard_udf()(col("shard"), col("rows"), options).alias("record")).iter_rows():
        rec = json.loads(row["record"])
        records[rec["index"]] = rec
        _log_record(log, len(records), num_shards, rec)
    return records


def _already_built(digests: dict[int, str], out: str) -> dict[int, Record]:
    """Shards a previous run completed: a record that matches this plan and a shard that passes its checksum."""
    fs, path = io.filesystem(io.join(out, cf.SHARD_DIR))
    try:
        names = [n.rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(path, detail=False)]
    except FileNotFoundError:
        return {}
    present = sorted(int(n[6:11]) for n in names if n.startswith("shard-") and n.endswith(".json") and len(n) == 16)
    if not present:
        return {}
    with ThreadPoolExecutor(8) as pool:  # reading and hashing committed shards: I/O and hashlib, both GIL-free
        found = pool.map(lambda i: udf.completed(out, i, digests[i]) if i in digests else None, present)
        return {i: {**rec, "status": "resumed"} for i, rec in zip(present, found, strict=True) if rec is not None}


def build_native(sel: Selection, out: str, spec: TransformSpec, classes: list[str], cfg, num_shards: int, selected: int,
                 log: Callable[[str], None]) -> dict[int, Record]:
    import time

    import daft
    from daft import col

    size = cfg.rows_per_shard
    records = _already_built(sel.shard_digests, out)
    for rec in records.values():
        _log_record(log, len(records), num_shards, rec)
    if len(records) == num_shards:
        return records
    rows = sel.frame().with_column("shard", (col("row") // size).cast(daft.DataType.int64()))
    if records:
        rows = rows.where(~col("shard").is_in(list(records)))
    # Threads, not Daft's worker processes: PIL releases the GIL while decoding and resizing, and on a 2-CPU
    # machine processes were no faster at 12k images (13.9 s vs 13.1 s) and far slower to start at 3k (4.1 s vs
    # 2.4 s): measured once while writing this, not a benchmark row. Threads also see memory://, which lives in
    # this process only.
    decode = udf.decode_udf(spec, cfg.batch_size, cfg.max_file_bytes, cfg.max_pixels, use_process=False)
    # no sort: the selection's files are in row order and the native runner keeps it (a reordered batch would
    # only wait in `pending` below)
    rows = rows.select("shard", "sample_id", "label", "split",
                       decode(col("uri"), col("uri_bytes"), col("sample_id"), spec.to_json()).alias("out"))
    rows = rows.select("shard", "sample_id", "label", "split", col("out").get("image").alias("image"),
                       col("out").get("error").alias("error"))
    index_of = mp.label_index(classes)
    pending: dict[int, dict[str, list]] = {}  # shard -> its rows so far (about one shard, as rows arrive in order)
    started = time.perf_counter()
    for batch in rows.to_arrow_iter():
        cols = {name: batch.column(name).to_pylist() for name in batch.column_names}
        for k, shard in enumerate(cols["shard"]):
            buf = pending.setdefault(shard, {"ids": [], "labels": [], "splits": [], "samples": []})
            buf["ids"].append(cols["sample_id"][k])
            buf["labels"].append(index_of.get(cols["label"][k], -1))
            buf["splits"].append(cols["split"][k] or "")
            buf["samples"].append(cols["image"][k] if cols["error"][k] is None else cols["error"][k])
            expected = size if shard < num_shards - 1 else selected - size * (num_shards - 1)
            if len(buf["ids"]) == expected:
                buf = pending.pop(shard)
                order = sorted(range(expected), key=buf["ids"].__getitem__)  # already sorted unless Daft reorders
                rec = udf.finish_shard(out, shard, *([buf[f][i] for i in order] for f in
                                                     ("ids", "labels", "splits", "samples")), spec,
                                       time.perf_counter() - started)
                records[shard] = rec
                _log_record(log, len(records), num_shards, rec)
    assert not pending, f"shards {sorted(pending)} received too few rows"
    return records
