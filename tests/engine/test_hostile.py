"""Hostile and odd inputs, generated in code: every file gets a row with correct metadata or a clear error."""

from __future__ import annotations

import io
import json
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

from ..support import REPO


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
        # cut inside the header: PIL cannot even open them ("not an image" before issue 38)
        "odd/cut-in-header.png": (png[:30], {"error": "truncated"}),
        "odd/cut-in-directory.tif": (_encode(_noise(32, 32), "TIFF")[:60], {"error": "truncated"}),
        "odd/cut-in-screen.gif": (_encode(_noise(10, 10, "P"), "GIF")[:12], {"error": "truncated"}),
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
        "import sys\n"
        "from tests.support.memory import peak_rss_bytes  # VmHWM: ru_maxrss would start at pytest's peak\n"
        "from tests.engine.test_hostile import png_bomb, BOMB_UNDER_PIL\n"
        "from dutycycle.engine import imageinfo\n"
        "from dutycycle.engine.transform import DecodeError, TransformSpec, decode_and_transform\n"
        "data = png_bomb(*BOMB_UNDER_PIL)\n"
        "before = peak_rss_bytes()\n"
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
        "after = peak_rss_bytes()\n"
        "print(facts.error); print(thumb); print(sample); print((after - before) >> 20)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=str(REPO),
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


# ---------------------------------------------------------------------------------------------------------
# No file bytes in any output; rows read only inside the table's source roots

SECRET = b"SECRET_TOKEN=abc123\n"
SECRET_PARTS = ("SECRET", "TOKEN", "abc123")


def test_file_bytes_never_reach_the_table_the_sheet_or_the_cli(tmp_path, capsys):
    """A text file in the source: its row says what it is (size, a guess) and why it is refused, never what it
    holds, in every column, the contact sheet and what the CLI prints."""
    from dutycycle.trainer.app.cli import main

    src = tmp_path / "src" / "notes"
    src.mkdir(parents=True)
    (src / "notes.jpg").write_bytes(SECRET)
    (src / "photo.jpg").write_bytes(_encode(_noise(20, 10), "JPEG"))
    table, sheet = str(tmp_path / "t"), str(tmp_path / "sheet.html")
    assert main(["ingest", str(tmp_path / "src"), table]) == 0
    assert main(["inspect", table, "--html", sheet]) == 0
    assert main(["materialize", table, str(tmp_path / "cache"), "--size", "8"]) == 0
    printed = capsys.readouterr()
    rows = read_arrow(table).to_pylist()
    outputs = {"table": repr(rows), "sheet": open(sheet, encoding="utf-8").read(),
               "cli": printed.out + printed.err}
    for where, text in outputs.items():
        for part in SECRET_PARTS:
            assert part not in text, (where, part)
    note = next(r for r in rows if r["uri"].endswith("notes.jpg"))
    assert note["error"] == "not an image: no known image signature (20 bytes of text)"


def test_contact_sheet_hides_content_that_older_tables_quote(tmp_path):
    """Tables ingested before errors stopped quoting a file's first bytes still hold them: the sheet drops them."""
    from dutycycle.engine.inspect import contact_sheet

    from ..support.tablemaker import write_table

    row = {"sample_id": "a" * 32, "uri": str(tmp_path / "notes.jpg"), "size_bytes": 20, "label": "cat",
           "error": "not an image: no known image signature (starts with 'SECRET_TOKEN=abc')"}
    table = write_table(str(tmp_path / "t"), [row], classes=["cat"])
    contact_sheet(open_table(table), str(tmp_path / "sheet.html"), limit=5, size=16)
    html = (tmp_path / "sheet.html").read_text()
    assert "SECRET" not in html and "no known image signature (content not shown)" in html


def test_decoder_messages_lose_the_bytes_they_quote():
    """Some decoder errors quote bytes of the file (a PNG chunk name, a TIFF header): the error keeps the words."""
    e = imageinfo.decode_failure(SyntaxError("broken PNG file (chunk b'SECR')"))
    assert str(e) == "corrupt: broken PNG file (chunk <bytes>)" and e.reason == "corrupt"
    assert imageinfo.describe_error(ValueError('header b"TOKEN\\"x" not valid')) == "header <bytes> not valid"


