"""The commit record of a checkpoint: ``manifest.json``, written last, naming every file with its size and BLAKE3
checksum, and carrying ``"format": 1`` (``engine.formats``: another format is refused).

A checkpoint is one directory per step, ``CHECKPOINT_DIR/step-00000012/``::

    __0_0.distcp, __1_0.distcp   each rank's shard of model and optimizer state (DCP, torch.save format)
    .metadata                    DCP's own index (a pickle; kept for plain DCP readers, never read here)
    metadata.json                the same index as JSON: what dutycycle's loads read (storage.py)
    trainer_state.json           step, epoch, loader position, RNG per rank, schedule, config, data lineage
    manifest.json                written last, by rank 0, once every rank's files are written: the commit

No manifest, no checkpoint: a directory without one (a save that was killed, a hand-made folder) is ignored.
DCP's ``.metadata`` is not enough as a commit marker: it holds no checksums (flipped bytes in a shard load as a
silently wrong tensor), and rewriting a directory in place is not atomic. Removing a checkpoint deletes its
manifest first, so a removal that is interrupted leaves an ignored directory, never a committed partial one.

A file name read from a manifest is data: it must be a plain name inside the step directory (no separators, no
``..``), or the checkpoint is refused.

Why BLAKE3: every byte of a save is hashed while it is written, on the core the save shares with training. On this
2-core machine sha256 hashed 0.98 GB/s and BLAKE3 4.1 GB/s (one thread, 256 MB), and a background write of 330 MB
took 0.68 CPU-seconds with sha256 against 0.37 with BLAKE3 (the rest is the copy into storage). It stays a
cryptographic hash, so a checksum means what sha256 meant: the bytes are the ones written.
"""

from __future__ import annotations

import errno
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field

from blake3 import blake3
from dutycycle.engine import formats, io, sealed
from dutycycle.engine.errors import ConfigError, CorruptArtifactError

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
METADATA_JSON = "metadata.json"
MAX_JSON_BYTES = 64 * 1024**2  # manifests, trainer state and metadata are small; a larger file is refused unread
DIGEST = sealed.MANIFEST_DIGEST  # the manifest's checksum of its own content (every other field)
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]*$")
_CHUNK = 8 * 1024**2
ALGORITHM = "blake3"  # the checksum every file record holds, under this key


def hasher():
    """A new BLAKE3 hash object (``update``, ``hexdigest``)."""
    return blake3()


@dataclass
class FileRecord:
    size: int
    digest: str  # BLAKE3, hex

    def to_json(self) -> dict:
        return {"size": self.size, ALGORITHM: self.digest}

    @classmethod
    def from_json(cls, rec: dict) -> FileRecord:
        return cls(int(rec["size"]), str(rec[ALGORITHM]))


