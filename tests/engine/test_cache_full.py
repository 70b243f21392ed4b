"""A full disk (or quota) while writing a cache or a table: the error names the device, the path and the bytes the
write needed; nothing is committed; no temporary file is left behind; a rerun with room finishes, keeping every
whole shard. Failures are injected at the OS call of each write in turn (fsync of the written bytes, or the
rename that publishes them), and one run fills a real file system: a tmpfs mounted for the test."""

from __future__ import annotations

import errno
import logging
import os
import re
from contextlib import contextmanager
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pytest
from dutycycle.engine import io
from dutycycle.engine.cache import format as cf
from dutycycle.engine.cache.materialize import materialize, open_cache
from dutycycle.engine.cache.reader import CacheReader
from dutycycle.engine.cache.shards import ReadConfig
from dutycycle.engine.cache.write import write_cache
from dutycycle.engine.errors import NoSpaceError
from dutycycle.engine.table import format as tf
from dutycycle.engine.table.commit import write_version
from dutycycle.engine.transform import TransformSpec

from ..support.cachemaker import make_cache
from ..support.fullfs import fill, tmpfs
from ..support.tablemaker import make_shapes_table

SPEC = TransformSpec(size=8)


def test_no_space_names_the_device_the_path_and_the_bytes(tmp_path):
    """ENOSPC and EDQUOT, raised here or as a cause; the same errors as text, after a Ray task or Daft's Rust
    writer carried them across a process boundary; anything else is not a full disk."""
    where = str(tmp_path / "x" / "f.bin")
    e = io.no_space(OSError(errno.ENOSPC, "No space left on device"), where, 1234)
    assert isinstance(e, NoSpaceError) and e.path == where and e.needed == 1234
    mount = e.device.split(" (")[0]
    assert os.path.exists(mount) and where.startswith(mount.rstrip("/") + "/")
    assert str(e).startswith(f"no space left on {e.device} at {where!r}; the write needed 1,234 bytes")
    cause = RuntimeError("wrapped")
    cause.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert str(io.no_space(cause, where)).startswith("quota exceeded on ")
    rust = RuntimeError("DaftError::ParquetError External: No space left on device (os error 28)")
    assert io.no_space(rust, "s3://bucket/t").device == "s3 storage"
    # a worker's own NoSpaceError, as text inside a Ray task error: its device, path and bytes, not the caller's
    ray = RuntimeError(f"ray::UDFProject()\ndaft.exceptions.DaftCoreException: PyO3Error NoSpaceError: {e}\n")
    got = io.no_space(ray, "/elsewhere")
    assert (got.device, got.path, got.needed, str(got)) == (e.device, where, 1234, str(e))
    assert io.no_space(OSError(errno.EACCES, "Permission denied"), where) is None
    assert io.no_space(RuntimeError("os error 2"), where) is None


@contextmanager
def failing_write(monkeypatch, pattern: str, err: int = errno.ENOSPC):
    """Make the first write to a file whose path matches ``pattern`` fail with ``err`` at the OS call: its fsync
    (the bytes are written, not yet durable) or, for files never fsynced, its publishing rename. Yields the list
    of failed paths (one, or none if the write never happened)."""
    real_fsync, real_replace, failed = os.fsync, os.replace, []

    def fsync(fd):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if not failed and re.search(pattern, path) and os.path.isfile(path):
            failed.append(path)
            raise OSError(err, os.strerror(err))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        if not failed and re.search(pattern, os.fspath(src)):
            failed.append(os.fspath(src))
            raise OSError(err, os.strerror(err))
        return real_replace(src, dst, **kw)

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", fsync)
        m.setattr(os, "replace", replace)
        yield failed


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) + ("/" if p.is_dir() else "") for p in root.rglob("*"))


def assert_nothing_half_written(root: Path) -> None:
    """No temporary file, no empty folder, every shard with its completion record, every record with its shard."""
    names = listing(root)
    assert not [n for n in names if ".tmp-" in n], names
    assert not [p for p in root.rglob("*") if p.is_dir() and not any(p.iterdir())], names
    shards = {n[:-6] for n in names if n.endswith(".arrow")}
    records = {n[:-5] for n in names if n.endswith(".json") and "/shards/" in n}
    assert shards == records, names


