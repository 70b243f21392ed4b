"""Curation on a real table: filters, stats, dedupe, sampling, splitting, thumbnails, saving with lineage."""

from __future__ import annotations

import io
import os
import random
import re
import shutil

import pyarrow.parquet as pq
import pytest
from daft import col
from dutycycle.engine import imageinfo
from dutycycle.engine.errors import ConfigError, DestinationError
from dutycycle.engine.synth import synthesize
from dutycycle.engine.table import format as tf
from dutycycle.engine.table.catalog import ingest
from dutycycle.engine.table.curate import allocate, choose_unique, split_rows
from dutycycle.engine.table.table import Table, open_table, read_arrow
from dutycycle.trainer.app.cli import main
from PIL import Image


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """40 shapes + 3 exact copies + 2 re-encoded near copies + broken files."""
    root = tmp_path_factory.mktemp("curate")
    src = root / "src"
    synthesize(str(src), 40, seed=21, broken_fraction=0.1)
    jpgs = sorted(p for p in (src / "star").iterdir() if p.suffix.lower() == ".jpg")
    good = [p for p in jpgs if _readable(p)]
    exact = [shutil.copy(p, p.with_name("copy_" + p.name)) for p in good[:3]]
    near = []
    for p in sorted(p for p in (src / "circle").iterdir() if _readable(p))[:2]:
        q = p.with_name("reencoded_" + p.stem + ".png")
        Image.open(p).convert("RGB").save(q, "PNG")
        near.append(q)
    table = str(root / "table")
    ingest(str(src), table, progress_every=0)
    return {"src": src, "table": table, "exact": exact, "near": near, "root": root}


def _readable(p) -> bool:
    try:
        with Image.open(p) as im:
            im.load()
        return True
    except Exception:
        return False


def test_stats_counts_classes_sizes_and_errors(dataset):
    t = open_table(dataset["table"])
    s = t.stats()
    rows = read_arrow(dataset["table"]).to_pylist()
    readable = [r for r in rows if r["error"] is None]
    assert s["rows"] == len(rows) == 45 and s["readable"] == len(readable)
    assert sum(s["classes"].values()) == len(readable) == sum(s["size_histogram"].values())
    assert s["classes"]["star"] == sum(1 for r in readable if r["label"] == "star")
    assert sum(s["errors"].values()) == 4 and set(s["formats"]) <= {"JPEG", "PNG", "WEBP"}
    assert t.classes == ["circle", "square", "star", "triangle"]


def test_where_sql_and_expression_agree(dataset):
    t = open_table(dataset["table"])
    a = t.where("label = 'star' AND width > 100")
    b = t.where((col("label") == "star") & (col("width") > 100))
    ua = sorted(a.to_arrow().column("uri").to_pylist())
    assert ua == sorted(b.to_arrow().column("uri").to_pylist()) and ua
    expected = sorted(
        r["uri"]
        for r in read_arrow(dataset["table"]).to_pylist()
        if r["label"] == "star" and (r["width"] or 0) > 100
    )
    assert ua == expected and a.operations == ("where label = 'star' AND width > 100",)


def test_dedupe_exact_and_near(dataset):
    t = open_table(dataset["table"])
    all_uris = set(t.to_arrow().column("uri").to_pylist())
    exact_only = set(t.dedupe(exact=True, near=False).to_arrow().column("uri").to_pylist())
    copies = {str(p) for p in dataset["exact"]}
    originals = {str(p.with_name(p.name[len("copy_") :])) for p in dataset["exact"]}
    for c, o in zip(sorted(copies), sorted(originals), strict=True):
        assert len({c, o} & exact_only) == 1  # exactly one of each identical pair stays
    ids = t.to_arrow().column("sample_id").to_pylist()
    assert len(exact_only) == len(set(ids)) <= len(all_uris) - 3  # one row per content hash
    assert {str(p) for p in dataset["near"]} <= exact_only  # re-encoded files are not byte-identical
    both = set(t.dedupe(exact=True, near=True, max_distance=4).to_arrow().column("uri").to_pylist())
    assert not {str(p) for p in dataset["near"]} & both
    assert len(both) < len(exact_only) < len(all_uris)
    with pytest.raises(ConfigError, match="max_distance"):
        t.dedupe(max_distance=40)