def _crafted(tmp_path):
    """A table whose recorded root is ``images/``, with rows inside it and rows pointing elsewhere: at
    ``/etc/passwd`` and at an image in another folder; and, inside the root, a symlink planted after ingest that
    points at that other image."""
    from ..support.tablemaker import add_file, write_table

    images, other = str(tmp_path / "images"), str(tmp_path / "other")
    rows = [add_file(images, f"cat/{i}.png", _encode(_noise(12, 10, seed=i), "PNG"), "cat") for i in range(4)]
    stranger = add_file(other, "stranger.png", _encode(_noise(12, 10, seed=9), "PNG"), "cat")
    hidden = add_file(other, "hidden.png", _encode(_noise(12, 10, seed=10), "PNG"), "cat")
    passwd = {**rows[0], "uri": "/etc/passwd", "sample_id": "e" * 32}
    planted = {**hidden, "uri": os.path.join(images, "cat", "planted.png")}
    os.symlink(hidden["uri"], planted["uri"])
    for r in (stranger, passwd, planted):
        r["split"] = "train"
    for r in rows:
        r["split"] = "train"
    table = write_table(str(tmp_path / "t"), [*rows, stranger, passwd, planted], classes=["cat"], roots=[images])
    return table, images, other, stranger["uri"]


def test_materialize_reads_only_rows_inside_the_tables_roots(tmp_path, capsys):
    from dutycycle.engine.cache.materialize import materialize
    from dutycycle.engine.errors import SourceError

    table, images, other, stranger = _crafted(tmp_path)
    logged: list[str] = []
    r = materialize(table, str(tmp_path / "cache"), TransformSpec(size=8), runner="native", log=logged.append)
    assert r.manifest.num_samples == 4 and r.manifest.skipped == {"outside_roots": 3}
    refusal = next(line for line in logged if "outside the table's source roots" in line)
    assert "--allow-root" in refusal and images in refusal
    # with the other folder allowed, its image is read, and the symlink into it too (each row records the id of
    # the bytes it points at, so the content check passes); /etc/passwd still is not read
    r2 = materialize(table, str(tmp_path / "cache"), TransformSpec(size=8), runner="native", allowed_roots=[other])
    assert r2.manifest.num_samples == 6 and r2.manifest.skipped == {"outside_roots": 1}
    assert r2.manifest.fingerprint != r.manifest.fingerprint and r2.uri != r.uri
    # the reuse index knows the roots: without them the first cache comes back, not the one with more rows
    assert materialize(table, str(tmp_path / "cache"), TransformSpec(size=8), runner="native").uri == r.uri
    # a table that records no roots (hand-written, source not a location) reads nothing until roots are named
    from ..support.tablemaker import write_table

    bare = write_table(str(tmp_path / "bare"), [dict(read_arrow(table).to_pylist()[0])], classes=["cat"], roots=[])
    with pytest.raises(SourceError, match=r"outside the table's source roots \(none recorded\)"):
        materialize(bare, str(tmp_path / "cache2"), TransformSpec(size=8), runner="native")
    assert materialize(bare, str(tmp_path / "cache2"), TransformSpec(size=8), runner="native",
                       allowed_roots=[images]).manifest.num_samples == 1
    # the CLI's --allow-root
    from dutycycle.trainer.app.cli import main

    assert main(["materialize", table, str(tmp_path / "cache3"), "--size", "8", "--json", "--quiet",
                 "--allow-root", other]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["samples"] == 6 and summary["skipped"] == {"outside_roots": 1}


def test_thumbnails_read_only_rows_inside_the_tables_roots(tmp_path, capsys):
    from dutycycle.engine.inspect import contact_sheet
    from dutycycle.trainer.app.cli import main

    table, images, other, stranger = _crafted(tmp_path)
    grid = contact_sheet(open_table(table), str(tmp_path / "sheet.html"), limit=10, size=16)
    assert sorted(grid.refused) == sorted(["/etc/passwd", stranger, os.path.join(images, "cat", "planted.png")])
    assert sum(1 for t in grid.thumbs if t.jpeg_b64) == 4
    html = (tmp_path / "sheet.html").read_text()
    assert "3 rows outside the table&#x27;s source roots" in html and "root:x:0:0" not in html
    grid = contact_sheet(open_table(table), str(tmp_path / "sheet.html"), limit=10, size=16, allowed_roots=[other])
    assert grid.refused == ["/etc/passwd"] and sum(1 for t in grid.thumbs if t.jpeg_b64) == 6
    # the CLI names the refused rows and takes --allow-root
    assert main(["inspect", table, "--html", str(tmp_path / "s2.html")]) == 0
    assert "3 rows outside the table's source roots" in capsys.readouterr().out
    assert main(["inspect", table, "--html", str(tmp_path / "s3.html"), "--allow-root", other, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["outside_roots"] == ["/etc/passwd"]
