"""Per-file image facts from bytes: header fields, EXIF orientation, integrity checks and a perceptual hash.

Everything here is bounded: only the decoders in ``limits.ALLOWED_FORMATS`` see the bytes, dimensions come from
the header (``Image.open`` is lazy), the pixel count is checked against a limit before anything is decoded, and
the perceptual hash and thumbnails decode a reduced image (JPEG draft mode picks a 1/2..1/8 scale inside the
decoder; other formats are decoded only up to ``limits.REDUCED_DECODE_MAX_PIXELS``). A file never raises out
of :func:`probe`: a problem becomes an ``error`` string whose prefix (before the first ``:``) is the reason
counted in summaries.

:func:`open_checked` is the one way untrusted bytes are opened (the table's probe and thumbnails, the cache's
decode, the raw loader), so a refused file has the same reason in a table row, a cache's skip counts and a
``DecodeError``.
"""

from __future__ import annotations

import hashlib
import io as _io
import re
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from .errors import DecodeError
from .limits import (
    ALLOWED_FORMATS,
    COEFFICIENT_BYTES,
    DEFAULT_MAX_PIXELS,
    JPEG_REDUCTIONS,
    REDUCED_DECODE_MAX_PIXELS,
    decode_budget_bytes,
    decode_bytes_per_pixel,
    decode_estimate,
    format_bytes_per_pixel,
)

ORIENTATION_TAG = 0x0112
HASH_HEX_CHARS = 32

# Reasons (the prefix of an error string, ``DecodeError.reason``): table summaries count rows per reason and
# a cache's manifest counts skipped samples per reason.
EMPTY = "empty file"
NOT_IMAGE = "not an image"
BOMB = "decompression bomb"
TRUNCATED = "truncated"
CORRUPT = "corrupt"
UNREADABLE = "unreadable"
UNSUPPORTED = "unsupported format"
TOO_LARGE = "too large"

# Signatures of image-like formats that are deliberately not decoded (not in ALLOWED_FORMATS), so the error can
# say "refused" rather than "not an image".
_REFUSED_SIGNATURES = {
    b"%!PS": "PostScript/EPS",
    b"\xc5\xd0\xd3\xc6": "EPS",
    b"%PDF": "PDF",
    b"8BPS": "PSD",
    b"icns": "ICNS",
    b"\x00\x00\x00\x0cjP  ": "JPEG 2000",
    b"\xffO\xffQ": "JPEG 2000",
    b"DDS ": "DDS",
    b"SIMPLE  =": "FITS",
}


def error_reason(error: str | None) -> str | None:
    """The counted reason of an error string: its text up to the first colon."""
    if error is None:
        return None
    return error.split(":", 1)[0]


def sample_id(data: bytes) -> str:
    """Content hash: identical bytes at two paths get the same id."""
    return hashlib.sha256(data).hexdigest()[:HASH_HEX_CHARS]


@dataclass
class ImageFacts:
    format: str | None = None
    width: int | None = None
    height: int | None = None
    mode: str | None = None
    channels: int | None = None
    orientation: int | None = None
    phash: int | None = None
    error: str | None = None


def tail_check(fmt: str, data: bytes) -> str | None:
    """Cheap end-of-stream checks that catch truncation without decoding pixels: the error, or None."""
    tail = data.rstrip(b"\x00")[-64:]
    # Some cameras append trailers after the end marker, so a marker further back counts too: for JPEG,
    # an end-of-image after the last start-of-scan (the scan data itself can hold no 0xFFD9).
    if fmt == "JPEG" and b"\xff\xd9" not in tail and data.rfind(b"\xff\xd9") <= data.rfind(b"\xff\xda"):
        return f"{TRUNCATED}: JPEG stream ends before its end-of-image marker ({len(data)} bytes)"
    if fmt == "PNG" and b"IEND" not in tail and data.rfind(b"IEND") < 0:
        return f"{TRUNCATED}: PNG stream ends before its IEND chunk ({len(data)} bytes)"
    if fmt == "WEBP" and len(data) >= 8:
        riff_size = int.from_bytes(data[4:8], "little") + 8
        if riff_size > len(data):
            return f"{TRUNCATED}: WebP header declares {riff_size} bytes, file has {len(data)}"
    return None


