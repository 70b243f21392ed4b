"""The node folder in a shared /tmp: created private, refused when someone else could have written it, and records
in it believed only when this user wrote them (anything else is hashed, fetched or rebuilt again)."""

from __future__ import annotations

import hashlib
import os
import stat
import time

import fsspec
import pytest
from dutycycle.engine.cache import format as cf
from dutycycle.engine.cache import node
from dutycycle.engine.cache.reader import CacheReader
from dutycycle.engine.cache.remote import DiskCache
from dutycycle.engine.cache.shards import ReadConfig, ReadStats
from dutycycle.engine.errors import CorruptArtifactError, DutycycleError

from ..support.cachemaker import make_cache

OTHER_UID = 65534  # "nobody": a user other than the one running the tests
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _plant(path: str, data: bytes, *, mode: int = 0o644, uid: int | None = None) -> None:
    """A record as another user (or a careless umask) would leave it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
    if uid is not None:
        os.chown(path, uid, uid)


def test_folder_is_created_private_and_records_are_written_private(tmp_path):
    root = node.node_dir(str(tmp_path / "a" / "node"))
    assert _mode(root) == 0o700
    node.write_file_atomic(os.path.join(root, "index", "x.npy"), b"x")
    assert _mode(os.path.join(root, "index", "x.npy")) == 0o600 and node.trusted(os.path.join(root, "index", "x.npy"))
    with node.file_lock(node.lock_path(root, "abcd")):
        pass
    assert _mode(node.lock_path(root, "abcd")) == 0o600


@pytest.mark.parametrize("mode", [0o777, 0o773, 0o770], ids=["777", "773", "770"])
def test_a_folder_others_can_write_is_refused_naming_it_and_the_variable(tmp_path, monkeypatch, mode):
    planted = tmp_path / "dutycycle-node-0"
    planted.mkdir()
    os.chmod(planted, mode)
    with pytest.raises(node.NodeDirError, match=rf"{planted}.*has mode {mode:o}.*DUTYCYCLE_NODE_DIR") as e:
        node.node_dir(str(planted))
    assert isinstance(e.value, DutycycleError)  # the CLI prints it on one line
    monkeypatch.setenv("DUTYCYCLE_NODE_DIR", str(planted))  # the same through the variable
    with pytest.raises(node.NodeDirError, match="DUTYCYCLE_NODE_DIR"):
        node.node_dir()
    os.chmod(planted, 0o700)  # the fix the message names
    assert node.node_dir() == str(planted)


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o711], ids=["755", "750", "711"])
def test_our_folder_that_only_we_can_write_is_made_private(tmp_path, mode):
    """Earlier releases made the folder 755: only its owner could write into it, so nothing in it is another
    user's; it is tightened to 700 and used, and its records are still judged one by one."""
    ours = tmp_path / "dutycycle-node-0"
    ours.mkdir()
    os.chmod(ours, mode)
    record = ours / "verified-abc"
    record.write_text("x")
    os.chmod(record, 0o644)
    assert node.node_dir(str(ours)) == str(ours)
    assert stat.S_IMODE(ours.stat().st_mode) == 0o700
    assert not node.trusted(str(record))  # an old 644 record is checked again, not believed


def test_a_file_in_its_place_is_refused(tmp_path):
    (tmp_path / "node").write_bytes(b"")
    with pytest.raises(node.NodeDirError, match="is not a directory"):
        node.node_dir(str(tmp_path / "node"))


@needs_root
def test_a_folder_owned_by_another_user_is_refused(tmp_path):
    planted = tmp_path / "node"
    planted.mkdir(mode=0o700)
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(node.NodeDirError, match=rf"{planted}.*owned by uid {OTHER_UID}.*DUTYCYCLE_NODE_DIR"):
        node.node_dir(str(planted))
    # nor may it be reached through a link another user planted, even one that leads to a folder of ours
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(ours)
    os.lchown(link, OTHER_UID, OTHER_UID)
    with pytest.raises(node.NodeDirError, match="symlink owned by uid"):
        node.node_dir(str(link))


