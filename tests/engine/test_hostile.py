"""Hostile and odd inputs, generated in code: every file gets a row with correct metadata or a clear error."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from dutycycle.engine import imageinfo
from dutycycle.engine import io as dio
from dutycycle.engine.limits import DEFAULT_MAX_PIXELS
from dutycycle.engine.table.catalog import ingest
from dutycycle.engine.table.table import open_table, read_arrow
from dutycycle.engine.transform import DecodeError, TransformSpec, decode_and_transform
from PIL import Image


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return (
        struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    )


def png_bomb(width: int, height: int) -> bytes:
    """A valid-looking PNG whose header claims width x height greyscale pixels; a few hundred bytes long."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 1024)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", idat)
        + _png_chunk(b"IEND", b"")
    )


EPS = (
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 120 80\n%%EndComments\n"
    b"newpath 10 10 moveto 110 70 lineto stroke\nshowpage\n%%EOF\n"
)


def _encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _noise(w, h, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode)


def hostile_files() -> dict[str, tuple[bytes, dict]]:
    """relative path -> (bytes, expected fields); an expected "error" value is the reason prefix."""
    jpeg = _encode(_noise(64, 48), "JPEG", quality=90)
    png = _encode(_noise(32, 32), "PNG")
    idat = png.index(b"IDAT") + 4
    corrupt_png = png[: idat + 10] + bytes(b ^ 0xFF for b in png[idat + 10 : idat + 40]) + png[idat + 40 :]
    exif = Image.Exif()
    exif[imageinfo.ORIENTATION_TAG] = 6
    rotated = _encode(_noise(40, 20), "JPEG", exif=exif.tobytes())
    exif8 = Image.Exif()
    exif8[imageinfo.ORIENTATION_TAG] = 3
    upside_down = _encode(_noise(40, 20), "JPEG", exif=exif8.tobytes())
    sixteen = Image.fromarray(np.arange(30 * 20, dtype=np.uint16).reshape(20, 30) * 50)
    rgba = _noise(24, 16).convert("RGBA")
    return {
        "odd/truncated.jpg": (jpeg[: len(jpeg) // 2], {"error": "truncated"}),
        "odd/header-only.jpg": (jpeg[:300], {"error": "truncated"}),
        "odd/empty.jpg": (b"", {"error": "empty file"}),
        "odd/random.jpg": (
            np.random.default_rng(1).integers(0, 256, 2048, dtype=np.uint8).tobytes(),
            {"error": "not an image"},
        ),
        "odd/page.jpg": (
            b"<!doctype html><html><body>404 not found</body></html>",
            {"error": "not an image"},
        ),
        "odd/notes.png": (b"just some text\nsaved with an image extension\n", {"error": "not an image"}),
        "odd/corrupt-chunk.png": (corrupt_png, {"error": "corrupt"}),
        "odd/bomb.png": (png_bomb(100_000, 100_000), {"error": "decompression bomb"}),
        "odd/bomb-under-pils-limit.png": (png_bomb(*BOMB_UNDER_PIL), {"error": "decompression bomb"}),
        # PIL would parse it with its EPS plugin and hand the pixels to Ghostscript; the allow-list refuses it
        "odd/vector.eps": (EPS, {"error": "unsupported format"}),
        "odd/vector-named.jpg": (EPS, {"error": "unsupported format"}),
        "odd/truncated.webp": (_encode(_noise(64, 64), "WEBP")[:200], {"error": "truncated"}),
        "modes/cmyk.jpg": (
            _encode(_noise(30, 20, "CMYK"), "JPEG"),
            {"mode": "CMYK", "channels": 4, "width": 30},
        ),
        "modes/sixteen.png": (
            _encode(sixteen, "PNG"),
            {"mode": "I;16", "channels": 1, "width": 30, "height": 20},
        ),
        "modes/palette.png": (_encode(_noise(30, 20, "P"), "PNG"), {"mode": "P", "channels": 1}),
        "modes/rgba.png": (_encode(rgba, "PNG"), {"mode": "RGBA", "channels": 4, "width": 24, "height": 16}),
        "modes/grey.jpg": (
            _encode(_noise(30, 20, "L"), "JPEG"),
            {"mode": "L", "channels": 1, "format": "JPEG"},
        ),
        "modes/photo.gif": (_encode(_noise(10, 10, "P"), "GIF"), {"format": "GIF", "channels": 1}),
        "exif/rotated.jpg": (rotated, {"width": 20, "height": 40, "orientation": 6}),
        "exif/upside-down.jpg": (upside_down, {"width": 40, "height": 20, "orientation": 3}),
        "names/a jpeg named.png": (jpeg, {"format": "JPEG", "width": 64, "height": 48}),
        "names/camera-trailer.jpg": (jpeg + b"SEFT trailer " * 40, {"format": "JPEG", "width": 64}),
        "names/trailing-bytes.png": (png + b"\x00junk" * 30, {"format": "PNG", "width": 32}),
        "names/UPPER.JPEG": (jpeg + b"", {"format": "JPEG"}),
        "names/ünïcødé 图像 name.JPG": (_encode(_noise(20, 10), "JPEG"), {"format": "JPEG", "width": 20}),
        "names/deeper/nested file.webp": (_encode(_noise(33, 17), "WEBP"), {"format": "WEBP", "width": 33}),
    }


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile") / "src"
    files = hostile_files()
    for rel, (data, _) in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    table = str(root.parent / "table")
    summary = ingest(str(root), table, progress_every=0)
    return root, table, files, summary


def test_every_file_gets_a_row_with_metadata_or_error(hostile):
    root, table, files, summary = hostile
    rows = {os.path.relpath(r["uri"], root): r for r in read_arrow(table).to_pylist()}
    assert sorted(rows) == sorted(files) and summary["rows"] == len(files)
    for rel, (_, expected) in files.items():
        r = rows[rel]
        assert r["label"] == rel.split("/")[0]
        if "error" in expected:
            assert r["error"] is not None and r["error"].startswith(expected["error"] + ": "), (
                rel,
                r["error"],
            )
            assert r["phash"] is None
        else:
            assert r["error"] is None, (rel, r["error"])
            assert r["phash"] is not None
            for key, value in expected.items():
                assert r[key] == value, (rel, key, r[key])
    expected_reasons = {}
    for _, exp in files.values():
        if "error" in exp:
            expected_reasons[exp["error"]] = expected_reasons.get(exp["error"], 0) + 1
    assert summary["errors"] == expected_reasons


# Under PIL's own limit (Image.MAX_IMAGE_PIXELS, ~89.5 Mpx: PIL would not even warn) and over dutycycle's
# (64 Mpx), so only dutycycle's header check can refuse it: removing that check fails this test.
BOMB_UNDER_PIL = (10_000, 8_000)


def test_bomb_under_pils_limit_is_refused_from_its_header_without_allocating():
    """Probe, thumbnail and the cache's decode all refuse it from the header; peak memory stays small."""
    w, h = BOMB_UNDER_PIL
    assert DEFAULT_MAX_PIXELS < w * h < Image.MAX_IMAGE_PIXELS
    code = (
        "import resource, sys\n"
        "from tests.engine.test_hostile import png_bomb, BOMB_UNDER_PIL\n"
        "from dutycycle.engine import imageinfo\n"
        "from dutycycle.engine.transform import DecodeError, TransformSpec, decode_and_transform\n"
        "data = png_bomb(*BOMB_UNDER_PIL)\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "facts = imageinfo.probe(data)\n"
        "try:\n"
        "    imageinfo.thumbnail_jpeg(data)\n"
        "    thumb = 'made'\n"
        "except ValueError as e:\n"
        "    thumb = str(e)\n"
        "try:\n"
        "    decode_and_transform(data, TransformSpec(size=8))\n"
        "    sample = 'made'\n"
        "except DecodeError as e:\n"
        "    sample = str(e)\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(facts.error); print(thumb); print(sample); print((after - before) // 1024)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    ).stdout.splitlines()
    ours = f"header claims {w}x{h} = {w * h} pixels, over the limit of {DEFAULT_MAX_PIXELS}"
    assert out[0] == out[1] == out[2] == f"decompression bomb: {ours}"  # one open, one reason, one message
    assert int(out[3]) < 64  # MiB: decoding would need 80 MB (L) to 320 MB (RGBA)


def test_eps_is_refused_unparsed_everywhere():
    """Not handed to PIL's EPS plugin (nor Ghostscript): a counted error at ingest, a counted skip in the cache."""
    facts = imageinfo.probe(EPS, with_phash=False)  # no pixel decode asked: the header alone must refuse it
    assert facts.error.startswith("unsupported format: PostScript/EPS is not decoded")
    assert (facts.format, facts.width, facts.height) == (None, None, None)
    with pytest.raises(DecodeError) as info:
        decode_and_transform(EPS, TransformSpec(size=8))
    assert info.value.reason == imageinfo.UNSUPPORTED == facts.error.split(":")[0]
    with pytest.raises(ValueError, match="unsupported format"):
        imageinfo.thumbnail_jpeg(EPS)


def test_file_over_the_byte_cap_is_an_error_row_without_being_read(tmp_path):
    src = tmp_path / "src" / "photos"
    src.mkdir(parents=True)
    (src / "small.jpg").write_bytes(_encode(_noise(20, 10), "JPEG"))
    with open(src / "huge.jpg", "wb") as f:  # 1 GiB as listed (sparse on disk): reading it whole would hurt
        f.write(_encode(_noise(20, 10), "JPEG"))
        f.truncate(2**30)
    s = ingest(str(tmp_path / "src"), str(tmp_path / "t"), max_file_bytes=1_000_000, progress_every=0)
    rows = {os.path.basename(r["uri"]): r for r in read_arrow(str(tmp_path / "t")).to_pylist()}
    assert rows["small.jpg"]["error"] is None and s["errors"] == {"too large": 1}
    assert rows["huge.jpg"]["error"].startswith("too large: over the per-file limit of 1000000 bytes")
    assert rows["huge.jpg"]["sample_id"].startswith("unreadable-") and rows["huge.jpg"]["size_bytes"] == 2**30
    with pytest.raises(dio.FileTooLargeError, match="--max-file-bytes"):
        dio.read_capped(str(src / "huge.jpg"), 1_000_000)
    assert len(dio.read_capped(str(src / "small.jpg"), 1_000_000)) == os.path.getsize(src / "small.jpg")


def test_reduced_decode_is_bounded_for_formats_without_draft_mode():
    """A PNG over the reduced-decode budget is not decoded for its hash or preview (a JPEG would be drafted)."""
    w, h = 5_000, 4_000  # 20 Mpx: a legal image (under max_pixels), over the 16 Mpx reduced-decode budget
    data = png_bomb(w, h)  # a valid header and chunks; decoding would run out of pixel data ("truncated")
    facts = imageinfo.probe(data)
    assert facts.error is None and facts.phash is None and (facts.width, facts.height) == (w, h)
    with pytest.raises(ValueError, match="too large: PNG of 5000x4000 pixels is over the reduced-decode budget"):
        imageinfo.thumbnail_jpeg(data)
    small = png_bomb(1_000, 1_000)  # under the budget: decoded, so the missing pixel data is found
    assert imageinfo.probe(small).error.startswith(("truncated", "corrupt"))


def test_own_pixel_limit_applies_below_pils():
    data = _encode(_noise(200, 100), "PNG")
    facts = imageinfo.probe(data, max_pixels=10_000)
    assert facts.error == "decompression bomb: header claims 200x100 = 20000 pixels, over the limit of 10000"
    assert imageinfo.probe(data, max_pixels=20_000).error is None


def test_exif_rotation_changes_displayed_size_and_thumbnail():
    exif = Image.Exif()
    exif[imageinfo.ORIENTATION_TAG] = 6
    data = _encode(_noise(80, 40), "JPEG", exif=exif.tobytes())
    facts = imageinfo.probe(data)
    assert (facts.width, facts.height, facts.orientation) == (40, 80, 6)
    thumb = Image.open(io.BytesIO(imageinfo.thumbnail_jpeg(data, size=64)))
    assert thumb.size == (32, 64)  # upright: taller than wide


def test_perceptual_hash_is_stable_under_reencoding_and_differs_across_images():
    a = _noise(64, 64, seed=1).resize((16, 16)).resize((128, 128))
    b = _noise(64, 64, seed=2).resize((16, 16)).resize((128, 128))
    ha = imageinfo.probe(_encode(a, "JPEG", quality=95)).phash
    ha2 = imageinfo.probe(_encode(a, "JPEG", quality=60)).phash
    ha3 = imageinfo.probe(_encode(a, "PNG")).phash
    hb = imageinfo.probe(_encode(b, "JPEG", quality=95)).phash
    assert imageinfo.hamming(ha, ha2) <= 4 and imageinfo.hamming(ha, ha3) <= 4
    assert imageinfo.hamming(ha, hb) > 12


def test_contact_sheet_renders_every_hostile_row(hostile, tmp_path):
    _, table, files, _ = hostile
    from dutycycle.engine.inspect import contact_sheet

    grid = contact_sheet(open_table(table), str(tmp_path / "sheet.html"), limit=100, size=48)
    assert len(grid) == len(files)
    readable = sum(1 for _, exp in files.values() if "error" not in exp)
    assert sum(1 for t in grid.thumbs if t.jpeg_b64) == readable  # CMYK, 16-bit, palette ... all previewed
    html = (tmp_path / "sheet.html").read_text()
    assert html.count("data:image/jpeg;base64,") == readable and "decompression bomb" in html
    assert "ünïcødé 图像 name.JPG" in html


def test_contact_sheet_escapes_every_value(tmp_path):
    """Every table value is untrusted text in the sheet: label, mode, split, format, error, file name."""
    from dutycycle.engine.inspect import contact_sheet

    from ..support.tablemaker import write_table

    evil = '"><script>alert(1)</script>'
    rows = [
        {"sample_id": "a" * 32, "uri": str(tmp_path / f"x{evil}.jpg"), "size_bytes": 1, "format": f"JPEG{evil}",
         "width": 4, "height": 4, "mode": f"RGB{evil}", "label": f"cat{evil}", "split": f"train{evil}",
         "error": f"corrupt: {evil}"},
    ]
    table = write_table(str(tmp_path / "t"), rows, classes=["cat"])
    contact_sheet(open_table(table), str(tmp_path / "sheet.html"), limit=5, size=16, summary=[f"note {evil}"])
    html = (tmp_path / "sheet.html").read_text()
    assert "<script>" not in html and "alert(1)" in html
    assert html.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 7  # label, mode, split, format, error, name, ...