def refused_format(data: bytes) -> str | None:
    """The name of a recognised but refused format (EPS, PDF, ...), from its signature; None otherwise."""
    for magic, name in _REFUSED_SIGNATURES.items():
        if data.startswith(magic):
            return name
    if data[4:8] == b"ftyp" and data[8:12] in (b"heic", b"heix", b"avif", b"mif1", b"msf1"):
        return "HEIF/AVIF"
    return None


def refusal(data: bytes) -> str | None:
    """Why ``data`` is not decoded when it is a recognised but refused format, else None: one message for
    every caller that opens untrusted bytes (the table's probe and thumbnails, the cache's decode)."""
    refused = refused_format(data)
    return f"{refused} is not decoded (allowed: {', '.join(ALLOWED_FORMATS)})" if refused else None


def _sniff(data: bytes) -> str:
    if data.startswith(b"\xff\xd8"):
        return "JPEG"
    if data.startswith(b"\x89PNG"):
        return "PNG"
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        return "WEBP"
    return ""


# Signatures strong enough that a file starting with one (or with at least 4 bytes of one, cut short) is that
# format even when no decoder can open it: a cut-short file of an allowed format is "truncated", not "not an
# image". (BMP's two-letter "BM" is too weak: text starts with it.)
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"),
    (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"),
)


def signature_format(data: bytes) -> str:
    """The allowed format whose signature ``data`` starts with, or is a cut-short prefix of (4 bytes or more)."""
    for magic, name in _SIGNATURES:
        if data.startswith(magic) or (len(data) >= 4 and magic.startswith(data)):
            return name
    return _sniff(data)


def _cut_header(fmt: str, data: bytes) -> str | None:
    """Why a file with ``fmt``'s signature that no decoder could open is cut short, or None (then: corrupt)."""
    for magic, name in _SIGNATURES:
        if name == fmt and len(data) < len(magic):
            return f"{TRUNCATED}: {len(data)} bytes, the start of a {fmt} signature"
    if fmt == "GIF" and not data.rstrip(b"\x00").endswith(b";"):
        return f"{TRUNCATED}: GIF stream ends before its trailer ({len(data)} bytes)"
    if fmt == "TIFF":  # the first directory (its entry count, 12 bytes an entry, the next offset) must be inside
        order = "little" if data.startswith(b"II") else "big"
        at = int.from_bytes(data[4:8], order) if len(data) >= 8 else len(data)
        entries = int.from_bytes(data[at : at + 2], order) if at + 2 <= len(data) else None
        if entries is None or at + 2 + 12 * entries + 4 > len(data):
            return f"{TRUNCATED}: TIFF stream ends inside its first directory ({len(data)} bytes)"
        return None
    return tail_check(fmt, data)


def _refuse(reason: str, detail: str) -> DecodeError:
    return DecodeError(reason, f"{reason}: {detail}")


# A file's bytes never appear in an error (a table's error column, a contact sheet, a log): errors describe the file
# (its size, a guess at what it is) and the reason, and decoder messages lose any bytes literal they quote.
_BYTES_LITERAL = re.compile(r"b'(?:[^'\\]|\\.)*'" + r'|b"(?:[^"\\]|\\.)*"')
_KNOWN_KINDS = (
    (b"PK\x03\x04", "a ZIP archive"), (b"\x1f\x8b", "gzip data"), (b"\x7fELF", "an ELF executable"),
    (b"MZ", "a Windows executable"), (b"\xfd7zXZ", "xz data"), (b"BZh", "bzip2 data"),
)


def describe_error(e: BaseException) -> str:
    """A decoder's message, without the bytes literals some of them quote from the file, at most 200 chars."""
    return _BYTES_LITERAL.sub("<bytes>", str(e))[:200]