@dataclass
class Manifest:
    step: int
    world_size: int
    files: dict[str, FileRecord]
    format: int = formats.FORMAT
    created: float = field(default_factory=time.time)
    info: dict = field(default_factory=dict)  # what was saved, for people: strategy, stage, bytes, timings

    def to_json(self) -> dict:
        """Plain JSON, with ``manifest_sha256``: the sha256 of the rest, so a manifest changed after its commit
        (a flipped digit in a size, a step, a timing) is refused rather than trusted."""
        d = asdict(self)
        d["files"] = {k: v.to_json() for k, v in sorted(self.files.items())}
        return sealed.seal(d)

    @classmethod
    def from_json(cls, d: dict, where: str) -> Manifest:
        formats.check(d, where)
        d = sealed.unseal(d, where, "the checkpoint is refused")
        try:
            files = {}
            for name, rec in d["files"].items():
                check_name(name, where)
                files[name] = FileRecord.from_json(rec)
            return cls(step=int(d["step"]), world_size=int(d["world_size"]), files=files, format=d["format"],
                       created=float(d["created"]), info=dict(d["info"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptArtifactError(f"{where} is malformed ({type(e).__name__}: {e})") from None


def check_name(name: str, where: str) -> str:
    """A file name from a manifest or DCP index must stay inside the step directory."""
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or name in (".", "..") or name == MANIFEST:
        raise CorruptArtifactError(f"{where} names the file {name!r}, which is not a plain file name inside the "
                                   "checkpoint directory; the checkpoint is refused")
    return name


# ------------------------------------------------------------------------------------------- step directories


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    m = _STEP_DIR.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def list_steps(root: str) -> list[tuple[int, str]]:
    """``(step, uri)`` of every step directory under ``root`` (committed or not), newest first."""
    fs, path = io.filesystem(root)
    fs.invalidate_cache(path)  # object-store listings are cached per process; other processes write here
    try:
        entries = fs.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for e in entries:
        if e.get("type") != "directory":
            continue
        step = parse_step(e["name"])
        if step is not None:
            out.append((step, io.join(root, step_name(step))))
    return sorted(out, reverse=True)


def is_committed(step_uri: str) -> bool:
    fs, path = io.filesystem(step_uri)
    fs.invalidate_cache(path)
    return fs.exists(f"{path.rstrip('/')}/{MANIFEST}")


def read_json_bounded(uri: str) -> object:
    """Read a small JSON file, refusing one larger than ``MAX_JSON_BYTES`` (never fetching more than one byte
    past it)."""
    fs, path = io.filesystem(uri)
    fs.invalidate_cache(path)  # another rank or process may have just committed it
    try:
        data = io.read_capped(uri, MAX_JSON_BYTES)
    except io.FileTooLargeError:
        raise CorruptArtifactError(f"{uri} is more than the {MAX_JSON_BYTES} bytes a checkpoint's JSON file may "
                                   "hold; the checkpoint is refused") from None
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptArtifactError(f"{uri} is not valid JSON ({e}); the checkpoint is refused") from None


def read_manifest(step_uri: str) -> Manifest | None:
    """The step's manifest, or None when it has none (not committed). A manifest whose step is not its
    directory's is refused."""
    uri = io.join(step_uri, MANIFEST)
    try:
        data = read_json_bounded(uri)
    except FileNotFoundError:
        return None
    manifest = Manifest.from_json(data, uri)
    step = parse_step(step_uri)
    if step is not None and manifest.step != step:
        raise CorruptArtifactError(f"{uri} says step {manifest.step} but lies in the directory of step {step}; "
                                   "the checkpoint is refused")
    return manifest


def write_manifest(step_uri: str, manifest: Manifest) -> None:
    """The commit: one atomic write (rename on a local disk, a single PUT on an object store), durable when this
    returns (saver.py says what survives a power cut). On a local disk: the step directory is fsynced first, so
    the names of the files the manifest lists are on disk before it can be; the manifest's bytes are fsynced
    before its rename (``io.write_json_atomic``); after the rename the step directory is fsynced again (the
    manifest's name: the commit), then the checkpoint root (the step directory's own name) and the root's parent
    (the root's name, new at a run's first save). An object store has no directories to sync: a PUT is durable
    and visible once it returns."""
    local = io.protocol(step_uri) == "file"
    fs, path = io.filesystem(step_uri)
    if local:
        fs.makedirs(path, exist_ok=True)  # (a save made it; a manifest written alone makes it here)
        fsync_dir(path)
    io.write_json_atomic(io.join(step_uri, MANIFEST), manifest.to_json())
    if local:
        root = os.path.dirname(path.rstrip("/"))
        for directory in (path, root, os.path.dirname(root)):
            fsync_dir(directory)


def fsync_dir(path: str) -> None:
    """fsync a local directory, so that the names created, renamed or removed in it survive a power cut. A file
    system that cannot sync a directory (``EINVAL``) is let be; any other failure (an I/O error) raises: the
    commit is then not durable, and the save must fail rather than report it."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------- checksums


def file_digest(uri: str) -> FileRecord:
    fs, path = io.filesystem(uri)
    h, size = hasher(), 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return FileRecord(size, h.hexdigest())


def verify_files(step_uri: str, manifest: Manifest, names: list[str]) -> list[str]:
    """Check ``names`` (a share of the manifest's files) against their recorded size and checksum; returns one
    message per problem, each naming the file."""
    fs, root = io.filesystem(step_uri)
    fs.invalidate_cache(root)
    problems = []
    for name in names:
        want = manifest.files[name]
        uri = io.resolve_inside(step_uri, name, "checkpoint")  # also refuses a symlink that leads elsewhere
        try:
            size = fs.size(f"{root.rstrip('/')}/{name}")
        except FileNotFoundError:
            problems.append(f"{name} is missing (listed in {MANIFEST})")
            continue
        if size != want.size:
            problems.append(f"{name} is {size} bytes but {MANIFEST} says {want.size} (truncated or overwritten)")
            continue
        got = file_digest(uri)
        if got.digest != want.digest:
            problems.append(f"{name} has {ALGORITHM} {got.digest[:16]}... but {MANIFEST} says "
                            f"{want.digest[:16]}... (corrupted)")
    return problems


# ------------------------------------------------------------------------------------------------- removal


def remove(step_uri: str) -> None:
    """Delete a checkpoint directory, manifest first: an interrupted removal leaves an uncommitted (ignored)
    directory, never a committed one with files missing. On a local disk the step directory is fsynced once the
    manifest is gone, so the uncommit is durable before any file goes (after a power cut the manifest cannot
    come back without its files), and a rollback's uncommit of steps it distrusts is durable before training goes
    on."""
    fs, path = io.filesystem(step_uri)
    manifest = f"{path.rstrip('/')}/{MANIFEST}"
    if fs.exists(manifest):
        fs.rm(manifest)
        if io.protocol(step_uri) == "file":
            fsync_dir(path)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def retention(root: str, keep: int, newest: int) -> list[int]:
    """After the commit of step ``newest``: keep the ``keep`` newest committed checkpoints at or below it, delete
    older committed ones and any uncommitted directory older than ``newest`` (left by killed saves). Directories
    newer than ``newest`` are left alone. Returns the steps deleted."""
    kept, deleted = 0, []
    for step, uri in list_steps(root):
        if step > newest:
            continue
        if is_committed(uri) and kept < keep:
            kept += 1
            continue
        if step == newest:  # never delete what was just committed
            continue
        remove(uri)
        deleted.append(step)
    return deleted


def checkpoint_root(cfg, run_dir: str) -> str:
    """Where a run's checkpoints go: ``checkpoint.dir``; else under Ray Train's storage when ``ray.storage_path`` is
    set (``STORAGE/RUN_NAME/checkpoints``: the place a Ray user already made shared); else ``RUN_DIR/checkpoints``
    ("" without any)."""
    if cfg.checkpoint.dir:
        return cfg.checkpoint.dir
    if cfg.ray.storage_path:
        return io.join(cfg.ray.storage_path, cfg.run.name, "checkpoints")
    return io.join(run_dir, "checkpoints") if run_dir else ""


def shared_root(cfg, root: str) -> bool:
    """Whether every node sees the checkpoint ``root``: an object store, a path ``checkpoint.shared_fs`` vouches
    for, or the default under ``ray.storage_path`` (which Ray Train itself needs shared on a multi-node cluster)."""
    return io.protocol(root) != "file" or cfg.checkpoint.shared_fs or \
        (not cfg.checkpoint.dir and bool(cfg.ray.storage_path))


def check_shared(cfg, world, root: str) -> None:
    """Refuse a local checkpoint path when the ranks span nodes, before training starts: each node would write
    only its own ranks' files while rank 0's manifest names them all, so no node could verify a commit (every
    resume would start over from step 0), and retention on rank 0 would never delete the other nodes' files.
    ``world``: the observed layout (cluster/topology.py)."""
    if not root or cfg.checkpoint.every <= 0 or world.num_nodes < 2 or shared_root(cfg, root):
        return
    raise ConfigError(f"checkpoint.dir = {root!r} is a local path and the workers run on {world.num_nodes} nodes "
                      f"({world.placement()}): each node would hold only its own ranks' files. Use an object store "
                      "(checkpoint.dir = \"s3://bucket/prefix\"), set ray.storage_path to shared storage (checkpoints "
                      "then go under it), or, if the path is on a file system every node mounts (NFS), set "
                      "checkpoint.shared_fs = true")
