"""``dutycycle export RUN``: the trained network as files other runtimes load, each checked against the model.

What is exported: ``PixelModel``, the network with the training normalization folded into the graph. Its input is
``image``, uint8 ``[batch, C, H, W]`` (channels first, RGB or grey as the transform makes them, the batch
dimension dynamic); its output ``logits``, ``[batch, classes]`` (no softmax). A consumer therefore needs only the
decode and the resize that the cache's transform did (``preprocessing.json`` states it: the TransformSpec, the
steps in words, the class names), never the mean and std, which cannot then drift from what was trained.

Files, under ``--out`` (default ``RUN/export``), each written whole (atomic) and only after every check passed,
``preprocessing.json`` last (the commit: it names the others):

    model.pt2            ``torch.export.save`` of the program: ``torch.export.load(path).module()(image)``
    model.onnx           where the ``onnx`` and ``onnxscript`` packages are installed (torch's dynamo exporter)
    preprocessing.json   input, output, transform, normalization (as folded in), classes, checks, provenance

Checks: each file is read back and run on random uint8 batches of 1 and 3 images (the program is traced at 2, so
both exercise the dynamic batch); the largest absolute difference from the model's logits on the same images
(``TrainedModel`` on ``preprocess.normalize_pixels``, the path training batches took) must stay within
``tolerance`` and is reported. ONNX runs in onnxruntime when it is installed, else in onnx's reference evaluator.
A model that cannot be exported fails with ``ExportError`` naming the step (trace, save, reload, check, ONNX
conversion, ONNX check) and the first lines of the cause.
"""

from __future__ import annotations

import contextlib
import io as _io
import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from dutycycle.engine import formats, io
from dutycycle.engine.errors import ConfigError, DutycycleError
from dutycycle.engine.limits import ALLOWED_FORMATS, DEFAULT_MAX_PIXELS
from dutycycle.engine.transform import TransformSpec
from torch import nn

from .load import TrainedModel, load_model

EXPORT_DIR = "export"
PROGRAM_FILE = "model.pt2"
ONNX_FILE = "model.onnx"
FACTS_FILE = "preprocessing.json"
EXAMPLE_BATCH = 2  # torch.export specializes dimensions of size 0 and 1, so the traced example holds 2 images
CHECK_BATCHES = (1, 3)  # checked on other sizes than the traced one: the batch dimension must really be dynamic


class ExportError(DutycycleError):
    """A model that cannot be exported, or whose exported form does not compute what the model computes."""


class PixelModel(nn.Module):
    """uint8 ``[B, C, H, W]`` -> logits: the training normalization, then the network. The arithmetic is the
    loader's (``loader.augment.to_tensor``): ``x * (float32(1/255) / std) + (-mean / std)`` in float32, or
    ``x / 255`` where the run did not normalize, so the exported graph sees the very inputs training saw."""

    def __init__(self, module: nn.Module, normalize: dict | None, channels: int, dtype: torch.dtype):
        super().__init__()
        self.module, self.dtype, self.normalized = module, dtype, normalize is not None
        if normalize is not None:
            std = np.broadcast_to(np.asarray(normalize["std"], np.float32), (channels,)).reshape(1, channels, 1, 1)
            mean = np.broadcast_to(np.asarray(normalize["mean"], np.float32), (channels,)).reshape(1, channels, 1, 1)
            self.register_buffer("scale", torch.from_numpy(np.float32(1.0 / 255.0) / std))
            self.register_buffer("shift", torch.from_numpy(-mean / std))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = image.to(torch.float32)
        x = x * self.scale + self.shift if self.normalized else x / 255.0
        return self.module(x.to(self.dtype))


