"""fsspec plumbing shared by every package: one place that turns a URI into a filesystem, and atomic writes.

Object-store credentials and endpoints come from the standard AWS environment variables
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``), so the
same settings reach s3fs (for our own reads and writes) and Daft (for its scans) without extra flags.
"""

from __future__ import annotations

import json
import os
import posixpath
import stat
import threading
import uuid
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from .errors import CorruptArtifactError, DestinationError, SourceError
from .nospace import no_space  # noqa: F401 - re-exported: writers call io.no_space

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


def open_path(uri: str, uri_bytes: bytes | None = None) -> str:
    """The path to open for a table row: its ``uri``, or, for a local name that is not UTF-8 text (the row's
    ``uri_bytes`` set, its ``uri`` only a readable form), the exact bytes as the ``str`` Python's file functions
    take (``os.fsdecode``). Every reader that opens a row's file goes through this."""
    return os.fsdecode(uri_bytes) if uri_bytes is not None else uri


def open_paths(rows) -> list[str]:
    """``open_path`` of each row of ``rows`` (an Arrow table or batch with ``uri`` and, unless it predates the
    column, ``uri_bytes``)."""
    uris = rows.column("uri").to_pylist()
    if "uri_bytes" not in rows.column_names:
        return uris
    return [open_path(u, b) for u, b in zip(uris, rows.column("uri_bytes").to_pylist(), strict=True)]


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


def _unlink_quietly(path: str) -> None:
    """Remove a local file this process was writing, if it is there (after a failed write, whose error is the one
    to report: a parent that is a file, or is gone, leaves nothing to remove)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def write_bytes_atomic(uri: str, data: bytes) -> None:
    """Write ``data`` so that a reader sees either the old object or the whole new one, never part of it.

    Local files: write a temporary sibling, fsync, rename (atomic on POSIX); the temporary file is removed on
    any failure (a full disk, an interrupt). Object stores: a single PUT is already atomic. ``memory://``: the
    write is a single dict assignment. A full disk or quota is a ``NoSpaceError`` naming the device, ``uri`` and
    the bytes.
    """
    fs, path = filesystem(uri)
    parent = posixpath.dirname(path)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    local = protocol_of(fs) == "file"
    try:
        if parent:
            fs.makedirs(parent, exist_ok=True)
        if local:
            _write_local_fsynced(tmp, lambda f: f.write(data))
            os.replace(tmp, path)
        else:
            with fs.open(path, "wb") as f:
                f.write(data)
    except BaseException as e:
        if local:  # nothing half-written stays behind, whatever stopped the write
            _unlink_quietly(tmp)
        if isinstance(e, PermissionError):
            raise DestinationError(f"cannot write {uri!r}: permission denied; choose a writable location") from e
        if isinstance(e, OSError):
            raise (no_space(e, uri, len(data)) or
                   DestinationError(f"cannot write {uri!r}: {e}; choose a writable location")) from e
        raise


def write_fsynced(uri: str, write) -> None:
    """Create ``uri`` with ``write(file)`` and make it durable before returning: a local file is fsynced (and its
    folder, so the name survives a power cut); an object store's PUT is durable once it returns. A local file
    that could not be written whole is removed (a full disk is a ``NoSpaceError`` naming the device and ``uri``)."""
    fs, path = filesystem(uri)
    parent = posixpath.dirname(path)
    local = protocol_of(fs) == "file"
    try:
        if parent:
            fs.makedirs(parent, exist_ok=True)
        if local:
            _write_local_fsynced(path, write)
            fsync_dir(parent)
        else:
            with fs.open(path, "wb") as f:
                write(f)
    except BaseException as e:
        if local:
            _unlink_quietly(path)
        named = no_space(e, uri)
        if named is not None and named is not e:
            raise named from e
        raise


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


# Locations whose exclusive create was probed in this process and found enforced: (protocol, path).
_EXCLUSIVE_CHECKED: set[tuple[str, str]] = set()
# memory:// lives in this process: one lock makes its check-then-set atomic across threads.
_MEMORY_LOCK = threading.Lock()
# What a conditional write that lost to a concurrent one answers: S3's 409 ConditionalRequestConflict (two
# conditional writes in flight at once) and 412 PreconditionFailed. s3fs maps only a 412 naming If-None-Match to
# FileExistsError; the others reach us as a plain OSError whose cause carries the server's answer.
_CONFLICT_CODES = frozenset({"ConditionalRequestConflict", "PreconditionFailed", "409", "412"})
_CONFLICT_STATUS = frozenset({409, 412})
PROBE_PREFIX = ".exclusive-probe-"  # sentinel files of the exclusive-create probe (vacuum removes leftovers)
_REPLACE_ATTEMPTS = 20


def is_write_conflict(exc: BaseException) -> bool:
    """Whether ``exc`` is a conditional write that lost to another writer (HTTP 409 or 412 from an S3-style
    store), found on the exception or its causes: such a write created nothing and can be retried."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = str((response.get("Error") or {}).get("Code", ""))
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code in _CONFLICT_CODES or status in _CONFLICT_STATUS:
                return True
        e = e.__cause__ or e.__context__
    return False


