"""Decode memory is bounded by bytes, not pixels: a wide mode (16-bit grey, 32-bit int or float grey, alpha) costs
no more than its accounted bytes a pixel, and a 16-bit image no more than an 8-bit RGB one of the same size.

Peaks are measured in fresh processes, from the kernel's peak RSS of that process (``VmHWM``). ``ru_maxrss`` is
not used: Linux carries it across fork and exec, so a child of this (large) test process would report the
parent's peak. Each child imports the decoder, reads the file, then decodes: the decode's cost is the peak after
minus the peak before, so the interpreter, the modules and the file's bytes cancel out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from dutycycle.engine import imageinfo
from dutycycle.engine.limits import DEFAULT_MAX_PIXELS, decode_budget_bytes, decode_bytes_per_pixel
from PIL import Image

from ..support import REPO

SIDE = 4000  # 16 Mpx: the decode (tens of MB) dominates the measurement noise (a few MB)
JPEG_SIDE = 3000  # 9 Mpx: the JPEGs' extra costs (26 and 34 MB) are still well above the noise
MB = 1024 * 1024

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="peak RSS read from /proc")

_CHILD = r"""
import json, sys
from dutycycle.engine import imageinfo  # noqa: F401 - numpy and PIL load before the first peak, not in the decode
from dutycycle.engine.transform import TransformSpec, decode_and_transform
from tests.support.memory import peak_rss_bytes as peak

with open(sys.argv[1], "rb") as f:
    data = f.read()