def test_choose_unique_matches_brute_force():
    rng = random.Random(0)
    base = [rng.getrandbits(64) for _ in range(60)]
    hashes = base + [h ^ (1 << rng.randrange(64)) ^ (1 << rng.randrange(64)) for h in base[:20]]
    rows = [
        {
            "uri": f"u{i:03d}",
            "sample_id": f"s{i}",
            "phash": h - (1 << 64) if h >= 1 << 63 else h,
            "error": None,
        }
        for i, h in enumerate(hashes)
    ]
    for d in (0, 2, 6):
        kept = choose_unique(rows, exact=False, near=True, max_distance=d)
        expected = []
        for r in rows:  # greedy in URI order against kept rows, by brute force
            if all(imageinfo.hamming(r["phash"], k["phash"]) > d for k in expected):
                expected.append(r)
        assert [r["uri"] for r in kept] == [r["uri"] for r in expected]
    assert len(choose_unique(rows, exact=False, near=True, max_distance=2)) == 60


def test_sample_is_stratified_and_deterministic(dataset):
    t = open_table(dataset["table"]).where("error IS NULL")
    s1 = t.sample(n=20, seed=1)
    s2 = t.sample(n=20, seed=1)
    s3 = t.sample(n=20, seed=2)
    u1 = sorted(s1.to_arrow().column("uri").to_pylist())
    assert len(u1) == 20 and u1 == sorted(s2.to_arrow().column("uri").to_pylist())
    assert u1 != sorted(s3.to_arrow().column("uri").to_pylist())
    full, sub = t.stats()["classes"], s1.stats()["classes"]
    for label, n in full.items():
        assert abs(sub[label] - 20 * n / sum(full.values())) < 1
    assert t.sample(fraction=0.5).count() == round(0.5 * t.count())
    with pytest.raises(ConfigError, match="exactly one"):
        t.sample()
    assert allocate({"a": 10, "b": 5, "c": 1}, 8) == {"a": 5, "b": 3, "c": 0}
    assert sum(allocate({"a": 3, "b": 3, "c": 3}, 100).values()) == 9


def test_resplit_divides_each_class_and_keeps_duplicates_together(dataset):
    t = open_table(dataset["table"]).where("error IS NULL")
    r = t.resplit("0.5,0.25,0.25", seed=3)
    rows = r.to_arrow().to_pylist()
    assert len(rows) == t.count() and r.df.column_names == tf.SCHEMA.names
    for label in t.classes:
        mine = [x["split"] for x in rows if x["label"] == label]
        assert abs(mine.count("train") - len(mine) / 2) <= 1
    by_id = {}
    for x in rows:
        by_id.setdefault(x["sample_id"], set()).add(x["split"])
    assert all(len(v) == 1 for v in by_id.values())
    dup = [{"uri": f"u{i}", "sample_id": "same", "label": "a"} for i in range(3)]
    assert len(set(split_rows(dup, "0.34,0.33,0.33", 0, "label").values())) == 1


def test_thumbnails_inline_html(dataset):
    t = open_table(dataset["table"])
    grid = t.where("label = 'square'").show_thumbnails(n=5, size=48)
    html = grid._repr_html_()
    assert len(grid) == 5 and html.count("<img ") == sum(1 for th in grid.thumbs if th.jpeg_b64) >= 3
    for th in grid.thumbs:
        if th.jpeg_b64:
            import base64

            im = Image.open(io.BytesIO(base64.b64decode(th.jpeg_b64)))
            assert im.format == "JPEG" and max(im.size) <= 48


