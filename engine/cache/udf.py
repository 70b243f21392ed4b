"""A cache shard's work, as plain functions and the Daft UDFs that run them: fetch, decode + transform, write.

- ``decode_chunk``: a few files -> each sample's bytes or skip reason (byte cap, content check, allowed decoders,
  bomb limit).
- ``finish_shard``: pixels of one shard -> the Arrow IPC shard written atomically, then its completion record.
- ``build_shard``: one whole shard (resume check, decode, finish) -- the unit of a Ray task.
- ``shard_udf`` wraps ``build_shard`` over the plan's one-row-per-shard frame (Ray runner); ``decode_udf`` wraps
  ``decode_chunk`` over batches of rows (native runner, Daft's threads). The bytes of a shard depend only on
  its rows and the spec, never on where it ran.

Imported only when materialize runs, so ``import dutycycle.engine`` stays free of Daft.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import io, sealed
from ..errors import CorruptArtifactError, DecodeError, SourceError
from ..imageinfo import TOO_LARGE, UNREADABLE
from ..imageinfo import sample_id as sample_id_of
from ..transform import TransformSpec, decode_and_transform
from . import format as cf
from . import node, stats
from .plan import label_index

FETCH_THREADS = 16  # concurrent reads per shard from object stores (latency-bound, not CPU-bound)

# The content check (``plan.CONTENT_CHECK``, part of the fingerprint): a fetched file's bytes must still hash to
# its row's content id (``imageinfo.sample_id``, the sha256 prefix ingest computed), else the cache would hold new
# pixels under the old id. A mismatch is a counted skip with this reason, and a warning that names the file.
CHANGED = "changed since ingest"
_log = logging.getLogger(__name__)


RECORD_DIGEST = "record_sha256"  # a completion record's checksum of its own content (every other field)
# every field a record may have: one more (such as a damaged checksum key) is a damaged record
_RECORD_FIELDS = frozenset({"index", "ids_digest", "shard", "skipped", "split_counts", "pixel_sums", "worker",
                            "seconds", RECORD_DIGEST})


def record_name(index: int) -> str:
    return f"{cf.SHARD_DIR}/shard-{index:05d}.json"


def ids_digest(ids: list[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:20]


def write_record(cache_uri: str, index: int, rec: dict[str, Any]) -> None:
    """Write shard ``index``'s completion record, sealed with ``record_sha256`` (the sha256 of its other fields):
    materialize copies a resumed record's counts into the manifest, so a record changed since is not trusted."""
    io.write_json_atomic(io.join(cache_uri, record_name(index)), sealed.seal(rec, RECORD_DIGEST))


def _is_counts(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and sealed.is_count(n) for k, n in v.items())


_SHARD_FIELDS = {f.name for f in dataclasses.fields(cf.ShardInfo)}


def _record_ok(rec: Any, index: int) -> bool:
    """Whether a parsed record is one of shard ``index``'s, whole: its checksum and the fields materialize reads."""
    if not isinstance(rec, dict) or not set(rec) <= _RECORD_FIELDS:
        return False
    if RECORD_DIGEST not in rec or not sealed.intact(rec, RECORD_DIGEST):
        return False
    shard = rec.get("shard")
    # a record names its own shard, nothing else
    if shard is not None and not (
        isinstance(shard, dict) and set(shard) == _SHARD_FIELDS
        and shard["path"] == cf.shard_name(index)
        and sealed.is_count(shard["rows"]) and sealed.is_count(shard["bytes"]) and isinstance(shard["sha256"], str)
        and cf.shard_checks_problem(shard) is None
    ):
        return False
    # a record without pixel sums (an older writer's) reads as not complete: the shard is built again
    return (rec.get("index") == index and isinstance(rec.get("ids_digest"), str)
            and _is_counts(rec.get("skipped")) and _is_counts(rec.get("split_counts"))
            and stats.sums_ok(rec.get("pixel_sums")))


