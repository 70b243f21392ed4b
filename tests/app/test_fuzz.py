"""A fuzz round over every artifact dutycycle reads back: seeded random truncations and byte flips (and, in JSON,
whitespace swapped for other whitespace) of

- table manifests: the versioned manifest ``_manifests/v00001.json``, read with the table's rows
  (``engine.table.table.read_arrow``), and the ``_manifest.json`` copy in a table that has only that one;
- the cache manifest ``manifest.json`` and a shard file ``shards/shard-00000.arrow``, read by a ``CacheLoader``
  (its split index, then every batch of an epoch);
- a shard's completion record ``shards/shard-00000.json``, read by materialize's resume check
  (``engine.cache.udf.completed``);
- a checkpoint's ``manifest.json`` and ``metadata.json``, read by resume (``resume.select`` of the step, its
  trainer state, the tensors through DCP); ``metadata.json`` also without the manifest's checksums in front, to
  exercise its own parser (``storage.read_state``);
- the loader state inside ``trainer_state.json`` (mutations only inside its ``"loader"`` object), read as resume
  reads it and loaded into the trainer's ``ArraySource``;
- a run's ``model.safetensors``, read by ``load_model``: the whole file (tensors and header), and its JSON header
  alone (where the metadata is: mutations that keep the JSON valid).

Each mutated artifact must give one of two outcomes:

- **refused**: a ``DutycycleError`` (``CorruptArtifactError``, ``ConfigError``, ...) whose message names the file
  or the artifact;
- **equal**: exactly the original's result (a flip in a byte that does not matter, such as JSON whitespace).

Anything else fails the case: a raw exception (``KeyError``, ``json.JSONDecodeError``, ``pyarrow.ArrowInvalid``, ...),
a ``DutycycleError`` that does not say which artifact, a different result read without complaint, or a hang
(every case has a timeout). For the shard completion record a third outcome is right: ``None``, "not complete",
after which materialize builds the shard again (the record is a resume hint, the shard's checksum decides).

Cases are numbered and seeded (40 per artifact, 440 in all). The engine's artifacts are built byte-for-byte the
same on every run (fixed times, writer ids and folder names), so each of their cases is the same mutation of the
same bytes everywhere; the checkpoint's timings and RNG states differ per run, and so do the model file's creation
time and code revision, so their cases differ slightly from run to run. A truncation that removed more than
whitespace can never read equal: the reader must notice it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pytest
from dutycycle.engine.errors import DutycycleError

CASES = 40  # per artifact
TIMEOUT_S = 30  # per case: a reader that hangs fails its case instead of the run


# ---------------------------------------------------------------------------------------------- mutations


def json_whitespace(data: bytes) -> list[int]:
    """Positions of whitespace between JSON tokens (not inside strings)."""
    out, in_string, escaped = [], False, False
    for i, c in enumerate(data):
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c in b" \n\t\r":
            out.append(i)
    return out


def mutation(data: bytes, case: int, seed: str, span: tuple[int, int] | None = None,
             is_json: bool = True) -> tuple[str, bytes]:
    """Case ``case`` of an artifact's fuzz round, inside ``span`` (default: the whole file). Of every ten cases,
    four truncate the file; in JSON, three flip a random byte by a random mask, one changes a digit into another
    digit and one a letter into another letter (flips that keep the JSON valid and change a value or a key),
    and one swaps a whitespace byte between tokens for another (which must read the same); in other files, six
    flip a random byte. The same (bytes, case, seed) give the same mutation everywhere."""
    rng = random.Random(f"{seed}:{case}")
    lo, hi = span or (0, len(data))
    kind = case % 10

    def replace(pos: int, new: int, how: str) -> tuple[str, bytes]:
        return (f"{how} at byte {pos}: {data[pos]:#04x} {chr(data[pos])!r} -> {new:#04x} {chr(new)!r}",
                data[:pos] + bytes([new]) + data[pos + 1:])

    if kind < 4:
        cut = rng.randrange(lo, hi)
        return f"truncated to {cut} of {len(data)} bytes", data[:cut]
    if is_json and kind >= 7:
        digits = b"0123456789"
        letters = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
        pool = {7: digits, 8: letters, 9: b" \n\t\r"}[kind]
        where = json_whitespace(data) if kind == 9 else [i for i in range(len(data)) if data[i] in pool]
        where = [i for i in where if lo <= i < hi]
        if where:
            pos = rng.choice(where)
            new = rng.choice([c for c in pool if c != data[pos]])
            return replace(pos, new, {7: "digit changed", 8: "letter changed", 9: "whitespace swapped"}[kind])
    pos = rng.randrange(lo, hi)
    return replace(pos, data[pos] ^ rng.randrange(1, 256), "byte flipped")


# ---------------------------------------------------------------------------------------------- artifacts


@dataclass
class Artifact:
    """One artifact's fuzz round: ``build(dir)`` writes a pristine copy under ``dir`` and returns the file to
    mutate (relative); ``read(dir)`` reads it back as a comparable value; an error must name one of ``names``
    (``{root}``: the folder of the mutated copy)."""

    name: str
    build: Callable[[str], str]
    read: Callable[[str], Any]
    names: tuple[str, ...]
    is_json: bool = True
    span: Callable[[bytes], tuple[int, int]] | None = None
    none_ok: bool = False  # None ("not complete: build it again") is a right answer for a resume hint


# --- tables


TABLE_ROWS = 12


def build_table(root: str) -> str:
    from dutycycle.engine.table import format as tf

    from ..support.tablemaker import write_table

    table = os.path.join(root, "table")
    rows = [{"sample_id": hashlib.sha256(str(i).encode()).hexdigest()[:32], "uri": f"file:///images/{i}.png",
             "size_bytes": 100 + i, "modified": str(1_700_000_000_000_000_000 + i), "format": "PNG", "width": 8,
             "height": 8, "mode": "RGB", "channels": 3, "orientation": 1, "label": ["circle", "square"][i % 2],
             "split": "train" if i % 4 else "val", "phash": i, "error": None} for i in range(TABLE_ROWS)]
    write_table(table, rows, classes=["circle", "square"])
    # the same bytes on every run: a fixed data folder, commit time and writer id
    (folder,) = [d for d in os.listdir(table) if d.startswith("v00001-")]
    os.rename(os.path.join(table, folder), os.path.join(table, "v00001-00000000"))
    path = os.path.join(table, tf.manifest_path(1))
    with open(path) as f:
        d = json.load(f)
    d["files"] = [p.replace(folder, "v00001-00000000") for p in d["files"]]
    d["created_at"], d["writer"] = 1_700_000_000.0, "0" * 32
    data = tf.encode(d)  # sealed with its checksum again, as format.commit writes it
    for name in (tf.manifest_path(1), tf.MANIFEST):
        with open(os.path.join(table, name), "wb") as f:
            f.write(data)
    return os.path.join("table", tf.manifest_path(1))


def build_table_copy_only(root: str) -> str:
    """A table with only ``_manifest.json`` (no versioned manifests): the copy is what a reader takes."""
    from dutycycle.engine.table import format as tf

    build_table(root)
    shutil.rmtree(os.path.join(root, "table", tf.MANIFEST_DIR))
    return os.path.join("table", tf.MANIFEST)


def read_table(root: str):
    from dutycycle.engine.table import format as tf
    from dutycycle.engine.table.table import read_arrow

    table = os.path.join(root, "table")
    manifest = tf.read_manifest(table)
    return asdict(manifest), read_arrow(table, manifest).to_pydict()


# --- caches


def build_cache(root: str) -> str:
    from ..support.cachemaker import make_cache

    make_cache(os.path.join(root, "cache"), 48, shape=(4, 4, 3), shards=2, splits={"train": 0.75, "val": 0.25})
    return os.path.join("cache", "manifest.json")


def build_shard(root: str) -> str:
    build_cache(root)
    return os.path.join("cache", "shards", "shard-00000.arrow")


def read_cache(root: str):
    """The manifest and an epoch of train batches, read by a CacheLoader with its own node folder (no split
    index or verified marker from another case)."""
    from dutycycle.engine.cache.shards import ReadConfig
    from dutycycle.loader import AugmentConfig, CacheLoader, LoaderConfig

    cfg = LoaderConfig(global_batch_size=8, mode="sync", augment=AugmentConfig(normalize=False),
                       read=ReadConfig(node_dir=os.path.join(root, "node")))
    loader = CacheLoader(os.path.join(root, "cache"), "train", config=cfg)
    batches = [(b["sample_id"], b["label"].tolist(), hashlib.sha256(b["image"].numpy().tobytes()).hexdigest())
               for b in loader]
    return loader.reader.manifest.to_json(), batches


def build_shard_record(root: str) -> str:
    """A shard written by materialize's own shard writer, with its completion record."""
    from dutycycle.engine.cache import udf
    from dutycycle.engine.transform import TransformSpec

    cache = os.path.join(root, "cache")
    spec = TransformSpec(size=4)
    n = 10
    ids = sorted(hashlib.sha256(str(i).encode()).hexdigest()[:32] for i in range(n))
    samples = [bytes([i]) * int(np.prod(spec.shape)) for i in range(n - 1)] + ["unreadable"]
    udf.finish_shard(cache, 0, ids, [i % 2 for i in range(n)], ["train"] * n, samples, spec)
    path = os.path.join(cache, udf.record_name(0))
    with open(path) as f:
        rec = json.load(f)
    rec["worker"], rec["seconds"] = "host:1", 0.0  # the same bytes on every run
    udf.write_record(cache, 0, rec)  # sealed with its checksum again, as finish_shard writes it
    with open(os.path.join(root, "ids_digest"), "w") as f:
        f.write(udf.ids_digest(ids))
    return os.path.join("cache", udf.record_name(0))


