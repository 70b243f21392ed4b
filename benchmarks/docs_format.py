"""Figures for people, as the rendered docs print them: rates, durations, byte counts, shares, ratios, and the
markdown pieces (tables, wrapped paragraphs, the source line naming a results file) a rendered block is made of."""

from __future__ import annotations

import textwrap
from pathlib import Path

from benchmarks._common import markdown_table as table  # noqa: F401 - the blocks' table

RESULTS = Path("benchmarks") / "results"
WRAP = 115  # generated prose and recorded verdict lines, wrapped like the hand-written lines around them


def _three_figures(v: float) -> str:
    """Three significant figures for 1 <= v < 1000 (fewer below 1): 338, 11.0, 1.04."""
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def rate(x: float) -> str:
    """A throughput (samples/s, images/s): 338k, 11.0k, 1.04k, 538, 28.7."""
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    return f"{_three_figures(x / 1e3)}k" if x >= 1e3 else _three_figures(x)


def secs(x: float | None) -> str:
    """A duration given in seconds: 4.4 ms, 27 ms, 2.68 s, 14.6 s, 3 min 32 s."""
    if x is None:
        return "-"
    if x < 1e-3:
        return f"{x * 1e6:.0f} µs"
    if x < 0.01:
        return f"{x * 1e3:.1f} ms"
    if x < 1:
        return f"{x * 1e3:.0f} ms"
    if x < 10:
        return f"{x:.2f} s"
    if x < 60:
        return f"{x:.1f} s"
    minutes, rest = divmod(round(x), 60)
    return f"{minutes} min {rest} s"


def millis(x: float) -> str:
    """A duration already in milliseconds."""
    return f"{x:.0f} ms" if x >= 10 else f"{x:.1f} ms"


def nbytes(x: float) -> str:
    """A byte count in binary units, three significant figures: 84.3 MiB, 651 MiB, 2.35 GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= size:
            return f"{_three_figures(x / size)} {unit}"
    return f"{x:.0f} B"


def mib(x: float) -> str:
    """A size already in MiB (the benchmarks record memory that way)."""
    return nbytes(x * 2**20)


def pct(frac: float, digits: int | None = None) -> str:
    """A share of a whole: 64%, 0.3%; ``digits`` fixes the decimals."""
    v = frac * 100
    if digits is None:
        digits = 0 if abs(v) >= 10 or v == 0 else 1
    return f"{v:.{digits}f}%"


def times(x: float) -> str:
    """A ratio: 628x, 20.4x, 1.12x, 0.0088x."""
    if x >= 100:
        return f"{x:,.0f}x"
    return f"{_three_figures(x)}x" if x >= 0.1 else f"{x:.2g}x"


def count(n: float) -> str:
    return f"{round(n):,}"


def elements(n: int) -> str:
    """A tensor length in Mi elements: 4M, 16M."""
    return f"{n / 2**20:.0f}M" if n >= 2**20 else f"{n / 2**10:.0f}K"


def source(*names: str) -> str:
    files = ", ".join(f"`{RESULTS.as_posix()}/{n}.json`" for n in names)
    return f"Source: {files}."


def gbit(x: float) -> str:
    return f"{x:.3g} Gbit/s"


def para(text: str) -> str:
    """Generated prose, wrapped like the hand-written lines around it."""
    return "\n".join(textwrap.wrap(text, WRAP, break_on_hyphens=False))


def sentence(text: str) -> str:
    """A note recorded in a results file, as a sentence."""
    text = text.strip().rstrip(".")
    return text[:1].upper() + text[1:] + "."


def verdict_block(text: str) -> str:
    lines = textwrap.wrap("[diagnose] verdict: " + text, WRAP, break_on_hyphens=False)
    return "```\n" + "\n".join(lines) + "\n```"


def command_line(text: str) -> str:
    """``cmd (a remark)`` as code followed by the remark."""
    cmd, sep, rest = text.partition(" (")
    return f"`{cmd}`" + (f" ({rest}" if sep else "")