def guess_kind(data: bytes) -> str:
    """What a file that is not an image seems to be, in words, from its first bytes (never quoting them)."""
    for magic, name in _KNOWN_KINDS:
        if data.startswith(magic):
            return name
    head = data[:512]
    text = _utf8_prefix(head)
    if text is not None and all(c.isprintable() or c in "\t\r\n\f" for c in text):
        stripped = text.lstrip().lower()
        if stripped.startswith(("<!doctype html", "<html")):
            return "HTML text"
        if stripped.startswith("<"):
            return "markup text (HTML or XML)"
        if stripped.startswith(("{", "[")):
            return "JSON-like text"
        return "text"
    return "binary data"


def _utf8_prefix(head: bytes) -> str | None:
    """``head`` as UTF-8 text, allowing its last character to be cut by the window; None when it is not UTF-8."""
    for k in (0, 1, 2, 3):
        try:
            return head[: len(head) - k].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return None


def decode_failure(e: BaseException, context: str = "") -> DecodeError:
    """The error for pixel data that fails to decode once the header parsed: truncated or corrupt."""
    reason = TRUNCATED if "truncat" in str(e).lower() else CORRUPT
    return _refuse(reason, f"{context}{describe_error(e)}")


def _cut_or(data: bytes, fmt: str, otherwise: DecodeError) -> DecodeError:
    """``truncated`` when the stream visibly ends early, else ``otherwise``."""
    cut = tail_check(fmt, data)
    return DecodeError(TRUNCATED, cut) if cut else otherwise


