"""Deterministic per-sample transforms: a spec as data, and one pure function that applies it to file bytes.

The same ``decode_and_transform`` runs inside the cache's Daft UDF (decode once) and in the loader's raw path
(decode every step), so a cached sample and a freshly decoded one are the same array. Random augmentations are
not part of a spec: they are not cacheable and belong to the loader, on batches.

Colour handling, so that every source becomes a correct sample of the spec's ``mode``: ``RGB`` (three channels)
or ``L`` (one channel, grey):

- ``1``, ``L``, ``CMYK``, ``YCbCr``, ``LAB``, ``HSV``, ``P`` without transparency: PIL's own conversion.
- 16-bit and 32-bit grey (``I;16*``, ``I``): scaled from the 16-bit range to 8 bits (PIL's ``convert("L")``
  clips at 255 instead, which turns most 16-bit images white).
- Anything with alpha (``RGBA``, ``LA``, ``PA``, ``P`` with a transparency entry): composited over the spec's
  ``background`` colour, **black** by default (so transparent pixels become 0, like premultiplied alpha);
  ``background="white"`` is the choice for documents and logos.
- ``mode="L"``: a grey source stays its one channel from decode to output (the rules above bring ``1``, 16-bit
  and float grey to 8 bits); a colour source is flattened to RGB as above (alpha composited over the background
  first) and converted with PIL's luma, ``convert("L")`` (ITU-R 601-2: L = R 299/1000 + G 587/1000 + B 114/1000),
  at the output size, after the resize (a grey pixel, R = G = B, keeps its value exactly). ``pad`` letterboxes
  on an ``L`` canvas of the background's grey (0 or 255).

Memory: a full-resolution decode is the largest thing a decode thread holds, so nothing beside it is allowed to
grow faster than one 8-bit RGB copy. Grey sources (``1``, ``L``, 16-bit, ``I``, ``F``) stay one 8-bit channel
through the resize and, for ``mode="RGB"``, become RGB only at the output size (PIL resamples each channel alike,
so the pixels are the ones an RGB resize gives); colour sources become ``L`` only at the output size too; wide modes and alpha are brought to 8 bits in strips of rows, so their
temporaries are a few MB whatever the image's size; the EXIF orientation is applied without a copy of an
upright image. ``limits.decode_bytes_per_pixel`` states what each mode then costs.

Any shape: ``shorter_crop`` resizes only its crop (``crop_box``; PIL's ``resize(box=)``), so a needle (4 x
1,000,000) is never resized whole (64 x 16,000,000). What a decode will hold is estimated from the header
before any pixel exists (``imageinfo.decode_cost``: the mode's bytes a pixel, PIL's row pointers, a
progressive JPEG's coefficients, an EXIF turn's upright copy); over the byte budget of an RGB image at the
pixel limit, a JPEG is decoded at 1/2, 1/4 or 1/8 of its size by its decoder (``draft``) and anything else is
refused (``open_checked``), with the same reason in ingest's row.
"""

from __future__ import annotations

import functools
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
MODES = ("RGB", "L")  # output colour mode: three channels, or one (grey)
CHANNELS = {"RGB": 3, "L": 1}
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
    mode: str = "RGB"  # RGB (3 channels) or L (1 channel, grey; colour sources converted with PIL's luma)
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
    def channels(self) -> int:
        return CHANNELS[self.mode]

    @property
    def shape(self) -> tuple[int, int, int]:
        c = self.channels
        return (self.size, self.size, c) if self.layout == "HWC" else (c, self.size, self.size)

    @property
    def sample_bytes(self) -> int:
        return self.channels * self.size * self.size

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


# Rows brought down to 8 bits at a time (wide modes, alpha): the conversion's temporaries stay a few MB.
_STRIP_BYTES = 1 << 20


@functools.cache
def _lut16():
    """0..65535 -> 0..255 with rounding, as one 64 KB table (an index, not int64 arithmetic per pixel)."""
    import numpy as np

    return ((np.arange(65536, dtype=np.uint32) * 255 + 32767) // 65535).astype(np.uint8)


def _strips(img):
    """``(top, bottom)`` row ranges of about ``_STRIP_BYTES`` at 4 bytes a pixel."""
    w, h = img.size
    rows = max(1, _STRIP_BYTES // (4 * max(1, w)))
    return [(top, min(h, top + rows)) for top in range(0, h, rows)]


def _wide_grey_to_l(img):
    """``I;16*``, ``I`` or ``F`` -> ``L``, a strip at a time: the only full-size array is the 8-bit result."""
    import numpy as np
    from PIL import Image

    w, h = img.size
    out = np.empty((h, w), np.uint8)
    lut = None if img.mode == "F" else _lut16()
    for top, bottom in _strips(img):
        a = np.asarray(img.crop((0, top, w, bottom)))
        if lut is None:  # float grey: already 0..255; NaN counts as 0
            out[top:bottom] = np.rint(np.clip(np.nan_to_num(a, nan=0.0), 0, 255))
        else:  # 16-bit grey ("I" holds 16-bit PNGs on some Pillows): scaled to 0..255 with rounding
            out[top:bottom] = lut[a if a.dtype.itemsize == 2 else np.clip(a, 0, 65535)]
    return Image.fromarray(out, "L")


def _composite(img, background: str):
    """An image with alpha (or a transparent colour) over the background colour -> ``RGB``, a strip at a time
    (compositing is per pixel, so strips give the pixels the whole image gives)."""
    from PIL import Image

    fill = BACKGROUNDS[background] + (255,)

    def whole(part):
        rgba = part.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, fill), rgba).convert("RGB")

    strips = _strips(img)
    if len(strips) == 1:
        return whole(img)
    w = img.width
    out = Image.new("RGB", img.size)
    for top, bottom in strips:
        out.paste(whole(img.crop((0, top, w, bottom))), (0, top))
    return out


