"""Names and sources a file system allows that ingest must not trip on, and the streaming listing that carries them.

File names on a local file system are bytes: anything but ``/`` and NUL, not necessarily UTF-8 (a Latin-1 name
copied from an old archive) and possibly holding control characters. Class folders typed on macOS (NFD) and Linux
(NFC) spell one letter two ways. A second source ingested into a table would drop the first one's rows. And the
listing streams: files are listed, diffed, probed and written a batch at a time, in the byte order of their paths.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import unicodedata

import pytest
from dutycycle.engine import io as dio
from dutycycle.engine.errors import ConfigError
from dutycycle.engine.table import format as tf
from dutycycle.engine.table import probe, scan
from dutycycle.engine.table.catalog import ingest
from dutycycle.engine.table.table import open_table, read_arrow
from dutycycle.trainer.app.cli import main
from PIL import Image


def _png(path: bytes | str, colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (12, 8), colour).save(buf, "PNG")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    return buf.getvalue()


NFC, NFD = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")


def test_non_text_and_control_character_names_keep_their_exact_bytes(tmp_path, capsys):
    """Fails on main: the listing's ``pa.array`` of names raised UnicodeEncodeError (surrogates) for the first
    name that is not UTF-8, so no ingest of such a folder ever committed."""
    src = os.fsencode(tmp_path / "src")
    files = {  # exact path bytes under src -> content
        b"cat/caf\xe9.png": _png(src + b"/cat/caf\xe9.png", (200, 0, 0)),  # Latin-1
        b"cat/\xff\xfe.png": _png(src + b"/cat/\xff\xfe.png", (0, 200, 0)),
        b"d\xf6g/x.png": _png(src + b"/d\xf6g/x.png", (0, 0, 200)),  # a class folder that is not text
        b"cat/new\nline\t\x1b[2J.png": _png(src + b"/cat/new\nline\t\x1b[2J.png", (9, 9, 9)),
        b"evil\x1b[31m/y.png": _png(src + b"/evil\x1b[31m/y.png", (90, 9, 9)),
    }
    table = str(tmp_path / "table")
    assert main(["ingest", os.fsdecode(src), table, "--progress-every", "0"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "evil\\x1b[31m: 1" in out, out  # a terminal shows the name, never obeys it
    rows = read_arrow(table).to_pylist()
    assert len(rows) == len(files)
    by_bytes = {r["uri_bytes"] or r["uri"].encode(): r for r in rows}
    for rel, data in files.items():
        r = by_bytes[src + b"/" + rel]
        assert r["error"] is None and r["sample_id"] == hashlib.sha256(data).hexdigest()[:32]  # read, not refused
        text = rel.decode("utf-8", "backslashreplace")
        assert r["uri"] == os.fsdecode(src) + "/" + text  # readable (and exact when the name is text)
        assert (r["uri_bytes"] is None) == (text.encode() == rel)
        with open(dio.open_path(r["uri"], r["uri_bytes"]), "rb") as f:
            assert f.read() == data  # the row opens its own file
    assert by_bytes[src + b"/cat/caf\xe9.png"]["uri"].endswith("/cat/caf\\xe9.png")
    assert sorted(open_table(table).stats()["classes"]) == ["cat", "d\\xf6g", "evil\x1b[31m"]
    # The exact bytes are the key: an unchanged folder is no new version; a changed name-that-is-not-text is
    # one modified row, a removed one one deleted row.
    assert ingest(os.fsdecode(src), table, progress_every=0)["committed"] is False
    _png(src + b"/cat/\xff\xfe.png", (1, 2, 3))
    os.unlink(src + b"/d\xf6g/x.png")
    s = ingest(os.fsdecode(src), table, progress_every=0)
    assert (s["committed"], s["modified"], s["deleted"], s["new_rows"], s["rows"]) == (True, 1, 1, 1, 4)


def test_labels_are_nfc_and_merged_folders_are_reported(tmp_path, capsys):
    """Fails on main: ``café`` (NFC) and ``café`` (NFD) were two classes."""
    src = tmp_path / "src"
    _png(str(src / NFC / "a.png"), (200, 0, 0))
    _png(str(src / NFD / "b.png"), (0, 200, 0))
    _png(str(src / "dog" / "c.png"), (0, 0, 200))
    table = str(tmp_path / "table")
    s = ingest(str(src), table, progress_every=0)
    assert s["classes"] == {NFC: 2, "dog": 1} and tf.read_manifest(table).classes == [NFC, "dog"]
    assert s["merged_labels"] == {NFC: sorted([NFC, NFD])}
    assert {r["label"] for r in read_arrow(table).to_pylist()} == {NFC, "dog"}
    # a later NFD folder joins the existing class, and the report says so
    _png(str(src / "dog" / NFD / "x.png"), (5, 5, 5))  # (deeper: still the "dog" class)
    _png(str(src / (NFD + "!")[:-1] / "d.png"), (7, 7, 7))
    assert main(["ingest", str(src), table, "--progress-every", "0"]) == 0
    out = capsys.readouterr().out
    assert f"merged into class {NFC} (Unicode NFC): folders " in out and ascii(NFD) in out, out
    assert open_table(table).stats()["classes"] == {NFC: 3, "dog": 2}
    # a mapping file's names find files the file system spells in another normal form; its labels are NFC too
    mapping = tmp_path / "labels.json"
    mapping.write_text(json.dumps({f"{NFC}.png": NFD, "x.png": "dog"}))
    other = tmp_path / "other"
    _png(str(other / f"{NFD}.png"), (3, 3, 3))
    _png(str(other / "x.png"), (4, 4, 4))
    s = ingest(str(other), str(tmp_path / "mapped"), labels=str(mapping), progress_every=0)
    assert s["classes"] == {NFC: 1, "dog": 1} and s["unlabelled"] == 0


def test_a_second_source_into_a_table_is_refused_and_the_first_kept(tmp_path):
    """Fails on main: ingesting folder B into A's table committed a version with B's rows only."""
    a, b, table = tmp_path / "a", tmp_path / "b", str(tmp_path / "table")
    _png(str(a / "cat" / "1.png"), (200, 0, 0))
    _png(str(b / "dog" / "2.png"), (0, 200, 0))
    ingest(str(a), table, progress_every=0)
    with pytest.raises(ConfigError, match=r"holds the rows of source .*/a'; ingesting .*/b' into it would drop "
                                          r"them .* into a new table"):
        ingest(str(b), table, progress_every=0)
    assert tf.read_manifest(table).version == 1 and read_arrow(table).num_rows == 1
    # the same source spelled another way is the same source
    again = ingest(str(a) + "/./", table, progress_every=0)
    assert again["committed"] is False and again["rows"] == 1


def _tricky(src) -> list[str]:
    """Names whose byte order differs from a folder-by-folder walk's naive order: ``a-c`` sorts before ``a/``."""
    rels = ["a-c.png", "a/b.png", "a/z/q.png", "a0.png", "b/a b.png", "b/a.png", "b/a/x.png", "c.png"]
    rels += [f"m/{i:03d}.png" for i in range(17)]
    for k, rel in enumerate(rels):
        _png(f"{src}/{rel}", (k * 9 % 256, 40, 90))
    return rels


