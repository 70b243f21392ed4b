"""Figures for people, as the rendered docs print them: the numbers as ``dutycycle.engine.numbers`` writes them
(under the short names the renderers call), and the markdown pieces (tables, wrapped paragraphs, the source line
naming a results file) a rendered block is made of."""

from __future__ import annotations

import textwrap
from pathlib import Path

from dutycycle.engine.numbers import count, elements, gbit, mib, millis, rate  # noqa: F401 - the renderers' names
from dutycycle.engine.numbers import percent as pct  # noqa: F401
from dutycycle.engine.numbers import ratio as times  # noqa: F401
from dutycycle.engine.numbers import seconds as secs  # noqa: F401
from dutycycle.engine.numbers import size as nbytes  # noqa: F401

from benchmarks._common import markdown_table as table  # noqa: F401 - the blocks' table

RESULTS = Path("benchmarks") / "results"
WRAP = 115  # generated prose and recorded verdict lines, wrapped like the hand-written lines around them


def source(*names: str) -> str:
    files = ", ".join(f"`{RESULTS.as_posix()}/{n}.json`" for n in names)
    return f"Source: {files}."


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
