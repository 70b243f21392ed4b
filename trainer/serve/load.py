"""``load_model(run_dir)``: a trained network from its ``model.safetensors`` alone, in eval mode, with its class
names and its preprocessing.

    import dutycycle
    model = dutycycle.load_model("runs/digits")          # or the path of a model.safetensors
    model.classes                                        # label index -> class name
    x = model.preprocess("photo.png")                    # float [C, H, W], as the training batches were
    logits = model(x[None])                              # the network as trained: [B, C, H, W] -> [B, classes]
    model.predict(["a.png", "b.jpg"], top_k=3)           # [Prediction(labels, probabilities, indices), ...]

Nothing in the file runs: the tensors are safetensors and the metadata JSON, validated field by field
(``step.modelfile``), the weights checked against the sha256 the run recorded. The network is built by the
factory the metadata names: a built-in one by name; a plug-in (``package.module:factory``) only when the caller
says it trusts that module (``trust_plugin=True``, ``--trust-plugin``), because importing it runs its code and
the name comes from the file.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence

import torch
from dutycycle.engine import io
from dutycycle.engine.errors import ConfigError, CorruptArtifactError
from dutycycle.engine.transform import TransformSpec
from dutycycle.trainer.config import ModelSection
from dutycycle.trainer.configtree import build
from dutycycle.trainer.step.modelfile import MODEL_FILE, ModelMetadata, read_metadata, weights_digest
from dutycycle.trainer.step.models import build_model
from torch import nn

from .preprocess import ImageLike, Preprocess


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One image's top-k classes, most probable first."""

    labels: tuple[str, ...]
    probabilities: tuple[float, ...]
    indices: tuple[int, ...]

    @property
    def label(self) -> str:
        return self.labels[0]

    @property
    def probability(self) -> float:
        return self.probabilities[0]