def _parent_uri(uri: str) -> str:
    if "://" in uri:
        scheme, rest = uri.split("://", 1)
        return f"{scheme}://" + posixpath.dirname(rest.rstrip("/"))
    return os.path.dirname(os.path.abspath(uri))


def _remove_quietly(uri: str) -> None:
    fs, path = filesystem(uri)
    try:
        fs.rm(path)
    except (FileNotFoundError, OSError, NotImplementedError):
        pass


def require_exclusive_create(location: str) -> None:
    """Refuse a store that does not enforce create-if-absent at ``location``, checked once per location and process.

    fsspec's base file accepts mode ``"xb"`` on backends that never check it, and S3-compatible servers may
    ignore ``If-None-Match``: on such a store two writers could both "create" one name and the second would
    silently replace the first. So before the first exclusive create at a location, a sentinel is created there
    twice: the second create must fail and the first's bytes must survive. The sentinel is removed either way.
    """
    fs, path = filesystem(location)
    proto = protocol_of(fs)
    key = (proto, path.rstrip("/"))
    if key in _EXCLUSIVE_CHECKED:
        return
    sentinel = join(location, f"{PROBE_PREFIX}{uuid.uuid4().hex}")
    first_bytes = f"exclusive-create probe {uuid.uuid4().hex}\n".encode()
    try:
        first = _create_exclusive(sentinel, first_bytes)
        second = _create_exclusive(sentinel, b"a second writer\n") if first else True
        kept = first and not second and _read_or_none(sentinel) == first_bytes
    finally:
        _remove_quietly(sentinel)
    if not kept:
        raise DestinationError(
            f"cannot commit to {location}: the {proto}:// store does not enforce create-if-absent writes (a second "
            "exclusive create of one name succeeded), so two writers could both commit one version and one's rows "
            "would be lost; keep the table on a local or shared file system, or on S3 with conditional writes "
            "(AWS S3, recent MinIO)"
        )
    _EXCLUSIVE_CHECKED.add(key)


def create_exclusive(uri: str, data: bytes, *, store: str | None = None) -> bool:
    """Create ``uri`` holding ``data`` only if nothing exists there; returns False when it already exists (or a
    concurrent conditional write won: a 409 or 412 from the store).

    The commit primitive of the table format: two writers racing for one name cannot both win, and a reader
    never sees a partial object. Local files: the data is written and fsynced under a temporary name, then
    hard-linked to the final name (``link`` fails if the name exists, atomically). Object stores: a conditional
    PUT (``If-None-Match: *`` on S3; s3fs's exclusive ``xb`` mode). ``memory://``: one process, check then set
    under a lock. The store at ``store`` (default: ``uri``'s folder) is probed first, once per process
    (``require_exclusive_create``), and refused if it does not enforce any of this.
    """
    if not data:
        # s3fs writes an empty object with a plain PUT, without the condition
        raise ValueError("create_exclusive needs non-empty data")
    require_exclusive_create(store or _parent_uri(uri))
    return _create_exclusive(uri, data)