def export_model(model: TrainedModel | str, out: str | None = None, *, onnx: bool | None = None,
                 trust_plugin: bool = False, seed: int = 0) -> dict[str, Any]:
    """Export ``model`` (a ``TrainedModel`` or a run directory / model file) under ``out`` (default: a folder
    ``export`` beside the model file). ``onnx``: None writes ONNX where the packages are installed, True requires
    it, False skips it. A ``TrainedModel`` is moved to the CPU. Returns what ``preprocessing.json`` holds, with
    ``out`` and the seconds taken."""
    t0 = time.perf_counter()
    trained = model if isinstance(model, TrainedModel) else load_model(model, trust_plugin=trust_plugin)
    trained = trained.eval().cpu()
    out = out or io.join(trained.source.rsplit("/", 1)[0] if "/" in trained.source else ".", EXPORT_DIR)
    want_onnx = _onnx_wanted(onnx)
    meta = trained.metadata
    c, h, w = meta.channels, meta.input["height"], meta.input["width"]
    pixel = PixelModel(trained.module, meta.normalize, c, trained.input_dtype).eval()
    gen = torch.Generator().manual_seed(seed)
    example = torch.randint(0, 256, (EXAMPLE_BATCH, c, h, w), dtype=torch.uint8, generator=gen)
    batches = [torch.randint(0, 256, (b, c, h, w), dtype=torch.uint8, generator=gen) for b in CHECK_BATCHES]
    with torch.no_grad():  # the model's own logits: the float batch training would have fed it
        expected = [trained(trained.preprocess.normalize_pixels(b.numpy()).to(trained.input_dtype)) for b in batches]
    tol = tolerance(trained.module, expected)
    name = meta.model["name"]

    program = _step("torch.export (trace)", name, lambda: _export(pixel, example))
    data = _step("torch.export.save", name, lambda: _save(program))
    reloaded = _step("torch.export.load (read back)", name, lambda: torch.export.load(_io.BytesIO(data)).module())
    checks = {"torch_export": _compare("torch.export check", name, lambda x: reloaded(x), batches, expected, tol)}
    files = {"torch_export": PROGRAM_FILE, "onnx": None}
    onnx_bytes = None
    if want_onnx:
        onnx_bytes = _step("ONNX conversion (torch.onnx.export, dynamo)", name, lambda: _to_onnx(pixel, example))
        run, runtime = _step("ONNX load", name, lambda: _onnx_runner(onnx_bytes))
        checks["onnx"] = {**_compare("ONNX check", name, run, batches, expected, tol), "runtime": runtime}
        files["onnx"] = ONNX_FILE
    facts = _facts(trained, files, checks)
    io.write_bytes_atomic(io.join(out, PROGRAM_FILE), data)
    if onnx_bytes is not None:
        io.write_bytes_atomic(io.join(out, ONNX_FILE), onnx_bytes)
    io.write_json_atomic(io.join(out, FACTS_FILE), facts)  # last: it names the files above
    if onnx_bytes is None and io.exists(io.join(out, ONNX_FILE)):  # an earlier export's, which no longer matches
        fs, path = io.filesystem(io.join(out, ONNX_FILE))
        fs.rm(path)
    return {**facts, "out": out, "seconds": round(time.perf_counter() - t0, 3)}


def tolerance(module: nn.Module, logits: list[torch.Tensor]) -> float:
    """How far a faithful export's logits may sit from the model's.

    The exported graph runs the same operations, but another runtime may sum in another order (onnx's reference
    evaluator convolves with NumPy, onnxruntime blocks its GEMMs its own way). Reordering a sum of n products
    moves it by at most gamma_n * sum |a_i b_i|, gamma_n = n u / (1 - n u), u the unit roundoff (2^-24 in
    float32, 2^-53 in float64; Higham, Accuracy and Stability of Numerical Algorithms, 2002, section 3.1). Taking
    n as the largest fan-in of the network's weight layers (a conv's in-channels x kernel area, a linear's
    in-features), charging each of its L such layers that relative error in turn, and measuring against the
    logits' largest magnitude (at least 1), gives L * gamma_n * max(1, max |logit|). For the built-in CNN
    (fan-in 576, 4 layers) that is 1.4e-4 relative; a faithful export measures ~1e-6 here."""
    layers = [m.weight for m in module.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)
              and m.weight.dim() >= 2]
    dtype = layers[0].dtype if layers else torch.float32
    u = torch.finfo(dtype).eps / 2
    n = max((int(p[0].numel()) for p in layers), default=1)
    scale = max([1.0] + [float(x.abs().max()) for x in logits])
    return max(1, len(layers)) * (n * u / (1 - n * u)) * scale


# -------------------------------------------------------------------------------------------------- steps


def _step(what: str, name: str, fn: Callable):
    """Run one export step; any failure becomes an ``ExportError`` naming the step, the model and the cause."""
    try:
        with _quiet():
            return fn()
    except DutycycleError:
        raise
    except Exception as e:  # noqa: BLE001 - torch's export raises many types; each one is this step failing
        lines = [x.strip() for x in str(e).splitlines() if x.strip()][:3]
        cause = " / ".join(lines)[:500] or type(e).__name__
        raise ExportError(f"export of model {name!r} failed at {what}: {type(e).__name__}: {cause}; the forward "
                          "must be traceable by torch.export (no Python branch on tensor values, no batch size "
                          "written into the code): https://pytorch.org/docs/stable/export.html") from e