def test_listing_streams_in_path_order_and_batches_bound_the_work(tmp_path, monkeypatch):
    src, table = str(tmp_path / "src"), str(tmp_path / "table")
    rels = _tricky(src)
    batches = list(scan.iter_listing(src, batch=4))
    assert [t.num_rows for t in batches] == [4] * 6 + [1]
    listed = [r for t in batches for r in t.column("rel").to_pylist()]
    assert listed == sorted(rels, key=str.encode) and len(listed) == 25
    seen = []
    real = probe.run_probe
    monkeypatch.setattr(probe, "run_probe", lambda cfg, todo, *a, **k: seen.append(todo.num_rows) or
                        real(cfg, todo, *a, **k))
    first = ingest(src, table, progress_every=0, batch_files=4)
    assert seen == [4] * 6 + [1] and first["rows"] == 25  # never more than a batch probed at once
    # a re-ingest diffs each batch against the committed rows of its key range: a change in the middle, a
    # deletion at each end, a new file between batches
    seen.clear()
    _png(f"{src}/b/a.png", (1, 1, 1))
    os.unlink(f"{src}/a-c.png")
    os.unlink(f"{src}/m/016.png")
    _png(f"{src}/b/a0.png", (2, 2, 2))
    s = ingest(src, table, progress_every=0, batch_files=4)
    assert (s["modified"], s["deleted"], s["new_rows"], s["unchanged"], s["rows"]) == (1, 2, 2, 22, 24)
    assert sum(seen) == 2
    fresh = str(tmp_path / "fresh")
    ingest(src, fresh, progress_every=0, batch_files=1000)
    key = lambda r: (r["uri"], r["sample_id"], r["split"], r["label"])  # noqa: E731
    assert sorted(map(key, read_arrow(table).to_pylist())) == sorted(map(key, read_arrow(fresh).to_pylist()))