def completed(cache_uri: str, index: int, digest: str) -> dict[str, Any] | None:
    """The shard's completion record if it exists, matches this plan and its shard passes the checksum; None
    ("not complete") otherwise. A record is a resume hint: a damaged one (not JSON, fields of the wrong type, a
    checksum that fails) reads as not complete too, and the shard is built again."""
    try:
        rec = io.read_json(io.join(cache_uri, record_name(index)))
    except (SourceError, CorruptArtifactError):  # missing, not a regular file, not JSON, too large for a record
        return None
    if not _record_ok(rec, index) or rec["ids_digest"] != digest:
        return None
    rec = {k: v for k, v in rec.items() if k != RECORD_DIGEST}
    if not rec["shard"]:  # every candidate of this shard was skipped; nothing to verify
        return rec
    info = cf.ShardInfo(**rec["shard"])
    uri = io.resolve_inside(cache_uri, info.path, "cache")
    fs, path = io.filesystem(uri)
    try:
        if io.protocol_of(fs) == "file":  # hashed in chunks: a whole shard need not sit in memory
            ok = os.path.getsize(path) == info.bytes and node.sha256_file(path) == info.sha256
        else:  # at most one byte past the recorded size is fetched: a larger object fails without being read
            data = io.read_capped(uri, info.bytes)
            ok = len(data) == info.bytes and hashlib.sha256(data).hexdigest() == info.sha256
    except (FileNotFoundError, io.FileTooLargeError):
        return None
    return rec if ok else None


def fetch(uris: list[str], max_bytes: int) -> list[bytes | str]:
    """Each file's bytes, or the skip reason (the reasons ingest records for the same files): ``unreadable``
    (missing, cannot be read) or ``too large`` (over the per-file byte cap, not read)."""

    def one(uri: str) -> bytes | str:
        try:
            return io.read_capped(uri, max_bytes)
        except io.FileTooLargeError:
            return TOO_LARGE
        except (OSError, ValueError):
            return UNREADABLE

    if not uris or io.protocol(uris[0]) in ("file", "memory"):
        return [one(u) for u in uris]
    with ThreadPoolExecutor(min(FETCH_THREADS, len(uris))) as pool:
        return list(pool.map(one, uris))


def transform(data: bytes | str, spec: TransformSpec, max_pixels: int) -> np.ndarray | str:
    """A sample, or the reason it is skipped (a hostile file is a counted skip, never a crashed worker)."""
    if isinstance(data, str):
        return data
    try:
        return decode_and_transform(data, spec, max_pixels)
    except DecodeError as e:
        return e.reason
    except Exception:  # noqa: BLE001 - anything else a decoder raises is a counted skip, as ingest records it
        return UNREADABLE


def check_content(data: bytes | str, sample_id: str, uri: str) -> bytes | str:
    """``data`` if it is what ingest hashed for this row (or already a skip reason), else ``CHANGED``."""
    if isinstance(data, str) or sample_id_of(data) == sample_id:
        return data
    _log.warning("%s: %s no longer has the content the table recorded (sample id %s); it is skipped. Re-ingest "
                 "the table to pick up the new content, then materialize again", CHANGED, uri, sample_id)
    return CHANGED


def decode_chunk(
    uris: list[str], spec: TransformSpec, max_bytes: int, max_pixels: int, sample_ids: list[str],
    uri_bytes: list[bytes | None] | None = None,
) -> list[bytes | str]:
    """Fetch + check + decode + transform a few files (``sample_ids``: their rows' content ids; ``uri_bytes``:
    their rows' exact names where not text, read through ``io.open_path``): each sample's bytes, or the reason
    it is skipped."""
    paths = [io.open_path(u, b) for u, b in zip(uris, uri_bytes or [None] * len(uris), strict=True)]
    fetched = [check_content(data, sid, uri)
               for data, sid, uri in zip(fetch(paths, max_bytes), sample_ids, uris, strict=True)]
    out = [transform(data, spec, max_pixels) for data in fetched]
    return [o if isinstance(o, str) else o.tobytes() for o in out]


def finish_shard(
    cache_uri: str,
    index: int,
    ids: list[str],
    labels: list[int],
    splits: list[str],
    samples: list[bytes | str],
    spec: TransformSpec,
    seconds: float = 0.0,
) -> dict[str, Any]:
    """Write shard ``index`` from its rows (sample-id order) and their samples (bytes, or a skip reason), then
    its completion record; returns the record plus ``status: "written"``. The record carries the shard's exact
    pixel sums per split and channel (``stats.split_sums``), which materialize adds up into the manifest's
    ``channel_stats``."""
    keep = [k for k, s in enumerate(samples) if not isinstance(s, str)]
    skipped = Counter(s for s in samples if isinstance(s, str))
    info, sums = None, {}
    if keep:
        pixels = np.frombuffer(b"".join(samples[k] for k in keep), np.uint8).reshape(len(keep), *spec.shape)
        kept_splits = [splits[k] for k in keep]
        info = cf.write_shard(cache_uri, index, [ids[k] for k in keep], [labels[k] for k in keep], kept_splits, pixels)
        sums = stats.split_sums(pixels, kept_splits, spec.layout)
    rec = {
        "index": index,
        "ids_digest": ids_digest(ids),
        "shard": None if info is None else dataclasses.asdict(info),
        "skipped": dict(skipped),
        "split_counts": dict(Counter(splits[k] for k in keep)),
        "pixel_sums": sums,
        "worker": worker_name(),
        "seconds": round(seconds, 3),
    }
    # The record is written after the shard: a record always describes a complete shard. A shard left without
    # its record would be rebuilt by a rerun anyway, so when the record cannot be written (a full disk) the shard
    # goes too: a failed run leaves only shards a rerun keeps.
    try:
        write_record(cache_uri, index, rec)
    except BaseException:
        if info is not None:
            fs, path = io.filesystem(io.join(cache_uri, info.path))
            try:
                fs.rm(path)
            except (FileNotFoundError, OSError):
                pass
        raise
    return {**rec, "status": "written"}


