"""The page of a step's trace (``dutycycle trace RUN --step N --html``): the step's images as thumbnails beside
their labels, rank and micro-batch, and each sample's loss when the run recorded it; self-contained HTML.

Thumbnails come from the source files the table names, read through the engine's safe open (engine/inspect.py:
header checked before decoding, reduced-scale decode, only files inside the table's source roots), so the page
shows the image a person would open, not the transformed sample.
"""

from __future__ import annotations

import html

from dutycycle.engine import io
from dutycycle.engine.inspect import ThumbnailGrid, make_thumb
from dutycycle.engine.roots import RootCheck, table_roots

from .rows import SplitData


def step_grid(rows: list[dict], data: SplitData, size: int = 96, title: str = "", summary=()) -> ThumbnailGrid:
    """The thumbnails of a step's rows (``Tracer.step_rows``), in rank and micro-batch order."""
    m = data.table_manifest()
    check = RootCheck(table_roots(m)) if m is not None else None
    found = data.table_rows([r["sample_id"] for r in rows])
    thumbs = []
    for r in rows:
        loss = "" if r.get("loss") is None else f" · loss {r['loss']:.4f}"
        meta = {**found.get(r["sample_id"], {}), "label": r["label"],
                "note": f"rank {r['rank']} · micro-batch {r['micro_batch']}{loss}"}
        if check is None or not meta.get("uri"):
            meta["error"] = "not in the table's version (vacuumed or moved)"
        thumbs.append(make_thumb(meta, size, roots=check))
    return ThumbnailGrid(thumbs, size=size, title=title, summary=list(summary))


def write_step_page(rows: list[dict], data: SplitData, out_uri: str, title: str, summary=()) -> ThumbnailGrid:
    grid = step_grid(rows, data, title=title, summary=summary)
    io.write_bytes_atomic(out_uri, grid.to_html().encode("utf-8"))
    return grid


def describe_step(rows: list[dict]) -> list[str]:
    """The lines above a step's table: where it ran and what selected its rows."""
    if not rows:
        return []
    r = rows[0]
    losses = [x["loss"] for x in rows if x.get("loss") is not None]
    lines = [f"step {r['step']}: epoch {r['epoch']}, global batch {r['batch']}, {len(rows)} samples; trained by "
             f"attempt {r['attempt']} at world size {r['world_size']}",
             f"table {r['table']} version {r['table_version']}; curation {r['curation']}"]
    if losses:
        lines.append(f"per-sample loss recorded: mean {sum(losses) / len(losses):.4f}, max {max(losses):.4f}")
    return [html.unescape(x) for x in lines]