def _corrupt_in_place(path: str) -> None:
    """Flip one byte in the middle: same size, new content."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def _planted_marker(root: str, path: str, sha256: str) -> str:
    """Where ``verify_once`` looks for the record of ``path`` at its current version."""
    return node._marker(root, node._version_key(path, os.stat(path), sha256, root))


@pytest.mark.parametrize("owner", ["other user", "loose mode", "symlink"])
def test_a_planted_verified_marker_does_not_vouch_for_a_corrupted_shard(tmp_path, owner):
    if owner == "other user" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    uri, root = str(tmp_path / "cache"), node.node_dir(str(tmp_path / "node"))
    make_cache(uri, 90, shards=3)
    info = cf.read_manifest(uri).shards[1]
    shard = os.path.join(uri, info.path)
    _corrupt_in_place(shard)
    marker = _planted_marker(root, shard, info.sha256)  # exactly the record an honest hash would have left
    if owner == "other user":
        _plant(marker, shard.encode(), mode=0o600, uid=OTHER_UID)
    elif owner == "loose mode":
        _plant(marker, shard.encode(), mode=0o666)
    else:
        _plant(str(tmp_path / "elsewhere"), shard.encode(), mode=0o600)
        os.makedirs(os.path.dirname(marker))
        os.symlink(tmp_path / "elsewhere", marker)
    assert node.verify_once(shard, info.sha256, info.bytes, root) == (False, True)  # hashed again: refused
    reader = CacheReader(uri, read=ReadConfig(node_dir=root))
    reader.images(0)
    with pytest.raises(CorruptArtifactError, match=r"shard-00001\.arrow.*fails its checksum"):
        reader.images(1)
    # an intact shard's record, once rewritten by this user, is believed again (hashed once, not every time)
    good = cf.read_manifest(uri).shards[2]
    path = os.path.join(uri, good.path)
    _plant(_planted_marker(root, path, good.sha256), path.encode(), mode=0o644)
    assert node.verify_once(path, good.sha256, good.bytes, root) == (True, True)
    assert node.verify_once(path, good.sha256, good.bytes, root) == (True, False)


def test_a_shard_rewritten_in_place_with_its_mtime_set_back_is_hashed_again(tmp_path):
    """A verified shard rewritten in place (same inode, same size) whose modification time is then set back, as
    ``cp -p``, ``touch -d`` or ``os.utime`` do, kept its record when the key ignored ctime: the reader believed
    it and served the new bytes. No call sets ctime back, so the record no longer matches and the shard is
    hashed again, and refused."""
    uri, root = str(tmp_path / "cache"), node.node_dir(str(tmp_path / "node"))
    make_cache(uri, 90, shards=3)
    info = cf.read_manifest(uri).shards[1]
    shard = os.path.join(uri, info.path)
    assert node.verify_once(shard, info.sha256, info.bytes, root) == (True, True)
    assert node.verify_once(shard, info.sha256, info.bytes, root) == (True, False)  # recorded
    before = os.stat(shard)
    time.sleep(0.05)  # file times come from the kernel's coarse clock (a tick of up to 10 ms): let it move
    _corrupt_in_place(shard)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(shard)
    assert (after.st_dev, after.st_ino, after.st_size, after.st_mtime_ns) == \
        (before.st_dev, before.st_ino, before.st_size, before.st_mtime_ns)
    assert after.st_ctime_ns != before.st_ctime_ns
    assert node.verify_once(shard, info.sha256, info.bytes, root) == (False, True)  # hashed again: refused
    reader = CacheReader(uri, read=ReadConfig(node_dir=root))
    with pytest.raises(CorruptArtifactError, match=r"shard-00001\.arrow.*fails its checksum"):
        reader.images(1)


@pytest.mark.parametrize("owner", ["other user", "loose mode"])
def test_a_planted_node_copy_of_a_remote_shard_is_fetched_again(tmp_path, owner):
    if owner == "other user" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    root = node.node_dir(str(tmp_path / "node"))
    remote = tmp_path / "remote.arrow"
    remote.write_bytes(os.urandom(4096))
    sha = hashlib.sha256(remote.read_bytes()).hexdigest()
    disk = DiskCache(root, None, ReadStats())
    local = disk.path_for(sha)
    forged = bytearray(remote.read_bytes())
    forged[100] ^= 0xFF
    _plant(local, bytes(forged), mode=0o600 if owner == "other user" else 0o644,
           uid=OTHER_UID if owner == "other user" else None)
    _plant(_planted_marker(root, local, sha), local.encode(), mode=0o600,
           uid=OTHER_UID if owner == "other user" else None)
    got = disk.fetch(fsspec.filesystem("file"), str(remote), sha, 4096)
    assert got == local and open(got, "rb").read() == remote.read_bytes()  # the real bytes, fetched again
    assert node.trusted(got) and disk.stats.shards_downloaded == 1
    assert node.verify_once(got, sha, 4096, root) == (True, False)  # its own record came with it


def test_a_planted_memory_ledger_is_not_believed(tmp_path):
    import json

    from dutycycle.loader import budget

    root = node.node_dir(str(tmp_path / "node"))
    ledger = os.path.join(root, "memory-ledger.json")
    _plant(ledger, json.dumps({"hog": {"bytes": 10**12, "pids": [os.getpid()]}}).encode(), mode=0o666)
    assert budget.reserved_bytes(root) == 0
    assert budget.reserve("mine", 100, 1000, shared=True, root=root).granted
    assert budget.reserved_bytes(root) == 100 and node.trusted(ledger)
    budget.release("mine", root)
