"""What a generated page must not show a person: program values instead of words and numbers."""

from __future__ import annotations

import re

# a Python None, a dict or list repr, a float printed with all its digits (15.163434147000771)
RAW = [(re.compile(r"\bNone\b"), "None"), (re.compile(r"\{'|'\}|\['|\[\d"), "a dict or list repr"),
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


def unresolved(page: str, folder) -> list[str]:
    """The links and images of ``page`` (saved in ``folder``) that a browser could not open: an embedded image
    that is not a PNG, a local file that is not there. Web addresses are out of scope (none are generated)."""
    import base64
    import os

    bad = []
    for ref in re.findall(r"(?:href|src)='([^']*)'", page):
        if ref.startswith("data:image/png;base64,"):
            if not base64.b64decode(ref.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n":
                bad.append(ref[:60])
        elif ref.startswith(("http://", "https://")):
            bad.append(f"an address outside the run: {ref}")
        else:
            path = ref.removeprefix("file://")
            if not os.path.exists(os.path.join(folder, path)):
                bad.append(ref)
    return bad
