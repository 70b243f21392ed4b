"""vacuum in the table's own time: a file's grace counts from when it left the table, not from its mtime, so a
reader of an older version keeps its files for the whole grace; files no version named keep the mtime rule."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import pytest
from dutycycle.engine.synth import synthesize
from dutycycle.engine.table import format as tf
from dutycycle.engine.table.catalog import ingest
from dutycycle.engine.table.table import Table, read_arrow
from dutycycle.engine.table.vacuum import vacuum
from dutycycle.trainer.app.cli import main
from PIL import Image, ImageDraw

TWO_HOURS = 2 * 3600


def _files(root) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def _backdate(root, seconds: float) -> None:
    """Make every file under ``root`` look written ``seconds`` ago."""
    then = time.time() - seconds
    for path in _files(root):
        os.utime(path, (then, then))


def _modify_one(src, seed: int) -> str:
    """Give one source image new content (a few pixels painted over), as an edit would."""
    victim = _files(src)[0]
    with Image.open(victim) as im:
        fmt, edited = im.format, im.convert("RGB")
    ImageDraw.Draw(edited).rectangle((0, 0, 3 + seed % 5, 3), fill=(seed * 37 % 256, 0, 255))
    edited.save(victim, format=fmt)
    return victim


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "src"
    synthesize(str(root), 12, seed=7)
    return root


def test_open_old_version_stays_readable_for_the_whole_grace(src, tmp_path, capsys):
    uri = str(tmp_path / "table")
    _backdate(src, TWO_HOURS)
    ingest(str(src), uri, progress_every=0)
    _backdate(uri, TWO_HOURS)  # the table was written two hours ago
    (old_file,) = tf.read_manifest(uri, 1).files
    orphan = os.path.join(uri, "v00009-deadbeef", "part-00000.parquet")  # left by a writer killed long ago
    os.makedirs(os.path.dirname(orphan))
    shutil.copy(os.path.join(uri, old_file), orphan)
    _backdate(os.path.dirname(orphan), TWO_HOURS)

    notebook = Table(uri, tf.read_manifest(uri, 1))  # a notebook holds version 1 open (a lazy Daft plan)
    before = notebook.to_arrow().sort_by("uri")
    edited = _modify_one(src, seed=8)
    second = ingest(str(src), uri, progress_every=0)
    assert second["version"] == 2 and second["modified"] == 1
    m2 = tf.read_manifest(uri)
    assert old_file not in m2.files  # copy-on-write: version 2 rewrote the file that lost a row

    # `dutycycle vacuum --keep-versions 1` with the default one-hour grace, right after the re-ingest
    assert main(["vacuum", uri, "--keep-versions", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["expired_versions"] == [1]
    assert out["removed_files"] == ["v00009-deadbeef/part-00000.parquet"]  # never committed: mtime rule
    assert os.path.exists(os.path.join(uri, old_file))  # left the table a moment ago: within its grace
    assert notebook.to_arrow().sort_by("uri").equals(before)  # the open version-1 table still reads
    assert edited in before.column("uri").to_pylist()

    # Version 2 recorded when the file left the table: its own commit time.
    assert [(r["path"], r["version"]) for r in m2.removed] == [(old_file, 2)]
    assert abs(m2.removed[0]["at"] - m2.created_at) < 1e-6 and m2.created_at > time.time() - 60
    # Still within a grace ten minutes longer than the time since it left, though its mtime is two hours old ...
    left = m2.removed[0]["at"]
    assert vacuum(uri, keep_versions=1, grace_seconds=time.time() - left + 600)["removed_files"] == []
    assert notebook.to_arrow().sort_by("uri").equals(before)
    # ... and deleted once the grace has passed since it left the table.
    time.sleep(max(0.0, left + 0.5 - time.time()))
    late = vacuum(uri, keep_versions=1, grace_seconds=0.25)
    assert late["removed_files"] == [old_file] and not os.path.exists(os.path.join(uri, old_file))
    assert read_arrow(uri).num_rows == 12  # the current version is untouched
    # The next commit stops carrying the record of a file vacuum has deleted.
    _modify_one(src, seed=9)
    ingest(str(src), uri, progress_every=0)
    m3 = tf.read_manifest(uri)
    assert old_file not in {r["path"] for r in m3.removed} and {r["version"] for r in m3.removed} == {3}


def _race_round(src, uri: str, rows: int) -> tuple[dict, list, int, int]:
    """One ingest while a reader and vacuum loop beside it; returns the ingest's summary, the loops' errors and
    how many reads and sweeps completed."""
    stop, errors, counts = threading.Event(), [], {"reads": 0, "sweeps": 0}

    def reader():
        while not stop.is_set():
            try:
                m = tf.read_manifest(uri)
                time.sleep(0.02)  # the version is open; a new one may be committed and vacuumed meanwhile
                got = read_arrow(uri, m)
                assert got.num_rows == rows == len(set(got.column("uri").to_pylist())), (m.version, got.num_rows)
                counts["reads"] += 1
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(("reader", repr(e)))
                return

    def sweeper():
        while not stop.is_set():
            try:
                vacuum(uri, keep_versions=1)
                counts["sweeps"] += 1
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(("vacuum", repr(e)))
                return

    threads = [threading.Thread(target=reader), threading.Thread(target=sweeper)]
    for t in threads:
        t.start()
    try:
        result = ingest(str(src), uri, progress_every=0)
        time.sleep(0.3)  # let both loops run against the new version too
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads)
    return result, errors, counts["reads"], counts["sweeps"]


def test_vacuum_racing_an_ingest_and_a_reader_loses_nothing(src, tmp_path):
    """Five rounds of: an ingest that rewrites a file (copy-on-write), vacuum expiring old versions in a loop
    with the default grace, and a reader that opens the newest version and reads it a moment later. The
    table's files are back-dated two hours each round, so only their removal time protects them."""
    uri = str(tmp_path / "table")
    ingest(str(src), uri, progress_every=0)
    rows = read_arrow(uri).num_rows
    deadline = time.time() + 240
    for rnd in range(5):
        _backdate(uri, TWO_HOURS)
        _modify_one(src, seed=20 + rnd)
        result, errors, reads, sweeps = _race_round(src, uri, rows)
        assert not errors, (rnd, errors)
        assert result["committed"] and result["version"] == rnd + 2 and reads and sweeps
        assert time.time() < deadline, f"round {rnd} ran past the time bound"
    # Nothing lost: the table holds exactly what a fresh ingest of the source sees.
    fresh = str(tmp_path / "fresh")
    ingest(str(src), fresh, progress_every=0)
    key = lambda r: (r["uri"], r["sample_id"], r["split"], r["error"])  # noqa: E731
    assert sorted(map(key, read_arrow(uri).to_pylist())) == sorted(map(key, read_arrow(fresh).to_pylist()))
    assert tf.committed_versions(uri) == [6]
    assert all(os.path.exists(os.path.join(uri, f)) for f in tf.read_manifest(uri).files)