def read_shard_record(root: str):
    from dutycycle.engine.cache import udf

    with open(os.path.join(root, "ids_digest")) as f:
        digest = f.read()
    return udf.completed(os.path.join(root, "cache"), 0, digest)


# --- checkpoints


N_IMAGES = 48


def _arrays():
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (N_IMAGES, 4, 4, 3), dtype=np.uint8), np.arange(N_IMAGES) % 3


def array_source():
    from dutycycle.trainer.step.data import ArraySource

    images, labels = _arrays()
    return ArraySource(images, labels, 8, 0, 1, seed=5, flip=True, fingerprint="synthetic-fuzz")


def tensors():
    import torch

    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(16, 8, generator=g), "b": torch.arange(8, dtype=torch.float32)},
            "optim": {"m": torch.randn(16, 8, generator=g), "lr": 0.1, "betas": (0.9, 0.999)}}


def build_checkpoint(root: str) -> str:
    from dutycycle.trainer.checkpoint.saver import Saver
    from dutycycle.trainer.checkpoint.state import TrainerState, capture_rng

    source = array_source()
    it = iter(source)
    next(it), next(it)
    saver = Saver(os.path.join(root, "ckpt"), rank=0, world_size=1, keep=2, async_save=False)
    saver.save(1, tensors(), TrainerState(step=1, epoch=0, loader=source.state_dict(), rng=[], world_size=1),
               capture_rng())
    saver.wait()
    saver.close()
    return os.path.join("ckpt", "step-00000001", "manifest.json")


