"""Limits shared by every decode path (ingest, materialize, thumbnails, the raw loader); a light module on purpose."""

import math

# The ceiling on header-claimed pixels, checked before anything is decoded: anything larger is recorded as a
# decompression bomb. 64 Mpx is well above any training photograph, keeps one decode under ~260 MB (with the
# byte budget below), and sits below PIL's own limit (``Image.MAX_IMAGE_PIXELS``, about 89.5 Mpx, which only
# warns up to twice that).
DEFAULT_MAX_PIXELS = 64_000_000

# What one full decode (``transform.decode_and_transform``) holds per pixel, by the mode PIL decodes into: the
# decoded image (PIL keeps 1, 2 or 4 bytes a pixel) plus its 8-bit copy at full size (one byte for grey
# sources, which stay grey until resized; four for RGB, which PIL keeps as RGBX); conversion temporaries are
# strips of about a MB. Peaks measured once by hand at 16 Mpx, decode alone, MiB: L 17, I;16 50, RGB 64, P 79,
# I and F 86 (5 bytes a pixel, then the decoder's and strips' buffers), CMYK 126, RGBA 128;
# tests/engine/test_decode_memory.py holds RGB, I;16, I, F and RGBA to their entries.
_DECODE_BYTES_PER_PIXEL = {"L": 1, "1": 2, "I;16": 3, "I;16L": 3, "I;16B": 3, "I;16N": 3, "RGB": 4, "P": 5,
                           "I": 6, "F": 6}
_WIDEST_BYTES_PER_PIXEL = 8  # any other mode: 4 bytes decoded + 4 of RGB (RGBA, LA, PA, CMYK, YCbCr, ...)

# The decode budget is what an 8-bit RGB image at the pixel limit holds: a mode that costs more bytes a pixel
# gets fewer pixels, so no image costs more to decode than the largest RGB one allowed.
RGB_DECODE_BYTES_PER_PIXEL = _DECODE_BYTES_PER_PIXEL["RGB"]


# The ceiling on a file's size, checked before the whole file is read (a listing's size, or a read of at most
# this many bytes plus one): larger files are recorded as "too large" instead of being pulled into memory.
DEFAULT_MAX_FILE_BYTES = 256 * 1024 * 1024

# The only PIL decoders that ever see untrusted bytes (``Image.open(..., formats=ALLOWED_FORMATS)``): common
# photo formats. Everything else (EPS, which PIL hands to Ghostscript, PSD, ICNS, ...) is refused unparsed.
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")

# Reduced decodes (perceptual hash, thumbnails): JPEG scales down inside the decoder (draft mode); other formats
# decode at full size, so they are decoded only up to this many pixels (16 Mpx, 64 MB as RGBA) and larger ones
# get no perceptual hash or preview.
REDUCED_DECODE_MAX_PIXELS = 16 * 1024 * 1024


# What PIL stores a decoded pixel in, by mode: an EXIF transpose (a rotated or mirrored photo) copies the decoded
# image at this size before anything else runs. Any other mode: 4 (RGB is kept as RGBX, alpha, CMYK, I, F).
_STORED_BYTES_PER_PIXEL = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16L": 2, "I;16B": 2, "I;16N": 2}

# A progressive JPEG's decoder keeps every DCT coefficient of the image until its last scan (a baseline JPEG
# streams a few rows of blocks): 2 bytes a coefficient, 64 a block, per component at its own sampling, whatever
# the scale it is decoded at. Measured once by hand, 4000x4000 RGB 4:2:0: 45 MiB over the baseline decode,
# 1.5 samples a pixel x 2 bytes.
COEFFICIENT_BYTES = 2

# JPEG decodes at 1/1, 1/2, 1/4 or 1/8 of its size inside the decoder (PIL's ``draft``): an image whose full
# decode is over the budget is decoded at the smallest of these reductions that fits, before its pixels exist.
JPEG_REDUCTIONS = (1, 2, 4, 8)


# PIL's resize weighs each output pixel with a row of filter weights (doubles) as long as the filter's reach in
# source pixels: the widest filter (lanczos, 3 pixels either side, scaled by the reduction) costs 2 x 3 x 8 bytes
# per source row and column, whatever the output size: nothing for a photo, 48 MB for the long side of a 4 x
# 1,000,000 needle (measured once by hand: 16 x 250,000 RGB PNG to 64 x 64 with lanczos, 11 MiB over its decode).
# Charged for every image, whatever the spec: the estimate is made where no spec is known (ingest).
RESAMPLE_BYTES_PER_LINE = 2 * 3 * 8

