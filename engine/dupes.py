"""A sheet (PNG) of the example pairs a dedupe removed (``table/dedupe_stats.py``): kept and removed side by side,
grouped by Hamming distance, so the distance can be chosen by looking. It reads only the example files, through the
table's source roots (``roots.py``) like every other reader of rows.
"""

from __future__ import annotations

import base64
import io as _io
from dataclasses import dataclass, field

from . import io
from .inspect import make_thumb
from .roots import OUTSIDE_ROOTS, RootCheck, table_roots
from .table.dedupe_stats import DedupeStats


def _tile(thumb, size: int):
    from PIL import Image, ImageDraw

    tile = Image.new("RGB", (size, size), (238, 238, 238))
    if thumb.jpeg_b64:
        with Image.open(_io.BytesIO(base64.b64decode(thumb.jpeg_b64))) as im:
            im = im.convert("RGB")
            tile.paste(im, ((size - im.width) // 2, (size - im.height) // 2))
    else:
        ImageDraw.Draw(tile).text((4, size // 2 - 6), (thumb.problem or "no preview")[:size // 6], fill=(150, 0, 0))
    return tile


def _exact_names(table, uris: list[str]) -> dict[str, bytes]:
    """The exact bytes (``uri_bytes``) of those of ``uris`` whose names are not text: an example names its
    rows by their readable ``uri``, and a file is opened by its bytes (``io.open_path``). One filtered scan."""
    from daft import col

    if not uris or "uri_bytes" not in table.df.column_names:
        return {}
    found = (table.df.where(col("uri").is_in(sorted(set(uris))) & col("uri_bytes").not_null())
             .select("uri", "uri_bytes").to_pydict())
    return dict(zip(found["uri"], found["uri_bytes"], strict=True))


@dataclass
class PairSheet:
    uri: str
    pairs: int
    refused: list[str] = field(default_factory=list)  # URIs outside the table's source roots (not read)


def pair_sheet(table, stats: DedupeStats, out_uri: str, size: int = 96, allowed_roots=None) -> PairSheet:
    """Write a PNG of ``stats.examples``: one line per pair (kept left, removed right), grouped by distance under
    a caption; reads only rows inside the table's source roots and ``allowed_roots`` (a refused file is a grey
    cell, counted in ``refused``)."""
    from PIL import Image, ImageDraw

    check = RootCheck(table_roots(table.manifest, allowed_roots))
    caption, gap = 16, 8
    width = 2 * size + 3 * gap + 320
    lines = []
    exact = _exact_names(table, [e[k] for e in stats.examples for k in ("kept", "removed")])
    for e in stats.examples:
        thumbs = [make_thumb({"uri": e[k], "uri_bytes": exact.get(e[k])}, size, roots=check)
                  for k in ("kept", "removed")]
        lines.append((e, thumbs))
    title = f"dedupe of {table.uri}: {stats.exact_removed} exact, {stats.near_removed} near removals"
    height = caption + gap + max(1, len(lines)) * (size + gap)
    sheet = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    draw.text((gap, 2), title[:width // 6], fill=(0, 0, 0))
    if not lines:
        draw.text((gap, caption + gap), "no duplicates removed", fill=(90, 90, 90))
    for i, (e, thumbs) in enumerate(lines):
        y = caption + gap + i * (size + gap)
        for j, th in enumerate(thumbs):
            sheet.paste(_tile(th, size), (gap + j * (size + gap), y))
        x = 3 * gap + 2 * size
        what = "exact copy (same bytes)" if e["distance"] is None else f"distance {e['distance']}"
        draw.text((x, y), what, fill=(0, 0, 0))
        draw.text((x, y + 16), ("kept " + e["kept"].rsplit("/", 1)[-1])[:52], fill=(0, 90, 0))
        draw.text((x, y + 32), ("removed " + e["removed"].rsplit("/", 1)[-1])[:52], fill=(150, 0, 0))
    buf = _io.BytesIO()
    sheet.save(buf, "PNG")
    io.write_bytes_atomic(out_uri, buf.getvalue())
    refused = sorted({th.meta["uri"] for _, ths in lines for th in ths if th.problem == OUTSIDE_ROOTS})
    return PairSheet(out_uri, len(lines), refused)