def test_save_subset_records_lineage(dataset, tmp_path):
    t = open_table(dataset["table"])
    view = t.where("label = 'star'").dedupe()
    saved = view.save(str(tmp_path / "stars"))
    m = tf.read_manifest(str(tmp_path / "stars"))
    assert m.lineage["parent"] == dataset["table"] and m.lineage["filter"] == "(label = 'star')"
    assert m.lineage["operations"] == list(view.operations) and m.classes == t.classes
    # Daft's writer stores strings as Arrow's large_string (the same Parquet UTF8 column to other readers)
    plain = pq.read_table([os.path.join(tmp_path / "stars", f) for f in m.files]).cast(tf.SCHEMA)
    assert plain.sort_by("uri").equals(view.to_arrow().sort_by("uri")) and m.num_rows == plain.num_rows
    assert isinstance(saved, Table) and saved.count() == plain.num_rows
    with pytest.raises(DestinationError, match="already exists"):
        view.save(str(tmp_path / "stars"))
    again = t.where("label = 'circle'").save(str(tmp_path / "stars"), overwrite=True)
    assert again.manifest.version == 2 and set(again.to_arrow().column("label").to_pylist()) == {"circle"}


def test_save_writes_on_daft_and_no_row_reaches_the_driver(dataset, tmp_path, monkeypatch):
    """``save`` hands the view's query to Daft's Parquet writer: every result that reaches this process during the
    save holds counts or file names, never a row's columns (main collected the whole view with ``to_arrow``).
    The manifest names Daft's files in the writer's own folder, with rows counted from their footers, and a
    resplit-and-sampled view reads back row for row, splits included."""
    import daft

    view = open_table(dataset["table"]).where("error IS NULL").resplit("0.5,0.25,0.25", seed=3).sample(n=30, seed=2)
    want = view.to_arrow().sort_by("uri")
    results: list[list[str]] = []

    def recording(name):
        original = getattr(daft.DataFrame, name)

        def method(self, *args, **kwargs):
            results.append(list(self.column_names))
            return original(self, *args, **kwargs)
        return method

    for name in ("collect", "to_arrow_iter", "iter_partitions", "iter_rows", "to_arrow", "to_pydict"):
        monkeypatch.setattr(daft.DataFrame, name, recording(name))
    saved = view.save(str(tmp_path / "subset"))
    monkeypatch.undo()
    assert results and ["path"] in results  # the writer ran, and returned its files' names
    leaked = [names for names in results if {"uri", "sample_id", "phash"} & set(names)]
    assert not leaked, f"rows of the view came back to the driver: {leaked}"
    m = tf.read_manifest(str(tmp_path / "subset"))
    folders = {f.split("/")[0] for f in m.files}
    assert len(folders) == 1 and folders.pop().startswith("v00001-") and m.num_rows == 30 == saved.count()
    assert all(re.fullmatch(r"[0-9a-f-]{36}-\d+\.parquet", f.split("/")[1]) for f in m.files)  # Daft's names
    assert read_arrow(str(tmp_path / "subset")).sort_by("uri").equals(want)


@pytest.mark.parametrize("vacuumed", [False, True])
def test_save_commits_its_files_after_a_concurrent_commit(dataset, tmp_path, monkeypatch, vacuumed):
    """A writer that commits first takes version 1 while the save's files are written: the save moves the files
    it wrote (once) into a data folder of version 2 and commits that, and both versions read back whole. When its
    files are gone meanwhile (a vacuum took the save for a killed writer), it writes them again."""
    from dutycycle.engine.table import commit

    dest = str(tmp_path / "raced")
    other = read_arrow(dataset["table"]).slice(0, 5)
    write_dataframe = commit.write_dataframe
    calls = []

    def racing(table_uri, folder, df):
        out = write_dataframe(table_uri, folder, df)
        calls.append(folder)
        if len(calls) == 1:
            commit.write_version(table_uri, other, classes=["circle"], source="the other writer")
            if vacuumed:
                shutil.rmtree(os.path.join(table_uri, folder))
        return out
    monkeypatch.setattr(commit, "write_dataframe", racing)
    view = open_table(dataset["table"]).where("label = 'square'")
    saved = view.save(dest)
    assert saved.manifest.version == 2 and {f.split("/")[0] for f in saved.manifest.files} <= {
        p for p in os.listdir(dest) if p.startswith("v00002-")}  # a folder of its own version
    assert len(calls) == 1 + vacuumed  # the query ran again only when its files were gone
    assert sorted(saved.to_arrow().column("uri").to_pylist()) == sorted(view.to_arrow().column("uri").to_pylist())
    first = tf.read_manifest(dest, 1)
    assert first.source == "the other writer" and read_arrow(dest, first).equals(other)
    folders = sorted(p for p in os.listdir(dest) if p.startswith("v0"))  # the save's first folder is gone
    assert folders == sorted({f.split("/")[0] for f in first.files + saved.manifest.files})
    assert sorted(os.listdir(dest + "/_manifests")) == ["v00001.json", "v00002.json"]


