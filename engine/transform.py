"""Deterministic per-sample transforms: a spec as data, and one pure function that applies it to file bytes.

The same ``decode_and_transform`` runs inside the cache's Daft UDF (decode once) and in the loader's raw path
(decode every step), so a cached sample and a freshly decoded one are the same array. Random augmentations are
not part of a spec: they are not cacheable and belong to the loader, on batches.

Colour handling, so that every source becomes a correct RGB sample:

- ``1``, ``L``, ``CMYK``, ``YCbCr``, ``LAB``, ``HSV``, ``P`` without transparency: PIL's own conversion.
- 16-bit and 32-bit grey (``I;16*``, ``I``): scaled from the 16-bit range to 8 bits (PIL's ``convert("L")``
  clips at 255 instead, which turns most 16-bit images white).
- Anything with alpha (``RGBA``, ``LA``, ``PA``, ``P`` with a transparency entry): composited over the spec's
  ``background`` colour, **black** by default (so transparent pixels become 0, like premultiplied alpha);
  ``background="white"`` is the choice for documents and logos.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, DecodeError
from .limits import DEFAULT_MAX_PIXELS

if TYPE_CHECKING:  # numpy and PIL load inside the functions: `dutycycle --help` reads only the choices here
    import numpy as np

RESIZE_POLICIES = ("shorter_crop", "pad", "stretch")
RESAMPLE_FILTERS = ("nearest", "box", "bilinear", "hamming", "bicubic", "lanczos")
LAYOUTS = ("HWC", "CHW")
DTYPES = ("uint8",)
MODES = ("RGB",)
BACKGROUNDS = {"black": (0, 0, 0), "white": (255, 255, 255)}

# Decompression-bomb bound: refuse an image whose header announces more pixels than this, before decoding.
MAX_PIXELS = DEFAULT_MAX_PIXELS  # one limit for ingest and materialize (see limits.py)


@dataclass(frozen=True)
class TransformSpec:
    """What a cached sample looks like. Frozen and hashable; its JSON is part of the cache fingerprint."""

    size: int = 64  # output is size x size
    resize: str = "shorter_crop"  # shorter side to `size` then centre crop | pad (letterbox) | stretch
    resample: str = "bilinear"  # PIL filter name
    layout: str = "HWC"
    dtype: str = "uint8"
    exif: bool = True  # apply EXIF orientation before anything else
    mode: str = "RGB"
    background: str = "black"  # alpha compositing and pad colour

    def __post_init__(self):
        if isinstance(self.size, bool) or not isinstance(self.size, int) or not 1 <= self.size <= 4096:
            raise ConfigError(f"TransformSpec.size={self.size!r} is invalid; use an integer from 1 to 4096")
        choices = {
            "resize": RESIZE_POLICIES,
            "resample": RESAMPLE_FILTERS,
            "layout": LAYOUTS,
            "dtype": DTYPES,
            "mode": MODES,
            "background": tuple(BACKGROUNDS),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"TransformSpec.{name}={getattr(self, name)!r} is invalid; use one of {', '.join(allowed)}"
                )
        if not isinstance(self.exif, bool):
            raise ConfigError(f"TransformSpec.exif={self.exif!r} is invalid; use true or false")

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.size, self.size, 3) if self.layout == "HWC" else (3, self.size, self.size)

    @property
    def sample_bytes(self) -> int:
        return 3 * self.size * self.size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): stable input for fingerprints."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransformSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(
                f"TransformSpec has no field {unknown[0]!r}; known fields: {', '.join(sorted(known))}"
            )
        return cls(**d)

    @classmethod
    def from_json(cls, s: str | dict[str, Any]) -> TransformSpec:
        if isinstance(s, dict):
            return cls.from_dict(s)
        try:
            d = json.loads(s)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"transform spec {s[:60]!r} is not valid JSON ({e.msg}); pass a JSON object"
            ) from e
        if not isinstance(d, dict):
            raise ConfigError(f"transform spec {s[:60]!r} is not a JSON object; pass an object of fields")
        return cls.from_dict(d)


def _resample(name: str):
    from PIL import Image

    return getattr(Image.Resampling, name.upper())


def to_rgb(img, background: str = "black"):
    """Any PIL mode -> an ``RGB`` image (see the module docstring for the rules)."""
    import numpy as np
    from PIL import Image

    mode = img.mode
    if mode == "RGB" and "transparency" not in img.info:
        return img
    if mode.startswith("I;16") or mode == "I":
        # 16-bit grey: scale the 0..65535 range to 0..255 with rounding; "I" holds 16-bit PNGs on some Pillows.
        a = np.asarray(img, dtype=np.int64)
        a = (np.clip(a, 0, 65535) * 255 + 32767) // 65535
        return Image.fromarray(a.astype(np.uint8), "L").convert("RGB")
    if mode == "F":
        a = np.clip(np.asarray(img, dtype=np.float64), 0, 255)
        return Image.fromarray(np.rint(a).astype(np.uint8), "L").convert("RGB")
    # A tRNS chunk gives P, L and RGB images a transparent colour: treat it as alpha.
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
        mode in ("P", "L", "RGB") and "transparency" in img.info
    )
    if has_alpha:
        rgba = img.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, BACKGROUNDS[background] + (255,))
        return Image.alpha_composite(canvas, rgba).convert("RGB")
    return img.convert("RGB")


def transform_image(img, spec: TransformSpec) -> np.ndarray:
    """Apply ``spec`` to a decoded PIL image; returns uint8 in the spec's layout."""
    import numpy as np
    from PIL import Image, ImageOps

    if spec.exif:
        img = ImageOps.exif_transpose(img)
    img = to_rgb(img, spec.background)
    size, resample = spec.size, _resample(spec.resample)
    w, h = img.size
    if spec.resize == "stretch":
        img = img.resize((size, size), resample)
    elif spec.resize == "shorter_crop":
        scale = size / min(w, h)
        nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
        img = img.resize((nw, nh), resample)
        left, top = (nw - size) // 2, (nh - size) // 2
        img = img.crop((left, top, left + size, top + size))
    else:  # pad: longer side to `size`, centred on the background colour
        scale = size / max(w, h)
        nw, nh = min(size, max(1, round(w * scale))), min(size, max(1, round(h * scale)))
        canvas = Image.new("RGB", (size, size), BACKGROUNDS[spec.background])
        canvas.paste(img.resize((nw, nh), resample), ((size - nw) // 2, (size - nh) // 2))
        img = canvas
    arr = np.asarray(img, dtype=np.uint8)
    assert arr.shape == (size, size, 3), arr.shape
    if spec.layout == "CHW":
        arr = arr.transpose(2, 0, 1)
    return np.ascontiguousarray(arr)


def decode_and_transform(data: bytes, spec: TransformSpec, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """File bytes -> uint8 sample in ``spec``'s layout. Raises ``DecodeError`` (with ``.reason``, one of
    ``imageinfo``'s reasons) on bad input."""
    # imageinfo loads PIL and numpy at import; this module stays light for the CLI's argument parsing
    from .imageinfo import BOMB, decode_failure, open_checked

    img = open_checked(data, max_pixels)
    try:
        img.load()
        return transform_image(img, spec)
    except DecodeError:
        raise
    except MemoryError as e:
        raise DecodeError(BOMB, f"{BOMB}: out of memory decoding a {img.size} image") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        # Truncated or corrupt data surfaces only when pixels are decoded.
        raise decode_failure(e, f"cannot decode {img.format or 'image'}: ") from e