def _create_exclusive(uri: str, data: bytes) -> bool:
    fs, path = filesystem(uri)
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    proto = protocol_of(fs)
    if proto == "file":
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            _write_local_fsynced(tmp, lambda f: f.write(data))
        except BaseException as e:
            _unlink_quietly(tmp)  # nothing was created; nothing half-written stays behind
            if isinstance(e, OSError):
                raise (no_space(e, uri, len(data)) or
                       DestinationError(f"cannot commit {uri!r}: {e}; choose a writable location")) from e
            raise
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as e:  # a file system without hard links (some FUSE or SMB mounts)
            raise DestinationError(
                f"cannot commit {uri!r}: this file system cannot hard-link ({e}), which the create-if-absent "
                "commit needs; keep the table on a local or shared POSIX file system, or on S3"
            ) from e
        finally:
            os.unlink(tmp)
        fsync_dir(parent)
        return True
    if proto == "memory":
        with _MEMORY_LOCK:
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
            f"cannot commit {uri!r}: {proto}:// has no create-if-absent write in fsspec ({e}); keep the table on a "
            "local or shared file system, or on S3 with conditional writes (AWS S3, recent MinIO)"
        ) from e
    except OSError as e:
        if is_write_conflict(e):
            return False  # another writer's conditional write won: a lost race the caller rebases, not a failure
        raise DestinationError(f"cannot commit {uri!r}: {e}; check the store and run again") from e
    return True


def _read_or_none(uri: str) -> bytes | None:
    fs, path = filesystem(uri)
    fs.invalidate_cache(path)
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        return None


