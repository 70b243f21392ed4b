"""Hostile entries in a source folder: only regular files are read, and every read is bounded by the byte cap.

A symlink to ``/dev/zero`` lists as a few bytes and never ends when read; opening a FIFO blocks until a writer
comes; a symlink out of the source root reads someone else's file; a file can grow between the listing and the
read. Each must become an error row, quickly, without the read growing past the cap. The tests that could hang
or grow without these checks carry a timeout that ends the whole run rather than wait.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from dutycycle.engine import io as dio
from dutycycle.engine.errors import CorruptArtifactError
from dutycycle.engine.roots import RootCheck
from dutycycle.engine.table import format as tf
from dutycycle.engine.table import scan
from dutycycle.engine.table.catalog import ingest
from dutycycle.engine.table.table import read_arrow
from PIL import Image

from ..support import REPO

# "thread": a read blocked in a FIFO or a native download cannot be interrupted by a signal; this method dumps the
# stacks and ends the run instead of hanging it.
QUICK = pytest.mark.timeout(120, method="thread")


def _jpeg(path, colour=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (24, 16), colour).save(buf, "JPEG")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


def _rows(table) -> dict[str, dict]:
    return {os.path.basename(r["uri"]): r for r in read_arrow(str(table)).to_pylist()}


@QUICK
def test_symlink_to_dev_zero_is_an_error_row_never_read(tmp_path):
    src = tmp_path / "src"
    _jpeg(src / "cats" / "good.jpg")
    os.symlink("/dev/zero", src / "cats" / "zero.jpg")
    s = ingest(str(src), str(tmp_path / "t"), progress_every=0)
    rows = _rows(tmp_path / "t")
    assert rows["good.jpg"]["error"] is None
    assert rows["zero.jpg"]["error"] == "symlink out of the source root: it points to '/dev/zero'"
    assert rows["zero.jpg"]["sample_id"].startswith("unreadable-") and rows["zero.jpg"]["phash"] is None
    assert s["errors"] == {"symlink out of the source root": 1}


@QUICK
def test_fifo_is_an_error_row_never_opened(tmp_path):
    src = tmp_path / "src"
    _jpeg(src / "cats" / "good.jpg")
    os.mkfifo(src / "cats" / "pipe.jpg")  # opening it for reading would block until a writer comes: never here
    s = ingest(str(src), str(tmp_path / "t"), progress_every=0)
    rows = _rows(tmp_path / "t")
    assert rows["pipe.jpg"]["error"] == "not a regular file: fifo" and rows["good.jpg"]["error"] is None
    assert s["errors"] == {"not a regular file": 1}
    # the capped reader itself refuses it without blocking, as it refuses a device
    with pytest.raises(dio.NotRegularFileError, match="fifo"):
        dio.read_capped(str(src / "cats" / "pipe.jpg"), 1000)
    with pytest.raises(dio.NotRegularFileError, match="character device"):
        dio.read_capped("/dev/zero", 1000)


@QUICK
def test_symlinks_are_followed_only_to_regular_files_inside_the_root(tmp_path):
    src, other = tmp_path / "src", tmp_path / "elsewhere"
    good = _jpeg(src / "cats" / "good.jpg")
    _jpeg(other / "private.jpg", colour=(10, 200, 10))  # a readable image, but not the source's
    (src / "cats" / "sub").mkdir()
    os.symlink(other / "private.jpg", src / "cats" / "out.jpg")
    os.symlink("../good.jpg", src / "cats" / "sub" / "inside.jpg")
    os.symlink("missing.jpg", src / "cats" / "dangling.jpg")
    os.symlink(src / "cats" / "sub", src / "cats" / "folder-link")
    os.symlink(other, src / "cats" / "out-folder")
    s = ingest(str(src), str(tmp_path / "t"), progress_every=0)
    rows = _rows(tmp_path / "t")
    assert rows["out.jpg"]["error"].startswith("symlink out of the source root: it points to ")
    assert rows["out-folder"]["error"].startswith("symlink out of the source root")
    assert rows["folder-link"]["error"] == "not a regular file: symlink to a folder"
    assert rows["dangling.jpg"]["error"].startswith("broken symlink: it points to 'missing.jpg'")
    inside = rows["inside.jpg"]
    assert inside["error"] is None and inside["sample_id"] == rows["good.jpg"]["sample_id"]
    assert inside["size_bytes"] == len(good) and inside["width"] == 24
    assert s["errors"] == {"symlink out of the source root": 2, "not a regular file": 1, "broken symlink": 1}
    # re-ingest: nothing changed, nothing probed again (the error rows keep their stamps)
    again = ingest(str(src), str(tmp_path / "t"), progress_every=0)
    assert again["committed"] is False and again["unchanged"] == s["rows"]


def _cfg(src, max_bytes):
    from dutycycle.engine.table.catalog import IngestConfig

    return IngestConfig(source=str(src), table="unused", max_file_bytes=max_bytes, progress_every=0)


@QUICK
def test_file_replaced_by_a_fifo_after_listing_is_refused_at_read(tmp_path):
    from dutycycle.engine.table import probe

    src = tmp_path / "src"
    _jpeg(src / "a" / "x.jpg")
    listing = scan.list_source(str(src))
    assert listing.num_rows == 1
    os.unlink(src / "a" / "x.jpg")
    os.mkfifo(src / "a" / "x.jpg")  # the listing said regular file; the read must check again, before opening
    out = probe.run_probe(_cfg(src, 1_000_000), listing, ["a"], "native", print).to_pylist()
    assert out[0]["error"] == "not a regular file: fifo"


GROWN = 512 << 20  # what the file becomes after it was listed (sparse: no disk used)
CAP = 1 << 20


def test_file_that_grows_after_listing_is_read_only_up_to_the_cap(tmp_path):
    """List, then let the file grow to 512 MiB, then read: a ``too large`` row, and the process never held more
    than about the cap (a whole read would hold the 512 MiB). Measured in a fresh process, whose peak RSS
    starts low."""
    src = tmp_path / "src"
    _jpeg(src / "a" / "x.jpg")
    code = f"""
