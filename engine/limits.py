"""Limits shared by every decode path (ingest, materialize, thumbnails, the raw loader); a light module on purpose."""

# The ceiling on header-claimed pixels, checked before anything is decoded: anything larger is recorded as a
# decompression bomb. 64 Mpx is well above any training photograph, keeps one RGBA decode under ~260 MB, and
# sits below PIL's own limit (``Image.MAX_IMAGE_PIXELS``, about 89.5 Mpx, which only warns up to twice that).
DEFAULT_MAX_PIXELS = 64_000_000

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
