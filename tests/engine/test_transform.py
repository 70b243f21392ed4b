"""Transform specs and decode_and_transform: validation, parity with an independent PIL pipeline, colour modes,
hostile input."""

from __future__ import annotations

import io as _io

import numpy as np
import pytest
from dutycycle.engine.errors import ConfigError
from dutycycle.engine.transform import DecodeError, TransformSpec, decode_and_transform
from PIL import Image, ImageOps

from ..support.tablemaker import jpeg_bytes, photo_image, png_bytes, shape_image

FILTERS = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC, "lanczos": Image.LANCZOS, "nearest": Image.NEAREST}


def reference(data: bytes, size: int, resample: str) -> np.ndarray:
    """The plain PIL pipeline, written out by hand: exif_transpose, RGB, shorter side to size, centre crop (HWC)."""
    img = ImageOps.exif_transpose(Image.open(_io.BytesIO(data))).convert("RGB")
    w, h = img.size
    if w < h:
        nw, nh = size, int(round(h * size / w))
    else:
        nw, nh = int(round(w * size / h)), size
    img = img.resize((nw, nh), FILTERS[resample])
    left, top = (nw - size) // 2, (nh - size) // 2
    return np.asarray(img.crop((left, top, left + size, top + size)))


def close_fraction(a: np.ndarray, b: np.ndarray, levels: int = 2) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype == np.uint8
    return float(np.mean(np.abs(a.astype(np.int16) - b.astype(np.int16)) <= levels))


# ------------------------------------------------------------------------------------------------- spec


def test_spec_is_frozen_hashable_and_round_trips():
    s = TransformSpec(size=32, resize="pad", resample="bicubic", layout="CHW", background="white")
    assert TransformSpec.from_json(s.to_json()) == s
    assert hash(s) == hash(TransformSpec.from_json(s.to_json()))
    assert s.shape == (3, 32, 32) and TransformSpec(size=8).shape == (8, 8, 3)
    assert s.to_json() != TransformSpec(size=33, resize="pad", resample="bicubic", layout="CHW").to_json()
    with pytest.raises(AttributeError):
        s.size = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"size": 0}, "size"),
        ({"size": "64"}, "size"),
        ({"resize": "crop"}, "resize"),
        ({"resample": "cubic"}, "resample"),
        ({"layout": "NHWC"}, "layout"),
        ({"dtype": "float32"}, "dtype"),
        ({"mode": "CMYK"}, "mode"),
        ({"exif": "yes"}, "exif"),
        ({"background": "grey"}, "background"),
    ],
)
def test_spec_validation_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=rf"TransformSpec\.{field}="):
        TransformSpec(**kwargs)


