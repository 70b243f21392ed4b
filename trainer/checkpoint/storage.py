"""DCP save and load through fsspec (local paths and ``s3://``), with what DCP lacks added at its seams.

DCP gives the sharded format and resharding: each rank writes its own file (``__{rank}_0.distcp``), rank 0 writes
the index (``.metadata``) once every rank's write has finished, and a load at any world size reads the slices it
needs. Added here, each at a public seam of DCP's storage classes:

- **Checksums while writing.** Every stream DCP writes through is hashed as it goes, so when ``dcp.save`` returns
  each rank knows the size and checksum of its own files without reading them back (on an object store a read-back
  would download the checkpoint again).
- **State in offload files stays out of memory.** A tensor that lives in a file map (``parallel.offload =
  "nvme"``: the optimizer state, or an asynchronous save's snapshot of it) has its pages dropped from the process
  as soon as DCP has written it (``_SavePlanner``), so a save holds one such tensor in memory at a time, not the
  whole state. Such saves use DCP's serial loader (``per_thread_copy_ahead = 0``), which resolves each tensor
  just before writing it; the state is in host memory anyway under that offload, so overlapping device copies
  would gain nothing.
- **Loads run no pickle.** DCP's ``.metadata`` is a pickle, and DCP's default load planner unpickles non-tensor
  values (optimizer hyperparameters) with the weights-only guard off. Rank 0 also writes the index as JSON
  (``metadata.json``); loads read that one, and load non-tensor values with ``weights_only=True`` (tensors and
  plain Python values only). Tensors are loaded by DCP with ``weights_only=True`` already. Every file a load
  touches is named in the manifest, and the manifest's checksums were verified first (resume.py).

The private parts of DCP it builds on (the fsspec file system, reader and writer, the storage record, the save
planner's plan cache, the nested-dict setter) are reached through trainer/parallel/fsdp_api.py, which lists the
torch versions they were checked against.
"""

from __future__ import annotations

import io as _io
import json
import os
import warnings
from contextlib import contextmanager

import torch
import torch.distributed.checkpoint as dcp
from dutycycle.engine import io
from dutycycle.engine.errors import CorruptArtifactError
from dutycycle.trainer.parallel import nvme
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..parallel.fsdp_api import (
    FileSystem,
    FsspecReader,
    FsspecWriter,
    drop_save_plan_cache,
    set_element,
    set_plan_cache_key,
    storage_info,
)
from .manifest import METADATA_JSON, FileRecord, check_name, hasher, read_json_bounded

# dcp.save/load in one process with no process group say so on every call; that is the intended use here
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# ---------------------------------------------------------------------------------------------------- writing


class _HashingStream(_io.RawIOBase):
    """Passes writes through to ``raw`` and hashes them (DCP writes each file front to back, no seeks)."""

    def __init__(self, raw):
        super().__init__()
        self.raw, self.hash, self.size = raw, hasher(), 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        n = self.raw.write(view)
        n = len(view) if n is None else n
        self.hash.update(view[:n])
        self.size += n
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        # callers take the descriptor to fsync it (DCP's finish does for .metadata right after pickle.dump):
        # flush first, or the tail still in the buffered file object would miss the fsync (it did: 0 bytes)
        self.raw.flush()
        return self.raw.fileno()

    def close(self) -> None:
        if not self.closed:
            super().close()  # flushes
            self.raw.close()


class _HashingFileSystem(FileSystem):
    """FsspecWriter's file system with every written file's size and checksum recorded by base name."""

    def __init__(self, records: dict[str, FileRecord]):
        super().__init__()
        self.records = records

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as stream:
            hashing = _HashingStream(stream)
            yield hashing
        self.records[os.path.basename(os.fspath(path))] = FileRecord(hashing.size, hashing.hash.hexdigest())

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        rec = self.records.pop(os.path.basename(os.fspath(path)), None)
        if rec is not None:
            self.records[os.path.basename(os.fspath(new_path))] = rec