import os, sys
from tests.support.memory import peak_rss_bytes  # VmHWM: ru_maxrss would start at pytest's peak
from dutycycle.engine.table import probe, scan
from dutycycle.engine.table.catalog import IngestConfig
src = {str(src)!r}
cfg = IngestConfig(source=src, table="unused", max_file_bytes={CAP}, progress_every=0)
listing = scan.list_source(src)
import daft; daft.from_pydict({{"a": [1]}}).collect()  # Daft's own start-up memory, before the baseline
before = peak_rss_bytes()
with open(os.path.join(src, "a", "x.jpg"), "r+b") as f:
    f.truncate({GROWN})
row = probe.run_probe(cfg, listing, ["a"], "native", print).to_pylist()[0]
after = peak_rss_bytes()
print(row["error"]); print((after - before) >> 20)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    error, grew_mib = out.stdout.strip().splitlines()[-2:]
    assert error.startswith(f"too large: over the per-file limit of {CAP} bytes"), error
    assert int(grew_mib) < 128, f"the read held {grew_mib} MiB for a {CAP >> 20} MiB cap"


@QUICK
def test_manifests_and_indexes_are_read_with_a_small_cap(tmp_path):
    """A manifest, pointer or index file is refused past ``io.MAX_MANIFEST_BYTES`` without being read whole, and
    never opened when it is a FIFO."""
    src = tmp_path / "src"
    _jpeg(src / "a" / "x.jpg")
    table = str(tmp_path / "t")
    ingest(str(src), table, progress_every=0)
    manifest = os.path.join(table, tf.manifest_path(1))
    with open(manifest, "r+b") as f:  # valid JSON first, then far more than any manifest holds
        f.seek(0, 2)
        f.write(b" " * 16)
        f.truncate(dio.MAX_MANIFEST_BYTES + 4096)
    with pytest.raises(CorruptArtifactError, match=f"larger than {dio.MAX_MANIFEST_BYTES} bytes"):
        tf.read_manifest(table)
    index = tmp_path / "index.json"
    os.mkfifo(index)
    with pytest.raises(dio.NotRegularFileError, match="fifo"):
        dio.read_json(str(index))
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"fingerprint": "abc"}))
    assert dio.read_json(str(small)) == {"fingerprint": "abc"}


@QUICK
def test_a_fifo_named_by_a_table_row_is_skipped_by_every_reader(tmp_path):
    """A row the table thought readable whose file became a FIFO: materialize, thumbnails and the raw path's
    decode refuse it without opening it (an open would block until a writer comes)."""
    from dutycycle.engine.cache.materialize import materialize
    from dutycycle.engine.inspect import make_thumb
    from dutycycle.engine.transform import DecodeError, TransformSpec
    from dutycycle.loader.decode import decode_one

    from ..support.tablemaker import add_file, write_table

    images = str(tmp_path / "images")
    buf = io.BytesIO()
    Image.new("RGB", (12, 10), (1, 2, 3)).save(buf, "PNG")
    rows = [add_file(images, "a/good.png", buf.getvalue(), "a"), add_file(images, "a/pipe.png", buf.getvalue(), "a")]
    rows[1]["sample_id"] = "b" * 32
    os.unlink(rows[1]["uri"])
    os.mkfifo(rows[1]["uri"])
    table = write_table(str(tmp_path / "t"), rows, classes=["a"])
    r = materialize(table, str(tmp_path / "cache"), TransformSpec(size=8), runner="native")
    assert r.manifest.num_samples == 1 and sum(r.manifest.skipped.values()) == 1
    assert "fifo" in make_thumb(rows[1], 16).problem
    with pytest.raises(DecodeError, match="fifo") as err:
        decode_one(rows[1]["uri"], TransformSpec(size=8), RootCheck([images]))
    assert err.value.reason == "not a regular file"