def assert_uncommitted(root: Path) -> None:
    assert not list(root.glob(f"*/{cf.MANIFEST}")) and not (root / cf.LATEST).exists()
    assert not list(root.glob(f"{cf.INDEX_DIR}/*")), listing(root)


def test_a_failed_write_at_each_step_of_materialize_commits_nothing_and_leaves_nothing(tmp_path, monkeypatch):
    table, _ = make_shapes_table(str(tmp_path / "data"), n=6)
    root = tmp_path / "cache"
    steps = [  # (the write that fails, what the error names): each run gets one step further
        (r"/shards/shard-00001\.arrow\.tmp-", "shard-00001.arrow"),
        (r"/shards/shard-00002\.json\.tmp-", "shard-00002.json"),  # a record: its shard is removed with it
        (rf"/{cf.INDEX_DIR}/[^/]+\.json\.tmp-", cf.INDEX_DIR),
        (rf"/{cf.MANIFEST}\.tmp-", cf.MANIFEST),
        (rf"/{cf.LATEST}\.tmp-", cf.LATEST),  # after the manifest: the manifest is taken back
    ]
    for pattern, named in steps:
        with failing_write(monkeypatch, pattern) as failed, pytest.raises(NoSpaceError) as got:
            materialize(table, str(root), SPEC, rows_per_shard=2)
        assert len(failed) == 1, pattern
        assert named in got.value.path and f"at {got.value.path!r}; the write needed" in str(got.value)
        assert got.value.needed > 0 and got.value.device
        assert_nothing_half_written(root)
        assert_uncommitted(root)
    # the second run kept shard 0, the third shards 0 and 1 (shard 2's record failed, so shard 2 went)
    res = materialize(table, str(root), SPEC, rows_per_shard=2)
    assert (res.shards_resumed, res.shards_written) == (3, 0) and not res.reused
    assert open_cache(str(root)).num_samples == 6
    assert_nothing_half_written(root)
    # a quota reads as a quota
    with failing_write(monkeypatch, rf"/{cf.LATEST}\.tmp-", errno.EDQUOT), pytest.raises(NoSpaceError,
                                                                                          match="^quota exceeded on"):
        materialize(table, str(root), TransformSpec(size=12), rows_per_shard=2)
    assert open_cache(str(root)).fingerprint == res.manifest.fingerprint  # `latest` still names the last commit


def test_a_failed_write_cache_leaves_nothing(tmp_path, monkeypatch):
    images = np.zeros((6, 2, 2, 3), np.uint8)
    for pattern in (r"/shards/shard-00002\.arrow\.tmp-", rf"/{cf.MANIFEST}\.tmp-"):
        with failing_write(monkeypatch, pattern) as failed, pytest.raises(NoSpaceError):
            write_cache(str(tmp_path / "c"), list("abcdef"), [0] * 6, ["train"] * 6, images, classes=["x"],
                        rows_per_shard=2)
        assert failed and not (tmp_path / "c").exists()


def _rows(n: int) -> pa.Table:
    cols = {name: [None] * n for name in tf.SCHEMA.names}
    cols["sample_id"] = [f"{i:032x}" for i in range(n)]
    cols["uri"] = [f"/data/{i}.png" for i in range(n)]
    return pa.table({k: pa.array(v, tf.SCHEMA.field(k).type) for k, v in cols.items()}, tf.SCHEMA)


