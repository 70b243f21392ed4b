"""vacuum in the table's own time: a file's grace counts from when it left the table, not from its mtime, so a
reader of an older version keeps its files for the whole grace; files no version named keep the mtime rule. It
refuses to run while a write is in progress, and a grace under the minimum only when told to."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import pytest
from dutycycle.engine import io
from dutycycle.engine.errors import ConfigError
from dutycycle.engine.synth import synthesize
from dutycycle.engine.table import format as tf
from dutycycle.engine.table.catalog import ingest
from dutycycle.engine.table.commit import try_commit, write_rows, write_version
from dutycycle.engine.table.table import Table, read_arrow
from dutycycle.engine.table.vacuum import MIN_GRACE_SECONDS, WriteInProgress, vacuum
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
    late = vacuum(uri, keep_versions=1, grace_seconds=0.25, allow_short_grace=True)
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
    stop, errors, counts = threading.Event(), [], {"reads": 0, "sweeps": 0, "refused": 0}

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
            except WriteInProgress:
                counts["refused"] += 1  # the ingest was between its first data write and its commit
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


def test_a_grace_under_the_minimum_needs_allow_short_grace(tmp_path, capsys):
    uri = str(tmp_path / "table")
    with pytest.raises(ConfigError, match=r"--grace-seconds 0 is below the minimum of 600: .*--allow-short-grace"):
        vacuum(uri, grace_seconds=0)  # refused before the table is even looked at
    assert MIN_GRACE_SECONDS == 600
    with pytest.raises(ConfigError, match="--grace-seconds nan must be a number >= 0"):
        vacuum(uri, grace_seconds=float("nan"), allow_short_grace=True)
    assert main(["vacuum", uri, "--grace-seconds", "599.5"]) == 2
    assert "599.5 is below the minimum of 600" in capsys.readouterr().err


def test_vacuum_during_an_ingest_refuses_and_the_ingest_commits_a_readable_version(src, tmp_path, monkeypatch, capsys):
    """`dutycycle vacuum --grace-seconds 0` while a real ingest has written its data files and not yet
    committed: vacuum refuses and deletes nothing, and the version the ingest then commits reads whole."""
    uri = str(tmp_path / "table")
    ingest(str(src), uri, progress_every=0)
    _backdate(uri, TWO_HOURS)
    _modify_one(src, seed=3)  # the next ingest writes a new row and a rewrite of the file that held the old one
    written, go, real_commit = threading.Event(), threading.Event(), tf.commit

    def paused_commit(table, manifest):  # the real commit, held until the main thread has run vacuum
        written.set()
        assert go.wait(60)
        return real_commit(table, manifest)

    monkeypatch.setattr(tf, "commit", paused_commit)
    result: dict = {}
    writer = threading.Thread(target=lambda: result.update(ingest(str(src), uri, progress_every=0)))
    writer.start()
    try:
        assert written.wait(60)
        (folder,) = [d for d in os.listdir(uri) if d.startswith("v00002-")]
        before = _files(uri)
        assert main(["vacuum", uri, "--grace-seconds", "0", "--allow-short-grace", "--keep-versions", "1"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{folder}/ holds files no version has committed" in err, err
        with pytest.raises(WriteInProgress, match="run it after the write commits"):
            vacuum(uri)  # the default grace too: a write in progress is refused whatever the grace
        assert _files(uri) == before and tf.committed_versions(uri) == [1]
    finally:
        go.set()
        writer.join(60)
    assert result["committed"] and result["version"] == 2
    assert read_arrow(uri).num_rows == 12 and tf.read_manifest(uri).version == 2
    (rewritten,) = tf.read_manifest(uri, 1).files  # version 2 copied it without the modified file's row
    swept = vacuum(uri, grace_seconds=0, allow_short_grace=True, keep_versions=1)
    assert swept["removed_files"] == [rewritten] and read_arrow(uri).num_rows == 12


def test_a_folder_above_the_newest_version_is_a_write_in_progress_until_silent(src, tmp_path):
    """A streaming writer's folder (its first part written two hours ago, its latest just now) stops vacuum
    whatever the grace; a killed writer's folder (silent for longer than the minimum grace) is removed, and if
    that writer comes back its commit is refused instead of naming files that are gone."""
    uri = str(tmp_path / "table")
    ingest(str(src), uri, progress_every=0)
    rows, v1 = read_arrow(uri), tf.read_manifest(uri)
    _backdate(uri, TWO_HOURS)
    folder = tf.data_dir(2)
    files = write_rows(uri, folder, [rows.slice(0, 6), rows.slice(6)])
    os.utime(os.path.join(uri, files[0]), (time.time() - TWO_HOURS,) * 2)
    streaming = tf.TableManifest(version=2, files=files, num_rows=12, classes=v1.classes, options=v1.options)
    for grace in (3600, 0):
        with pytest.raises(WriteInProgress, match=rf"{folder}/ holds files no version has committed, written \d+ s ago"):
            vacuum(uri, grace_seconds=grace, allow_short_grace=True)
    assert try_commit(uri, folder, streaming) and read_arrow(uri).num_rows == 12

    killed = tf.data_dir(3)
    gone = write_rows(uri, killed, [rows])
    _backdate(os.path.join(uri, killed), MIN_GRACE_SECONDS + 60)
    assert vacuum(uri)["kept_recent"] == 1  # not in progress any more, but within the default grace of an hour
    swept = vacuum(uri, grace_seconds=MIN_GRACE_SECONDS)
    assert swept["removed_files"] == gone and swept["kept_recent"] == 0
    late = tf.TableManifest(version=3, files=gone, num_rows=12, classes=v1.classes, options=v1.options)
    assert not try_commit(uri, killed, late)  # its files are gone: it writes them again instead
    assert tf.committed_versions(uri) == [1, 2] and read_arrow(uri).num_rows == 12

    # A manifest's temporary file: a local commit between its write and its link.
    tmp = os.path.join(uri, tf.MANIFEST_DIR, "v00003.json.tmp-" + "ab" * 16)
    open(tmp, "wb").write(b"{}")
    with pytest.raises(WriteInProgress, match=r"_manifests/ is being committed"):
        vacuum(uri)
    _backdate(os.path.join(uri, tf.MANIFEST_DIR), TWO_HOURS)
    assert vacuum(uri)["removed_files"] == ["_manifests/v00003.json.tmp-" + "ab" * 16]


def test_a_write_in_progress_on_s3(s3):
    """The same rules on an object store: the in-progress folder is seen through the objects' LastModified, and
    a commit whose objects are gone is refused rather than committed."""
    uri = f"{s3}/table"
    rows = tf.SCHEMA.empty_table()
    v1 = write_version(uri, rows, classes=[])
    folder = tf.data_dir(2)
    files = write_rows(uri, folder, [rows])
    with pytest.raises(WriteInProgress, match=rf"{folder}/ holds files no version has committed, written \d+ s ago"):
        vacuum(uri, grace_seconds=0, allow_short_grace=True)
    fs, path = io.filesystem(io.join(uri, folder))
    fs.rm(path, recursive=True)  # as a vacuum that took the writer for a killed one would
    assert not try_commit(uri, folder, tf.TableManifest(version=2, files=files, num_rows=0, classes=[]))
    assert tf.committed_versions(uri) == [1] and tf.read_manifest(uri) == v1
    assert vacuum(uri, grace_seconds=0, allow_short_grace=True)["removed_files"] == []
    assert read_arrow(uri).num_rows == 0