def test_spec_from_json_rejects_unknown_fields_and_bad_json():
    with pytest.raises(ConfigError, match="no field 'colour'"):
        TransformSpec.from_json('{"colour": "red"}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        TransformSpec.from_json("{size: 3")


# ------------------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("resample", ["bilinear", "bicubic", "lanczos"])
def test_parity_with_plain_pil_on_shapes_and_photos(resample):
    rng = np.random.default_rng(1)
    spec = TransformSpec(size=64, resample=resample)
    outs, refs = [], []
    for i in range(24):
        w, h = (int(v) for v in rng.integers(128, 257, 2))
        img = shape_image(i, w, h)[0] if i % 2 else photo_image(rng, w, h)
        data = jpeg_bytes(img, orientation=[1, 3, 6, 8, 2, 5][i % 6])
        outs.append(decode_and_transform(data, spec))
        refs.append(reference(data, 64, resample))
    photos = np.stack(outs[0::2]), np.stack(refs[0::2])
    shapes = np.stack(outs[1::2]), np.stack(refs[1::2])
    assert close_fraction(*photos) >= 0.99
    assert close_fraction(*shapes) >= 0.99
    # The photos are not flat: the check compares real detail, not constant colour.
    assert photos[1].std() > 30


def test_exif_orientation_is_applied():
    # A wide image tagged "rotate 90" must come out tall-content: compare against the pre-rotated pixels.
    rng = np.random.default_rng(2)
    img = photo_image(rng, 160, 96)
    upright = decode_and_transform(png_bytes(img.transpose(Image.Transpose.ROTATE_270)), TransformSpec(size=48))
    tagged = decode_and_transform(jpeg_bytes(img, orientation=6, quality=98), TransformSpec(size=48))
    ignored = decode_and_transform(jpeg_bytes(img, orientation=6, quality=98), TransformSpec(size=48, exif=False))
    assert close_fraction(tagged, upright, 6) > 0.95
    assert close_fraction(ignored, upright, 6) < 0.5


def test_layouts_and_policies():
    rng = np.random.default_rng(3)
    data = png_bytes(photo_image(rng, 120, 60))
    hwc = decode_and_transform(data, TransformSpec(size=40))
    chw = decode_and_transform(data, TransformSpec(size=40, layout="CHW"))
    assert hwc.dtype == np.uint8 and hwc.shape == (40, 40, 3) and chw.flags.c_contiguous
    assert np.array_equal(chw, hwc.transpose(2, 0, 1))
    # pad: a 2:1 image leaves background bands above and below (black by default, white on request)
    pad = decode_and_transform(data, TransformSpec(size=40, resize="pad"))
    assert pad.shape == (40, 40, 3) and (pad[:9] == 0).all() and (pad[-9:] == 0).all() and pad[15:25].std() > 5
    white = decode_and_transform(data, TransformSpec(size=40, resize="pad", background="white"))
    assert (white[:9] == 255).all()
    stretch = decode_and_transform(data, TransformSpec(size=40, resize="stretch"))
    ref = np.asarray(Image.open(_io.BytesIO(data)).convert("RGB").resize((40, 40), Image.BILINEAR))
    assert np.array_equal(stretch, ref)


# ------------------------------------------------------------------------------------------------- colour modes


def _one(img: Image.Image, **kw) -> np.ndarray:
    """Transform a uniform image to 4x4 and return its (single) colour."""
    out = decode_and_transform(png_bytes(img, **kw), TransformSpec(size=4, resample="nearest"))
    assert out.shape == (4, 4, 3)
    assert (out == out[0, 0]).all()
    return out[0, 0].astype(int)


def test_sixteen_bit_grey_is_scaled_not_clipped():
    for value, expected in [(65535, 255), (32896, 128), (257, 1), (0, 0)]:
        img = Image.fromarray(np.full((8, 8), value, np.uint16))
        assert img.mode.startswith("I;16")
        assert _one(img).tolist() == [expected] * 3
    # a 16-bit gradient keeps its ordering (PIL's convert("L") would clip it all to 255)
    grad = Image.fromarray(np.arange(64, dtype=np.uint16).reshape(8, 8) * 1000)
    out = decode_and_transform(png_bytes(grad), TransformSpec(size=8, resample="nearest"))
    assert out[..., 0].ravel().tolist() == sorted(out[..., 0].ravel().tolist()) and out.max() == 245  # 63000 * 255 / 65535


def test_palette_transparency_cmyk_alpha_grey_and_bilevel():
    # palette with a transparent entry: that entry composites to the background (black)
    p = Image.new("P", (8, 8), 1)
    p.putpalette([10, 20, 30, 200, 100, 50] + [0] * 762)
    assert _one(p).tolist() == [200, 100, 50]
    assert _one(p, transparency=1).tolist() == [0, 0, 0]
    # CMYK: pure cyan -> (0, 255, 255); no ink -> white
    assert _one_jpeg(Image.new("CMYK", (8, 8), (255, 0, 0, 0))) == pytest.approx([0, 255, 255], abs=3)
    assert _one_jpeg(Image.new("CMYK", (8, 8), (0, 0, 0, 0))) == pytest.approx([255, 255, 255], abs=3)
    # RGBA half transparent over black: colour * alpha / 255
    assert _one(Image.new("RGBA", (8, 8), (200, 100, 50, 128))) == pytest.approx([100, 50, 25], abs=1)
    assert _one(Image.new("RGBA", (8, 8), (200, 100, 50, 0))).tolist() == [0, 0, 0]
    # LA, L and 1
    assert _one(Image.new("LA", (8, 8), (180, 255))).tolist() == [180] * 3
    assert _one(Image.new("L", (8, 8), 77)).tolist() == [77] * 3
    assert _one(Image.new("1", (8, 8), 1)).tolist() == [255] * 3
    # white background on request
    white = decode_and_transform(png_bytes(Image.new("RGBA", (8, 8), (0, 0, 0, 0))),
                                 TransformSpec(size=4, background="white"))
    assert (white == 255).all()


def _one_jpeg(img: Image.Image) -> list[int]:
    buf = _io.BytesIO()
    img.save(buf, "JPEG", quality=95)
    assert Image.open(_io.BytesIO(buf.getvalue())).mode == "CMYK"
    out = decode_and_transform(buf.getvalue(), TransformSpec(size=4))
    return out[0, 0].astype(int).tolist()


# ------------------------------------------------------------------------------------------------- hostile input


def test_decompression_bomb_is_refused_from_the_header():
    data = png_bytes(Image.new("L", (300, 300), 9))
    assert decode_and_transform(data, TransformSpec(size=8)).shape == (8, 8, 3)
    with pytest.raises(DecodeError, match="300x300") as e:
        decode_and_transform(data, TransformSpec(size=8), max_pixels=300 * 300 - 1)
    assert e.value.reason == "decompression bomb"
    # A truncated file whose header promises a huge image: refused before any pixel is decoded
    # (a decode attempt would report "truncated" instead).
    big = png_bytes(Image.new("L", (4000, 4000), 0), compress_level=9)[:2000]
    with pytest.raises(DecodeError) as e:
        decode_and_transform(big, TransformSpec(size=8), max_pixels=1_000_000)
    assert e.value.reason == "decompression bomb"


def test_corrupt_and_truncated_files_raise_decode_error():
    with pytest.raises(DecodeError) as e:
        decode_and_transform(b"hello, not an image", TransformSpec())
    assert e.value.reason == "not an image" and str(e.value).startswith("not an image: ")
    data = jpeg_bytes(photo_image(np.random.default_rng(4), 200, 150))
    with pytest.raises(DecodeError) as e:
        decode_and_transform(data[: len(data) // 3], TransformSpec())
    assert e.value.reason == "truncated"
    with pytest.raises(DecodeError) as e:
        decode_and_transform(b"", TransformSpec())
    assert e.value.reason == "empty file"


# ------------------------------------------------------------------------------------------------- decode memory


def _tiff_bytes(img: Image.Image) -> bytes:
    buf = _io.BytesIO()
    img.save(buf, "TIFF")
    return buf.getvalue()


def test_decode_budget_counts_bytes_per_pixel_not_pixels():
    """At the same pixel count, a mode that holds more bytes a pixel than 8-bit RGB is over the byte budget."""
    from dutycycle.engine import imageinfo

    limit = 250_000  # pixels; the budget is 1,134,000 bytes: 4 a pixel, as PIL holds RGB, + 134,000 for the rows
    # and columns (row pointers, filter weights) of an image at the limit 16 times taller than wide
    fits = {
        "RGB": png_bytes(Image.new("RGB", (500, 500))),
        "L": png_bytes(Image.new("L", (500, 500))),
        "I;16": png_bytes(Image.fromarray(np.zeros((500, 500), np.uint16))),
        "RGBA half": png_bytes(Image.new("RGBA", (500, 250))),  # 8 bytes a pixel, half the pixels
        "F two thirds": _tiff_bytes(Image.fromarray(np.zeros((330, 500), np.float32))),
    }
    for name, data in fits.items():
        assert decode_and_transform(data, TransformSpec(size=8), max_pixels=limit).shape == (8, 8, 3), name
    over = {
        "RGBA": png_bytes(Image.new("RGBA", (500, 500))),
        "LA": png_bytes(Image.new("LA", (500, 500))),
        "F": _tiff_bytes(Image.fromarray(np.zeros((500, 500), np.float32))),
        "P with a transparent colour": png_bytes(Image.new("P", (500, 500)), transparency=0),
    }
    for name, data in over.items():
        with pytest.raises(DecodeError, match=r"bytes to decode .* over the budget of 1134000 bytes") as e:
            decode_and_transform(data, TransformSpec(size=8), max_pixels=limit)
        assert e.value.reason == "decompression bomb", name
        # one limit: ingest records the same refusal for the row
        assert imageinfo.probe(data, max_pixels=limit).error == str(e.value), name


@pytest.mark.parametrize("resize", ["shorter_crop", "pad", "stretch"])
def test_wide_grey_and_alpha_in_strips_give_the_whole_image_pixels(monkeypatch, resize):
    """16-bit, 32-bit and float grey and alpha are brought to 8 bits a strip of rows at a time; the pixels are
    those of the whole-image conversion (written out here with PIL and int64 numpy), grey resized as RGB."""
    from dutycycle.engine import transform

    rng = np.random.default_rng(5)
    h, w = 150, 97
    g16 = rng.integers(0, 65536, (h, w), dtype=np.uint16)
    i32 = rng.integers(-5000, 90000, (h, w), dtype=np.int32)
    f32 = rng.uniform(-20, 280, (h, w)).astype(np.float32)
    rgba = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)

    def grey(a):
        return Image.fromarray(a.astype(np.uint8), "L").convert("RGB")

    def scaled16(a):
        return grey((np.clip(a.astype(np.int64), 0, 65535) * 255 + 32767) // 65535)

    def composite(img):
        canvas = Image.new("RGBA", img.size, (255, 255, 255, 255))
        return Image.alpha_composite(canvas, img.convert("RGBA")).convert("RGB")

    cases = {
        "I;16": (png_bytes(Image.fromarray(g16)), scaled16(g16)),
        "I": (_tiff_bytes(Image.fromarray(i32)), scaled16(i32)),
        "F": (_tiff_bytes(Image.fromarray(f32)), grey(np.rint(np.clip(f32.astype(np.float64), 0, 255)))),
        "RGBA": (png_bytes(Image.fromarray(rgba)), composite(Image.fromarray(rgba))),
    }
    spec = TransformSpec(size=24, resize=resize, background="white")
    monkeypatch.setattr(transform, "_STRIP_BYTES", 4 * w * 7)  # 7 rows a strip: 22 strips, the last one short
    for mode, (data, whole) in cases.items():
        assert Image.open(_io.BytesIO(data)).mode == mode
        expected = transform.transform_image(whole, spec)  # an RGB image: no conversion left to do
        assert np.array_equal(decode_and_transform(data, spec), expected), mode


# ------------------------------------------------------------------------------------------------- any shape


@pytest.mark.parametrize("resample", ["bilinear", "lanczos"])
def test_shorter_crop_resizes_only_its_crop_and_gives_the_resize_then_crop_pixels(resample):
    """The crop is taken before the resize (a needle's whole resized image would be huge: see
    test_decode_memory); the pixels are those of resizing the whole image and cropping (``reference``), up to
    the rounding of the box's coordinates."""
    rng = np.random.default_rng(6)
    for w, h in [(3, 900), (900, 5), (1, 257), (130, 97), (64, 64), (200, 64)]:
        data = png_bytes(photo_image(rng, w, h))
        got = decode_and_transform(data, TransformSpec(size=32, resample=resample))
        assert close_fraction(got, reference(data, 32, resample), levels=1) >= 0.99, (w, h)


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = _io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def test_a_jpeg_over_the_byte_budget_is_decoded_smaller_and_a_png_needle_refused():
    """The header's estimate (pixels, row pointers, a progressive JPEG's coefficients, an EXIF turn's upright
    copy) decides before decoding: a JPEG over the budget is decoded at 1/2..1/8 by its decoder, anything else
    over it is refused, with the same error in ingest's row."""
    from dutycycle.engine import imageinfo

    img = photo_image(np.random.default_rng(7), 400, 300)
    limit = 400 * 300  # the pixel limit at the image's own size: its pixels fit, with the extra costs they do not
    for name, data in {"progressive": _encode(img, "JPEG", quality=95, progressive=True),
                       "turned": jpeg_bytes(img, orientation=6, quality=95)}.items():
        assert imageinfo.decode_reduction(imageinfo.open_checked(data, limit), limit) == 2, name
        small = decode_and_transform(data, TransformSpec(size=64), max_pixels=limit)
        full = decode_and_transform(data, TransformSpec(size=64))  # the default limit: decoded at full size
        assert close_fraction(small, full, 12) > 0.95, name  # the same picture, from a 200x150 decode
        assert imageinfo.probe(data, max_pixels=limit).error is None, name
    # a PNG has no reduced decode: a needle whose row pointers alone are over the budget is refused
    needle = png_bytes(Image.new("L", (1, 20_000)))  # 20,000 pixels, 320,000 bytes of row pointers
    assert decode_and_transform(needle, TransformSpec(size=8)).shape == (8, 8, 3)
    with pytest.raises(DecodeError, match=r"1x20000 L pixels, \d+ bytes to decode .* raise max_pixels to decode it") as e:
        decode_and_transform(needle, TransformSpec(size=8), max_pixels=40_000)
    assert e.value.reason == "decompression bomb"
    assert imageinfo.probe(needle, max_pixels=40_000).error == str(e.value)


def test_a_file_cut_short_is_truncated_wherever_it_is_cut():
    """Cut inside its header (a PNG's IHDR, a GIF's screen descriptor, a TIFF's directory) a file used to read
    as "not an image"; ingest's row and the decoder now both say truncated. A damaged header is corrupt, and
    what has no image signature stays "not an image"."""
    from dutycycle.engine import imageinfo

    img = photo_image(np.random.default_rng(8), 40, 30)
    for fmt in ("PNG", "JPEG", "GIF", "TIFF"):
        data = _encode(img, fmt)
        for cut in (4, 8, 12, 20, 30, 40, 100, len(data) // 2, len(data) - 20):
            error = imageinfo.probe(data[:cut]).error
            assert imageinfo.error_reason(error) == "truncated", (fmt, cut, error)
            with pytest.raises(DecodeError) as e:
                decode_and_transform(data[:cut], TransformSpec(size=8))
            assert e.value.reason == "truncated", (fmt, cut, str(e.value))
    png = _encode(img, "PNG")
    assert imageinfo.error_reason(imageinfo.probe(png[:8] + bytes(40) + png[-12:]).error) == "corrupt"
    for data in (b"just some text", b"\x89PNX\r\n", b"BM not a bitmap", b"GIF"):
        assert imageinfo.error_reason(imageinfo.probe(data).error) == "not an image", data
