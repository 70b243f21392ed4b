"""The transformed-sample cache: exactness, reuse and invalidation, commit and resume, object stores, CLI."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import zlib

import numpy as np
import pyarrow as pa
import pytest
from dutycycle.engine import io
from dutycycle.engine.cache import format as cf
from dutycycle.engine.cache.materialize import materialize, open_cache
from dutycycle.engine.cache.reader import CacheReader
from dutycycle.engine.errors import ConfigError, CorruptArtifactError, SourceError
from dutycycle.engine.transform import TransformSpec, decode_and_transform

from ..support.tablemaker import CLASSES, add_file, jpeg_bytes, make_shapes_table, photo_image, write_table
from .test_transform import close_fraction, reference

SPEC = TransformSpec(size=32)


def _read_all(reader: CacheReader):
    ids, labels, splits, images = [], [], [], []
    for i in range(reader.num_shards):
        ids += reader.column(i, "sample_id").tolist()
        labels += reader.column(i, "label").tolist()
        splits += reader.column(i, "split").tolist()
        images.append(reader.images(i))
    return ids, labels, splits, np.concatenate(images)


def test_write_cache_sorts_by_sample_id_and_commits_a_readable_cache(tmp_path):
    from dutycycle.engine.cache.write import write_cache

    images = np.arange(5 * 2 * 2 * 3, dtype=np.uint8).reshape(5, 2, 2, 3)
    ids, labels, splits = ["e", "b", "d", "a", "c"], [0, 1, 2, 3, 0], ["train", "val", "train", "train", "val"]
    m = write_cache(str(tmp_path / "c"), ids, labels, splits, images, classes=list("wxyz"), rows_per_shard=2)
    assert [s.rows for s in m.shards] == [2, 2, 1] and m.split_counts == {"train": 3, "val": 2}
    order = [ids.index(i) for i in sorted(ids)]
    got_ids, got_labels, got_splits, got_images = _read_all(open_cache(str(tmp_path / "c")))
    assert got_ids == sorted(ids) and got_labels == [labels[k] for k in order]
    assert got_splits == [splits[k] for k in order] and np.array_equal(got_images, images[order])
    again = write_cache(str(tmp_path / "d"), ids, labels, splits, images, classes=list("wxyz"), rows_per_shard=2)
    assert again.fingerprint == m.fingerprint  # derived from the content when none is given
    with pytest.raises(ConfigError, match="one id, label, split and image per sample"):
        write_cache(str(tmp_path / "e"), ids, labels[:4], splits, images, classes=list("wxyz"))


def _file_bytes(uri: str) -> bytes:
    fs, path = io.filesystem(uri)
    with fs.open(path, "rb") as f:
        return f.read()


def _check_exact(reader: CacheReader, rows: list[dict], spec: TransformSpec = SPEC):
    """Every good row exactly once, no error row, labels and splits from the table, pixels = the transform."""
    ids, labels, splits, images = _read_all(reader)
    good = {r["sample_id"]: r for r in rows if r["error"] is None}
    assert sorted(ids) == ids and len(ids) == len(set(ids)) == len(good)
    assert set(ids) == set(good)
    for k, sid in enumerate(ids):
        row = good[sid]
        assert labels[k] == CLASSES.index(row["label"]) and splits[k] == row["split"]
        assert np.array_equal(images[k], decode_and_transform(_file_bytes(row["uri"]), spec))
    assert reader.manifest.split_counts == {s: splits.count(s) for s in set(splits)}
    return ids, images


def _files(folder) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


def test_materialize_local_is_exact_and_open(tmp_path):
    table, rows = make_shapes_table(str(tmp_path / "data"), n=30, n_errors=3)
    res = materialize(table, str(tmp_path / "cache"), SPEC, rows_per_shard=8)
    assert not res.reused and res.shards_written == 4
    m = res.manifest
    assert res.uri == str(tmp_path / "cache" / m.fingerprint)
    assert m.num_samples == 30 and m.skipped == {"table_error": 3} and m.shape == [32, 32, 3]
    assert m.spec == SPEC.to_dict() and m.classes == CLASSES and [s.rows for s in m.shards] == [8, 8, 8, 6]
    reader = open_cache(str(tmp_path / "cache"))  # the root resolves to its latest committed cache
    assert reader.uri == res.uri
    os.unlink(tmp_path / "cache" / "latest")  # without the pointer, the only committed cache is found
    assert open_cache(str(tmp_path / "cache")).uri == res.uri
    ids, images = _check_exact(reader, rows)
    # ...and to the independent PIL pipeline within 2 levels
    good = {r["sample_id"]: r for r in rows if r["error"] is None}
    ref = np.stack([reference(_file_bytes(good[s]["uri"]), 32, "bilinear") for s in ids])
    assert close_fraction(images, ref) >= 0.99
    # plain pyarrow reads a shard without dutycycle
    t = pa.ipc.open_file(os.path.join(res.uri, m.shards[0].path)).read_all()
    assert t.schema.field("image").type == pa.binary(32 * 32 * 3) and t.column("sample_id").to_pylist() == ids[:8]


def test_reuse_does_no_work_and_changes_make_new_caches(tmp_path):
    table, rows = make_shapes_table(str(tmp_path / "data"), n=12)
    root = tmp_path / "cache"
    first = materialize(table, str(root), SPEC, rows_per_shard=5)
    before = _files(root / first.manifest.fingerprint)

    # Reuse needs neither the images (deleted here) nor any decoding, and touches no file.
    for r in rows:
        os.rename(r["uri"], r["uri"] + ".gone")
    again = materialize(table, str(root), SPEC, rows_per_shard=5)
    assert again.reused and again.uri == first.uri and _files(root / first.manifest.fingerprint) == before
    # Without the index shortcut the fingerprint is recomputed from the table: still reused.
    for p in (root / "_index").iterdir():
        p.unlink()
    assert materialize(table, str(root), SPEC, rows_per_shard=5).reused
    for r in rows:
        os.rename(r["uri"] + ".gone", r["uri"])

    # A different spec, a filter, or a changed table: a new fingerprint folder beside the old one.
    chw = materialize(table, str(root), TransformSpec(size=32, layout="CHW"))
    assert not chw.reused and chw.manifest.fingerprint != first.manifest.fingerprint
    # `latest` follows the cache the most recent call returned, reused or new
    assert open_cache(str(root)).uri == chw.uri
    assert materialize(table, str(root), SPEC, rows_per_shard=5).reused and open_cache(str(root)).uri == first.uri
    assert np.array_equal(_read_all(open_cache(chw.uri))[3], _read_all(open_cache(first.uri))[3].transpose(0, 3, 1, 2))
    sub = materialize(table, str(root), SPEC, where="label = 'circle'")
    assert sub.manifest.num_samples == sum(r["label"] == "circle" for r in rows)
    extra = add_file(str(tmp_path / "data" / "images"), "square/new.jpg",
                     jpeg_bytes(photo_image(np.random.default_rng(9), 64, 80)), "square")
    write_table(table, [*rows, extra])
    grown = materialize(table, str(root), SPEC)
    assert not grown.reused and grown.manifest.num_samples == 13
    assert len({first.uri, chw.uri, sub.uri, grown.uri}) == 4
    assert all(cf.is_committed(u) for u in (first.uri, chw.uri, sub.uri, grown.uri))
    # the root resolves to the latest commit; a root without `latest` and several caches is ambiguous
    assert open_cache(str(root)).uri == grown.uri
    os.unlink(root / "latest")
    with pytest.raises(SourceError, match="holds 4 committed caches"):
        open_cache(str(root))


def test_fingerprint_blocks_ignore_shard_size_and_match_the_raw_plan(tmp_path, monkeypatch):
    """The fingerprint combines per-block digests (blocks of 3 rows here, so 10 samples make 4 blocks): it does not
    depend on the shard size, and the raw loader's in-memory plan computes the same one as the Daft plan."""
    from dutycycle.engine.cache import plan
    from dutycycle.engine.cache.materialize import plan_rows

    table, rows = make_shapes_table(str(tmp_path / "data"), n=10, n_errors=1)
    default_fp = plan_rows(table, SPEC).fingerprint
    monkeypatch.setattr(plan, "FINGERPRINT_BLOCK", 3)
    a = materialize(table, str(tmp_path / "a"), SPEC, rows_per_shard=4)
    b = materialize(table, str(tmp_path / "b"), SPEC, rows_per_shard=7)
    assert a.manifest.fingerprint == b.manifest.fingerprint == plan_rows(table, SPEC).fingerprint != default_fp
    assert [s.rows for s in a.manifest.shards] == [4, 4, 2] and [s.rows for s in b.manifest.shards] == [7, 3]
    moved = [dict(r, split="val" if r["split"] == "train" else "train") if i == 5 else r for i, r in enumerate(rows)]
    write_table(table, moved)  # one row's split changes: its block's digest, so the fingerprint
    assert plan_rows(table, SPEC).fingerprint != a.manifest.fingerprint


