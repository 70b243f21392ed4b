"""fsspec plumbing shared by every package: one place that turns a URI into a filesystem, and atomic writes.

Object-store credentials and endpoints come from the standard AWS environment variables
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``), so the
same settings reach s3fs (for our own reads and writes) and Daft (for its scans) without extra flags.
"""

from __future__ import annotations

import json
import os
import posixpath
import uuid
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from .errors import CorruptArtifactError, DestinationError, SourceError

# Schemes Daft's own readers understand (its Parquet scans and URL downloads, hf:// included); others
# (memory://, ...) are read in-process through fsspec. One list, so ingest, tables and caches agree.
DAFT_SCHEMES = ("file", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "http", "https", "hf")


def storage_options(uri: str) -> dict[str, Any]:
    """fsspec storage options for ``uri``; for s3 the endpoint comes from ``AWS_ENDPOINT_URL``."""
    if uri.startswith(("s3://", "s3a://")):
        opts: dict[str, Any] = {}
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
        if endpoint:
            opts["client_kwargs"] = {"endpoint_url": endpoint}
        return opts
    return {}


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return ``(fs, path)`` for any fsspec URI or local path."""
    fs, path = url_to_fs(uri, **storage_options(uri))
    return fs, path


def protocol(uri: str) -> str:
    return uri.split("://", 1)[0] if "://" in uri else "file"


def join(uri: str, *parts: str) -> str:
    """Join path parts onto a URI without touching the scheme."""
    if "://" in uri:
        scheme, rest = uri.split("://", 1)
        return f"{scheme}://" + posixpath.join(rest, *parts)
    return os.path.join(uri, *parts)


def resolve_inside(root: str, rel: str, what: str = "artifact") -> str:
    """The URI of ``rel`` (a path read from ``root``'s manifest) under ``root``, refusing any path that leaves it.

    A manifest is data, not a command: an absolute path, a URI, ``..`` that climbs above the root, an empty
    name, a NUL byte or (locally) a symlink that points outside the root is refused with an error naming the
    path, so a hostile or corrupted manifest cannot make a reader open or a writer delete files elsewhere.
    """
    bad = None
    if not isinstance(rel, str) or not rel.strip():
        bad = "is empty"
    elif "\x00" in rel:
        bad = "holds a NUL byte"
    elif "://" in rel or rel.startswith(("/", "\\")) or (len(rel) > 1 and rel[0].isalpha() and rel[1] == ":"):
        bad = "is absolute"
    else:
        norm = posixpath.normpath(rel)
        if norm in (".", "..") or norm.startswith("../"):
            bad = "leaves the root"
    if bad is None and protocol(root) == "file":
        real_root = os.path.realpath(root)
        real = os.path.realpath(os.path.join(root, norm))
        if os.path.commonpath([real_root, real]) != real_root:
            bad = "resolves outside the root (through a symlink)"
    if bad is not None:
        raise CorruptArtifactError(
            f"{what} {root!r} names the path {rel!r}, which {bad}; its manifest is corrupt or hostile and is "
            "refused: recreate it"
        )
    return join(root, norm)


def to_uri(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """Turn an fs-relative path back into a full URI (``unstrip_protocol`` with a local-path special case)."""
    if protocol_of(fs) == "file":
        return path
    return fs.unstrip_protocol(path)


def protocol_of(fs: fsspec.AbstractFileSystem) -> str:
    p = fs.protocol
    p = p[0] if isinstance(p, (tuple, list)) else p
    return "file" if p in ("file", "local") else p


def daft_io_config():
    """A ``daft.io.IOConfig`` that points Daft's native S3 client at the same endpoint as s3fs."""
    from daft.io import IOConfig, S3Config

    endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
    s3 = S3Config(
        endpoint_url=endpoint,
        key_id=os.environ.get("AWS_ACCESS_KEY_ID"),
        access_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
        region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        # Path-style addressing is what local S3-compatible servers (moto, minio) speak.
        force_virtual_addressing=False,
    )
    return IOConfig(s3=s3)


def _write_local_fsynced(path: str, write) -> None:
    """Create the local file ``path`` with ``write(file)`` and fsync it, so its bytes are on disk before the caller
    renames, links or commits it."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def write_bytes_atomic(uri: str, data: bytes) -> None:
    """Write ``data`` so that a reader sees either the old object or the whole new one, never part of it.

    Local files: write a temporary sibling, fsync, rename (atomic on POSIX). Object stores: a single PUT is
    already atomic. ``memory://``: the write is a single dict assignment.
    """
    fs, path = filesystem(uri)
    parent = posixpath.dirname(path)
    try:
        if parent:
            fs.makedirs(parent, exist_ok=True)
        if protocol_of(fs) == "file":
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            _write_local_fsynced(tmp, lambda f: f.write(data))
            os.replace(tmp, path)
        else:
            with fs.open(path, "wb") as f:
                f.write(data)
    except PermissionError as e:
        raise DestinationError(f"cannot write {uri!r}: permission denied; choose a writable location") from e
    except OSError as e:
        raise DestinationError(f"cannot write {uri!r}: {e}; choose a writable location") from e


def write_fsynced(uri: str, write) -> None:
    """Create ``uri`` with ``write(file)`` and make it durable before returning: a local file is fsynced (and its
    folder, so the name survives a power cut); an object store's PUT is durable once it returns."""
    fs, path = filesystem(uri)
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if protocol_of(fs) == "file":
        _write_local_fsynced(path, write)
        fsync_dir(parent)
    else:
        with fs.open(path, "wb") as f:
            write(f)


def fsync_dir(path: str) -> None:
    """fsync a local folder so the names created in it are durable (a no-op where the OS does not allow it)."""
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def create_exclusive(uri: str, data: bytes) -> bool:
    """Create ``uri`` holding ``data`` only if nothing exists there; returns False when it already exists.

    The commit primitive of the table format: two writers racing for one name cannot both win, and a reader
    never sees a partial object. Local files: the data is written and fsynced under a temporary name, then
    hard-linked to the final name (``link`` fails if the name exists, atomically). Object stores: a conditional
    PUT (``If-None-Match: *`` on S3; s3fs's exclusive ``xb`` mode). ``memory://``: one process, check then set.
    """
    fs, path = filesystem(uri)
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    proto = protocol_of(fs)
    if proto == "file":
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        _write_local_fsynced(tmp, lambda f: f.write(data))
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        fsync_dir(parent)
        return True
    if proto == "memory":
        if fs.exists(path):
            return False
        fs.pipe_file(path, data)
        return True
    try:
        with fs.open(path, "xb") as f:
            f.write(data)
    except FileExistsError:
        return False
    except ValueError as e:  # a filesystem without exclusive create: refusing beats a commit that can lose
        raise DestinationError(
            f"cannot commit {uri!r}: {proto}:// has no create-if-absent write in fsspec ({e}); use a local "
            "path or s3://"
        ) from e
    return True


def read_capped(uri: str, max_bytes: int) -> bytes:
    """Read a whole file, refusing one larger than ``max_bytes`` before reading it all (never more than
    ``max_bytes + 1`` bytes are fetched). Raises ``FileTooLargeError`` (a ``SourceError``)."""
    fs, path = filesystem(uri)
    with fs.open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise FileTooLargeError(
            f"{uri!r} is larger than the per-file limit of {max_bytes} bytes; raise --max-file-bytes to read it"
        )
    return data


class FileTooLargeError(SourceError):
    """A file over the per-file byte cap (counted as a skip by ingest and materialize)."""


def write_json_atomic(uri: str, obj: Any) -> None:
    write_bytes_atomic(uri, json.dumps(obj, indent=2, sort_keys=True).encode())


def read_json(uri: str) -> Any:
    fs, path = filesystem(uri)
    try:
        with fs.open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError as e:
        raise SourceError(f"{uri!r} does not exist") from e


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.exists(path)