def test_a_failed_save_leaves_no_files(dataset, tmp_path):
    """A query that fails while Daft writes (a user's function raising on one row, after others were written)
    commits nothing, leaves nothing behind in the destination and surfaces its own error; a full disk reported
    by Daft's writer is named."""
    import daft
    from dutycycle.engine.errors import NoSpaceError
    from dutycycle.engine.table.commit import _write_error

    @daft.func(return_dtype=daft.DataType.int32())
    def width(uri: str, w: int | None) -> int | None:
        if "/triangle/" in uri:
            raise RuntimeError(f"the user's function failed on {uri}")
        return w

    t = open_table(dataset["table"])
    bad = Table(t.uri, t.manifest, t.df.with_column("width", width(col("uri"), col("width"))), ("broken",))
    dest = tmp_path / "failed"
    with pytest.raises(Exception, match="the user's function failed"):
        bad.save(str(dest))
    assert not tf.committed_versions(str(dest)) and [p.name for p in dest.iterdir()] == []
    full = _write_error(str(dest), str(dest / "v00001-x"), RuntimeError("write failed: No space left on device (os error 28)"))
    assert isinstance(full, NoSpaceError) and "no space left on" in str(full) and str(dest) in str(full)


def test_a_dataframe_streams_in_batches_where_daft_cannot_write(dataset, monkeypatch):
    """``memory://`` (no Daft writer): the query's batches come back in turn and are regrouped into files of
    ``ROWS_PER_FILE`` rows; an empty view is one empty file."""
    import daft
    from dutycycle.engine.table import commit

    monkeypatch.setattr(commit, "ROWS_PER_FILE", 7)
    rows = read_arrow(dataset["table"]).slice(0, 20)
    df = daft.from_arrow(rows)
    m = commit.write_version("memory://curate-stream/t", df, classes=[])
    assert m.num_rows == 20 and [read_arrow("memory://curate-stream/t", m).num_rows] == [20] and len(m.files) == 3
    assert read_arrow("memory://curate-stream/t").sort_by("uri").equals(rows.sort_by("uri"))
    empty = commit.write_version("memory://curate-stream/e", df.where(col("uri") == "none"), classes=[])
    assert empty.num_rows == 0 and len(empty.files) == 1


def test_to_pandas(dataset):
    df = open_table(dataset["table"]).where("label = 'triangle'").to_pandas()
    assert list(df.columns) == tf.SCHEMA.names and set(df["label"]) == {"triangle"}


def test_save_and_open_on_s3(dataset, s3):
    sub = open_table(dataset["table"]).where("error IS NULL").sample(n=8, seed=0)
    sub.save(f"{s3}/subset")
    back = open_table(f"{s3}/subset")
    assert back.count() == 8 and back.manifest.lineage["parent"] == dataset["table"]
    assert sorted(back.to_arrow().column("uri").to_pylist()) == sorted(
        sub.to_arrow().column("uri").to_pylist()
    )