def test_object_store_listing_streams_in_path_order(s3):
    src, table = f"{s3}/src", f"{s3}/table"
    rels = _tricky_remote(src)
    listed = [r for t in scan.iter_listing(src, batch=3) for r in t.column("rel").to_pylist()]
    assert listed == sorted(rels, key=str.encode)
    fs, root = dio.filesystem(src)
    assert not [k for k in fs.dircache if k.startswith(root)]  # no folder's listing kept once it was read
    s = ingest(src, table, progress_every=0, batch_files=3)
    assert s["rows"] == len(rels) and not s["errors"]
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.rm(f"{src}/a/b.png")
    again = ingest(src, table, progress_every=0, batch_files=3)
    assert (again["deleted"], again["unchanged"], again["rows"]) == (1, len(rels) - 1, len(rels) - 1)


def _tricky_remote(src: str) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem()
    rels = ["a-c.png", "a/b.png", "a/z/q.png", "a0.png", "b/a.png", "b/a/x.png", "c.png"]
    for k, rel in enumerate(rels):
        buf = io.BytesIO()
        Image.new("RGB", (6, 6), (k * 30, 0, 0)).save(buf, "PNG")
        fs.pipe(f"{src}/{rel}", buf.getvalue())
    return rels


def test_a_folder_that_cannot_be_listed_is_an_error_row_and_an_unlistable_source_is_refused(tmp_path, monkeypatch):
    """EACCES injected at ``os.scandir`` (root, who runs the tests here, reads every folder): the folder's files
    are not silently missing, and a source that cannot be listed is no source with every file deleted."""
    import errno

    from dutycycle.engine.errors import SourceError

    src = tmp_path / "src"
    _png(str(src / "ok" / "a.png"), (1, 1, 1))
    _png(str(src / "locked" / "b.png"), (2, 2, 2))
    table = str(tmp_path / "table")
    assert ingest(str(src), table, progress_every=0)["rows"] == 2
    real, locked = os.scandir, {os.fsencode(src / "locked")}

    def scandir(path):
        if path in locked:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real(path)

    monkeypatch.setattr(scan.os, "scandir", scandir)
    s = ingest(str(src), table, progress_every=0)
    rows = {r["uri"]: r["error"] for r in read_arrow(table).to_pylist()}
    assert rows[str(src / "locked")] == "unreadable folder: Permission denied" and s["errors"] == {
        "unreadable folder": 1}
    locked.add(os.fsencode(src))
    with pytest.raises(SourceError, match=r"cannot be listed \(unreadable folder: Permission denied\)"):
        ingest(str(src), table, progress_every=0)
    assert read_arrow(table).num_rows == 2


