"""Split folders at ingest: a collection laid out ``train/<class>/...``, ``Validation/``, ``test/`` becomes one table
whose split comes from the top folder and whose label from the folder below; re-ingest, curation and materialize
keep working; the layout's rules, the flag that turns it off and the refusals. Real PNG files written here."""

from __future__ import annotations

import io as _io

import numpy as np
import pytest
from dutycycle.engine.cache.materialize import materialize
from dutycycle.engine.errors import ConfigError
from dutycycle.engine.table import format as tf
from dutycycle.engine.table.catalog import ingest
from dutycycle.engine.table.split import assign_split, folder_layout
from dutycycle.engine.table.table import open_table, read_arrow
from dutycycle.engine.transform import TransformSpec
from dutycycle.trainer.app.cli import main
from PIL import Image

FILES = {  # path -> (split, label) the table must give it
    "train/cat/a0.png": ("train", "cat"),
    "train/cat/a1.png": ("train", "cat"),
    "train/dog/a2.png": ("train", "dog"),
    "train/dog/deep/a3.png": ("train", "dog"),  # deeper folders: still the class below the split folder
    "train/test/a4.png": ("train", "test"),  # a class named like a split, below a split folder: a class
    "Validation/cat/b0.png": ("val", "cat"),
    "Validation/dog/b1.png": ("val", "dog"),
    "test/dog/c0.png": ("test", "dog"),
    "test/cat/c1.png": ("test", "cat"),
    "test/c2.png": ("test", None),  # in a split folder, outside any class folder: unlabelled
    ".cache/x.png": (None, None),  # a hidden folder is not looked at: no split, no class
}


def png(seed: int, grey: bool = False) -> bytes:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (12, 10) if grey else (12, 10, 3), dtype=np.uint8)
    buf = _io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def write(root, rel: str, data: bytes) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.fixture
def source(tmp_path):
    src = tmp_path / "src"
    for k, rel in enumerate(FILES):
        write(src, rel, png(k, grey=k % 2 == 0))
    write(src, "docs/README.md", b"# notes, not images: the docs/ folder does not hide the layout\n")
    return src


def rows_by_rel(table: str, src) -> dict[str, dict]:
    prefix = str(src) + "/"
    return {r["uri"][len(prefix):]: r for r in read_arrow(table).to_pylist()}


def test_split_folders_become_the_split_column_and_re_ingest_keeps_them(source, tmp_path, capsys):
    table = str(tmp_path / "table")
    assert main(["ingest", str(source), table]) == 0  # the command line, with its progress lines
    out, err = capsys.readouterr()
    assert "ingest: split folders Validation/ -> val, test/, train/" in err
    assert "splits: test: 3, train: 5, val: 2 (from split folders Validation/ -> val, test/, train/)" in out
    rows = rows_by_rel(table, source)
    for rel, (split, label) in FILES.items():
        assert (rows[rel]["split"], rows[rel]["label"], rows[rel]["error"]) == (split, label, None), rel
    assert rows["docs/README.md"]["split"] is None and rows["docs/README.md"]["error"].startswith("not an image")
    m = tf.read_manifest(table)
    assert m.classes == ["cat", "dog", "test"] and m.options["split"] is None
    assert m.options["split_assignment"] == {"by": "folders",
                                             "folders": {"Validation": "val", "test": "test", "train": "train"}}

    # re-ingest: one file added, one deleted, one rewritten; the diff probes only those and keeps the splits
    write(source, "Validation/cat/b2.png", png(100))
    (source / "test/cat/c1.png").unlink()
    write(source, "train/cat/a0.png", png(101))
    s = ingest(str(source), table, progress_every=0)
    assert (s["version"], s["new_rows"], s["deleted"], s["modified"]) == (2, 2, 1, 1)
    rows = rows_by_rel(table, source)
    assert "test/cat/c1.png" not in rows and rows["Validation/cat/b2.png"]["split"] == "val"
    assert (rows["train/cat/a0.png"]["split"], rows["train/cat/a0.png"]["label"]) == ("train", "cat")
    assert s["splits"] == {"train": 5, "val": 3, "test": 2}
    assert tf.read_manifest(table).options["split_assignment"]["by"] == "folders"
    # nothing changed: no new version
    assert not ingest(str(source), table, progress_every=0)["committed"]

    # the same table with splits assigned another way is refused, naming the way back
    with pytest.raises(ConfigError, match=r"takes its splits from split folders .* split folders are turned off"):
        ingest(str(source), table, split_folders=False, progress_every=0)
    write(source, "misc/cat/m0.png", png(102))  # images in a folder that is no split: not split folders any more
    with pytest.raises(ConfigError, match=r"top-level folder\(s\) misc are no split names"):
        ingest(str(source), table, progress_every=0)


