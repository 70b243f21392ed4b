"""Limits shared by every decode path (ingest, materialize, the raw loader); a light module on purpose."""

# The ceiling on header-claimed pixels (PIL's own default: about 89 megapixels). Anything larger is recorded as
# a decompression bomb without being decoded.
DEFAULT_MAX_PIXELS = 89_478_485