class _SavePlanner(DefaultSavePlanner):
    """DCP's save planner, dropping a file-mapped tensor's pages (``nvme.drop_pages``) once it is written.

    DCP's serial loader resolves the write items of a file one at a time and writes each before resolving the
    next, so when an item is resolved the previous one is on its way to storage: its pages go then, and the
    last one's in ``finish_writing``. (With DCP's overlapping loader, used on CUDA machines unless
    ``per_thread_copy_ahead`` is 0, items are resolved ahead of writing: ``_Writer`` turns it off when maps
    exist.) A dropped page that is read again comes back from its file: only memory is at stake, never values."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._written = None

    def resolve_data(self, write_item):
        self.finish_writing()
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor) and nvme.mapped(data):
            self._written = data
        return data

    def finish_writing(self) -> None:
        if self._written is not None:
            nvme.drop_pages(self._written)
            self._written = None


class _Writer(FsspecWriter):
    """FsspecWriter that records checksums of what it writes and adds the JSON index beside ``.metadata``."""

    def __init__(self, uri: str):
        local = io.protocol(uri) == "file"
        # fsync each file on a local disk; an object store's PUT is durable when it returns (DCP would call
        # os.sync() for the whole machine on streams without a file descriptor). With file-mapped state in
        # this process, DCP's serial loader (see _SavePlanner).
        copy_ahead = {"per_thread_copy_ahead": 0} if nvme.any_mapped() else {}
        super().__init__(uri, sync_files=local, **copy_ahead, **io.storage_options(uri))
        self.records: dict[str, FileRecord] = {}
        self.fs = _HashingFileSystem(self.records)
        self.path = self.fs.init_path(uri, **io.storage_options(uri))

    def finish(self, metadata: Metadata, results) -> None:
        super().finish(metadata, results)  # fills metadata.storage_data, writes .metadata
        data = json.dumps(metadata_to_json(metadata), separators=(",", ":")).encode()
        with self.fs.create_stream(self.fs.concat_path(self.path, METADATA_JSON), "wb") as f:
            f.write(data)
            if self.sync_files:  # durable before the caller writes a manifest naming it, as .metadata is
                try:
                    os.fsync(f.fileno())
                except (AttributeError, _io.UnsupportedOperation):
                    os.sync()


def write_state(state: dict, uri: str, process_group=None, plan_cache: str | None = None) -> dict[str, FileRecord]:
    """``dcp.save`` of ``state`` into the directory ``uri`` (every rank calls it; ``process_group`` carries DCP's
    planning collectives). Returns the files this rank wrote (rank 0: also the indexes) with sizes and checksums.

    ``plan_cache``: a key under which DCP keeps this save's plans for the next save of the same state layout (as
    torchtitan does). Every save of a run has the same tensors in the same shards, so from the second save on
    each rank sends an empty plan instead of pickling all of its write items to rank 0 and back: on a ZeRO-3 ViT
    of 545 tensors per rank the planning collectives were a third of the time an asynchronous save held Python's
    lock (measured with py-spy). A changed layout is detected by DCP (the plans are compared) and planned anew.
    DCP keeps the cache in class-level dicts, keyed per planner class unless told otherwise; ``drop_plan_cache``
    frees a key."""
    planner = _SavePlanner(enable_plan_caching=plan_cache is not None)
    if plan_cache is not None:
        set_plan_cache_key(planner, plan_cache)  # one cache per Saver: another run in this process plans its own
    writer = _Writer(uri)
    try:
        with _no_zip_crc32():
            dcp.save(state, storage_writer=writer, planner=planner, process_group=process_group)
    finally:
        planner.finish_writing()
    return dict(writer.records)


def drop_plan_cache(key: str) -> None:
    """Forget the plans DCP cached under ``key`` (a closed Saver's)."""
    drop_save_plan_cache(key)


@contextmanager
def _no_zip_crc32():
    """DCP writes each tensor with ``torch.save``, whose zip container checksums every record with CRC32. The
    manifest's checksum (taken while writing) already covers every byte, and resume verifies it before any load,
    so the CRC is a second checksum of the same bytes: 0.24 of 0.68 CPU-seconds per 336 MB on a 2-core machine,
    taken from training while an asynchronous save runs. ``torch.load`` reads such files (it does not check the
    CRC). The switch is process-wide; nothing else in the trainer calls ``torch.save``."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


# ---------------------------------------------------------------------------------------------------- reading


class _Reader(FsspecReader):
    """FsspecReader that reads the JSON index, and only files the (verified) manifest names."""

    def __init__(self, uri: str, allowed: set[str]):
        super().__init__(uri, **io.storage_options(uri))
        self.uri, self.allowed = uri, allowed

    def read_metadata(self, *args, **kwargs) -> Metadata:
        where = io.join(self.uri, METADATA_JSON)
        metadata = metadata_from_json(read_json_bounded(where), where)
        for info in metadata.storage_data.values():
            if check_name(info.relative_path, where) not in self.allowed:
                raise CorruptArtifactError(f"{where} refers to {info.relative_path!r}, which the manifest does not "
                                           "list; the checkpoint is refused")
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor values (optimizer hyperparameters) loaded with ``weights_only=True``: no code runs on load."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_state(state: dict, uri: str, allowed: set[str], process_group=None, reader=None) -> None:
    """``dcp.load`` into ``state`` (tensors filled in place, resharded to this world size). ``reader``: a
    ``_Reader`` to use instead of one over ``uri`` (peer.py's, over memory it fills). A failure on any rank
    raises ``CorruptArtifactError`` with every rank's reason (DCP's own ``CheckpointException`` derives from
    ``BaseException``, which ``except Exception`` would miss)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=reader or _Reader(uri, allowed), planner=_SafeLoadPlanner(),
                 process_group=process_group)
    except CheckpointException as e:
        reasons = "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}"
                            for rank, (exc, _) in sorted(e.failures.items()))
        raise CorruptArtifactError(f"checkpoint {uri} could not be loaded as its {METADATA_JSON} describes it "
                                   f"({reasons})") from None


