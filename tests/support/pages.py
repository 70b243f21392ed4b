"""What a generated page must not show a person: program values instead of words and numbers."""

from __future__ import annotations

import re

# a Python None, a dict or list repr, a float printed with all its digits (15.163434147000771)
RAW = [(re.compile(r"\bNone\b"), "None"), (re.compile(r"\{'|'\}|\['"), "a dict or list repr"),
       (re.compile(r"\d+\.\d{5,}"), "a float repr")]


def raw_values(page: str) -> list[str]:
    """The raw program values ``page`` shows (embedded images left out: base64 may spell anything)."""
    text = re.sub(r"src='data:[^']*'", "", page)
    text = re.sub(r"<code>[^<]*</code>", "", text)  # paths and settings quoted as code may hold anything
    found = []
    for pattern, what in RAW:
        for m in pattern.finditer(text):
            found.append(f"{what}: ...{text[max(0, m.start() - 40):m.end() + 40]}...")
    return found
