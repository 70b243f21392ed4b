"""Which rows a contact sheet shows: the first rows, a seeded random sample, or some of each class."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from dutycycle.engine.errors import ConfigError
from dutycycle.engine.inspect import contact_sheet, sample_rows
from dutycycle.engine.table.table import open_table
from dutycycle.trainer.app.cli import main
from PIL import Image

from ..support.tablemaker import add_file, png_bytes, write_table

COUNTS = {"a": 30, "b": 6, "c": 2, None: 1}  # in path order: every "a" first, as an ingest of class folders lists


@pytest.fixture(scope="module")
def table():
    # memory:// paths are the same on every run, so the seeded hash picks the same rows every run
    root = "memory://inspect-sample"
    rows = []
    for label, n in COUNTS.items():
        for i in range(n):
            img = Image.new("RGB", (8, 8), (i * 8, 40 * len(rows) % 256, 0))
            rows.append(add_file(f"{root}/images", f"{label or 'unlabelled'}/{i:03d}.png", png_bytes(img), label))
    return open_table(write_table(f"{root}/table", rows, classes=["a", "b", "c"])), rows


def test_random_is_seeded_uniform_and_stable_under_filtering(table):
    t, rows = table
    first, note = sample_rows(t, 6, "first")
    assert [r["uri"] for r in first] == [r["uri"] for r in rows[:6]] and note == "the first 6 rows in table order"
    assert {r["label"] for r in first} == {"a"}  # why the default is not "first": one class folder's files

    picks = {seed: [r["uri"] for r in sample_rows(t, 6, "random", seed)[0]] for seed in range(12)}
    assert picks[3] == [r["uri"] for r in sample_rows(t, 6, seed=3)[0]]  # random is the default; same seed, rows
    assert all(len(set(p)) == 6 for p in picks.values()) and len({tuple(sorted(p)) for p in picks.values()}) >= 10
    label = {r["uri"]: r["label"] for r in rows}
    share = Counter(label[u] for p in picks.values() for u in p)
    assert 0.6 <= share["a"] / 72 <= 0.92  # 30 of 39 rows are "a": 0.77 expected
    assert share["b"] + share["c"] + share[None] >= 8  # the other classes show up (9 of 39 rows: 16.6 expected)

    # a row's pick depends on the row and the seed only: a filtered view keeps the rows it still holds
    kept = [u for u in picks[5] if label[u] != "a"]
    view = sample_rows(t.where("label != 'a'"), 6, "random", 5)[0]
    assert set(kept) <= {r["uri"] for r in view}


def test_per_class_shows_each_class_and_the_cli_and_sheet_say_how(table, tmp_path, capsys):
    t, _ = table
    one, note = sample_rows(t, 6, "per_class", seed=1)  # 4 classes (a missing label is one): 1 of each
    assert [r["label"] for r in one] == ["a", "b", "c", None] and "4 of 4 classes shown" in note
    three = [r["label"] for r in sample_rows(t, 12, "per_class", seed=1)[0]]
    assert Counter(three) == {"a": 3, "b": 3, "c": 2, None: 1}
    assert three == sorted(three, key=lambda x: (x is None, x or ""))  # class by class
    few = sample_rows(t, 2, "per_class", seed=1)[0]
    assert len(few) == 2 and len({r["label"] for r in few}) == 2  # more classes than thumbnails: one each

    grid = contact_sheet(t, str(tmp_path / "sheet.html"), limit=12, size=16, sample="per_class", seed=1)
    assert len(grid) == 9 and all(th.jpeg_b64 for th in grid.thumbs)
    assert "up to 3 rows of each class at random (seed 1)" in (tmp_path / "sheet.html").read_text()
    out = tmp_path / "cli.html"
    assert main(["inspect", t.uri, "--sample", "per_class", "--seed", "1", "--limit", "12", "--html", str(out),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["thumbnails"] == 9

    with pytest.raises(ConfigError, match="sample='shuffled'.*first, random, per_class"):
        sample_rows(t, 6, "shuffled")
    with pytest.raises(ConfigError, match="seed='1'"):
        sample_rows(t, 6, "random", "1")