# ------------------------------------------------------------------------------------------ the JSON index


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptArtifactError(f"{where} names the unknown dtype {name!r}; the checkpoint is refused")
    return dtype


def metadata_to_json(md: Metadata) -> dict:
    """DCP's index as plain JSON: tensor entries (dtype, size, chunks), byte entries, and where each is stored."""
    entries = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            entries[fqn] = {"bytes": True}
        else:
            p = m.properties
            assert p.layout == torch.strided and p.memory_format == torch.contiguous_format, (fqn, p)
            entries[fqn] = {"dtype": _dtype_name(p.dtype), "requires_grad": p.requires_grad, "size": list(m.size),
                            "chunks": [[list(c.offsets), list(c.sizes)] for c in m.chunks]}
    storage = [{"fqn": k.fqn, "offset": None if k.offset is None else list(k.offset), "index": k.index,
                "file": v.relative_path, "start": v.offset, "length": v.length,
                "transforms": list(v.transform_descriptors or [])}
               for k, v in md.storage_data.items()]
    planner = {k: list(v) for k, v in (md.planner_data or {}).items()}
    return {"version": md.version, "entries": entries, "storage": storage, "planner": planner}


def metadata_from_json(d, where: str) -> Metadata:
    try:
        entries = {}
        for fqn, e in d["entries"].items():
            if e.get("bytes"):
                entries[fqn] = BytesStorageMetadata()
                continue
            props = TensorProperties(dtype=_dtype(e["dtype"], where), requires_grad=bool(e["requires_grad"]))
            chunks = [ChunkStorageMetadata(offsets=torch.Size(map(int, o)), sizes=torch.Size(map(int, s)))
                      for o, s in e["chunks"]]
            entries[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(map(int, e["size"])),
                                                 chunks=chunks)
        storage = {}
        for s in d["storage"]:
            key = MetadataIndex(str(s["fqn"]), None if s["offset"] is None else [int(x) for x in s["offset"]],
                                None if s["index"] is None else int(s["index"]))
            storage[key] = storage_info(str(s["file"]), int(s["start"]), int(s["length"]),
                                        [str(t) for t in s["transforms"]] or None)
        planner = {str(k): tuple(v) for k, v in d["planner"].items()}
        for key in storage:  # DCP would fail deep in its planner on an entry it cannot place
            if key.fqn not in entries:
                raise CorruptArtifactError(f"{where} says where {key.fqn!r} is stored but does not index it; the "
                                           "checkpoint is refused")
        return Metadata(state_dict_metadata=entries, planner_data=planner, storage_data=storage,
                        version=d["version"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptArtifactError(f"{where} is malformed ({type(e).__name__}: {e}); the checkpoint is refused") \
            from None
