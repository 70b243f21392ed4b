"""A path read from a manifest is data, not a command: absolute paths, `..` and symlinks out of the root are refused.

Each hostile manifest below names a real, valid file outside its artifact (a Parquet file, an Arrow shard with
the right checksum), so without the check the reader would happily open it: the refusal is the only thing
that makes these tests pass. A hostile manifest's author can compute its checksum too, so each is sealed again
(``seal``): the path check, not the checksum, refuses it.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from dutycycle.engine import io, sealed
from dutycycle.engine.cache import format as cf
from dutycycle.engine.cache.materialize import materialize, open_cache
from dutycycle.engine.errors import CorruptArtifactError
from dutycycle.engine.table import format as tf
from dutycycle.engine.table.table import open_table, read_arrow
from dutycycle.engine.transform import TransformSpec

from ..support.cachemaker import make_cache
from ..support.tablemaker import make_shapes_table


@pytest.mark.parametrize("rel", ["a.parquet", "v00001-ab/part-00000.parquet", "x/../y.arrow", "./z"])
def test_relative_paths_inside_the_root_resolve(tmp_path, rel):
    assert io.resolve_inside(str(tmp_path), rel) == os.path.normpath(os.path.join(str(tmp_path), rel))
    assert io.resolve_inside("s3://bucket/t", rel).startswith("s3://bucket/t/")


@pytest.mark.parametrize(
    "rel, why",
    [("../x.parquet", "leaves the root"), ("a/../../x", "leaves the root"), ("..", "leaves the root"),
     ("/etc/passwd", "is absolute"), ("s3://other/x", "is absolute"), ("", "is empty"), ("a\x00b", "NUL"),
     ("C:/x", "is absolute")],
)
def test_paths_leaving_the_root_are_refused(tmp_path, rel, why):
    with pytest.raises(CorruptArtifactError, match=why) as info:
        io.resolve_inside(str(tmp_path), rel, "table")
    assert repr(rel) in str(info.value) and "recreate it" in str(info.value)


def _rewrite_table_manifest(table: str, files: list[str]) -> None:
    for name in (tf.manifest_path(1), tf.MANIFEST):
        path = os.path.join(table, name)
        d = json.loads(open(path).read())
        d["files"] = files
        open(path, "w").write(json.dumps(sealed.seal(d)))


@pytest.mark.parametrize("hostile", ["../../outside.parquet", "{abs}"])
def test_table_manifest_naming_a_file_outside_is_refused(tmp_path, hostile):
    table, _ = make_shapes_table(str(tmp_path / "data"), n=3)
    outside = tmp_path / "outside.parquet"  # a valid table file, just not this table's
    shutil.copy(os.path.join(table, tf.read_manifest(table).files[0]), outside)
    rel = hostile.replace("{abs}", str(outside))
    assert os.path.exists(os.path.normpath(os.path.join(table, rel)))
    _rewrite_table_manifest(table, [rel])
    for action in (lambda: tf.read_manifest(table), lambda: open_table(table), lambda: read_arrow(table),
                   lambda: materialize(table, str(tmp_path / "cache"), TransformSpec(size=8))):
        with pytest.raises(CorruptArtifactError, match="outside|leaves the root|is absolute"):
            action()


def test_cache_manifest_naming_a_shard_outside_is_refused(tmp_path):
    cache = tmp_path / "cache"
    m = make_cache(str(cache), n=12, shards=2)
    outside = tmp_path / "elsewhere.arrow"  # a byte-identical shard (checksum matches) outside the cache
    shutil.copy(cache / m.shards[0].path, outside)
    for rel in ("../elsewhere.arrow", str(outside)):
        d = json.loads((cache / cf.MANIFEST).read_text())
        d["shards"][0]["path"] = rel
        (cache / cf.MANIFEST).write_text(json.dumps(sealed.seal(d)))
        with pytest.raises(CorruptArtifactError, match="elsewhere.arrow"):
            open_cache(str(cache))


def test_cache_shard_symlinked_outside_is_refused(tmp_path):
    cache = tmp_path / "cache"
    m = make_cache(str(cache), n=12, shards=2)
    outside = tmp_path / "elsewhere.arrow"
    shard = cache / m.shards[1].path
    shutil.move(shard, outside)
    os.symlink(outside, shard)
    with pytest.raises(CorruptArtifactError, match="through a symlink"):
        open_cache(str(cache))


def test_cache_root_pointers_are_data_not_paths(tmp_path):
    """`latest` and the reuse index name fingerprint folders; one naming a folder outside the root is refused."""
    table, _ = make_shapes_table(str(tmp_path / "data"), n=4)
    root = tmp_path / "cache"
    res = materialize(table, str(root), TransformSpec(size=8))
    stolen = tmp_path / "stolen"
    shutil.copytree(res.uri, stolen)  # a committed cache outside the root
    (root / cf.LATEST).write_text("../stolen\n")
    with pytest.raises(CorruptArtifactError, match="stolen"):
        open_cache(str(root))
    (index,) = (root / cf.INDEX_DIR).iterdir()
    index.write_text(json.dumps({"fingerprint": "../stolen"}))
    with pytest.raises(CorruptArtifactError, match="stolen"):
        materialize(table, str(root), TransformSpec(size=8))
