"""Train / val / test splits: the names, the fractions a user passes, the split of one sample, and split folders.

Two ways a row gets its split at ingest:

- **by hash** (``assign_split``): a pure function of its content hash and the fractions, so identical files
  always land in the same split, whichever writer (ingest, a curated save) assigns it;
- **by folder** (``folder_layout``): a collection laid out ``train/<class>/...``, ``val/`` (or ``valid/``,
  ``validation/``) and ``test/`` above the class folders, as datasets are often shipped. The split is the top
  folder's (``validation`` and ``valid`` -> ``val``), the class the folder below it. Recognised only when every
  top-level folder holding images is a split name, compared case-insensitively; folders whose name starts with
  a dot and ``__MACOSX`` (archive debris) are not looked at. "Holding images" means holding a file with an image
  extension (``IMAGE_EXTENSIONS``), or any file when no file of the source has one (images named without
  extensions), so a ``docs/`` folder of notes beside ``train/`` and ``test/`` does not hide the layout.
"""

from __future__ import annotations

import hashlib
import posixpath
from dataclasses import dataclass, field

from ..errors import ConfigError

SPLIT_NAMES = ("train", "val", "test")
DEFAULT_SPLIT = (0.8, 0.1, 0.1)
# folder name (lower case) -> split: the names datasets ship their splits under
SPLIT_FOLDERS = {"train": "train", "val": "val", "valid": "val", "validation": "val", "test": "test"}
# extensions of the formats ingest decodes (limits.ALLOWED_FORMATS), lower case
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".apng", ".webp", ".gif", ".bmp", ".dib",
                              ".tif", ".tiff"})
IGNORED_FOLDERS = ("__MACOSX",)  # besides hidden ones (a leading dot): never a split, never a reason against one


def parse_split(text: str | tuple | list) -> tuple[float, float, float]:
    """``"0.8,0.1,0.1"`` -> ``(0.8, 0.1, 0.1)``; fractions for train, val, test that sum to 1."""
    parts = text.split(",") if isinstance(text, str) else list(text)
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ConfigError(
            f"--split {text!r} is not three numbers; use train,val,test fractions like 0.8,0.1,0.1"
        ) from None
    if len(values) != 3 or any(v < 0 for v in values) or abs(sum(values) - 1.0) > 1e-6:
        raise ConfigError(
            f"--split {text!r} must be three non-negative fractions (train,val,test) that sum to 1, e.g. 0.8,0.1,0.1"
        )
    return values[0], values[1], values[2]


def assign_split(sample_id: str, fractions: tuple[float, ...]) -> str:
    """Deterministic split from the content hash: identical files always land in the same split."""
    u = int(hashlib.sha256(("split:" + sample_id).encode()).hexdigest()[:15], 16) / float(1 << 60)
    edge = 0.0
    for name, frac in zip(SPLIT_NAMES, fractions, strict=True):
        edge += frac
        if u < edge:
            return name
    return SPLIT_NAMES[-1]


@dataclass(frozen=True)
class FolderLayout:
    """How a source's top-level folders holding images relate to splits: ``found`` maps those named like a split
    (as named on disk) to the split, ``others`` lists the rest. The source is laid out in split folders
    (``recognised``) when there are some of the first and none of the second; ``splits`` is then ``found``, else
    empty."""

    found: dict[str, str] = field(default_factory=dict)
    others: tuple[str, ...] = ()

    @property
    def recognised(self) -> bool:
        return bool(self.found) and not self.others

    @property
    def splits(self) -> dict[str, str]:
        return dict(self.found) if self.recognised else {}

    def split_of(self, rel: str) -> str | None:
        """The split of the file at ``rel`` (relative to the source): its top folder's; None outside them."""
        top, sep, _ = rel.partition("/")
        return self.splits.get(top) if sep else None


def _ignored(folder: str) -> bool:
    return folder.startswith(".") or folder in IGNORED_FOLDERS


def folder_layout(rels) -> FolderLayout:
    """The split folders of a source from its files' paths relative to it (see the module docstring), in one pass
    over ``rels`` (an iterable: a streamed listing is not held), keeping a few flags per top-level folder."""
    has_ext = False
    with_image: set[str] = set()  # top-level folders holding a file with an image extension
    with_file: set[str] = set()  # ... holding any file
    for rel in rels:
        image = posixpath.splitext(rel)[1].lower() in IMAGE_EXTENSIONS
        has_ext = has_ext or image
        top, sep, _ = rel.partition("/")
        if not sep or _ignored(top):
            continue
        with_file.add(top)
        if image:
            with_image.add(top)
    holding = with_image if has_ext else with_file
    found = {f: SPLIT_FOLDERS[f.lower()] for f in sorted(holding) if f.lower() in SPLIT_FOLDERS}
    return FolderLayout(found, tuple(sorted(f for f in holding if f.lower() not in SPLIT_FOLDERS)))


def describe_folders(splits: dict[str, str]) -> str:
    """``train/ -> train, Validation/ -> val`` for messages."""
    return ", ".join(f"{f}/" + ("" if f == s else f" -> {s}") for f, s in sorted(splits.items()))


def describe_assignment(a: dict) -> str:
    """A table's ``options.split_assignment`` in words: "from split folders train/, test/", "by content hash
    (0.8,0.1,0.1)", "by resplit(...)"."""
    if a.get("by") == "folders":
        return f"from split folders {describe_folders(a.get('folders') or {})}"
    if a.get("by") == "resplit":
        return f"by {a.get('operation', 'a resplit')}"
    return f"by content hash ({','.join(map(str, a.get('fractions') or DEFAULT_SPLIT))})"
