"""fsspec plumbing shared by every room: one place that turns a URI into a filesystem, and atomic writes.

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

from .errors import DestinationError, SourceError


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
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:
            with fs.open(path, "wb") as f:
                f.write(data)
    except PermissionError as e:
        raise DestinationError(f"cannot write {uri!r}: permission denied; choose a writable location") from e
    except OSError as e:
        raise DestinationError(f"cannot write {uri!r}: {e}; choose a writable location") from e


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