def _flatten(img, background: str = "black"):
    """Any PIL mode -> ``L`` (grey sources) or ``RGB`` (see the module docstring for the rules)."""
    mode = img.mode
    transparent = "transparency" in img.info
    if mode in ("RGB", "L") and not transparent:
        return img
    if mode.startswith("I;16") or mode in ("I", "F"):
        return _wide_grey_to_l(img)
    if mode == "1":
        return img.convert("L")
    # A tRNS chunk gives P, L and RGB images a transparent colour: treat it as alpha.
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or (mode in ("P", "L", "RGB") and transparent):
        return _composite(img, background)
    return img.convert("RGB")


def _upright(img):
    """``ImageOps.exif_transpose`` without its copy of an image that is already upright."""
    # heavy: imageinfo loads PIL and numpy at import; this module stays light for the CLI's argument parsing
    from .imageinfo import orientation_of, upright

    img.load()
    return upright(img, orientation_of(img))  # malformed EXIF reads as upright, as ingest reads it


def _to_mode(img, mode: str):
    """An ``L`` or ``RGB`` image (``_flatten``'s output, resized) in the spec's ``mode``."""
    return img if img.mode == mode else img.convert(mode)  # RGB -> L: PIL's luma; L -> RGB: grey in every channel


def crop_box(w: int, h: int, size: int) -> tuple[float, float, float, float]:
    """``shorter_crop``'s region of a ``w`` x ``h`` image, in its own pixel coordinates: the centre
    ``size`` x ``size`` crop of the image resized shorter side to ``size``, mapped back. Resizing only this box
    (PIL's ``resize(box=)``, whose filters still read the pixels just outside it) gives that crop's pixels
    without the whole resized image, which for a 4 x 1,000,000 image would be 64 x 16,000,000."""
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    left, top = (nw - size) // 2, (nh - size) // 2
    sx, sy = w / nw, h / nh
    return (left * sx, top * sy, (left + size) * sx, (top + size) * sy)


def transform_image(img, spec: TransformSpec) -> np.ndarray:
    """Apply ``spec`` to a decoded PIL image; returns uint8 in the spec's layout and mode."""
    import numpy as np
    from PIL import Image

    if spec.exif:
        img = _upright(img)
    img = _flatten(img, spec.background)  # L or RGB: converted to the spec's mode at the output size only
    size, resample = spec.size, _resample(spec.resample)
    w, h = img.size
    if spec.resize == "stretch":
        img = _to_mode(img.resize((size, size), resample), spec.mode)
    elif spec.resize == "shorter_crop":
        img = _to_mode(img.resize((size, size), resample, box=crop_box(w, h, size)), spec.mode)
    else:  # pad: longer side to `size`, centred on the background colour
        scale = size / max(w, h)
        nw, nh = min(size, max(1, round(w * scale))), min(size, max(1, round(h * scale)))
        fill = BACKGROUNDS[spec.background]
        canvas = Image.new(spec.mode, (size, size), fill if spec.mode == "RGB" else fill[0])
        canvas.paste(_to_mode(img.resize((nw, nh), resample), spec.mode), ((size - nw) // 2, (size - nh) // 2))
        img = canvas
    arr = np.asarray(img, dtype=np.uint8)
    if arr.ndim == 2:  # L: one channel, kept as an axis so every sample has the spec's shape
        arr = arr[:, :, None]
    assert arr.shape == (size, size, spec.channels), arr.shape
    if spec.layout == "CHW":
        arr = arr.transpose(2, 0, 1)
    return np.ascontiguousarray(arr)


def decode_and_transform(data: bytes, spec: TransformSpec, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """File bytes -> uint8 sample in ``spec``'s layout. Raises ``DecodeError`` (with ``.reason``, one of
    ``imageinfo``'s reasons) on bad input."""
    # heavy: imageinfo loads PIL and numpy at import; this module stays light for the CLI's argument parsing
    from .imageinfo import BOMB, TRUNCATED, decode_failure, decode_reduction, open_checked, tail_check

    img = open_checked(data, max_pixels)
    cut = tail_check(img.format or "", data)  # as ingest reads it: a stream that ends early is truncated, even
    if cut:  # where the pixels it lost were only its end marker's
        raise DecodeError(TRUNCATED, cut)
    reduction = decode_reduction(img, max_pixels)  # open_checked refused an image that fits at no reduction
    if reduction > 1:  # a JPEG over the byte budget: the decoder scales it down, before any pixel exists
        full = img.size
        img.draft(None, (max(1, full[0] // reduction), max(1, full[1] // reduction)))
        if img.size != (-(-full[0] // reduction), -(-full[1] // reduction)):  # no reduction took: never decode
            raise DecodeError(BOMB, f"{BOMB}: {full[0]}x{full[1]} JPEG over the decode budget could not be "
                                    f"decoded at 1/{reduction} scale")
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