def build_checkpoint_metadata(root: str) -> str:
    build_checkpoint(root)
    return os.path.join("ckpt", "step-00000001", "metadata.json")


def _load_tensors(uri: str, files: set[str]):
    import torch
    from dutycycle.trainer.checkpoint.storage import read_state

    want = tensors()
    got = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
           "optim": {"m": torch.zeros(16, 8), "lr": 0.0, "betas": (0.0, 0.0)}}
    read_state(got, uri, files)
    return {"model": {k: v.tolist() for k, v in got["model"].items()},
            "optim": {"m": got["optim"]["m"].tolist(), "lr": got["optim"]["lr"],
                      "betas": list(got["optim"]["betas"])}}


def read_checkpoint(root: str):
    """Resume's reads of one step: select (manifest, checksums), the trainer state, the tensors."""
    from dutycycle.trainer.checkpoint import resume

    selected = resume.select(os.path.join(root, "ckpt", "step-00000001"), 0, 1)
    state = resume.read_trainer_state(selected)
    return (selected.step, {k: asdict(v) for k, v in selected.manifest.files.items()}, state.to_json(),
            _load_tensors(selected.uri, set(selected.manifest.files)))


def read_checkpoint_unverified(root: str):
    """The tensors read through ``metadata.json`` with no checksum in front: its own parser must hold."""
    from dutycycle.trainer.checkpoint import manifest as mf

    step = os.path.join(root, "ckpt", "step-00000001")
    return _load_tensors(step, set(mf.read_manifest(step).files))