class TrainedModel(nn.Module):
    """A trained network (``module``, as the run built it) with what inference needs: ``classes``,
    ``preprocess`` (a ``Preprocess``), ``metadata`` (the model file's ``ModelMetadata``) and ``source`` (the file).
    ``forward`` is the network's: normalized float ``[B, C, H, W]`` -> logits ``[B, len(classes)]``."""

    def __init__(self, module: nn.Module, metadata: ModelMetadata, preprocess: Preprocess, source: str):
        super().__init__()
        self.module = module
        self.metadata, self.preprocess, self.source = metadata, preprocess, source
        self.classes = list(metadata.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    @property
    def input_dtype(self) -> torch.dtype:
        """The floating dtype the weights hold (float64 for a run with run.precision = "fp64")."""
        p = next((t for t in self.module.parameters() if t.is_floating_point()), None)
        return p.dtype if p is not None else torch.float32

    @property
    def device(self) -> torch.device:
        p = next(self.module.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    @torch.inference_mode()
    def probabilities(self, x: torch.Tensor) -> torch.Tensor:
        """Softmax over the classes for a preprocessed batch ``[B, C, H, W]`` (moved to the model's device and
        dtype), in float32 or wider."""
        logits = self(x.to(self.device, self.input_dtype))
        return torch.softmax(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, dim=1)

    def top_k(self, x: torch.Tensor, k: int = 5) -> list[Prediction]:
        """The ``k`` most probable classes of each image of a preprocessed batch."""
        probs = self.probabilities(x)
        k = _check_k(k, len(self.classes))
        p, i = probs.topk(k, dim=1)
        return [Prediction(tuple(self.classes[j] for j in row_i), tuple(float(v) for v in row_p), tuple(row_i))
                for row_p, row_i in zip(p.tolist(), i.tolist(), strict=True)]

    def predict(self, images: Iterable[ImageLike], top_k: int = 5, batch_size: int = 64) -> list[Prediction]:
        """Preprocess and classify ``images`` (paths or URIs, bytes, PIL images) in batches of ``batch_size``;
        a file that is no usable image raises ``DecodeError`` naming it (``dutycycle predict`` records such
        files in its output instead)."""
        if batch_size < 1:
            raise ConfigError(f"batch_size = {batch_size} must be at least 1")
        out: list[Prediction] = []
        chunk: list = []
        for image in images:
            chunk.append(image)
            if len(chunk) == batch_size:
                out += self.top_k(self.preprocess.batch(chunk), top_k)
                chunk = []
        if chunk:
            out += self.top_k(self.preprocess.batch(chunk), top_k)
        return out


def _check_k(k: int, num_classes: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"top_k = {k!r} must be a positive integer, e.g. 5")
    return min(k, num_classes)


def model_file(run: str | os.PathLike) -> str:
    """The model file of ``run``: a run directory (its ``model.safetensors``) or the file itself."""
    run = os.fspath(run)
    return run if run.endswith(".safetensors") else io.join(run, MODEL_FILE)


def load_model(run: str | os.PathLike, *, device: str | torch.device | None = None, trust_plugin: bool = False,
               transform: TransformSpec | None = None) -> TrainedModel:
    """The network a run trained, from ``RUN/model.safetensors`` alone (no config, cache or table needed), in eval
    mode on ``device`` (default CPU). ``run``: a run directory or a ``.safetensors`` path (any fsspec URI).
    ``trust_plugin``: build a plug-in model (``model.name = "package.module:factory"``) by importing its module.
    ``transform``: the image transform to use instead of the recorded one (required only for a model trained on
    synthetic arrays, which records none)."""
    uri = model_file(run)
    meta = read_metadata(uri)
    module = _build(meta, uri, trust_plugin)
    _load_weights(module, meta, uri)
    spec, why = (transform, "") if transform is not None else _spec(meta, uri)
    module.eval()
    model = TrainedModel(module, meta, Preprocess(spec, meta.normalize, meta.channels, no_spec=why), uri).eval()
    if device is not None:
        model.to(device)
    return model


def _spec(meta: ModelMetadata, uri: str) -> tuple[TransformSpec | None, str]:
    """The recorded transform, or None and why there is none usable (the network still loads: only decoding
    files needs it)."""
    if meta.transform is None:
        return None, ("this model records no image transform (it was trained on in-memory arrays, data.source = "
                      "'synthetic')")
    try:
        return TransformSpec.from_dict(dict(meta.transform)), ""
    except (ConfigError, TypeError) as e:
        return None, (f"{uri} records the transform {meta.transform}, which is no TransformSpec this dutycycle "
                      f"applies ({e}; the dutycycle that wrote it: {meta.code.get('dutycycle')})")


def _build(meta: ModelMetadata, uri: str, trust_plugin: bool) -> nn.Module:
    name = meta.model["name"]
    try:
        section = build(ModelSection, dict(meta.model["args"]), "model")
        section.check("model")
    except ConfigError as e:
        raise ConfigError(f"{uri}: the model's recorded arguments do not fit this dutycycle ({e}); use the "
                          f"dutycycle that wrote it ({meta.code.get('dutycycle')})") from None
    if section.name != name:
        raise CorruptArtifactError(f"{uri}: the metadata names model {name!r} and its arguments {section.name!r}; "
                                   "take the file again from its run directory")
    if ":" in name and not trust_plugin:
        raise ConfigError(f"{uri} was trained with the plug-in model {name!r}; building it imports that module, "
                          "which runs its code, and the name comes from the file: pass trust_plugin=True "
                          "(dutycycle predict/export: --trust-plugin) if you trust it")
    return build_model(section, meta.channels, len(meta.classes), meta.size)


def _read_tensors(uri: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load, load_file

    try:
        if io.protocol(uri) == "file":
            return load_file(uri.removeprefix("file://"), device="cpu")  # memory-mapped
        fs, path = io.filesystem(uri)
        return load(fs.cat_file(path))
    except SafetensorError as e:
        raise CorruptArtifactError(f"{uri}: the tensors cannot be read ({e}); take the file again from its run "
                                   "directory") from None


def _load_weights(module: nn.Module, meta: ModelMetadata, uri: str) -> None:
    state = _read_tensors(uri)
    if len(state) != meta.weights["tensors"] or weights_digest(state) != meta.weights["sha256"]:
        raise CorruptArtifactError(f"{uri}: the weights do not match the sha256 the run recorded for them (changed "
                                   "or damaged after the run wrote them); take the file again from its run directory")
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(dtypes) == 1:  # keep what was trained (float64 for run.precision = "fp64"); the factory builds float32
        module.to(dtypes.pop())
    missing, unexpected = _mismatch(module, state)
    if missing or unexpected:
        raise ConfigError(f"{uri}: the weights do not fit the model {meta.model['name']!r} built from the recorded "
                          f"arguments (missing: {_names(missing)}; unexpected: {_names(unexpected)}); the model's "
                          "code changed since training: use the version that trained it")
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as e:  # shapes differ
        raise ConfigError(f"{uri}: the weights do not fit the model {meta.model['name']!r} built from the recorded "
                          f"arguments ({str(e).splitlines()[-1].strip()}); the model's code changed since "
                          "training: use the version that trained it") from None


def _mismatch(module: nn.Module, state: dict) -> tuple[list[str], list[str]]:
    own = set(module.state_dict())
    return sorted(own - set(state)), sorted(set(state) - own)


def _names(names: Sequence[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "") if names else "none"
