"""Every engine artifact carries ``"format": 1``: a table or cache manifest of another format, or of none, is
refused naming the file and the version found (sealed again, so only the format check can refuse it); one
missing a field, or its checksum, is refused too (nothing is read as an earlier shape)."""

from __future__ import annotations

import json
import os

import pytest
from dutycycle.engine import formats, sealed
from dutycycle.engine.cache import format as cf
from dutycycle.engine.errors import CorruptArtifactError, FormatError
from dutycycle.engine.table import format as tf

from ..support.cachemaker import make_cache


def _table(tmp_path) -> tuple[str, str]:
    uri = str(tmp_path / "table")
    tf.commit(uri, tf.TableManifest(version=1, files=[], num_rows=0, classes=[]))
    return uri, os.path.join(uri, tf.manifest_path(1))


def _cache(tmp_path) -> tuple[str, str]:
    uri = str(tmp_path / "cache")
    make_cache(uri, 20, shards=2)
    return uri, os.path.join(uri, cf.MANIFEST)


def _rewrite(path: str, change) -> None:
    d = json.loads(open(path).read())
    change(d)
    open(path, "w").write(json.dumps(sealed.seal(d)))


READERS = {"table": (_table, lambda uri: tf.read_manifest(uri, 1)), "cache": (_cache, cf.read_manifest)}


def test_artifacts_are_written_at_format_1(tmp_path):
    for make, read in READERS.values():
        uri, path = make(tmp_path)
        assert json.loads(open(path).read())["format"] == formats.FORMAT == 1
        assert read(uri).format == 1


@pytest.mark.parametrize("kind", sorted(READERS))
@pytest.mark.parametrize("found, said", [(2, "has format 2"), ("1", "has format '1'"), (None, "has no `format` field")])
def test_another_format_is_refused_naming_the_file_and_the_version(tmp_path, kind, found, said):
    make, read = READERS[kind]
    uri, path = make(tmp_path)
    _rewrite(path, lambda d: d.pop("format") if found is None else d.update(format=found))
    with pytest.raises(FormatError, match=rf"{os.path.basename(path)}'? {said}; this dutycycle reads format 1 only: "
                                          "re-create it with this version of dutycycle") as e:
        read(uri)
    assert path in str(e.value) and isinstance(e.value, CorruptArtifactError)


@pytest.mark.parametrize("kind, field", [("table", "removed"), ("table", "writer"), ("cache", "skipped"),
                                         ("cache", "options")])
def test_a_manifest_missing_a_field_is_refused_naming_it(tmp_path, kind, field):
    make, read = READERS[kind]
    uri, path = make(tmp_path)
    _rewrite(path, lambda d: d.pop(field))
    with pytest.raises(CorruptArtifactError, match=f"`{field}`"):
        read(uri)


def test_a_shard_entry_without_its_piecewise_checksums_is_refused(tmp_path):
    uri, path = _cache(tmp_path)
    _rewrite(path, lambda d: [s.pop("chunk_sha256") for s in d["shards"]])
    with pytest.raises(CorruptArtifactError, match="lacks `chunk_sha256`"):
        cf.read_manifest(uri)


@pytest.mark.parametrize("kind", sorted(READERS))
def test_a_manifest_without_its_checksum_is_refused(tmp_path, kind):
    make, read = READERS[kind]
    uri, path = make(tmp_path)
    d = json.loads(open(path).read())
    del d[sealed.MANIFEST_DIGEST]
    open(path, "w").write(json.dumps(d))
    with pytest.raises(CorruptArtifactError, match=f"has no checksum \\({sealed.MANIFEST_DIGEST}\\)"):
        read(uri)


def test_the_check_names_what_it_found():
    formats.check({"format": 1}, "x")
    for d, said in (([], "is not a JSON object"), ({"format": True}, "has format True"),
                    ({"format": 1.0}, "has format 1.0")):
        with pytest.raises(FormatError, match=f"^x {said}; "):
            formats.check(d, "x")
    assert formats.stamp({"a": 1, "format": 7}) == {"format": 1, "a": 1}