# PIL keeps a pointer (8 bytes) to every row of an image: nothing for a photo, but a 4 x 1,000,000 image holds
# 8 MB of them beside its 16 MB of pixels, and a 1 x 64,000,000 one 512 MB. Charged for the decoded image and its
# 8-bit copy (and an upright copy's rows): measured once by hand, 4 x 1,000,000 RGB PNG, 24 MiB to decode.
ROW_POINTER_BYTES = 8


# Decoders that hold more than the image they fill: Pillow decodes every WebP through libwebp's animation decoder,
# which keeps RGBA canvases of its own beside PIL's image. Measured once by hand (peak over the process before it,
# whole decode): 2000x2000 RGB 70 MiB, 3000x3000 RGB 149 MiB, grey or lossless alike: about 17 bytes a pixel.
_FORMAT_BYTES_PER_PIXEL = {"WEBP": 17}


def format_bytes_per_pixel(fmt: str | None) -> int:
    """What a format's decoder holds a pixel beyond the mode's accounting (0: nothing more)."""
    return _FORMAT_BYTES_PER_PIXEL.get(fmt or "", 0)


def stored_bytes_per_pixel(mode: str) -> int:
    return _STORED_BYTES_PER_PIXEL.get(mode, 4)


def decode_estimate(width: int, height: int, mode: str, *, transparent: bool = False, turned: bool = False,
                    coefficient_bytes: int = 0, fmt: str = "") -> int:
    """Bytes a decode of a ``width`` x ``height`` image in PIL ``mode`` holds at its peak, from its header: the
    decode and its 8-bit copy (``decode_bytes_per_pixel``, or the format ``fmt``'s decoder's own bytes a pixel
    where those are more, and their row pointers), the upright copy of a
    ``turned`` image (EXIF orientation 2..8) and a progressive JPEG's ``coefficient_bytes``. The transform
    after it holds O(output) more: it crops before it resizes, so no intermediate grows with the image's shape."""
    pixels = width * height
    lines = 2 * height * ROW_POINTER_BYTES + (width + height) * RESAMPLE_BYTES_PER_LINE
    turn = pixels * stored_bytes_per_pixel(mode) + max(width, height) * ROW_POINTER_BYTES if turned else 0
    per_pixel = max(decode_bytes_per_pixel(mode, transparent), format_bytes_per_pixel(fmt))
    return pixels * per_pixel + lines + turn + coefficient_bytes


def decode_bytes_per_pixel(mode: str, transparent: bool = False) -> int:
    """Bytes a pixel that a full decode of an image in PIL ``mode`` holds at its peak (see above); an ``L``,
    ``P`` or ``RGB`` image with a transparent colour is composited into RGB, like an alpha mode."""
    if transparent and mode in ("L", "P", "RGB"):
        return (4 if mode == "RGB" else 1) + RGB_DECODE_BYTES_PER_PIXEL  # decoded + the composited RGB
    return _DECODE_BYTES_PER_PIXEL.get(mode, _WIDEST_BYTES_PER_PIXEL)


# The budget's allowance for what grows with rows and columns (row pointers, filter weights): that of an RGB image
# at the pixel limit 16 times taller than wide (so any ordinary shape at the limit fits, and a needle of the same
# pixel count does not).
BUDGET_ASPECT = 16


def decode_budget_bytes(max_pixels: int) -> int:
    """The bytes a decode may hold under the pixel limit ``max_pixels``: an 8-bit RGB image at the limit, with
    the rows and columns of one ``BUDGET_ASPECT`` times taller than wide."""
    tall = math.isqrt(BUDGET_ASPECT * max_pixels)
    wide = max(1, max_pixels // tall)
    lines = decode_estimate(wide, tall, "RGB") - wide * tall * RGB_DECODE_BYTES_PER_PIXEL
    return max_pixels * RGB_DECODE_BYTES_PER_PIXEL + lines


# How a sample's pixels are computed from the decode, beyond the spec: named in the fingerprint so a cache made
# by an earlier rule (resize the whole image, then crop) is built again rather than mixed with this one's.
GEOMETRY = "crop-then-resize (resize box)"


def decode_accounting() -> dict:
    """The bytes a pixel charged per mode (``"*"``: any other mode), the other charges and reductions of
    ``decode_estimate`` and the transform's geometry, for fingerprints of what was decoded."""
    return {**_DECODE_BYTES_PER_PIXEL, "*": _WIDEST_BYTES_PER_PIXEL,
            "turned": {**_STORED_BYTES_PER_PIXEL, "*": 4}, "progressive_coefficient": COEFFICIENT_BYTES,
            "row_pointer": ROW_POINTER_BYTES, "resample_line": RESAMPLE_BYTES_PER_LINE,
            "formats": dict(_FORMAT_BYTES_PER_PIXEL),
            "budget_aspect": BUDGET_ASPECT,
            "jpeg_reductions": list(JPEG_REDUCTIONS), "geometry": GEOMETRY}