def test_split_is_refused_and_the_flag_turns_split_folders_off(source, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"--split 0.7,0.2,0.1 was given, but source .* split folders .* drop "
                                          r"--split, or pass --no-split-folders"):
        ingest(str(source), str(tmp_path / "t0"), split="0.7,0.2,0.1", progress_every=0)
    assert main(["ingest", str(source), str(tmp_path / "t1"), "--split", "0.5,0.5,0"]) == 2
    assert "drop --split" in capsys.readouterr().err
    assert not tf.committed_versions(str(tmp_path / "t1"))  # nothing written

    # off: labels from the first folder level, splits by content hash, as before split folders existed
    table = str(tmp_path / "flat")
    assert main(["ingest", str(source), table, "--no-split-folders", "--split", "0.5,0.5,0", "--progress-every",
                 "0"]) == 0
    assert "(by content hash (0.5,0.5,0.0))" in capsys.readouterr().out
    rows = rows_by_rel(table, source)
    for rel in FILES:
        top = rel.split("/")[0]
        assert rows[rel]["label"] == top and rows[rel]["split"] == assign_split(rows[rel]["sample_id"],
                                                                                (0.5, 0.5, 0.0)), rel
    m = tf.read_manifest(table)
    assert m.options["split_assignment"] == {"by": "hash", "fractions": [0.5, 0.5, 0.0]}
    # a re-ingest keeps the table's fractions without repeating them, and refuses the layout's splits
    write(source, "train/cat/new.png", png(200))
    assert ingest(str(source), table, split_folders=False, progress_every=0)["version"] == 2
    with pytest.raises(ConfigError, match=r"was split by content hash .* pass --no-split-folders"):
        ingest(str(source), table, progress_every=0)


def test_which_layouts_count_as_split_folders():
    assert folder_layout(["train/a/1.png", "VAL/a/2.jpg", "Test/b/3.JPG"]).splits == {
        "Test": "test", "VAL": "val", "train": "train"}
    assert folder_layout(["train/a/1.png", "valid/a/2.png"]).splits == {"train": "train", "valid": "val"}
    # a folder of images that is no split name: class folders as before, and the layout says why
    mixed = folder_layout(["train/a/1.png", "extra/2.png"])
    assert not mixed.recognised and mixed.others == ("extra",) and mixed.found == {"train": "train"}
    assert not folder_layout(["cat/1.png", "dog/2.png"]).recognised  # the common class-folder layout
    # folders without images, hidden folders and archive debris do not count; nor do files at the top
    assert folder_layout(["train/a/1.png", "notes/readme.txt", ".git/x.png", "__MACOSX/y.png", "z.png"]).recognised
    # images named without extensions: then any file counts
    assert folder_layout(["train/a/1", "test/b/2"]).recognised
    assert not folder_layout(["train/a/1", "other/b/2"]).recognised


def test_curation_and_materialize_keep_the_folder_splits(source, tmp_path):
    table = str(tmp_path / "table")
    write(source, "test/dog/copy.png", (source / "train/cat/a1.png").read_bytes())  # the same content twice
    ingest(str(source), table, progress_every=0)
    t = open_table(table)
    # (the hidden folder's image has no split: null, counted as such)
    assert t.where("split = 'test'").count() == 4
    assert t.stats()["splits"] == {"None": 1, "test": 4, "train": 5, "val": 2}
    readable = t.where("error IS NULL AND split IS NOT NULL")
    unique = readable.dedupe(exact=True, near=False)
    assert unique.count() == readable.count() - 1
    kept = unique.sample(n=6, stratify_by="split", seed=0)
    saved = kept.save(str(tmp_path / "subset"))
    assert saved.manifest.options["split_assignment"]["by"] == "folders"  # the parent's splits, kept
    assert set(r["split"] for r in read_arrow(str(tmp_path / "subset")).to_pylist()) <= {"train", "val", "test"}
    resplit = readable.resplit("0.5,0.5,0", seed=0).save(str(tmp_path / "resplit"))
    a = resplit.manifest.options["split_assignment"]
    assert a["by"] == "resplit" and a["operation"].startswith("resplit('0.5,0.5,0'") and a["before"]["by"] == "folders"

    # every split goes into the cache unless filtered
    spec = TransformSpec(size=8, mode="L")
    cache = materialize(table, str(tmp_path / "cache"), spec)
    # (the content in both train/cat/ and test/dog/ is one sample, kept under the smaller URI, test/dog/copy.png,
    # as materialize keeps one row per content; the hidden folder's image has no split: "")
    assert cache.manifest.split_counts == {"train": 4, "val": 2, "test": 4, "": 1}
    assert cache.manifest.skipped == {"table_error": 1, "duplicate": 1}
    assert cache.manifest.channel_stats["split"] == "train" and cache.manifest.channel_stats["samples"] == 4
    only = materialize(table, str(tmp_path / "cache"), spec, where="split = 'test'")
    assert only.manifest.split_counts == {"test": 4} and only.manifest.channel_stats["split"] == "all"
