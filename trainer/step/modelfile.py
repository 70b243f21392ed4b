"""What ``model.safetensors`` says about itself: the facts that make the weights usable without the run's config,
its cache or its table.

safetensors stores a string-to-string ``__metadata__`` map in its JSON header (no code, no pickle). dutycycle
writes two keys there: ``"format": "pt"`` (the convention Hugging Face's loaders look for) and ``"dutycycle"``,
one JSON object:

    format          1 (``engine.formats``): a file of another format is refused
    classes         label index -> class name
    input           what the network takes: {"channels", "height", "width", "mode" ("RGB", "L"), "layout":
                    "NCHW", "dtype"} (float, normalized as below)
    normalize       {"mean": [...], "std": [...]}: inputs were ``(x / 255 - mean) / std`` per channel; null: ``x / 255``
    transform       the TransformSpec that made a sample from its file (null for in-memory synthetic data)
    model           {"name": "cnn" or "package.module:factory", "args": the [model] section}
    weights         {"dtype", "tensors", "sha256"}: ``weights_digest`` of the tensors, checked on load
    data            {"source", "table", "table_version", "cache", "fingerprint"}: where the training data came from
    code            {"dutycycle": version, "git": revision or null, "git_dirty": bool or null, "torch": version}
    created_at      seconds since the epoch
    manifest_sha256 sha256 of the other fields' canonical JSON (``engine.sealed``): a changed field is refused

Writing (rank 0, in ``summary.summarize_run``) and reading (``serve.load``) share this module, so the two cannot
drift apart. Reading parses only the header (at most ``MAX_HEADER_BYTES``) and validates every field before any
of it is used; errors name the file and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from pathlib import Path
from typing import Any

from dutycycle.engine import formats, io, sealed
from dutycycle.engine.errors import CorruptArtifactError, SourceError
from dutycycle.trainer.configtree import as_tree

MODEL_FILE = "model.safetensors"
METADATA_KEY = "dutycycle"
# safetensors' own ceiling on a header (its Rust reader refuses larger): a file claiming more is not read further
MAX_HEADER_BYTES = 100_000_000
_FIX = "take the file again from its run directory, or train again to write it with this dutycycle"


@dataclasses.dataclass(frozen=True)
class ModelMetadata:
    """The ``"dutycycle"`` metadata of a model file, validated."""

    classes: list[str]
    input: dict[str, Any]
    normalize: dict[str, list[float]] | None
    transform: dict[str, Any] | None
    model: dict[str, Any]
    weights: dict[str, Any]
    data: dict[str, Any]
    code: dict[str, Any]
    created_at: float

    @property
    def channels(self) -> int:
        return self.input["channels"]

    @property
    def size(self) -> int:
        return self.input["height"]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------------ writing


def model_metadata(cfg, info, state: dict, weights_sha256: str) -> dict[str, str]:
    """The safetensors metadata for the consolidated ``state`` of a run of ``cfg`` trained on ``info`` (a
    ``step.data.DataInfo``); ``weights_sha256`` is ``weights_digest(state)``."""
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state.values() if t.is_floating_point()})
    spec = dict(info.spec) if info.spec else None
    lineage = info.lineage or {}
    options = lineage.get("options") or {}
    body = {
        "classes": list(info.classes),
        "input": {"channels": info.channels, "height": info.size, "width": info.size,
                  # the colour mode the transform produced; synthetic shapes are drawn in RGB
                  "mode": (spec or {}).get("mode") or ("L" if info.channels == 1 else "RGB"),
                  "layout": "NCHW", "dtype": dtypes[0] if len(dtypes) == 1 else "float32"},
        "normalize": info.normalize,
        "transform": spec,
        "model": {"name": cfg.model.name, "args": as_tree(cfg.model)},
        "weights": {"dtype": ",".join(dtypes), "tensors": len(state), "sha256": weights_sha256},
        "data": {"source": cfg.data.source, "table": lineage.get("table") or None,
                 # a cache records the table version it was made from; the raw path's plan names only the table
                 "table_version": options.get("table_version"), "cache": lineage.get("cache") or None,
                 "fingerprint": info.fingerprint},
        "code": code_revision(),
        "created_at": time.time(),
    }
    d = sealed.seal(formats.stamp(body))
    return {"format": "pt", METADATA_KEY: json.dumps(d, sort_keys=True)}


def weights_digest(state: dict) -> str:
    """sha256 over a consolidated state dict's tensors (names sorted): equal digests mean bit-identical weights."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name, p in sorted(state.items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def code_revision() -> dict[str, Any]:
    """dutycycle's version, torch's, and the git revision of dutycycle's source tree when it runs from a
    checkout (an editable install); None where unknown."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        own = version("dutycycle")
    except PackageNotFoundError:
        own = None
    # the folder holding engine/, loader/ and trainer/; only a checkout has .git right there (asking git from an
    # installed copy would walk up and report whatever repository the environment happens to sit in)
    root = Path(__file__).resolve().parents[2]
    git = dirty = None
    if (root / ".git").exists():
        git = _git(root, "rev-parse", "HEAD")
        status = _git(root, "status", "--porcelain", "--untracked-files=no") if git else None
        dirty = None if status is None else bool(status)
    return {"dutycycle": own, "git": git, "git_dirty": dirty, "torch": torch.__version__}


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                             check=True)
    except (OSError, subprocess.SubprocessError):  # no git, not a repository, too slow: unknown
        return None
    return out.stdout.strip()


# ------------------------------------------------------------------------------------------------ reading


def read_header(uri: str) -> dict[str, Any]:
    """The JSON header of the safetensors file at ``uri`` (tensor entries and ``__metadata__``), read without the
    tensors: 8 bytes of length (little-endian), then that much JSON."""
    fs, path = io.filesystem(uri)
    try:
        with fs.open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 2 <= n <= MAX_HEADER_BYTES:
                raise CorruptArtifactError(f"{uri} is not a safetensors file (its header length reads {n}); {_FIX}")
            raw = f.read(n)
    except FileNotFoundError:
        raise SourceError(f"no model file at {uri!r}: a run writes {MODEL_FILE} when it finishes with "
                          "run.save_model = true; pass a finished run's directory") from None
    except IsADirectoryError:
        raise SourceError(f"{uri!r} is a folder, not a model file; pass the run directory or its {MODEL_FILE}") \
            from None
    if len(raw) != n:
        raise CorruptArtifactError(f"{uri} is cut short: its header claims {n} bytes, the file holds {len(raw)}; {_FIX}")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptArtifactError(f"{uri}: the safetensors header is not JSON ({e}); {_FIX}") from None
    if not isinstance(header, dict):
        raise CorruptArtifactError(f"{uri}: the safetensors header is not a JSON object; {_FIX}")
    return header


def read_metadata(uri: str) -> ModelMetadata:
    """The validated dutycycle metadata of the model file at ``uri``."""
    meta = read_header(uri).get("__metadata__")
    text = meta.get(METADATA_KEY) if isinstance(meta, dict) else None
    if not isinstance(text, str):
        raise CorruptArtifactError(
            f"{uri} carries no dutycycle metadata (the `{METADATA_KEY}` entry of its safetensors metadata): it was "
            "written by another tool or before dutycycle recorded it; train again with this dutycycle, or load "
            "the tensors yourself with safetensors.torch.load_file into the model the run's config.json names")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise CorruptArtifactError(f"{uri}: the `{METADATA_KEY}` metadata is not JSON ({e}); {_FIX}") from None
    where = f"{uri} (its `{METADATA_KEY}` metadata)"
    formats.check(d, where)
    body = sealed.unseal(d, where, _FIX)
    problem = _problem(body)
    if problem:
        raise CorruptArtifactError(f"{where} is malformed: {problem}; {_FIX}")
    return ModelMetadata(**{f.name: body[f.name] for f in dataclasses.fields(ModelMetadata)})


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _problem(d: dict[str, Any]) -> str | None:
    """What is wrong with the metadata's fields (all present, of the types and shapes readers rely on), or None."""
    missing = [f.name for f in dataclasses.fields(ModelMetadata) if f.name not in d]
    if missing:
        return f"{', '.join(f'`{m}`' for m in missing)} missing"
    classes, inp = d["classes"], d["input"]
    if not isinstance(classes, list) or not classes or not all(isinstance(c, str) for c in classes):
        return "`classes` must be a non-empty list of names"
    if not isinstance(inp, dict) or not all(sealed.is_count(inp.get(k)) and inp.get(k) > 0
                                            for k in ("channels", "height", "width")):
        return "`input` must hold positive `channels`, `height` and `width`"
    if not all(isinstance(inp.get(k), str) for k in ("mode", "layout", "dtype")):
        return "`input` must name its `mode`, `layout` and `dtype`"
    norm = d["normalize"]
    if norm is not None:
        ok = isinstance(norm, dict) and all(
            isinstance(norm.get(k), list) and len(norm[k]) in (1, inp["channels"]) and all(map(_is_number, norm[k]))
            for k in ("mean", "std"))
        if not ok or not all(s > 0 for s in norm["std"]):
            return "`normalize` must be null or hold `mean` and `std` lists, one value per channel, std > 0"
    if d["transform"] is not None and not isinstance(d["transform"], dict):
        return "`transform` must be null or an object of TransformSpec fields"
    model = d["model"]
    if not isinstance(model, dict) or not isinstance(model.get("name"), str) or not isinstance(model.get("args"), dict):
        return "`model` must hold a `name` and its `args`"
    w = d["weights"]
    if not isinstance(w, dict) or not isinstance(w.get("sha256"), str) or not sealed.is_count(w.get("tensors")):
        return "`weights` must hold `sha256` and `tensors`"
    for name in ("data", "code"):
        if not isinstance(d[name], dict):
            return f"`{name}` must be an object"
    if not _is_number(d["created_at"]):
        return "`created_at` must be a number"
    return None