def test_decode_failures_are_counted_not_fatal(tmp_path):
    table, rows = make_shapes_table(str(tmp_path / "data"), n=9, n_errors=1)
    images = str(tmp_path / "data" / "images")
    data = jpeg_bytes(photo_image(np.random.default_rng(5), 120, 90))
    truncated = add_file(images, "circle/cut.jpg", data[: len(data) // 4], "circle")  # cut, but the row says good
    vanished = add_file(images, "square/gone.jpg", jpeg_bytes(photo_image(np.random.default_rng(6), 90, 90)), "square")
    os.unlink(vanished["uri"])
    # a header-only PNG promising 50000 x 50000 pixels (the table row claims it is fine)
    ihdr = struct.pack(">IIBBBBB", 50000, 50000, 8, 0, 0, 0, 0)
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    bomb = add_file(images, "square/bomb.png", png, "square", error="set below")
    bomb["error"] = None
    copy = add_file(images, "circle/copy.jpg", _file_bytes(rows[0]["uri"]), rows[0]["label"])  # same content
    write_table(table, [*rows, truncated, vanished, bomb, copy])
    res = materialize(table, str(tmp_path / "cache"), SPEC, rows_per_shard=4)
    assert res.manifest.skipped == {
        "table_error": 1, "truncated": 1, "unreadable": 1, "decompression bomb": 1, "duplicate": 1
    }
    assert res.manifest.num_samples == 9
    _check_exact(open_cache(res.uri), rows)


def test_a_file_edited_after_ingest_is_skipped_and_counted(tmp_path, caplog):
    """Its bytes no longer hash to the row's content id: caching them would put new pixels under the old id."""
    from dutycycle.engine.cache import udf

    table, rows = make_shapes_table(str(tmp_path / "data"), n=6)
    edited = rows[2]["uri"]
    with open(edited, "wb") as f:  # still a valid image, just not the one ingest saw
        f.write(jpeg_bytes(photo_image(np.random.default_rng(11), 60, 50)))
    with caplog.at_level("WARNING", logger="dutycycle.engine.cache.udf"):
        res = materialize(table, str(tmp_path / "cache"), SPEC, rows_per_shard=4)
    assert res.manifest.skipped == {"changed since ingest": 1} and res.manifest.num_samples == 5
    warned = [r.getMessage() for r in caplog.records if "changed since ingest" in r.getMessage()]
    assert len(warned) == 1 and edited in warned[0] and "Re-ingest the table" in warned[0]
    _check_exact(open_cache(res.uri), [r for r in rows if r["uri"] != edited])
    # the Ray runner's unit of work (a whole shard) checks the same way
    shard_rows = [{k: r[k] for k in ("sample_id", "uri", "label", "split")} for r in rows]
    rec = udf.build_shard(str(tmp_path / "ray-like"), 0, shard_rows, SPEC, CLASSES, batch_size=4,
                          max_bytes=1 << 20, max_pixels=1 << 20)
    assert rec["skipped"] == {"changed since ingest": 1} and rec["shard"]["rows"] == 5


def test_fingerprint_covers_the_settings_that_decide_rows_and_pixels(tmp_path, monkeypatch):
    """Caps, decoder version and content check are in the fingerprint (and the reuse index): changing one makes
    a new cache; the same settings reuse the same one."""
    import PIL
    from dutycycle.engine.cache import plan

    table, _ = make_shapes_table(str(tmp_path / "data"), n=4)
    root = str(tmp_path / "cache")
    base = materialize(table, root, SPEC)
    fp = base.manifest.fingerprint
    same = materialize(table, root, SPEC)
    assert same.reused and same.manifest.fingerprint == fp
    pixels = materialize(table, root, SPEC, max_pixels=10_000_000)
    assert not pixels.reused and pixels.manifest.fingerprint != fp
    capped = materialize(table, root, SPEC, max_file_bytes=100_000_000)
    assert not capped.reused and len({fp, pixels.manifest.fingerprint, capped.manifest.fingerprint}) == 3
    assert materialize(table, root, SPEC, max_pixels=10_000_000).manifest.fingerprint == pixels.manifest.fingerprint
    # without the reuse index, the recomputed fingerprint agrees
    for p in (tmp_path / "cache" / "_index").iterdir():
        p.unlink()
    assert materialize(table, root, SPEC).manifest.fingerprint == fp
    # the raw loader's plan computes the same fingerprint as materialize under the same caps
    from dutycycle.engine.cache.materialize import plan_rows

    assert plan_rows(table, SPEC, max_pixels=10_000_000).fingerprint == pixels.manifest.fingerprint
    assert "content_check" in plan.decode_settings()
    monkeypatch.setattr(PIL, "__version__", "0.0.1")  # another decoder version
    assert plan.decode_settings()["decoder"] == "Pillow 0.0.1"
    assert materialize(table, root, SPEC).manifest.fingerprint != fp


def test_files_over_the_byte_cap_are_skipped_unread(tmp_path):
    table, rows = make_shapes_table(str(tmp_path / "data"), n=6)
    cap = sorted(r["size_bytes"] for r in rows)[2]  # three files fit, three are over
    res = materialize(table, str(tmp_path / "cache"), SPEC, max_file_bytes=cap)
    assert res.manifest.skipped == {"too large": 3} and res.manifest.num_samples == 3
    _check_exact(open_cache(res.uri), [r for r in rows if r["size_bytes"] <= cap])


def test_uncommitted_or_corrupt_caches_are_refused(tmp_path):
    table, rows = make_shapes_table(str(tmp_path / "data"), n=10)
    res = materialize(table, str(tmp_path / "cache"), SPEC, rows_per_shard=4)
    shard = tmp_path / "cache" / res.manifest.fingerprint / "shards" / "shard-00001.arrow"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    reader = open_cache(str(tmp_path / "cache"))
    reader.images(0)
    with pytest.raises(CorruptArtifactError, match="shard-00001.arrow"):
        reader.images(1)
    # A rerun after the manifest is gone rewrites only the damaged shard (its record no longer verifies).
    os.unlink(tmp_path / "cache" / res.manifest.fingerprint / "manifest.json")
    with pytest.raises(SourceError, match="manifest.json is missing"):
        open_cache(res.uri)
    before = _files(tmp_path / "cache" / res.manifest.fingerprint / "shards")
    again = materialize(table, str(tmp_path / "cache"), SPEC, rows_per_shard=4)
    after = _files(tmp_path / "cache" / res.manifest.fingerprint / "shards")
    assert not again.reused and again.shards_written == 1 and again.shards_resumed == 2
    assert after["shard-00000.arrow"] == before["shard-00000.arrow"]
    assert after["shard-00002.arrow"] == before["shard-00002.arrow"]
    assert after["shard-00001.arrow"] != before["shard-00001.arrow"]
    _check_exact(open_cache(again.uri), rows)


def test_bad_filter_and_empty_selection_are_user_errors(tmp_path):
    table, _ = make_shapes_table(str(tmp_path / "data"), n=3)
    with pytest.raises(ConfigError, match="nope"):
        materialize(table, str(tmp_path / "cache"), SPEC, where="nope = 1")
    with pytest.raises(SourceError, match="no readable rows"):
        materialize(table, str(tmp_path / "cache"), SPEC, where="label = 'hexagon'")
    with pytest.raises(SourceError, match="_manifest.json is missing"):
        materialize(str(tmp_path / "nowhere"), str(tmp_path / "cache"), SPEC)


def test_memory_filesystem_end_to_end():
    import uuid

    root = f"memory://dc-{uuid.uuid4().hex[:8]}"
    table, rows = make_shapes_table(root, n=10, n_errors=1)
    res = materialize(table, f"{root}/cache", SPEC, rows_per_shard=4)
    assert res.manifest.skipped == {"table_error": 1}
    _check_exact(open_cache(f"{root}/cache"), rows)
    assert materialize(table, f"{root}/cache", SPEC, rows_per_shard=4).reused


def test_s3_end_to_end(s3):
    table, rows = make_shapes_table(s3, n=10, n_errors=1)
    res = materialize(table, f"{s3}/cache", SPEC, rows_per_shard=4)
    assert res.uri == f"{s3}/cache/{res.manifest.fingerprint}" and res.manifest.num_samples == 10
    _check_exact(open_cache(f"{s3}/cache"), rows)
    assert materialize(table, f"{s3}/cache", SPEC, rows_per_shard=4).reused


def _cli(*args, env_extra=None, timeout=300):
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "DAFT_ANALYTICS_ENABLED": "0", "DAFT_PROGRESS_BAR": "0",
           **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "dutycycle.trainer", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.mark.slow
def test_cli_materialize_and_reuse(tmp_path):
    table, rows = make_shapes_table(str(tmp_path / "data"), n=8, n_errors=2)
    out = _cli("materialize", table, str(tmp_path / "cache"), "--size", "24", "--layout", "CHW")
    assert out.returncode == 0, out.stderr
    assert "samples: 8" in out.stdout and "table_error=2" in out.stdout and "reused:  no" in out.stdout
    again = _cli("materialize", table, str(tmp_path / "cache"), "--size", "24", "--layout", "CHW", "--json")
    summary = json.loads(again.stdout)
    assert summary["reused"] and summary["samples"] == 8
    _check_exact(open_cache(summary["cache"]), rows, TransformSpec(size=24, layout="CHW"))
    sub = _cli("materialize", table, str(tmp_path / "cache"), "--size", "24", "--where", "label = 'square'", "--json")
    assert json.loads(sub.stdout)["samples"] == sum(r["label"] == "square" and r["error"] is None for r in rows)
    bad = _cli("materialize", table, str(tmp_path / "cache"), "--size", "0")
    assert bad.returncode == 2 and "TransformSpec.size=0" in bad.stderr
    bad = _cli("materialize", table, str(tmp_path / "cache"), "--where", "colour = 'red'")
    assert bad.returncode == 2 and "--where" in bad.stderr and "colour" in bad.stderr


@pytest.mark.slow
@pytest.mark.ray
def test_cli_ray_runner_matches_native(tmp_path):
    table, rows = make_shapes_table(str(tmp_path / "data"), n=12, n_errors=1)
    native = materialize(table, str(tmp_path / "native"), SPEC, rows_per_shard=5)
    out = _cli("materialize", table, str(tmp_path / "ray"), "--size", "32", "--rows-per-shard", "5",
               "--runner", "ray", "--json", timeout=400)  # RAY_ADDRESS=local from conftest: a fresh cluster
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["fingerprint"] == native.manifest.fingerprint and not summary["reused"]
    ray_m = cf.read_manifest(summary["cache"])
    assert [s.sha256 for s in ray_m.shards] == [s.sha256 for s in native.manifest.shards]
    assert ray_m.options["runner"] == "ray"
    # the statistics, added up from the records of shards built in Ray tasks, are the native run's exactly
    assert ray_m.channel_stats == native.manifest.channel_stats and ray_m.channel_stats["split"] == "train"


def test_public_names_resolve():
    import dutycycle.engine as engine

    assert engine.TransformSpec is TransformSpec and engine.materialize is materialize
    assert engine.open_cache is open_cache


def test_end_to_end_from_synth_and_ingest(tmp_path):
    import pyarrow.parquet as pq
    from dutycycle.engine.synth import synthesize
    from dutycycle.engine.table import format as tf
    from dutycycle.engine.table.catalog import ingest

    synthesize(str(tmp_path / "images"), n=40, seed=3, broken_fraction=0.1)
    table = str(tmp_path / "table")
    ingest(str(tmp_path / "images"), table, phash=False)
    t = pa.concat_tables([pq.read_table(u) for u in tf.file_uris(table)])
    rows = t.to_pylist()
    n_err = sum(r["error"] is not None for r in rows)
    assert n_err > 0
    res = materialize(table, str(tmp_path / "cache"), SPEC, rows_per_shard=16)
    assert res.manifest.skipped == {"table_error": n_err}
    classes = tf.read_manifest(table).classes
    reader = open_cache(str(tmp_path / "cache"))
    ids, labels, splits, images = _read_all(reader)
    good = {r["sample_id"]: r for r in rows if r["error"] is None}
    assert ids == sorted(good)
    assert [classes[k] for k in labels] == [good[s]["label"] for s in ids]
    assert splits == [good[s]["split"] for s in ids]
    ref = np.stack([reference(_file_bytes(good[s]["uri"]), 32, "bilinear") for s in ids])
    assert close_fraction(images, ref) >= 0.99


@pytest.mark.parametrize("damage", [b"{not json", b"[1, 2]", b'{"fingerprint": 7}'])
def test_a_damaged_reuse_index_entry_is_a_miss_not_a_crash(tmp_path, damage):
    """The reuse index only saves planning: an entry that is not JSON, not an object or names no fingerprint
    is passed over, and materialize plans the same cache again."""
    table, _ = make_shapes_table(str(tmp_path / "data"), n=6)
    root = str(tmp_path / "cache")
    first = materialize(table, root, SPEC)
    (entry,) = (tmp_path / "cache" / "_index").iterdir()
    entry.write_bytes(damage)
    again = materialize(table, root, SPEC)
    assert again.manifest.fingerprint == first.manifest.fingerprint


def test_a_fingerprint_folder_swapped_for_another_valid_cache_is_refused(tmp_path):
    """ROOT/<fp> holds the cache of fingerprint fp. A folder replaced by another valid cache (copied over, swapped,
    renamed) passed every check before, since its manifest and shards agree with each other: materialize reused
    it and readers opened it, serving another transform's samples under the first one's fingerprint. Its name
    must be the fingerprint its manifest records, wherever the folder is reached from."""

    table, _ = make_shapes_table(str(tmp_path / "data"), n=6)
    root = tmp_path / "cache"
    a = materialize(table, str(root), SPEC)
    b = materialize(table, str(root), TransformSpec(size=16))
    fa, fb = a.manifest.fingerprint, b.manifest.fingerprint
    assert fa != fb
    shutil.rmtree(root / fa)
    shutil.copytree(root / fb, root / fa)  # a valid cache, in the wrong folder
    swapped = rf"holds the cache of fingerprint '{fb}', not '{fa}'.*Delete"
    with pytest.raises(CorruptArtifactError, match=swapped):
        materialize(table, str(root), SPEC)  # through the reuse index
    with pytest.raises(CorruptArtifactError, match=swapped):
        open_cache(str(root / fa))  # named directly
    cf.write_latest(str(root), fa)
    with pytest.raises(CorruptArtifactError, match=swapped):
        open_cache(str(root))  # through `latest`
    assert open_cache(str(root / fb)).fingerprint == fb  # the real one is untouched
    shutil.copytree(root / fb, tmp_path / "kept")  # a copy outside any cache root may have any name
    assert open_cache(str(tmp_path / "kept")).fingerprint == fb