def open_checked(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Open an image lazily with the allowed decoders only, and refuse it before decoding when its header
    claims more than ``max_pixels``.

    Raises ``DecodeError`` (a ``ValueError``) whose ``reason`` is one of this module's reasons and whose
    message starts with it; every caller that decodes uses this, so no code path allocates a bomb.
    """
    if not data:
        raise _refuse(EMPTY, "0 bytes")
    try:
        with warnings.catch_warnings():
            # PIL warns between 1x and 2x its own limit; we apply our own limit just below.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            # TIFF's parser warns about a cut or damaged directory, once per file: the file's error says it
            warnings.simplefilter("ignore", UserWarning)
            im = Image.open(_io.BytesIO(data), formats=ALLOWED_FORMATS)
    except Image.DecompressionBombError as e:
        raise _refuse(BOMB, str(e)) from None
    except UnidentifiedImageError:
        reason = refusal(data)
        if reason:
            raise _refuse(UNSUPPORTED, reason) from None
        fmt = signature_format(data)
        if fmt:  # an allowed format's signature that no decoder can open: cut short, or damaged
            cut = _cut_header(fmt, data)
            raise (DecodeError(TRUNCATED, cut) if cut else _refuse(
                CORRUPT, f"{fmt} signature, but its header cannot be parsed ({len(data)} bytes)")) from None
        raise _refuse(NOT_IMAGE, f"no known image signature ({len(data)} bytes of {guess_kind(data)})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # the header hit the end of the data or garbage
        raise _cut_or(data, _sniff(data), decode_failure(e)) from None
    w, h = im.size
    if w <= 0 or h <= 0:
        raise _refuse(CORRUPT, f"header claims {w}x{h} pixels")
    if w * h > max_pixels:
        raise _refuse(BOMB, f"header claims {w}x{h} = {w * h} pixels, over the limit of {max_pixels}")
    if decode_reduction(im, max_pixels) is None:
        raise _refuse(BOMB, _over_budget(im, max_pixels))
    return im


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _coefficient_bytes(im: Image.Image) -> int:
    """A progressive JPEG's whole-image DCT coefficients (``limits.COEFFICIENT_BYTES``), from its header."""
    if im.format != "JPEG" or not im.info.get("progressive"):
        return 0
    layers = getattr(im, "layer", None) or [(0, 1, 1, 0)] * len(im.getbands())  # (id, h and v sampling, table)
    hmax, vmax = max(c[1] for c in layers), max(c[2] for c in layers)
    w, h = im.size
    blocks = sum(_ceil(_ceil(w * c[1], hmax), 8) * _ceil(_ceil(h * c[2], vmax), 8) for c in layers)
    return blocks * 64 * COEFFICIENT_BYTES


def decode_cost(im: Image.Image, reduction: int = 1, turned: bool | None = None) -> int:
    """``limits.decode_estimate`` for ``im`` (opened, not decoded) decoded at 1/``reduction`` of its size;
    ``turned``: whether it has an EXIF orientation to apply (None: read it)."""
    w, h = im.size
    if turned is None:
        turned = orientation_of(im) != 1
    return decode_estimate(_ceil(w, reduction), _ceil(h, reduction), im.mode, transparent="transparency" in im.info,
                           turned=turned, coefficient_bytes=_coefficient_bytes(im), fmt=im.format or "")


def decode_reduction(im: Image.Image, max_pixels: int = DEFAULT_MAX_PIXELS) -> int | None:
    """The reduction (1: full size) at which ``im`` decodes within the byte budget of ``max_pixels``, from its
    header: a JPEG over the budget is decoded smaller inside the decoder (``limits.JPEG_REDUCTIONS``); None when
    nothing fits (the image is refused)."""
    budget = decode_budget_bytes(max_pixels)
    for reduction in JPEG_REDUCTIONS if im.format == "JPEG" else (1,):
        # EXIF is parsed only when its answer matters: most images fit even if they had to be turned
        if decode_cost(im, reduction, turned=True) <= budget or decode_cost(im, reduction) <= budget:
            return reduction
    return None


def _over_budget(im: Image.Image, max_pixels: int) -> str:
    w, h = im.size
    per_pixel = max(decode_bytes_per_pixel(im.mode, "transparency" in im.info), format_bytes_per_pixel(im.format))
    extra = ["row pointers and filter weights"]
    if orientation_of(im) != 1:
        extra.append("its upright copy")
    if _coefficient_bytes(im):
        extra.append(f"{_coefficient_bytes(im)} bytes of progressive JPEG coefficients")
    smallest = f"; at 1/{JPEG_REDUCTIONS[-1]} scale still {decode_cost(im, JPEG_REDUCTIONS[-1])} bytes" \
        if im.format == "JPEG" else ""
    return (f"header claims {w}x{h} {im.mode} pixels, {decode_cost(im)} bytes to decode ({per_pixel} a pixel"
            + "".join(f", + {e}" for e in extra) + f"), over the budget of {decode_budget_bytes(max_pixels)} "
            f"bytes (an RGB image at the limit of {max_pixels} pixels){smallest}; raise max_pixels to decode it")


def orientation_of(im: Image.Image) -> int:
    try:
        value = int(im.getexif().get(ORIENTATION_TAG, 1))
    except Exception:  # malformed EXIF blocks are common in the wild; they must not fail the file
        return 1
    return value if 1 <= value <= 8 else 1


# EXIF orientation -> the transpose that makes the image upright (the table ImageOps.exif_transpose uses).
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def upright(im: Image.Image, orientation: int) -> Image.Image:
    """Apply an EXIF orientation explicitly (works on images that lost their EXIF block while resizing)."""
    method = _TRANSPOSE.get(orientation)
    return im.transpose(method) if method is not None else im


def _dct_matrix(n: int) -> np.ndarray:
    k = np.arange(n)[:, None]
    i = np.arange(n)[None, :]
    m = np.cos(np.pi * (2 * i + 1) * k / (2 * n)) * np.sqrt(2.0 / n)
    m[0] /= np.sqrt(2.0)
    return m


_DCT32 = _dct_matrix(32)


def reduced_decode(im: Image.Image, mode: str, size: int, max_pixels: int = REDUCED_DECODE_MAX_PIXELS):
    """Decode ``im`` for a small derivative (hash, preview) at bounded cost; returns the loaded image.

    JPEG: draft mode makes the decoder itself scale by 1/2..1/8 (at least ``size`` px kept), so even the
    largest allowed JPEG costs a few megapixels. Other formats have no reduced decode in PIL, so they are
    decoded only when at most ``max_pixels``; a larger one raises ``ValueError`` ("too large: ...").
    """
    if im.format == "JPEG":
        im.draft(mode, (size, size))
    elif im.width * im.height > max_pixels:
        raise ValueError(
            f"{TOO_LARGE}: {im.format} of {im.width}x{im.height} pixels is over the reduced-decode budget of "
            f"{max_pixels} pixels"
        )
    im.load()
    return im


def phash_of(im: Image.Image, orientation: int = 1) -> int:
    """64-bit DCT perceptual hash as a signed int64, computed from a reduced decode (see ``reduced_decode``).

    Resize to 32x32 grey, 2-D DCT, keep the 8x8 lowest frequencies, set a bit where a coefficient exceeds
    their median. Similar-looking images differ in few bits (Hamming distance).
    """
    im = reduced_decode(im, "L", 32)
    small = im.convert("L").resize((32, 32), Image.Resampling.BILINEAR)
    small = upright(small, orientation)
    a = np.asarray(small, dtype=np.float64)
    coeffs = (_DCT32 @ a @ _DCT32.T)[:8, :8].ravel()
    median = np.partition(coeffs[1:], 31)[31]  # median of the 63 AC terms (np.median is slow for 63 values)
    bits = coeffs > median
    return int(np.packbits(bits).view(">i8")[0])  # big-endian: the first coefficient is the top bit


def hamming(a: int, b: int) -> int:
    return ((a ^ b) & ((1 << 64) - 1)).bit_count()


def probe(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS, with_phash: bool = True) -> ImageFacts:
    """Facts about one file's bytes; never raises."""
    try:
        return _probe(data, max_pixels, with_phash)
    except Exception as e:  # the contract: a file gets a row with an error, ingest never crashes on a file
        return ImageFacts(error=f"{UNREADABLE}: {type(e).__name__}: {describe_error(e)}")


def _probe(data: bytes, max_pixels: int, with_phash: bool) -> ImageFacts:
    try:
        im = open_checked(data, max_pixels)
    except DecodeError as e:
        return ImageFacts(error=str(e))
    fmt = im.format
    w, h = im.size
    mode = im.mode
    channels = len(im.getbands())
    orientation = orientation_of(im)
    if orientation >= 5:  # 5..8 rotate by 90 degrees: displayed width is the stored height
        w, h = h, w
    facts = ImageFacts(format=fmt, width=w, height=h, mode=mode, channels=channels, orientation=orientation)
    bad = tail_check(fmt or "", data)
    if bad is None and fmt == "PNG":
        # verify() walks the chunks and checks their CRCs without decoding pixels.
        try:
            Image.open(_io.BytesIO(data), formats=("PNG",)).verify()
        except Exception as e:
            bad = f"{CORRUPT}: {type(e).__name__}: {describe_error(e)}"
    if bad is None and with_phash and (im.format == "JPEG" or w * h <= REDUCED_DECODE_MAX_PIXELS):
        # (a larger non-JPEG gets no perceptual hash: dedupe then finds only its exact copies)
        try:
            facts.phash = phash_of(im, orientation)
        except OSError as e:
            bad = str(decode_failure(e))
        except Exception as e:
            bad = f"{CORRUPT}: {type(e).__name__}: {describe_error(e)}"
    if bad is not None:
        facts.error = bad
        facts.phash = None
    return facts


def thumbnail_jpeg(data: bytes, size: int = 128, max_pixels: int = DEFAULT_MAX_PIXELS) -> bytes:
    """A small RGB JPEG of an image, upright, decoded at reduced scale; raises ValueError (``DecodeError`` for a
    bad file, a ``too large`` one past the reduced-decode budget)."""
    im = open_checked(data, max_pixels)
    orientation = orientation_of(im)
    try:
        im = reduced_decode(im, "RGB", size)
        im.thumbnail((size, size))
    except OSError as e:
        raise decode_failure(e) from None
    im = upright(im, orientation)
    if im.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        arr = np.asarray(im, dtype=np.float64)
        im = Image.fromarray((255 * arr / max(arr.max(), 1)).astype(np.uint8))
    im = im.convert("RGB")
    out = _io.BytesIO()
    im.save(out, "JPEG", quality=80)
    return out.getvalue()