def test_a_failed_table_write_commits_nothing_and_leaves_nothing(tmp_path, monkeypatch):
    table = tmp_path / "table"
    for pattern, named in ((r"/v00001-[0-9a-f]+/part-00000\.parquet$", "part-00000.parquet"),
                           (rf"/{tf.MANIFEST_DIR}/v00001\.json\.tmp-", "v00001.json")):
        with failing_write(monkeypatch, pattern) as failed, pytest.raises(NoSpaceError) as got:
            write_version(str(table), _rows(5), classes=["a"])
        assert len(failed) == 1 and named in got.value.path and got.value.needed != 0
        assert tf.committed_versions(str(table)) == []
        assert not [n for n in listing(table) if n.startswith("v0") or ".tmp-" in n], listing(table)
    # the pointer copy is written after the commit: the version stands, its files stay, the error is still said
    with failing_write(monkeypatch, rf"/{tf.MANIFEST}\.tmp-") as failed, pytest.raises(NoSpaceError):
        write_version(str(table), _rows(5), classes=["a"])
    assert failed and tf.committed_versions(str(table)) == [1]
    assert tf.read_manifest(str(table)).num_rows == 5 and len(tf.file_uris(str(table))) == 1
    assert not [n for n in listing(table) if ".tmp-" in n]


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 256 KiB tmpfs, mounted for the test and unmounted after (root only)."""
    with tmpfs(tmp_path / "tmpfs") as mnt:
        yield mnt


def test_a_full_file_system_during_materialize_and_reads(tmp_path, tiny_tmpfs, caplog):
    """A real full disk: materialize stops with the named error (not a corrupt cache), leaves whole shards only,
    and finishes once room is made; a table write fails the same way; a node folder too full to record a
    verified shard still reads the cache."""
    table, rows = make_shapes_table(str(tmp_path / "data"), n=12)
    root = tiny_tmpfs / "cache"
    filler = fill(tiny_tmpfs, 20 << 10)  # room for five 4 KiB pages: two shards and their records, not six
    with pytest.raises(NoSpaceError) as got:
        materialize(table, str(root), TransformSpec(size=16), rows_per_shard=2)
    assert str(got.value).startswith(f"no space left on {tiny_tmpfs} (tmpfs) at '{root}/")
    assert got.value.needed > 0
    assert_nothing_half_written(root)
    assert_uncommitted(root)
    kept = len(list(root.glob("*/shards/*.arrow")))
    assert kept >= 1, listing(root)  # whole shards stay for the rerun
    with pytest.raises(NoSpaceError, match=f"no space left on {tiny_tmpfs} "):
        write_version(str(tiny_tmpfs / "table"), _rows(20_000), classes=["a"])
    assert not [n for n in listing(tiny_tmpfs / "table") if n.startswith("v0") or ".tmp-" in n]
    filler.unlink()
    res = materialize(table, str(root), TransformSpec(size=16), rows_per_shard=2)
    assert res.shards_resumed == kept and res.manifest.num_samples == len(rows)
    # the node folder full: reading verifies every shard, cannot record it, says so and reads on
    uri = str(tmp_path / "small")
    make_cache(uri, 20, shape=(4, 4, 3), shards=2)
    node_dir = tiny_tmpfs / "node"
    node_dir.mkdir(mode=0o700)
    fill(tiny_tmpfs, 0)
    with caplog.at_level(logging.WARNING, logger="dutycycle.engine.cache.node"):
        reader = CacheReader(uri, read=ReadConfig(node_dir=str(node_dir)))
        assert sum(int(np.asarray(reader.images(i)).sum() >= 0) for i in range(reader.num_shards)) == 2
    assert reader.stats.shards_hashed == 2 and "could not record that" in caplog.text
    # a remote cache's node copy that does not fit: the node disk named, not a corrupt cache
    remote = "memory://zpp-full/cache"
    info = make_cache(remote, 20, shape=(16, 16, 3), shards=1).shards[0]
    # the disk budget as sized while there was room (by default half the free space, here none left)
    reader = CacheReader(remote, read=ReadConfig(remote="disk", node_dir=str(node_dir), disk_cache_bytes=1 << 20))
    try:
        with pytest.raises(NoSpaceError) as got:
            reader.images(0)
    finally:
        fsspec.filesystem("memory").rm("/zpp-full", recursive=True)
    assert got.value.path == os.path.join(str(node_dir), "shards", f"{info.sha256}.arrow")
    assert got.value.needed == info.bytes and str(tiny_tmpfs) in got.value.device
    assert not [n for n in listing(node_dir) if ".tmp-" in n]