def loader_span(data: bytes) -> tuple[int, int]:
    """The bytes of the ``"loader": {...}`` object in trainer_state.json."""
    start = data.index(b'"loader": {') + len(b'"loader": ')
    depth = 0
    for i in range(start, len(data)):
        depth += {0x7B: 1, 0x7D: -1}.get(data[i], 0)
        if depth == 0:
            return start, i + 1
    raise AssertionError("unbalanced loader object")


def build_loader_state(root: str) -> str:
    build_checkpoint(root)
    return os.path.join("ckpt", "step-00000001", "trainer_state.json")


def read_loader_state(root: str):
    """trainer_state.json read as resume reads it (the manifest's checksum of the file first: the loader state
    has none of its own), its loader state loaded into a fresh ArraySource: the position and the next batch."""
    from dutycycle.trainer.checkpoint import resume

    selected = resume.select(os.path.join(root, "ckpt", "step-00000001"), 0, 1)
    state = resume.read_trainer_state(selected)
    source = array_source()
    source.load_state_dict(state.loader)
    batch = next(iter(source))
    return source.position(), batch["sample_id"], batch["image"].sum().item()


# --- a run's model file


def build_model_file(root: str) -> str:
    """A ``model.safetensors`` as a run writes it: a small CNN's tensors with its dutycycle metadata."""
    import torch
    from dutycycle.engine.transform import TransformSpec
    from dutycycle.trainer.config import load_config
    from dutycycle.trainer.parallel.state import to_safetensors
    from dutycycle.trainer.step.data import DataInfo
    from dutycycle.trainer.step.modelfile import model_metadata, weights_digest
    from dutycycle.trainer.step.models import build_model

    cfg = load_config(None, ["data.source=synthetic", "model.width=4", "model.depth=1", "model.groups=2"])
    torch.manual_seed(0)
    state = build_model(cfg.model, 3, 2, 8).state_dict()
    info = DataInfo(2, 3, 8, 10, 2, fingerprint="fuzz", classes=["circle", "square"],
                    normalize={"mean": [0.5], "std": [0.25]}, spec=TransformSpec(size=8).to_dict())
    os.makedirs(os.path.join(root, "run"))
    with open(os.path.join(root, "run", "model.safetensors"), "wb") as f:
        f.write(to_safetensors(state, model_metadata(cfg, info, state, weights_digest(state))))
    return os.path.join("run", "model.safetensors")


def header_span(data: bytes) -> tuple[int, int]:
    """The JSON header of a safetensors file: after its 8-byte length, that many bytes."""
    return 8, 8 + int.from_bytes(data[:8], "little")


def read_model_file(root: str):
    """``load_model`` of the run: its metadata and the network's logits on a fixed input."""
    import torch
    from dutycycle.trainer.serve.load import load_model

    model = load_model(os.path.join(root, "run"))
    with torch.no_grad():
        logits = model(torch.linspace(-1, 1, 2 * 3 * 8 * 8).reshape(2, 3, 8, 8))
    return model.metadata.to_dict(), repr(model.preprocess), logits.tolist()


ARTIFACTS = {a.name: a for a in [
    Artifact("table_manifest", build_table, read_table, ("v00001.json",)),
    Artifact("table_manifest_copy", build_table_copy_only, read_table, ("_manifest.json",)),
    # a cache's errors may name the cache folder instead of the file: "materialize it again" mends either
    Artifact("cache_manifest", build_cache, read_cache, ("manifest.json", "{root}/cache")),
    Artifact("cache_shard", build_shard, read_cache, ("shard-00000.arrow", "{root}/cache"), is_json=False),
    Artifact("shard_record", build_shard_record, read_shard_record, ("shard-00000.json",), none_ok=True),
    Artifact("checkpoint_manifest", build_checkpoint, read_checkpoint, ("manifest.json",)),
    Artifact("checkpoint_metadata", build_checkpoint_metadata, read_checkpoint, ("metadata.json",)),
    Artifact("checkpoint_metadata_unverified", build_checkpoint_metadata, read_checkpoint_unverified,
             ("metadata.json",)),
    Artifact("loader_state", build_loader_state, read_loader_state, ("loader state", "trainer_state.json"),
             span=loader_span),
    Artifact("model_file", build_model_file, read_model_file, ("model.safetensors",), is_json=False),
    Artifact("model_file_header", build_model_file, read_model_file, ("model.safetensors",), span=header_span),
]}

