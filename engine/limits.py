"""Limits shared by every decode path (ingest, materialize, thumbnails, the raw loader); a light module on purpose."""

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


def decode_bytes_per_pixel(mode: str, transparent: bool = False) -> int:
    """Bytes a pixel that a full decode of an image in PIL ``mode`` holds at its peak (see above); an ``L``,
    ``P`` or ``RGB`` image with a transparent colour is composited into RGB, like an alpha mode."""
    if transparent and mode in ("L", "P", "RGB"):
        return (4 if mode == "RGB" else 1) + RGB_DECODE_BYTES_PER_PIXEL  # decoded + the composited RGB
    return _DECODE_BYTES_PER_PIXEL.get(mode, _WIDEST_BYTES_PER_PIXEL)


def decode_budget_bytes(max_pixels: int) -> int:
    """The bytes a decode may hold under the pixel limit ``max_pixels``."""
    return max_pixels * RGB_DECODE_BYTES_PER_PIXEL


def decode_accounting() -> dict[str, int]:
    """The bytes a pixel charged per mode (``"*"``: any other mode), for fingerprints of what was decoded."""
    return {**_DECODE_BYTES_PER_PIXEL, "*": _WIDEST_BYTES_PER_PIXEL}
