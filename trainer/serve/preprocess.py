"""What happens to an image before the trained network sees it, as one callable (torchvision's
``weights.transforms()`` habit): decode and transform with the spec the cache was made with, then normalize as
the training batches were.

Every step is the training path's own code, so a file gives the pixels its cache sample holds and the tensor its
training batch held: ``engine.transform.decode_and_transform`` behind ``imageinfo.open_checked`` (the allowed
decoders, the pixel limit before any decode), ``io.read_capped`` for files (the per-file byte cap, regular files
only), and ``loader.augment.to_tensor`` for the normalization ((x / 255 - mean) / std folded into one multiply
and one add, float32), or ``x / 255`` where the run did not normalize (``step.data.LoaderSource``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from dutycycle.engine import io
from dutycycle.engine.errors import ConfigError, DecodeError
from dutycycle.engine.imageinfo import BOMB, TOO_LARGE, UNREADABLE, decode_failure
from dutycycle.engine.limits import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_PIXELS
from dutycycle.engine.transform import TransformSpec, decode_and_transform, transform_image
from dutycycle.loader.augment import to_tensor
from dutycycle.loader.config import AugmentConfig

# what ``Preprocess`` takes: a path or fsspec URI, a file's bytes, or a PIL image
ImageLike = Any


class Preprocess:
    """``preprocess(image) -> float tensor [C, H, W]``, ``preprocess.batch(images) -> [B, C, H, W]``.

    ``spec``: the TransformSpec that made the training samples (None: none usable, ``no_spec`` says why; then
    only ``normalize_pixels`` works). ``normalize``: ``{"mean", "std"}`` as trained, or None for ``x / 255``.
    ``channels``: what the network takes. ``max_pixels`` / ``max_file_bytes``: the decode limits of the safe
    open (the defaults ingest and materialize use)."""

    def __init__(self, spec: TransformSpec | None, normalize: dict | None, channels: int, *,
                 max_pixels: int = DEFAULT_MAX_PIXELS, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 no_spec: str = ""):
        self.spec, self.normalize, self.channels = spec, normalize, channels
        self.no_spec = no_spec or "no image transform was given"  # why ``spec`` is None, for the error
        self.max_pixels, self.max_file_bytes = max_pixels, max_file_bytes
        self._augment = (AugmentConfig.eval(True, tuple(normalize["mean"]), tuple(normalize["std"]))
                         if normalize else None)

    def __repr__(self) -> str:
        norm = (f"mean={self.normalize['mean']}, std={self.normalize['std']}" if self.normalize else "x / 255")
        return f"Preprocess(spec={self.spec!r}, normalize: {norm}, channels={self.channels})"

    # -- pixels ---------------------------------------------------------------------------------------------
    def pixels(self, image: ImageLike) -> np.ndarray:
        """The transform's uint8 output for ``image``, channels first ``[C, H, W]``: what the cache holds for the
        same file. Raises ``DecodeError`` (its ``reason`` one of ``imageinfo``'s) for a file that is no usable
        image."""
        spec = self.require_spec()
        if isinstance(image, (str, os.PathLike)):
            arr = decode_and_transform(read_file(os.fspath(image), self.max_file_bytes), spec, self.max_pixels)
        elif isinstance(image, (bytes, bytearray, memoryview)):
            arr = decode_and_transform(bytes(image), spec, self.max_pixels)
        elif _is_pil(image):
            arr = _transform_pil(image, spec, self.max_pixels)
        else:
            raise TypeError(f"cannot preprocess a {type(image).__name__}: pass a file path or URI, the file's bytes, "
                            "or a PIL image")
        return self._channels_first(arr)

    def require_spec(self) -> TransformSpec:
        """The transform, or ``ConfigError`` saying why there is none and how to give one."""
        if self.spec is None:
            raise ConfigError(f"{self.no_spec}; pass transform=TransformSpec(size=...) to load_model to choose one, "
                              "or give normalize_pixels() uint8 arrays yourself")
        return self.spec

    def _channels_first(self, arr: np.ndarray) -> np.ndarray:
        if arr.ndim == 2:  # one grey channel without its axis
            arr = arr[None]
        elif self.spec.layout == "HWC":
            arr = arr.transpose(2, 0, 1)
        if arr.shape[0] != self.channels:
            raise ConfigError(f"the transform {self.spec!r} gives {arr.shape[0]} channels and the model takes "
                              f"{self.channels}; pass the transform the model was trained with")
        return np.ascontiguousarray(arr)

    # -- tensors --------------------------------------------------------------------------------------------
    def normalize_pixels(self, pixels: np.ndarray) -> torch.Tensor:
        """uint8 ``[B, C, H, W]`` (numpy) -> the float32 batch the network was trained on."""
        if pixels.dtype != np.uint8 or pixels.ndim != 4 or pixels.shape[1] != self.channels:
            raise ValueError(f"normalize_pixels takes uint8 [B, {self.channels}, H, W], got {pixels.dtype} "
                             f"{list(pixels.shape)}")
        if self._augment is not None:
            return to_tensor(pixels, self._augment, layout="CHW")
        return torch.from_numpy(np.ascontiguousarray(pixels)).float().div_(255.0)

    def __call__(self, image: ImageLike) -> torch.Tensor:
        return self.normalize_pixels(self.pixels(image)[None])[0]

    def batch(self, images: Iterable[ImageLike]) -> torch.Tensor:
        arrays = [self.pixels(i) for i in images]
        if not arrays:
            raise ValueError("batch() needs at least one image")
        return self.normalize_pixels(np.stack(arrays))


def read_file(uri: str, max_bytes: int) -> bytes:
    """A file's bytes under the per-file cap; every failure is a ``DecodeError`` with ingest's reason."""
    try:
        return io.read_capped(uri, max_bytes)
    except io.FileTooLargeError as e:
        raise DecodeError(TOO_LARGE, f"{TOO_LARGE}: {e}") from None
    except FileNotFoundError:
        raise DecodeError(UNREADABLE, f"{UNREADABLE}: no such file {uri!r}") from None
    except IsADirectoryError:
        raise DecodeError(UNREADABLE, f"{UNREADABLE}: {uri!r} is a folder") from None
    except (OSError, ValueError) as e:  # permission, a FIFO or device (NotRegularFileError), a broken URI
        raise DecodeError(UNREADABLE, f"{UNREADABLE}: {uri!r}: {e}") from None


def _is_pil(image: Any) -> bool:
    from PIL import Image  # heavy: only when an object that is no path or bytes comes in

    return isinstance(image, Image.Image)


def _transform_pil(img, spec: TransformSpec, max_pixels: int) -> np.ndarray:
    """A PIL image the caller opened: the pixel limit checked before its pixels are loaded, as for bytes."""
    w, h = img.size
    if w * h > max_pixels:
        raise DecodeError(BOMB, f"{BOMB}: a {w}x{h} image is over the limit of {max_pixels} pixels")
    try:
        return transform_image(img, spec)
    except DecodeError:
        raise
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise decode_failure(e, "cannot decode the image: ") from e
