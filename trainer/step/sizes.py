"""The run's workers over time, read back from ``metrics.jsonl``: the world size of each attempt and each change.

Two kinds of row say it. Every attempt's row (``{"event": "attempt", "world_size": W, "step": N, "started": t,
"loop_started": t}``, written when its training loop begins; ``step`` is where it began) gives the size the run
trained at from that step on. The driver adds a ``resize`` row for each change when the run ends (``{"event":
"resize", "from": W0, "to": W1, "step": N, "kind": "shrink" | "grow", "seconds": {part: s}, "total_s",
"steps_redone", ...}``, launch/account.py) with what it cost, part by part. Until then (a live run), or in a run
resumed at another size before resize rows were written, a change is read from two consecutive attempts' sizes
alone. So a change is each resize row, and each pair of consecutive attempts whose sizes differ that no resize
row explains.

Plain functions over rows, so the report (report.png), the run's page (report.html) and the demo's page draw the
same figures. Rows from before attempts recorded their size (no ``world_size``) give no sizes and no changes.
"""

from __future__ import annotations


def attempts(rows: list[dict]) -> list[dict]:
    """Each attempt that recorded its size, oldest first: ``{"attempt": i (from 1), "world_size", "step" (where
    it began), "started", "loop_started", "end" (its last step row's time, or its loop start when it logged no
    step), "last_step"}``. Wall-clock times, as the rows hold them."""
    rows_a = sorted((r for r in rows if r.get("event") == "attempt"), key=lambda r: r["started"])
    steps = sorted((r for r in rows if "loss" in r and "time" in r), key=lambda r: r["time"])
    resumes = [r for r in rows if r.get("event") == "resume" and "time" in r]
    out = []
    for i, r in enumerate(rows_a):
        nxt = rows_a[i + 1]["started"] if i + 1 < len(rows_a) else float("inf")
        # the steps this attempt trained and the run kept (a failed attempt's steps after the commit it died
        # past were dropped and trained again by the next: they are not here)
        mine = [s for s in steps if r["loop_started"] <= s["time"] < nxt]
        end = mine[-1]["time"] if mine else r["loop_started"]
        after = rows_a[i + 2]["started"] if i + 2 < len(rows_a) else float("inf")
        died = _last_alive(resumes, nxt, after)
        out.append({"attempt": i + 1, "world_size": r.get("world_size"), "step": r.get("step", 0),
                    "started": r["started"], "loop_started": r["loop_started"],
                    "end": max(end, died) if died is not None else end,
                    "last_step": mine[-1]["step"] if mine else None})
    return out


def _last_alive(resumes: list[dict], start: float, stop: float) -> float | None:
    """When an attempt wrote its last row, as the ``resume`` row of the attempt after it (written between
    ``start`` and ``stop``) measured it: ``down_s`` runs from that row to the new attempt's metrics writer,
    made just before its restore. The failed attempt trained until then, though its rows after the commit it
    resumed from were dropped."""
    for r in resumes:
        if start <= r["time"] < stop and r.get("down_s") is not None:
            return r["time"] - float(r.get("restore_s", 0.0)) - float(r["down_s"])
    return None


def changes(rows: list[dict]) -> list[dict]:
    """Every change of the run's size, in order: ``{"step", "from", "to", "kind", "source", "seconds",
    "total_s", "steps_redone"}``. ``kind``: ``"shrink"`` or ``"grow"``; ``step``: the step training continued
    from at the new size. ``source``: ``"resize"`` when a resize row says it (its parts in ``seconds``, from
    the old size's last step to the first at the new size in ``total_s``, the steps trained again), or
    ``"attempts"`` when only the attempts' sizes do (a run resumed at another size before the driver wrote
    resize rows): then the three figures are None."""
    resizes = [r for r in rows if r.get("event") == "resize"]
    unused = list(resizes)
    out = [_resize(r) for r in resizes]
    seq = [a for a in attempts(rows) if a["world_size"] is not None]
    for prev, cur in zip(seq, seq[1:], strict=False):
        if prev["world_size"] == cur["world_size"]:
            continue
        match = next((r for r in unused if r.get("from") == prev["world_size"] and r.get("to") == cur["world_size"]),
                     None)
        if match is not None:  # the resize row says this change, with its parts
            unused.remove(match)
            continue
        out.append({"step": cur["step"], "from": prev["world_size"], "to": cur["world_size"],
                    "kind": _kind(prev["world_size"], cur["world_size"]), "source": "attempts", "seconds": None,
                    "total_s": None, "steps_redone": None})
    return sorted(out, key=lambda c: c["step"])


def _kind(old: int, new: int) -> str:
    return "shrink" if new < old else "grow"


def _resize(r: dict) -> dict:
    seconds = r.get("seconds")
    return {"step": r["step"], "from": r["from"], "to": r["to"], "kind": r.get("kind") or _kind(r["from"], r["to"]),
            "source": "resize", "seconds": dict(seconds) if isinstance(seconds, dict) else None,
            "total_s": r.get("total_s"), "steps_redone": r.get("steps_redone")}


def path(rows: list[dict]) -> list[int]:
    """The sizes the run trained at, in order, each once per stretch: ``[3, 2, 3]``."""
    out: list[int] = []
    for a in attempts(rows):
        w = a["world_size"]
        if w is not None and (not out or out[-1] != w):
            out.append(w)
    return out


def path_text(sizes: list[int]) -> str:
    """``[3, 2, 3]`` -> ``"3 -> 2 -> 3"`` (the arrow in words a page or a PNG title can show alike)."""
    return " \u2192 ".join(map(str, sizes))
