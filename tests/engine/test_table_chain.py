"""A table manifest is checked against its place: its version must be the one its file name says, and it must
chain to the manifest of the version before it. Each forged manifest below is a real, valid, sealed manifest (an
older version of the same table, or another table's), so its own checksum passes: only these checks refuse it.
Without them a reader takes the forged rows and vacuum deletes the real newest version's files."""

from __future__ import annotations

import json
import os
import shutil
import time

import pyarrow as pa
import pytest
from dutycycle.engine import sealed
from dutycycle.engine.errors import CorruptArtifactError, DestinationError
from dutycycle.engine.table import format as tf
from dutycycle.engine.table.commit import write_version
from dutycycle.engine.table.table import read_arrow
from dutycycle.engine.table.vacuum import vacuum
from dutycycle.trainer.app.cli import main

TWO_HOURS = 2 * 3600


def _rows(start: int, n: int) -> pa.Table:
    """``n`` table rows (nulls where a test needs no value), sample ids counting from ``start``."""
    cols: dict[str, list] = {name: [None] * n for name in tf.SCHEMA.names}
    cols.update(sample_id=[f"{i:032x}" for i in range(start, start + n)],
                uri=[f"file:///images/{i}.png" for i in range(start, start + n)], label=["a"] * n, split=["train"] * n)
    return pa.table({name: pa.array(cols[name], tf.SCHEMA.field(name).type) for name in tf.SCHEMA.names}, tf.SCHEMA)


def _table(uri: str, versions: int) -> list[tf.TableManifest]:
    """A table of ``versions`` versions, version k holding rows [0, 2k) in files of its own, all written two
    hours ago: only a manifest naming them keeps them from vacuum's default grace."""
    made = [write_version(uri, _rows(0, 2 * k), classes=["a"]) for k in range(1, versions + 1)]
    then = time.time() - TWO_HOURS
    for d, _, names in os.walk(uri):
        for name in names:
            os.utime(os.path.join(d, name), (then, then))
    return made


def _files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_an_older_manifest_copied_over_the_newest_is_refused_and_vacuum_keeps_the_newest_files(tmp_path, capsys):
    uri = str(tmp_path / "t")
    v1, v2, v3 = _table(uri, 3)
    newest = os.path.join(uri, tf.manifest_path(3))
    original = open(newest, "rb").read()
    shutil.copy(os.path.join(uri, tf.manifest_path(2)), newest)  # an older backup restored over the newest
    before = _files(uri)
    for read in (lambda: tf.read_manifest(uri), lambda: tf.read_manifest(uri, 3), lambda: read_arrow(uri),
                 lambda: vacuum(uri)):
        with pytest.raises(CorruptArtifactError, match=r"v00003\.json' holds version 2, not the version 3 its name"):
            read()
    assert main(["vacuum", uri, "--keep-versions", "1"]) == 2
    assert "holds version 2" in capsys.readouterr().err
    assert _files(uri) == before  # nothing expired, nothing deleted: version 3's files are all there
    assert set(v3.files) <= set(before)

    open(newest, "wb").write(original)  # the real version 3 back: the table reads as it did
    assert tf.read_manifest(uri).version == 3 and read_arrow(uri).num_rows == 6
    swept = vacuum(uri, keep_versions=1)
    # versions 1 and 2 expire; their files left the table at versions 2 and 3's commits, moments ago: kept
    assert swept["expired_versions"] == [1, 2] and swept["removed_files"] == [] and swept["kept_recent"] == 2
    assert all(os.path.exists(os.path.join(uri, f)) for f in v1.files + v2.files + v3.files)
    assert read_arrow(uri).num_rows == 6