@contextlib.contextmanager
def _quiet():
    """torch's exporters log graph dumps and notes on optional packages (torchvision's ops) at WARNING; what
    matters reaches the caller as the step's error."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _batch_dim():
    return {"image": {0: torch.export.Dim("batch", min=1)}}


def _export(pixel: PixelModel, example: torch.Tensor):
    return torch.export.export(pixel, (example,), dynamic_shapes=_batch_dim())


def _save(program) -> bytes:
    buf = _io.BytesIO()
    torch.export.save(program, buf)
    return buf.getvalue()


def _to_onnx(pixel: PixelModel, example: torch.Tensor) -> bytes:
    import onnx

    program = torch.onnx.export(pixel, (example,), dynamo=True, dynamic_shapes=_batch_dim(),
                                input_names=["image"], output_names=["logits"], verbose=False)
    proto = program.model_proto
    onnx.checker.check_model(proto)
    return proto.SerializeToString()  # protobuf's limit: 2 GB (a larger model fails here, named as this step)


def _onnx_runner(data: bytes):
    """``(run, runtime)``: ``run(uint8 batch) -> logits`` in onnxruntime if installed, else onnx's reference
    evaluator (pure NumPy: slow, and here only for a few small batches)."""
    try:
        import onnxruntime as ort
    except ImportError:
        import onnx
        from onnx.reference import ReferenceEvaluator

        evaluator = ReferenceEvaluator(onnx.load_from_string(data))
        return (lambda x: torch.from_numpy(np.asarray(evaluator.run(None, {"image": x.numpy()})[0]))), \
            "onnx.reference"
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return (lambda x: torch.from_numpy(session.run(None, {"image": x.numpy()})[0])), "onnxruntime"


def _compare(what: str, name: str, run, batches, expected, tol: float) -> dict[str, Any]:
    def diff() -> float:
        worst = 0.0
        with torch.no_grad():
            for x, want in zip(batches, expected, strict=True):
                got = run(x)
                if tuple(got.shape) != tuple(want.shape):
                    raise ExportError(f"export of model {name!r} failed at {what}: logits of shape "
                                      f"{list(got.shape)} for a batch of {len(x)}, the model gives {list(want.shape)}")
                worst = max(worst, float((got.double() - want.double()).abs().max()))
        return worst

    worst = _step(what, name, diff)
    if not worst <= tol:  # also refuses NaN
        raise ExportError(f"export of model {name!r} failed at {what}: its logits differ from the model's by up to "
                          f"{worst:.3g}, over the tolerance {tol:.3g} (see serve/export.py: tolerance)")
    return {"max_abs_diff": worst, "tolerance": tol, "batch_sizes": list(CHECK_BATCHES)}


def _onnx_wanted(onnx: bool | None) -> bool:
    try:
        import onnx as _onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError:
        if onnx:
            raise ConfigError("ONNX export needs the onnx and onnxscript packages: pip install onnx onnxscript "
                              "(or dutycycle's dev extra), or leave ONNX out") from None
        return False
    return onnx is not False


def _steps(spec: TransformSpec | None, shape: tuple[int, int, int]) -> list[str]:
    """The transform in words, for a consumer outside Python (``decode_and_transform`` is the definition)."""
    steps = [f"read the file; decode only {', '.join(ALLOWED_FORMATS)}, at most {DEFAULT_MAX_PIXELS} pixels"]
    if spec is None:
        return steps + ["no transform recorded: resize as the training arrays were made"]
    n, size, how = spec.size, f"{spec.size}x{spec.size}", spec.resample
    resize = {"shorter_crop": f"resize the shorter side to {n} ({how}), centre-crop {size}",
              "pad": f"resize the longer side to {n} ({how}), centre it on a {size} {spec.background} canvas",
              "stretch": f"resize to {size} ({how})"}
    c, h, w = shape
    return steps + [
        "turn it upright by its EXIF orientation" if spec.exif else "ignore the EXIF orientation",
        f"convert to {spec.mode}, transparent pixels over {spec.background}",
        resize.get(spec.resize, f"resize by the policy {spec.resize!r}"),
        f"uint8 pixels, channels first: [{c}, {h}, {w}]; stack images into [batch, {c}, {h}, {w}]",
    ]


def _facts(trained: TrainedModel, files: dict, checks: dict) -> dict[str, Any]:
    meta = trained.metadata
    c, h, w = meta.channels, meta.input["height"], meta.input["width"]
    spec = trained.preprocess.spec
    return formats.stamp({
        "files": files,
        "input": {"name": "image", "dtype": "uint8", "layout": "NCHW", "shape": ["batch", c, h, w],
                  "mode": meta.input["mode"], "range": [0, 255]},
        "output": {"name": "logits", "shape": ["batch", len(meta.classes)],
                   "note": "no softmax in the graph: probabilities = softmax(logits, dim=1)"},
        "in_graph": ("x / 255, then (x - mean) / std per channel" if meta.normalize else "x / 255"),
        "normalize": meta.normalize,
        "preprocessing": _steps(spec, (c, h, w)),
        # dutycycle.engine.TransformSpec(**transform) and decode_and_transform do all of the above; null: none usable
        "transform": spec.to_dict() if spec is not None else None,
        "classes": list(meta.classes),
        "model": meta.model,
        "weights_sha256": meta.weights["sha256"],
        "source": trained.source,
        "checks": checks,
        "torch": torch.__version__,
        "code": meta.code,
        "data": meta.data,
    })
