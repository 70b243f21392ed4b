"""Look at a table: thumbnails with their metadata, inline in Jupyter or as a self-contained HTML contact sheet.

Thumbnails are decoded at reduced scale after the header's pixel count is checked (imageinfo.open_checked),
and embedded as base64 JPEG, so the HTML file opens in a browser without the images next to it. Only rows inside
the table's source roots are read (``roots``: a crafted table's ``/etc/passwd`` row is a refused cell, counted
and named in the summary), and no cell quotes a file's bytes. Which rows a sheet shows is ``sample_rows``'s choice:
a seeded random sample by default, some of each class, or the first rows; the sheet says which.
"""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field

from . import io
from .errors import ConfigError
from .imageinfo import DEFAULT_MAX_PIXELS, describe_error, thumbnail_jpeg
from .limits import DEFAULT_MAX_FILE_BYTES
from .roots import OUTSIDE_ROOTS, RootCheck, describe, table_roots

# An error string in a table may quote the start of a file ("(starts with '...')"): file bytes are never shown.
_QUOTED_HEAD = re.compile(r"\(starts with .*\)", re.DOTALL)

# How a sheet chooses its rows (``sample_rows``). The default is "random": the first rows in path order are
# usually one class folder's first files, which says little about a dataset; a seeded random sample is a fair
# look at all of it, and the same seed shows the same rows run after run.
SAMPLES = ("first", "random", "per_class")
DEFAULT_SAMPLE = "random"

META_COLUMNS = ("uri", "label", "split", "format", "width", "height", "mode", "size_bytes", "error",
                "uri_bytes")  # uri_bytes: what a thumbnail opens (io.open_path), never shown
_CSS = """
body{font-family:system-ui,sans-serif;margin:16px;color:#222}
.dc-grid{display:flex;flex-wrap:wrap;gap:8px}
.dc-cell{width:SIZEpx;font-size:11px;line-height:1.25;overflow:hidden;word-break:break-all}
.dc-cell img{width:SIZEpx;height:SIZEpx;object-fit:contain;background:#eee;display:block}
.dc-err{width:SIZEpx;height:SIZEpx;background:#fdd;color:#900;display:flex;align-items:center;
justify-content:center;text-align:center;font-size:10px;padding:2px;box-sizing:border-box}
.dc-label{font-weight:600}
"""


@dataclass
class Thumb:
    meta: dict
    jpeg_b64: str | None = None
    problem: str | None = None


@dataclass
class ThumbnailGrid:
    """A list of thumbnails that renders itself as HTML (Jupyter calls ``_repr_html_``)."""

    thumbs: list[Thumb]
    size: int = 96
    title: str = ""
    summary: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # URIs not read: outside the table's source roots

    def _cells(self) -> str:
        cells = []
        for t in self.thumbs:
            m = t.meta
            m = {**m, "error": scrub_error(m.get("error"))}
            # every value is untrusted; uri_bytes is only read through (``uri`` is its readable form)
            e = {k: html.escape("" if v is None else str(v)) for k, v in m.items() if k != "uri_bytes"}
            name = html.escape(str(m.get("uri") or "").rsplit("/", 1)[-1])
            if t.jpeg_b64:
                pic = f'<img src="data:image/jpeg;base64,{t.jpeg_b64}" alt="{name}">'
            else:
                pic = f'<div class="dc-err">{html.escape(t.problem or "no preview")}</div>'
            dims = f"{e.get('width')}x{e.get('height')}" if m.get("width") else "?"
            info = (
                f'<div class="dc-label">{html.escape(str(m.get("label")))}</div>'
                f"<div>{name}</div><div>{e.get('format')} {dims} {e.get('mode', '')}</div>"
                f"<div>{e.get('split', '')} · {e.get('size_bytes')} B</div>"
            )
            if m.get("note"):  # a caller's line under the facts (a trace: the sample's rank, micro-batch, loss)
                info += f"<div>{e['note']}</div>"
            if m.get("error"):
                info += f'<div style="color:#900">{e["error"]}</div>'
            cells.append(f'<div class="dc-cell" title="{e.get("uri", "")}">{pic}{info}</div>')
        return "".join(cells)

    def _repr_html_(self) -> str:
        style = _CSS.replace("SIZE", str(self.size)).replace("body{", ".dc-root{")
        return f'<div class="dc-root"><style>{style}</style><div class="dc-grid">{self._cells()}</div></div>'

    def to_html(self) -> str:
        """A complete, self-contained HTML document (the contact sheet)."""
        style = _CSS.replace("SIZE", str(self.size))
        summary = "".join(f"<li>{html.escape(line)}</li>" for line in self.summary)
        return (
            "<!doctype html><html><head><meta charset='utf-8'>"
            f"<title>{html.escape(self.title)}</title><style>{style}</style></head><body>"
            f"<h1>{html.escape(self.title)}</h1><ul>{summary}</ul>"
            f'<div class="dc-grid">{self._cells()}</div></body></html>'
        )

    def __len__(self) -> int:
        return len(self.thumbs)


def scrub_error(error: str | None) -> str | None:
    """A table's error string as the sheet shows it: any quoted file content removed (a table is data: its
    error strings may quote a file, whoever wrote it)."""
    return None if error is None else _QUOTED_HEAD.sub("(content not shown)", error)


