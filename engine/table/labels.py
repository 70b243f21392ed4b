"""Labels of ingested files: a mapping file (CSV or JSON), the class folder, and the one spelling of a class.

A label comes from the mapping (by path relative to the source, then by file name) or from the first folder level
(the level below the split folder for a source in split folders), and is normalised to Unicode NFC
(``normalise_label``): macOS writes names in NFD, Linux keeps what was typed (usually NFC), so ``café`` can reach
one collection spelled two ways, and two classes that look the same would split one class in two.
"""

from __future__ import annotations

import csv
import io as _io
import json
import posixpath
import unicodedata

from .. import io
from ..errors import ConfigError, SourceError


def load_labels(uri: str) -> dict[str, str]:
    """Read a label mapping: JSON ``{"name or rel/path": "label"}`` or CSV rows ``name,label`` (header optional)."""
    fix = "pass a CSV (name,label) or JSON mapping file"
    try:
        # bounded, and only a regular file is opened (a FIFO would block the open, a device never end)
        data = io.read_capped(uri, io.MAX_MANIFEST_BYTES)
    except (FileNotFoundError, IsADirectoryError):
        raise SourceError(f"--labels {uri!r} does not exist; {fix}") from None
    except io.NotRegularFileError as e:
        raise SourceError(f"--labels {uri!r} is a {e.kind}, not a file; {fix}") from None
    except io.FileTooLargeError:
        raise ConfigError(
            f"--labels {uri!r} is larger than {io.MAX_MANIFEST_BYTES} bytes, far more than a label mapping holds; {fix}"
        ) from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--labels {uri!r} is not UTF-8 text ({e}); {fix}") from None
    if uri.lower().endswith(".json"):
        try:
            mapping = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"--labels {uri!r} is not valid JSON ({e}); write an object {{name: label}}"
            ) from None
        if not isinstance(mapping, dict):
            raise ConfigError(f"--labels {uri!r} must hold a JSON object {{name: label}}")
        return _with_nfc_keys({str(k): str(v) for k, v in mapping.items()})
    mapping = {}
    for row in csv.reader(_io.StringIO(text)):
        if not row or not row[0].strip():
            continue
        if len(row) < 2:
            raise ConfigError(f"--labels {uri!r}: row {row!r} needs two columns; write name,label per line")
        key, label = row[0].strip(), row[1].strip()
        if (
            not mapping
            and key.lower() in ("path", "file", "filename", "name", "uri")
            and label.lower() == "label"
        ):
            continue  # header
        mapping[key] = label
    return _with_nfc_keys(mapping)


def _with_nfc_keys(mapping: dict[str, str]) -> dict[str, str]:
    """``mapping`` plus each key's NFC spelling (where no key has it already), so a file name the file system
    wrote in another normal form (macOS writes NFD) still finds its label."""
    out = dict(mapping)
    for key, label in mapping.items():
        out.setdefault(unicodedata.normalize("NFC", key), label)
    return out


def label_for(rel: str, mapping: dict[str, str] | None, split_folders: bool = False) -> str | None:
    """Label of a file from its path relative to the source: the mapping (by rel path, then name, each as written
    and then in NFC), else its first folder level, or with ``split_folders`` the level below its split folder
    (``train/cat/a.png`` -> ``cat``). Not yet normalised: see ``normalise_label``."""
    if mapping is not None:
        for key in (rel, posixpath.basename(rel)):
            for spelling in (key, unicodedata.normalize("NFC", key)):
                if spelling in mapping:
                    return mapping[spelling]
        return None
    if split_folders:
        rel = rel.partition("/")[2]
    folder = posixpath.dirname(rel)
    return folder.split("/")[0] if folder else None


def normalise_label(label: str | None) -> str | None:
    """A class name in Unicode NFC: one class however the file system or the keyboard composed its letters."""
    return None if label is None else unicodedata.normalize("NFC", label)