def test_a_manifest_from_another_table_breaks_the_chain(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    *_, a3 = _table(a, 3)
    _, b2 = _table(b, 2)
    # The chain is recorded at the commit: each version carries the digest of the one before.
    assert a3.previous_sha256 == json.loads(open(os.path.join(a, tf.manifest_path(2))).read())["manifest_sha256"]
    assert tf.read_manifest(a, 1).previous_sha256 is None

    target = os.path.join(a, tf.manifest_path(2))
    original = open(target, "rb").read()
    shutil.copy(os.path.join(b, tf.manifest_path(2)), target)  # version 2, valid and sealed, but b's
    for read, names in ((lambda: tf.read_manifest(a), "v00003.json does not chain to _manifests/v00002.json"),
                        (lambda: tf.read_manifest(a, 2), "v00002.json does not chain to _manifests/v00001.json"),
                        (lambda: vacuum(a), "does not chain")):
        with pytest.raises(CorruptArtifactError, match=names) as e:
            read()
        assert "replaced after its commit" in str(e.value) and a in str(e.value)
    open(target, "wb").write(original)
    # Nor does a commit chain onto one: b's newest replaced by a's version 2, the next commit to b is refused.
    b_newest = os.path.join(b, tf.manifest_path(2))
    b_original = open(b_newest, "rb").read()
    shutil.copy(target, b_newest)
    with pytest.raises(CorruptArtifactError, match="v00002.json does not chain to _manifests/v00001.json"):
        tf.commit(b, tf.TableManifest(version=3, files=b2.files, num_rows=4, classes=["a"]))
    open(b_newest, "wb").write(b_original)
    assert tf.committed_versions(b) == [1, 2]
    assert tf.read_manifest(a).version == 3 and read_arrow(a).num_rows == 6

    # Expired by vacuum, the parent is no longer there to check against: the version still reads.
    os.remove(os.path.join(a, tf.manifest_path(2)))
    assert tf.read_manifest(a).version == 3
    # A version after 1 that claims no parent (its checksum made again) is refused on its own.
    d = json.loads(open(os.path.join(a, tf.manifest_path(3))).read())
    d["previous_sha256"] = None
    open(os.path.join(a, tf.manifest_path(3)), "w").write(json.dumps(sealed.seal(d)))
    with pytest.raises(CorruptArtifactError, match="`previous_sha256` is None at version 3"):
        tf.read_manifest(a)
    # A manifest committed before versions chained has no such field: read (unchained), and the next commit chains
    # to it, so tables written then stay readable and writable.
    del d["previous_sha256"]
    open(os.path.join(a, tf.manifest_path(3)), "w").write(json.dumps(sealed.seal(d)))
    assert tf.read_manifest(a).version == 3 and tf.read_manifest(a).previous_sha256 is None
    a4 = tf.TableManifest(version=4, files=tf.read_manifest(a).files, num_rows=6, classes=["a"])
    tf.commit(a, a4)
    sha3 = json.loads(open(os.path.join(a, tf.manifest_path(3))).read())["manifest_sha256"]
    assert tf.read_manifest(a).version == 4 and tf.read_manifest(a).previous_sha256 == sha3

    # A damaged manifest before the newest leaves the chain unchecked: refused, saying how to go on.
    first = os.path.join(b, tf.manifest_path(1))
    damaged = open(first).read().replace('"num_rows": 2', '"num_rows": 3')
    open(first, "w").write(damaged)
    with pytest.raises(CorruptArtifactError, match=r"version 2 cannot be checked against the version before it.*"
                                                   r"fails its own checksum.*delete it to expire version 1"):
        tf.read_manifest(b)
    os.remove(first)
    assert tf.read_manifest(b) == b2 and read_arrow(b).num_rows == 4


def test_a_table_with_only_its_manifest_copy_keeps_its_files(tmp_path):
    """A table whose versioned manifests are gone (copied without them) still reads from ``_manifest.json``:
    vacuum keeps the files that copy names."""
    uri = str(tmp_path / "t")
    (m,) = _table(uri, 1)
    shutil.rmtree(os.path.join(uri, tf.MANIFEST_DIR))
    assert read_arrow(uri).num_rows == 2
    assert vacuum(uri)["removed_files"] == []
    assert read_arrow(uri).num_rows == 2 and all(os.path.exists(os.path.join(uri, f)) for f in m.files)
    os.utime(os.path.join(uri, m.files[0]))  # written just now: the copy's own version, no write in progress
    assert vacuum(uri, grace_seconds=0, allow_short_grace=True)["removed_files"] == []


def test_a_commit_names_new_files_only_in_its_own_folder_and_only_canonical_names_are_versions(tmp_path):
    uri = str(tmp_path / "t")
    (v1,) = _table(uri, 1)
    stray = "v00001-0000beef/part-00000.parquet"  # an older version's folder: vacuum could not see it in progress
    os.makedirs(os.path.join(uri, os.path.dirname(stray)))
    shutil.copy(os.path.join(uri, v1.files[0]), os.path.join(uri, stray))
    with pytest.raises(DestinationError, match=r"version 2 would name the data file 'v00001-0000beef/part-00000"
                                               r"\.parquet'.*format\.data_dir\(2\)"):
        tf.commit(uri, tf.TableManifest(version=2, files=[*v1.files, stray], num_rows=4, classes=["a"]))
    assert tf.committed_versions(uri) == [1]
    # Names other than the ones manifest_path gives are no versions, so no reader takes them for the newest.
    shutil.copy(os.path.join(uri, tf.manifest_path(1)), os.path.join(uri, tf.MANIFEST_DIR, "v000007.json"))
    shutil.copy(os.path.join(uri, tf.manifest_path(1)), os.path.join(uri, tf.MANIFEST_DIR, "v7.json"))
    assert tf.committed_versions(uri) == [1] and tf.read_manifest(uri).version == 1