def make_thumb(
    meta: dict,
    size: int,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_bytes: int = DEFAULT_MAX_FILE_BYTES,
    roots: RootCheck | None = None,
) -> Thumb:
    """Fetch one file and make its thumbnail; any problem becomes a note on the cell, never an exception. With
    ``roots``, a row outside them is not read (``OUTSIDE_ROOTS``)."""
    if meta.get("error"):
        return Thumb(meta, problem=meta["error"].split(":", 1)[0])
    path = io.open_path(meta.get("uri"), meta.get("uri_bytes"))  # a name that is not text: its exact bytes
    if roots is not None and roots.outside(path):
        return Thumb(meta, problem=OUTSIDE_ROOTS)
    try:
        data = io.read_capped(path, max_bytes)
        jpeg = thumbnail_jpeg(data, size=size, max_pixels=max_pixels)
    except Exception as e:  # a file may have changed since ingest: show it, do not fail the sheet
        return Thumb(meta, problem=f"{type(e).__name__}: {describe_error(e)}"[:120])
    return Thumb(meta, jpeg_b64=base64.b64encode(jpeg).decode("ascii"))


def sample_rows(table, limit: int, sample: str = DEFAULT_SAMPLE, seed: int = 0) -> tuple[list[dict], str]:
    """The rows a sheet shows (``META_COLUMNS``) and a line saying how they were chosen; planned on Daft, so
    only ``limit`` rows reach this process whatever the table's size.

    - ``first``: the table's first ``limit`` rows, in its order (path order for an ingested table).
    - ``random``: ``limit`` rows chosen uniformly by a seeded hash of each row's URI (the smallest hashes): the
      same rows for the same seed and table however it is partitioned, and a row's place does not depend on
      which other rows exist (a filtered view shows the same rows it kept).
    - ``per_class``: ``limit // classes`` rows of each label (at least one; a missing label is a class), chosen
      by the same hash within each label, shown class by class; with more classes than ``limit``, ``limit``
      classes of them, chosen by the same hash.
    """
    from daft import Window, col
    from daft.functions import row_number

    if sample not in SAMPLES:
        raise ConfigError(f"sample={sample!r} is not a way to choose thumbnails; use one of {', '.join(SAMPLES)}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed={seed!r} is not an integer; pass an integer (the same seed shows the same rows)")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigError(f"limit={limit!r} is not a positive integer; pass how many thumbnails to show")
    df = table.df.select(*[c for c in META_COLUMNS if c in table.df.column_names])
    if sample == "first":
        return df.limit(limit).to_pylist(), f"the first {limit} rows in table order"
    df = df.with_column("_key", col("uri").hash(seed=seed))  # uint64; the URI breaks a tie
    if sample == "random":
        rows = df.sort(["_key", "uri"]).limit(limit).exclude("_key").to_pylist()
        return rows, f"{len(rows)} rows at random (seed {seed})"
    classes = df.select("label").distinct().count_rows()
    each = max(1, limit // max(1, classes))
    ranked = df.with_column("_rank", row_number().over(Window().partition_by("label").order_by(["_key", "uri"])))
    rows = (ranked.where(col("_rank") <= each).sort(["_rank", "_key", "uri"]).limit(limit)
            .exclude("_key", "_rank").to_pylist())
    shown = len({r["label"] for r in rows})
    rows.sort(key=lambda r: (r["label"] is None, r["label"] or ""))  # class by class; the hash order within each
    note = f"up to {each} rows of each class at random (seed {seed}), {shown} of {classes} classes shown"
    return rows, note


def thumbnail_grid(
    table, limit: int = 16, size: int = 96, title: str = "", summary=(), allowed_roots=None,
    sample: str = DEFAULT_SAMPLE, seed: int = 0,
) -> ThumbnailGrid:
    """Thumbnails of ``limit`` rows of ``table`` (a ``Table``) chosen by ``sample`` (``sample_rows``), reading
    only rows inside the table's source roots and ``allowed_roots`` (extra roots, for a table assembled from
    several sources)."""
    rows, chosen = sample_rows(table, limit, sample, seed)
    roots = table_roots(table.manifest, allowed_roots)
    check = RootCheck(roots)
    thumbs = [make_thumb(r, size, roots=check) for r in rows]
    refused = [t.meta.get("uri") for t in thumbs if t.problem == OUTSIDE_ROOTS]
    lines = [*summary, f"thumbnails: {chosen}"]
    if refused:
        lines.append(f"{len(refused)} rows {OUTSIDE_ROOTS} ({describe(roots)}) were not read, e.g. {refused[0]!r}; "
                     "name extra roots with --allow-root (allowed_roots=[...]) if the table spans several sources")
    return ThumbnailGrid(thumbs, size=size, title=title, summary=lines, refused=refused)


def contact_sheet(
    table, out_uri: str, limit: int = 64, size: int = 128, summary=(), allowed_roots=None,
    sample: str = DEFAULT_SAMPLE, seed: int = 0,
) -> ThumbnailGrid:
    """Write a self-contained HTML contact sheet of ``limit`` rows chosen by ``sample`` ("random" by default:
    ``sample_rows``) to ``out_uri``."""
    title = f"dutycycle: {table.uri}" + (f" ({'; '.join(table.operations)})" if table.operations else "")
    grid = thumbnail_grid(table, limit=limit, size=size, title=title, summary=summary, allowed_roots=allowed_roots,
                          sample=sample, seed=seed)
    io.write_bytes_atomic(out_uri, grid.to_html().encode("utf-8"))
    return grid