def test_committed_rows_come_back_in_path_order_a_key_range_at_a_time(tmp_path):
    """``SortedRows`` over a file written in path order (three row groups, read one at a time) and one that is
    not (read whole and sorted), keyed by the exact path bytes; a missing data file is named, not skipped."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from dutycycle.engine.errors import CorruptArtifactError

    ordered = pa.table({"uri": ["/s/a", "/s/c", "/s/e"], "size_bytes": [1, 2, 3], "modified": ["1", "2", "3"]})
    pq.write_table(ordered, tmp_path / "ordered.parquet", row_group_size=1)
    shuffled = pa.table({"uri": ["/s/d", "/s/b\\xff", "/s/b"], "size_bytes": [4, 5, 6], "modified": ["4", "5", "6"],
                         "uri_bytes": pa.array([None, b"/s/b\xff", None], pa.binary())})
    pq.write_table(shuffled, tmp_path / "shuffled.parquet")
    rows = scan.SortedRows([str(tmp_path / "ordered.parquet"), str(tmp_path / "shuffled.parquet")],
                           scan.STATE_COLUMNS)

    def keys(t):
        return sorted(zip(t.column("_key").to_pylist(), t.column("_file").to_pylist(), strict=True))

    assert keys(rows.upto(b"/s/b\xff")) == [(b"/s/a", 0), (b"/s/b", 1), (b"/s/b\xff", 1)]
    assert keys(rows.upto(b"/s/c")) == [(b"/s/c", 0)]
    assert rows.upto(b"/s/c") is None
    assert keys(rows.upto(None)) == [(b"/s/d", 1), (b"/s/e", 0)] and rows.upto(None) is None
    gone = str(tmp_path / "gone.parquet")
    with pytest.raises(CorruptArtifactError, match="gone.parquet' does not exist"):
        scan.SortedRows([gone]).upto(None)
    assert scan.SortedRows([gone], missing_ok=True).upto(None) is None


def test_rows_with_non_text_and_control_character_names_are_read_by_every_reader(tmp_path):
    """Fails on main: ingest kept such rows, but materialize, the raw loader, the contact sheet and the dedupe pair
    sheet opened ``uri`` (only the readable form of a name that is not text) and skipped or refused them. Every
    reader opens a row's file through ``io.open_path``: the cache holds the sample, decoded to the same pixels as
    a text-named copy; the raw loader's batches equal the cache loader's; both sheets show the pictures."""
    import numpy as np
    from dutycycle.engine.cache.materialize import materialize
    from dutycycle.engine.cache.reader import CacheReader
    from dutycycle.engine.cache.udf import build_shard
    from dutycycle.engine.dupes import pair_sheet
    from dutycycle.engine.inspect import contact_sheet
    from dutycycle.engine.transform import TransformSpec
    from dutycycle.loader import AugmentConfig, CacheLoader, LoaderConfig, RawLoader
    from PIL import PngImagePlugin

    src = os.fsencode(tmp_path / "src")
    latin1 = _png(src + b"/cat/caf\xe9.png", (200, 30, 30))  # not UTF-8 text: opened by its bytes
    _png(src + b"/cat/new\nline\x1b[2J.png", (30, 30, 200))  # text, with control characters
    _png(src + b"/d\xf6g/\xff.png", (30, 200, 30))  # a class folder that is not text either
    # the same pixels as the Latin-1 file in other bytes (a text chunk): a sample of its own, to compare pixels
    info = PngImagePlugin.PngInfo()
    info.add_text("note", "same pixels")
    os.makedirs(src + b"/dog")
    Image.new("RGB", (12, 8), (200, 30, 30)).save(os.fsdecode(src + b"/dog/text.png"), "PNG", pnginfo=info)
    with open(src + b"/dog/same-bytes.png", "wb") as f:  # an exact copy: the dedupe pair sheet shows both
        f.write(latin1)
    table, spec = str(tmp_path / "table"), TransformSpec(size=8)
    ingest(os.fsdecode(src), table, split="1,0,0", progress_every=0)
    rows = {(r["uri_bytes"] or r["uri"].encode()).rsplit(b"/", 1)[-1]: r for r in read_arrow(table).to_pylist()}
    assert len(rows) == 5 and not any(r["error"] for r in rows.values())

    result = materialize(table, str(tmp_path / "cache"), spec, runner="native")
    assert result.manifest.num_samples == 4 and result.manifest.skipped == {"duplicate": 1}  # the exact copy
    reader = CacheReader(result.uri)
    ids = list(reader.column(0, "sample_id"))
    images = dict(zip(ids, reader.images(0), strict=True))
    assert {rows[n]["sample_id"] for n in (b"caf\xe9.png", b"new\nline\x1b[2J.png", b"\xff.png")} <= set(images)
    latin1_sample, copy_sample = images[rows[b"caf\xe9.png"]["sample_id"]], images[rows[b"text.png"]["sample_id"]]
    assert np.array_equal(latin1_sample, copy_sample) and latin1_sample.std() > 0  # the file decoded, not blank
    # the Ray runner's unit of work (a shard's rows as the plan's structs) opens them the same way
    mine = [{k: r[k] for k in ("sample_id", "uri", "uri_bytes", "label", "split")} for n, r in rows.items()
            if n != b"same-bytes.png"]
    rec = build_shard(str(tmp_path / "ray-shard"), 0, mine, spec, ["cat", "d\\xf6g", "dog"], batch_size=2,
                      max_bytes=1 << 20, max_pixels=1 << 20)
    assert rec["shard"]["rows"] == 4 and not rec["skipped"]

    config = LoaderConfig(global_batch_size=2, mode="sync", drop_last=False)
    cached = CacheLoader(result.uri, "train", config=config)
    a = cached.config.augment  # normalized by the cache's statistics; the raw path is given them
    raw = RawLoader(table, spec, "train", config=LoaderConfig(
        global_batch_size=2, mode="sync", drop_last=False, augment=AugmentConfig(mean=a.mean, std=a.std)))
    assert raw.fingerprint == cached.fingerprint and len(raw) == len(cached) == 2
    for a, b in zip(raw, cached, strict=True):  # the raw path read every file, and decoded what the cache holds
        assert list(a["sample_id"]) == list(b["sample_id"]) and np.array_equal(a["image"], b["image"])

    t = open_table(table)
    sheet = contact_sheet(t, str(tmp_path / "sheet.html"), limit=8)
    assert len(sheet) == 5 and all(th.jpeg_b64 and th.problem is None for th in sheet.thumbs)
    pairs = t.dedupe_stats(max_distance=0, examples=2)
    assert [(e["kept"].rsplit("/", 1)[-1], e["removed"].rsplit("/", 1)[-1]) for e in pairs.examples
            if e["distance"] is None] == [("caf\\xe9.png", "same-bytes.png")]
    assert pair_sheet(t, pairs, str(tmp_path / "pairs.png"), size=32).pairs >= 1
    png = np.asarray(Image.open(tmp_path / "pairs.png").convert("RGB")).astype(float)
    for x in (8, 8 + 32 + 8):  # kept, removed: each tile shows the red picture, not a grey "unreadable" cell
        middle = png[24 + 13:24 + 19, x + 11:x + 21].mean(axis=(0, 1))  # inside the 12x8 picture, centred
        assert np.abs(middle - (200, 30, 30)).max() < 8, middle  # (JPEG's error on a flat colour: a few levels)


def test_a_row_whose_exact_bytes_lie_outside_the_roots_is_not_read(tmp_path):
    """A crafted table: ``uri`` inside the source root, ``uri_bytes`` naming a file outside it. The roots check
    looks at the path a reader opens (``io.open_path``), so materialize, the raw loader and the sheet refuse it."""
    from dutycycle.engine.cache.materialize import materialize, plan_rows
    from dutycycle.engine.inspect import thumbnail_grid
    from dutycycle.engine.roots import OUTSIDE_ROOTS
    from dutycycle.engine.transform import TransformSpec

    from ..support.tablemaker import add_file, write_table

    src = str(tmp_path / "src")
    inside = add_file(src, "cat/a.png", _png(str(tmp_path / "a.png"), (1, 2, 3)), "cat")
    secret = _png(str(tmp_path / "secret.png"), (9, 9, 9))  # outside the root
    crafted = add_file(src, "cat/b.png", secret, "cat")
    os.unlink(crafted["uri"])
    crafted["uri_bytes"] = os.fsencode(tmp_path / "secret.png")
    table = write_table(str(tmp_path / "table"), [inside, crafted], roots=[src])
    spec = TransformSpec(size=8)
    plan = plan_rows(table, spec)
    assert plan.outside == 1 and plan.paths == [inside["uri"]]
    assert materialize(table, str(tmp_path / "cache"), spec, runner="native").manifest.skipped == {"outside_roots": 1}
    grid = thumbnail_grid(open_table(table), limit=4)
    assert sorted(th.problem or "read" for th in grid.thumbs) == sorted([OUTSIDE_ROOTS, "read"])