def test_cli_inspect_writes_contact_sheet(dataset, tmp_path, capsys):
    out = tmp_path / "sheet.html"
    rc = main(["inspect", dataset["table"], "--where", "label = 'star'", "--limit", "6", "--html", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "classes: star" in text and "contact sheet" in text
    html = out.read_text()
    assert html.startswith("<!doctype html>") and 3 <= html.count("data:image/jpeg;base64,") <= 6
    assert "label = &#x27;star&#x27;" in html or "label = 'star'" in html
    assert main(["inspect", dataset["table"], "--where", "nosuchcolumn > 1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nosuchcolumn" in err


def test_dedupe_stats_split_exact_and_near_with_a_sheet_of_pairs(dataset, tmp_path, capsys):
    import json

    import numpy as np
    from dutycycle.engine.dupes import pair_sheet
    from dutycycle.engine.table.dedupe_stats import DedupeStats

    t = open_table(dataset["table"]).where("error IS NULL")
    s = t.dedupe_stats(max_distance=4, examples=2)
    view = t.dedupe(max_distance=4)
    originals = {str(p.with_name(p.name[len("copy_"):])) for p in dataset["exact"]}
    near = {str(p) for p in dataset["near"]}
    assert (s.rows, s.exact_removed) == (t.count(), 3) and s.kept == view.count() == s.rows - 3 - s.near_removed
    assert s.near_removed == sum(s.near_by_distance.values()) >= 2 and set(s.near_by_distance) == set(range(5))
    assert view.near_search.exact and s.search.method == "pigeonhole" and s.search.pairs >= 1
    exact = [e for e in s.examples if e["distance"] is None]
    assert len(exact) == 2 and {e["removed"] for e in exact} <= originals  # "copy_..." sorts first: kept
    assert all(e["kept"] == e["removed"].replace("/star/", "/star/copy_") for e in exact)
    shown = [e for e in s.examples if e["distance"] is not None]
    assert near <= {e["removed"] for e in shown} and all(len([x for x in shown if x["distance"] == e["distance"]]) <= 2
                                                          for e in shown)
    for e in shown:  # each example is within its stated distance
        kept, removed = (read_arrow(dataset["table"]).filter(pc_eq("uri", u)).column("phash")[0].as_py()
                         for u in (e["kept"], e["removed"]))
        assert imageinfo.hamming(kept, removed) == e["distance"]

    sheet = pair_sheet(t, s, str(tmp_path / "pairs.png"), size=48)
    png = Image.open(tmp_path / "pairs.png")
    assert png.format == "PNG" and sheet.pairs == len(s.examples) and not sheet.refused
    assert png.height == 16 + 8 + len(s.examples) * (48 + 8)
    tile = np.asarray(png.convert("L"))[24:24 + 48, 8:8 + 48]  # the first kept thumbnail: drawn, not the blank grey
    assert tile.std() > 5
    outside = DedupeStats(1, 0, 1, 0, {}, [{"distance": None, "kept": "/etc/hostname", "removed": "/etc/hosts"}])
    assert pair_sheet(t, outside, str(tmp_path / "x.png")).refused == ["/etc/hostname", "/etc/hosts"]

    out = tmp_path / "unique"
    rc = main(["dedupe", dataset["table"], "--where", "error IS NULL", "--json", "--sheet", str(tmp_path / "c.png"),
               "--save", str(out), "--recall-sample", "20"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["exact_removed"] == 3 and report["near_removed"] == s.near_removed
    assert report["sheet"]["pairs"] == len([e for e in report["examples"]]) and (tmp_path / "c.png").exists()
    assert report["saved"]["rows"] == s.kept and report["near_recall"]["recall"] in (None, 1.0)
    assert sorted(open_table(str(out)).to_arrow().column("uri").to_pylist()) == sorted(
        view.to_arrow().column("uri").to_pylist())
    assert main(["dedupe", dataset["table"], "--max-distance", "17", "--no-sheet"]) == 2
    assert "max_distance 17" in capsys.readouterr().err


def pc_eq(column, value):
    import pyarrow.compute as pc

    return pc.field(column) == value
