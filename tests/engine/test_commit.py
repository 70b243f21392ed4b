"""The table commit on any store: exclusive create is probed, a lost conditional write rebases, and the
`_manifest.json` copy for plain readers only moves forward."""

from __future__ import annotations

import json
import os
import threading
import time

import fsspec
import pytest
from dutycycle.engine import io
from dutycycle.engine.errors import DestinationError
from dutycycle.engine.synth import synthesize
from dutycycle.engine.table import format as tf
from dutycycle.engine.table.catalog import ingest
from dutycycle.engine.table.commit import write_version
from fsspec.implementations.memory import MemoryFileSystem


class LaxMemoryFileSystem(MemoryFileSystem):
    """A store that accepts mode "xb" without enforcing it, as fsspec's base file does on backends that never
    check it (and as an S3-compatible server that ignores If-None-Match behaves): "xb" writes like "wb"."""

    protocol = "laxmem"
    store: dict = {}
    pseudo_dirs = [""]

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("laxmem://"))

    def _open(self, path, mode="rb", *args, **kwargs):
        return super()._open(path, mode.replace("x", "w"), *args, **kwargs)

    def unstrip_protocol(self, name):
        return "laxmem://" + name.lstrip("/")


@pytest.fixture
def lax_store():
    fsspec.register_implementation("laxmem", LaxMemoryFileSystem, clobber=True)
    LaxMemoryFileSystem.store.clear()
    yield "laxmem://tables"
    LaxMemoryFileSystem.store.clear()


def test_a_store_that_does_not_enforce_exclusive_create_is_refused(lax_store, tmp_path):
    # The store really lets a second "exclusive" create replace the first: that is what would lose a commit.
    fs, path = io.filesystem(f"{lax_store}/raw/x")
    for data in (b"first", b"second"):
        with fs.open(path, "xb") as f:
            f.write(data)
    assert fs.cat_file(path) == b"second"

    with pytest.raises(DestinationError) as info:
        io.create_exclusive(f"{lax_store}/direct/_manifests/v00001.json", b"{}")
    msg = str(info.value)
    assert "laxmem://" in msg and "create-if-absent" in msg
    assert "local or shared file system" in msg and "S3 with conditional writes" in msg

    synthesize(str(tmp_path / "src"), 4, seed=0)
    with pytest.raises(DestinationError, match="laxmem://tables/t: the laxmem:// store does not enforce create-if-absent"):
        ingest(str(tmp_path / "src"), f"{lax_store}/t", progress_every=0)
    assert not tf.committed_versions(f"{lax_store}/t")  # refused before any commit
    leftovers = [p for p in LaxMemoryFileSystem.store if io.PROBE_PREFIX in p]
    assert leftovers == []  # the probe's sentinel is cleaned up


def test_probe_runs_once_per_location_and_leaves_nothing(tmp_path, monkeypatch):
    calls = []
    raw = io._create_exclusive
    monkeypatch.setattr(io, "_create_exclusive", lambda uri, data: calls.append(uri) or raw(uri, data))
    table = str(tmp_path / "t")
    for v in (1, 2, 3):
        assert io.create_exclusive(os.path.join(table, "_manifests", f"v{v}.json"), b"x", store=table)
    assert not io.create_exclusive(os.path.join(table, "_manifests", "v1.json"), b"y", store=table)
    probes = [c for c in calls if io.PROBE_PREFIX in c]
    assert len(probes) == 2 and probes[0] == probes[1]  # one sentinel, created twice, once per process
    assert not [n for _, _, fs in os.walk(table) for n in fs if n.startswith(io.PROBE_PREFIX)]


@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_pointer_copy_is_never_replaced_by_an_older_version(where, tmp_path, request):
    base = {"local": str(tmp_path), "memory": f"memory://ptr-{os.getpid()}-{time.time_ns()}"}.get(where)
    uri = f"{base or request.getfixturevalue('s3')}/table"
    first = write_version(uri, tf.SCHEMA.empty_table(), classes=[])
    second = write_version(uri, tf.SCHEMA.empty_table(), classes=[])
    assert (first.version, second.version) == (1, 2)
    pointer = io.join(uri, tf.MANIFEST)
    assert io.read_json(pointer)["version"] == 2
    fs, path = io.filesystem(io.join(uri, tf.manifest_path(1)))
    stale = fs.cat_file(path)
    assert not tf.publish_pointer(uri, 1, stale)  # a writer that committed v1 publishing late
    assert io.read_json(pointer)["version"] == 2
    assert tf.read_manifest(uri).version == 2


def test_pointer_moves_forward_when_two_commits_publish_at_once(tmp_path, monkeypatch):
    """Writer A committed v2 and is about to replace `_manifest.json` when writer B commits v3 and publishes:
    A's late write must not put v2 over v3."""
    uri = str(tmp_path / "table")
    write_version(uri, tf.SCHEMA.empty_table(), classes=[])
    v1 = tf.read_manifest(uri)
    pointer = os.path.join(uri, tf.MANIFEST)
    a_writing, written = threading.Event(), []
    real_write = io.write_bytes_atomic

    def slow_write(target, data):
        if target == pointer:
            if threading.current_thread().name == "writer-a":
                a_writing.set()
                time.sleep(1.0)  # B commits and publishes meanwhile (or waits for A, if A holds the pointer)
            written.append(json.loads(data)["version"])
        return real_write(target, data)

    monkeypatch.setattr(io, "write_bytes_atomic", slow_write)

    def commit(version, name):
        try:
            tf.commit(uri, tf.TableManifest(version=version, files=list(v1.files), num_rows=0, classes=[]))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append((name, e))

    errors: list = []
    a = threading.Thread(target=commit, args=(2, "a"), name="writer-a")
    a.start()
    assert a_writing.wait(30)
    b = threading.Thread(target=commit, args=(3, "b"), name="writer-b")
    b.start()
    a.join(30)
    b.join(30)
    assert not a.is_alive() and not b.is_alive() and not errors, errors
    assert tf.committed_versions(uri) == [1, 2, 3]
    assert json.loads(open(pointer).read())["version"] == 3
    assert written == sorted(written) and written[-1] == 3  # every replacement moved it forward


def test_s3_pointer_replace_is_conditional(s3):
    """On S3 the read and the write of the pointer are one step: a replace that landed in between makes ours
    fail its If-Match and read again."""
    uri = f"{s3}/cas/_manifest.json"
    fs, path = io.filesystem(uri)
    seen = []

    def should_replace(current):
        seen.append(current)
        if len(seen) == 1:
            fs.pipe_file(path, b'{"version": 7}')  # another writer, between our read and our write
        return io_version(current) < 5

    def io_version(current):
        return json.loads(current)["version"] if current else 0

    assert not io.replace_if(uri, b'{"version": 5}', should_replace)
    assert seen == [None, b'{"version": 7}']
    fs.invalidate_cache(path)
    assert fs.cat_file(path) == b'{"version": 7}'
    assert io.replace_if(uri, b'{"version": 8}', lambda cur: io_version(cur) < 8)
    assert fs.cat_file(path) == b'{"version": 8}'
    # The same when the object exists: our If-Match on the ETag we read fails, and we read again.
    seen.clear()

    def racing_replace(current):
        seen.append(current)
        if len(seen) == 1:
            fs.pipe_file(path, b'{"version": 10}')
        return io_version(current) < 9

    assert not io.replace_if(uri, b'{"version": 9}', racing_replace)
    assert seen == [b'{"version": 8}', b'{"version": 10}']
    fs.invalidate_cache(path)
    assert fs.cat_file(path) == b'{"version": 10}'