before = peak()
out = decode_and_transform(data, TransformSpec(size=64, **json.loads(sys.argv[3])), max_pixels=int(sys.argv[2]))
print(json.dumps({"before": before, "after": peak(), "shape": list(out.shape)}))
"""


def decode_cost(path, max_pixels: int = DEFAULT_MAX_PIXELS, **spec) -> dict:
    """``{"before", "after", "cost"}`` in bytes: a fresh process's peak RSS before and after decoding ``path``
    (to a 64 x 64 sample of ``TransformSpec(**spec)``)."""
    root = str(REPO)
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(max_pixels), json.dumps(spec)], capture_output=True,
                         text=True, check=True, cwd=root, timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["shape"] == [64, 64, 3]
    return {**got, "cost": got["after"] - got["before"]}


def _ramp(dtype, top: int, side: int = SIDE) -> np.ndarray:
    """Smooth content with some texture, so the PNGs compress like images do, not like noise."""
    x, y = np.arange(side, dtype=np.int32)[None, :], np.arange(side, dtype=np.int32)[:, None]
    return ((x * 7 + y * 13 + (x * y) % 97) % top).astype(dtype)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("wide")
    ramp8 = _ramp(np.uint8, 256)
    made = {
        "RGB": (Image.fromarray(np.stack([ramp8, ramp8[::-1], ramp8[:, ::-1]], -1)), "png"),
        "I;16": (Image.fromarray(_ramp(np.uint16, 65536)), "png"),
        "I": (Image.fromarray(_ramp(np.int32, 70000) - 1000), "tif"),
        "F": (Image.fromarray(_ramp(np.float32, 300) - 20), "tif"),
        "RGBA": (Image.fromarray(np.stack([ramp8, ramp8[::-1], ramp8[:, ::-1], ramp8.T], -1)), "png"),
    }
    paths = {}
    for mode, (img, ext) in made.items():
        path = str(d / f"{mode.replace(';', '')}.{ext}")
        img.save(path, compress_level=1) if ext == "png" else img.save(path)
        assert Image.open(path).mode == mode
        paths[mode] = path
    return paths


def test_sixteen_bit_grey_costs_no_more_than_eight_bit_rgb_of_the_same_size(images):
    rgb, grey16 = decode_cost(images["RGB"]), decode_cost(images["I;16"])
    print(f"decode peak over the process before it, {SIDE}x{SIDE}: RGB 8-bit {rgb['cost'] / MB:.0f} MB, "
          f"grey 16-bit {grey16['cost'] / MB:.0f} MB; whole process: {rgb['after'] / MB:.0f} MB, "
          f"{grey16['after'] / MB:.0f} MB")
    assert rgb["cost"] > 0.9 * SIDE * SIDE * 4  # the decode dominates: PIL holds RGB as 4 bytes a pixel
    assert grey16["cost"] <= 1.1 * rgb["cost"]


@pytest.mark.parametrize("mode", ["RGB", "I;16", "I", "F", "RGBA"])
def test_each_mode_costs_what_the_pixel_budget_accounts_for(images, mode):
    """The byte budget charges ``decode_bytes_per_pixel``: a mode that cost more would slip past it."""
    got = decode_cost(images[mode])
    accounted = SIDE * SIDE * decode_bytes_per_pixel(mode)
    print(f"{mode}: {got['cost'] / MB:.0f} MB measured, {accounted / MB:.0f} MB accounted")
    assert got["cost"] <= 1.1 * accounted + 4 * MB  # a few MB of strips and decoder buffers beside the image


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> dict[str, str]:
    """Images whose decode costs more than their mode's bytes a pixel: a needle (16 x 250,000: the transform
    used to resize it to 64 x 1,000,000 before cropping), a progressive JPEG (its coefficients), an
    EXIF-rotated one (its upright copy) and a WebP (libwebp's own canvases)."""
    d = tmp_path_factory.mktemp("shapes")
    ramp8 = _ramp(np.uint8, 256, JPEG_SIDE)
    needle = np.tile(ramp8[:, :16], (84, 1))[:250_000]
    rgb = Image.fromarray(np.stack([ramp8, ramp8[::-1], ramp8[:, ::-1]], -1))
    exif = Image.Exif()
    exif[imageinfo.ORIENTATION_TAG] = 6
    paths = {"needle": str(d / "needle.png"), "progressive": str(d / "progressive.jpg"),
             "rotated": str(d / "rotated.jpg")}
    Image.fromarray(np.stack([needle, needle[::-1], needle], -1)).save(paths["needle"], compress_level=1)
    paths["webp"] = str(d / "photo.webp")
    rgb.crop((0, 0, 2000, 2000)).save(paths["webp"], quality=80, method=0)  # method 0: the fastest encoder
    rgb.save(paths["progressive"], quality=90, progressive=True)
    rgb.save(paths["rotated"], quality=90, exif=exif.tobytes())
    return paths


@pytest.mark.parametrize("shape, spec", [("needle", {}), ("needle", {"resize": "pad", "resample": "lanczos"}),
                                         ("progressive", {}), ("rotated", {}), ("webp", {})])
def test_any_shape_costs_what_its_header_estimate_says(shapes, shape, spec):
    """``imageinfo.decode_cost`` (from the header, before decoding) holds for the whole decode and transform:
    the needle's crop (the default spec) and its filter weights (lanczos over its whole length)."""
    with open(shapes[shape], "rb") as f:
        estimate = imageinfo.decode_cost(imageinfo.open_checked(f.read()))
    got = decode_cost(shapes[shape], **spec)
    print(f"{shape} {spec}: {got['cost'] / MB:.0f} MB measured, {estimate / MB:.0f} MB estimated")
    assert got["cost"] <= 1.1 * estimate + 4 * MB


def test_a_jpeg_over_the_budget_is_decoded_smaller_within_it(shapes):
    """With the pixel limit at the image's own size, a progressive JPEG's full decode (pixels + coefficients) is
    over the byte budget: the decoder scales it down (1/2) and the decode stays within the budget."""
    limit = JPEG_SIDE * JPEG_SIDE
    with open(shapes["progressive"], "rb") as f:
        im = imageinfo.open_checked(f.read(), limit)
    assert imageinfo.decode_cost(im) > decode_budget_bytes(limit) and imageinfo.decode_reduction(im, limit) == 2
    got = decode_cost(shapes["progressive"], limit)
    print(f"progressive at the limit: {got['cost'] / MB:.0f} MB measured, budget {decode_budget_bytes(limit) / MB:.0f}")
    assert got["cost"] <= decode_budget_bytes(limit) + 4 * MB  # the decoder's buffers, as above