def build_shard(
    cache_uri: str,
    index: int,
    rows: list[dict],
    spec: TransformSpec,
    classes: list[str],
    *,
    batch_size: int,
    max_bytes: int,
    max_pixels: int,
) -> dict[str, Any]:
    """Shard ``index`` of ``rows`` (dicts: sample_id, uri, uri_bytes, label, split), start to finish, unless a
    verified record says it is done; returns its record plus ``status`` ("written" or "resumed")."""
    t0 = time.perf_counter()
    rows = sorted(rows, key=lambda r: r["sample_id"])
    ids = [r["sample_id"] for r in rows]
    done = completed(cache_uri, index, ids_digest(ids))
    if done is not None:
        return {**done, "status": "resumed"}
    samples: list[bytes | str] = []
    for lo in range(0, len(rows), batch_size):  # only one batch of file bytes is held at a time
        chunk = rows[lo : lo + batch_size]
        samples += decode_chunk([r["uri"] for r in chunk], spec, max_bytes, max_pixels,
                                [r["sample_id"] for r in chunk], [r.get("uri_bytes") for r in chunk])
    index_of = label_index(classes)
    labels = [index_of.get(r["label"], -1) for r in rows]
    splits = [r["split"] or "" for r in rows]
    return finish_shard(cache_uri, index, ids, labels, splits, samples, spec, time.perf_counter() - t0)


def worker_name() -> str:
    """Where a shard was built (the Ray node when running in a Ray worker, else the host), for debugging."""
    import socket
    import sys

    node = ""
    if "ray" in sys.modules:
        try:
            import ray

            if ray.is_initialized():
                node = ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - naming the worker must never fail a shard
            node = ""
    return f"{socket.gethostname()}:{os.getpid()}" + (f":node={node}" if node else "")


def shard_udf():
    """Daft row UDF over the plan's shard frame: (shard, rows, options JSON) -> record JSON (Ray runner)."""
    import daft

    @daft.func(return_dtype=daft.DataType.string())
    def write_shard(shard: int, rows: list[dict], options: str) -> str:
        o = json.loads(options)
        rec = build_shard(
            o["cache"], int(shard), rows, TransformSpec.from_dict(o["spec"]), o["classes"],
            batch_size=o["batch_size"], max_bytes=o["max_bytes"], max_pixels=o["max_pixels"],
        )
        return json.dumps(rec)

    return write_shard


def decode_udf(spec: TransformSpec, batch_size: int, max_bytes: int, max_pixels: int, use_process: bool):
    """Daft batch UDF: file URIs, their exact names (``uri_bytes``) and their rows' sample ids ->
    struct{image: the sample's bytes, error: skip reason} (native runner)."""
    import daft

    out_type = daft.DataType.struct(
        {"image": daft.DataType.fixed_size_binary(spec.sample_bytes), "error": daft.DataType.string()}
    )

    @daft.func.batch(return_dtype=out_type, batch_size=batch_size, use_process=use_process)
    def decode(uris: daft.Series, uri_bytes: daft.Series, sample_ids: daft.Series, spec_json: str):
        import pyarrow as pa

        s = TransformSpec.from_json(spec_json)
        out = decode_chunk(uris.to_pylist(), s, max_bytes, max_pixels, sample_ids.to_pylist(),
                           uri_bytes.to_pylist())
        return pa.StructArray.from_arrays(
            [pa.array([None if isinstance(o, str) else o for o in out], pa.binary(s.sample_bytes)),
             pa.array([o if isinstance(o, str) else None for o in out], pa.string())],
            names=["image", "error"],
        )

    return decode