def replace_if(uri: str, data: bytes, should_replace) -> bool:
    """Replace ``uri`` with ``data`` if ``should_replace(current bytes, or None when absent)`` says so; returns
    whether it wrote. No other writer's replace lands between the read and the write where the store allows it:
    local files under an exclusive ``flock`` of the sidecar ``<uri>.lock`` (the kernel releases it if the
    process dies), S3 with a PUT conditional on the ETag read (``If-Match``, or ``If-None-Match: *`` when
    absent), read again and retried when it lost, ``memory://`` under a process lock. Other stores read,
    compare and write, so a racing writer can slip in between: callers that need monotonic contents check again
    after writing."""
    fs, path = filesystem(uri)
    proto = protocol_of(fs)
    if proto == "file":
        import fcntl

        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        with open(f"{path}.lock", "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes (or the process dies)
            if not should_replace(_read_or_none(uri)):
                return False
            write_bytes_atomic(uri, data)
            return True
    if proto == "memory":
        with _MEMORY_LOCK:
            if not should_replace(_read_or_none(uri)):
                return False
            fs.pipe_file(path, data)
            return True
    if proto in ("s3", "s3a"):
        for _ in range(_REPLACE_ATTEMPTS):
            fs.invalidate_cache(path)
            try:
                etag = fs.info(path).get("ETag")
                current = fs.cat_file(path)
            except FileNotFoundError:
                etag, current = None, None
            if not should_replace(current):
                return False
            condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
            try:
                fs.pipe_file(path, data, **condition)
                return True
            except FileExistsError:
                continue
            except OSError as e:
                if is_write_conflict(e):
                    continue  # another writer replaced it since our read: read it again
                raise DestinationError(f"cannot write {uri!r}: {e}; choose a writable location") from e
        raise DestinationError(f"{uri!r} kept changing under concurrent writers; run again")
    if not should_replace(_read_or_none(uri)):
        return False
    write_bytes_atomic(uri, data)
    return True


def read_capped(uri: str, max_bytes: int) -> bytes:
    """Read a whole file, refusing one larger than ``max_bytes`` before reading it all (never more than
    ``max_bytes + 1`` bytes are fetched, whatever a listing said about its size). Raises ``FileTooLargeError``
    (a ``SourceError``). A local path must be a regular file (after symlinks): a FIFO, socket or device is
    refused with ``NotRegularFileError`` before it is opened, since opening a FIFO blocks and a device never
    ends."""
    if protocol(uri) == "file":
        data = _read_local_capped(uri[len("file://"):] if uri.startswith("file://") else uri, max_bytes, uri)
    else:
        fs, path = filesystem(uri)
        with fs.open(path, "rb") as f:
            data = _read_upto(f.read, max_bytes + 1)
    if len(data) > max_bytes:
        raise FileTooLargeError(
            f"{uri!r} is larger than the per-file limit of {max_bytes} bytes; raise --max-file-bytes to read it"
        )
    return data


def _read_upto(read, n: int, first: int | None = None) -> bytes:
    """Up to ``n`` bytes from ``read`` (a file's read method), looping over short reads; ``first`` sizes the first
    request (a file's size + 1 finds its end in one read without reserving ``n`` bytes)."""
    parts, got = [], 0
    while got < n:
        asked = min(n - got, first) if first and not parts else min(n - got, 1 << 20)
        chunk = read(asked)
        parts.append(chunk)
        got += len(chunk)
        # A short read is the end of the file (regular files and fsspec's buffered files return fewer bytes only
        # there). Stopping here matters beyond speed: asking again would allocate a large buffer only to get
        # nothing, and glibc then raises its mmap threshold, so later batch buffers stay in the heap for good.
        if len(chunk) < asked:
            break
    return b"".join(parts)


def file_kind(mode: int) -> str:
    """What an ``st_mode`` describes, in words: ``regular file``, ``fifo``, ``socket``, ``character device``, ..."""
    for test, name in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "folder"), (stat.S_ISLNK, "symlink"),
                       (stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def _read_local_capped(path: str, max_bytes: int, uri: str) -> bytes:
    # The type is checked before the open (stat never opens), and again on the open descriptor, so a file swapped
    # for a FIFO or device in between is refused too. O_NONBLOCK keeps that open from blocking on a FIFO.
    kind = file_kind(os.stat(path).st_mode)
    if kind == "regular file":
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(path, flags)
        try:
            st = os.fstat(fd)
            kind = file_kind(st.st_mode)
            if kind == "regular file":
                return _read_upto(lambda n: os.read(fd, n), max_bytes + 1, first=st.st_size + 1)
        finally:
            os.close(fd)
    raise NotRegularFileError(kind, f"{uri!r} is not a regular file but a {kind}; it is not read")


# Manifests, pointers (``latest``), indexes and shard records are small: a table manifest names one path per data
# file (about 50 bytes each), a cache manifest about 200 bytes per shard, so 64 MiB holds over a million files or
# 300,000 shards. Anything larger is damaged or hostile, and is refused before it is read whole.
MAX_MANIFEST_BYTES = 64 << 20


def read_small(uri: str) -> bytes:
    """The bytes of a manifest, pointer, index or record file, refusing one over ``MAX_MANIFEST_BYTES`` (never
    more than that plus one byte are fetched) with a ``CorruptArtifactError`` naming it."""
    try:
        return read_capped(uri, MAX_MANIFEST_BYTES)
    except FileTooLargeError:
        raise CorruptArtifactError(
            f"{uri!r} is larger than {MAX_MANIFEST_BYTES} bytes, far more than a manifest, pointer or index holds; it is damaged "
            "or hostile and is refused: recreate it"
        ) from None


class FileTooLargeError(SourceError):
    """A file over the per-file byte cap (counted as a skip by ingest and materialize)."""


class NotRegularFileError(SourceError):
    """A local path that is a FIFO, socket, device or folder rather than a regular file; ``kind`` says which."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind

    def __reduce__(self):  # keep the kind when a worker process ships the error back
        return (NotRegularFileError, (self.kind, str(self)))


def write_json_atomic(uri: str, obj: Any) -> None:
    write_bytes_atomic(uri, json.dumps(obj, indent=2, sort_keys=True).encode())


def read_json(uri: str, fix: str = "recreate it") -> Any:
    """A small JSON artifact (manifest, pointer, index, record), read with the manifest cap. A missing file is a
    ``SourceError``; bytes that are not JSON (not UTF-8, malformed, nested too deep) are a
    ``CorruptArtifactError`` naming the file and ``fix``."""
    try:
        data = read_small(uri)
    except FileNotFoundError as e:
        raise SourceError(f"{uri!r} does not exist") from e
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CorruptArtifactError(f"{uri!r} is not valid JSON ({type(e).__name__}: {e}); {fix}") from None


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.exists(path)