# ---------------------------------------------------------------------------------------------- the round


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Each artifact built once: (folder, file to mutate, its bytes, the original read)."""
    built = {}
    for name, art in ARTIFACTS.items():
        root = str(tmp_path_factory.mktemp(f"pristine-{name}"))
        rel = art.build(root)
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        built[name] = (root, rel, data, art.read(root))
    return built


def classify(art: Artifact, root: str, original) -> tuple[str, str]:
    """``(outcome, detail)``: outcome is equal, refused, none (resume hints only) or one of the failures
    different, unnamed, leaked."""
    try:
        got = art.read(root)
    except DutycycleError as e:
        named = any(token.format(root=root) in str(e) for token in art.names)
        return ("refused" if named else "unnamed"), f"{type(e).__name__}: {e}"
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException derives from BaseException
        if not isinstance(e, Exception) and type(e).__name__ != "CheckpointException":
            raise
        return "leaked", f"{type(e).__name__}: {e}"
    if got is None and art.none_ok:
        return "none", "read as not complete (rebuilt)"
    return ("equal", "") if got == original else ("different", f"read without error but differs: {got!r:.300}")


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("name, case", [pytest.param(name, case, id=f"{name}-{case}")
                                        for name in ARTIFACTS for case in range(CASES)])
def test_a_mutated_artifact_is_refused_naming_it_or_reads_the_same(name, case, pristine, tmp_path):
    art = ARTIFACTS[name]
    src, rel, data, original = pristine[name]
    root = str(tmp_path / "copy")
    shutil.copytree(src, root, ignore=shutil.ignore_patterns("node"))
    what, mutated = mutation(data, case, name, art.span(data) if art.span else None, art.is_json)
    with open(os.path.join(root, rel), "wb") as f:
        f.write(mutated)
    outcome, detail = classify(art, root, original)
    assert outcome in ("equal", "refused", "none"), f"{rel} {what}: {outcome}: {detail}"
    if data[len(mutated):].strip():  # a cut that removed content cannot read the same: the reader must see it
        assert outcome != "equal", f"{rel} {what}: read as if whole"



@pytest.mark.parametrize("name, key", [("table_manifest", "manifest_sha256"), ("table_manifest_copy", "manifest_sha256"),
                                       ("cache_manifest", "manifest_sha256"), ("shard_record", "record_sha256")])
def test_an_artifact_without_its_checksum_is_refused_naming_it(name, key, pristine, tmp_path):
    """Every artifact of format 1 is written with its checksum: one without it is refused, naming it (a shard's
    completion record reads as not complete, and the shard is built again)."""
    art = ARTIFACTS[name]
    src, rel, data, original = pristine[name]
    root = str(tmp_path / "copy")
    shutil.copytree(src, root, ignore=shutil.ignore_patterns("node"))
    d = json.loads(data)
    del d[key]
    with open(os.path.join(root, rel), "w") as f:
        json.dump(d, f, indent=1)
    outcome, detail = classify(art, root, original)
    assert outcome == ("none" if name == "shard_record" else "refused"), f"{outcome}: {detail}"
    if outcome == "refused":
        assert f"has no checksum ({key})" in detail, detail


def test_a_table_manifest_naming_a_missing_data_file_is_refused_naming_it(pristine, tmp_path):
    """A damage the checksum cannot see (the manifest sealed again, or the file deleted by hand): the read names
    the table's version and the file."""
    from dutycycle.engine.errors import CorruptArtifactError
    from dutycycle.engine.table import format as tf

    src, rel, data, _ = pristine["table_manifest"]
    root = str(tmp_path / "copy")
    shutil.copytree(src, root)
    d = json.loads(data)
    d["files"] = [p.replace("part-00000", "part-00009") for p in d["files"]]
    with open(os.path.join(root, rel), "wb") as f:
        f.write(tf.encode(d))
    with pytest.raises(CorruptArtifactError, match=r"version 1 names the data file '[^']*part-00009\.parquet', which "
                                                   "does not exist"):
        read_table(root)
