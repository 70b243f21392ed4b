"""Generated images and metadata tables for cache tests, written through the table format contract directly
(so cache tests do not depend on ingest). Everything is generated in code: no downloaded data; shapes come from
the engine's one generator (``dutycycle.engine.synth.draw_shapes``)."""

from __future__ import annotations

import hashlib
import io as _io

import numpy as np
import pyarrow as pa
from dutycycle.engine import imageinfo, io
from dutycycle.engine.synth import CLASSES as SHAPE_CLASSES
from dutycycle.engine.synth import draw_shapes
from dutycycle.engine.table import format as tf
from dutycycle.engine.table.commit import write_version
from PIL import Image, ImageFilter

CLASSES = list(SHAPE_CLASSES)


def shape_image(index: int, w: int, h: int, seed: int = 0) -> tuple[Image.Image, str]:
    """Shape image ``index`` of the default synthetic data at ``w`` x ``h``, and its class name."""
    pixels, labels = draw_shapes(1, (h, w), seed, start=index)
    return Image.fromarray(pixels[0]), CLASSES[labels[0]]


def photo_image(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    """Photograph-like content: smooth illumination gradients, blurred blobs, fine texture and sensor noise."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack(
        [
            128 + 90 * np.sin(x / w * rng.uniform(1, 4) + rng.uniform(0, 6)) * np.cos(y / h * rng.uniform(1, 3)),
            128 + 80 * np.cos((x + y) / (w + h) * rng.uniform(2, 6)),
            128 + 70 * np.sin(y / h * rng.uniform(1, 5) + rng.uniform(0, 6)),
        ],
        axis=-1,
    )
    for _ in range(6):  # soft objects
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(0.05, 0.3) * min(w, h)
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))[..., None]
        base = base * (1 - blob) + rng.uniform(0, 255, 3) * blob
    texture = 12 * np.sin(x * rng.uniform(0.5, 1.5)) * np.sin(y * rng.uniform(0.5, 1.5))
    noise = rng.normal(0, 6, base.shape)
    arr = np.clip(base + texture[..., None] + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(arr, "RGB").filter(ImageFilter.GaussianBlur(0.6))


def jpeg_bytes(img: Image.Image, orientation: int = 1, quality: int = 90) -> bytes:
    buf = _io.BytesIO()
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    img.save(buf, "JPEG", quality=quality, exif=exif.tobytes())
    return buf.getvalue()


def png_bytes(img: Image.Image, **kw) -> bytes:
    buf = _io.BytesIO()
    img.save(buf, "PNG", **kw)
    return buf.getvalue()


def sample_id(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def split_of(sid: str) -> str:
    v = int(sid[:8], 16) % 10
    return "train" if v < 8 else "val"


def common_folder(uris: list[str]) -> str:
    """The deepest folder holding every one of ``uris`` (compared by '/'-separated parts, scheme kept)."""
    parts = [u.split("/")[:-1] for u in uris]
    common = parts[0] if parts else []
    for p in parts[1:]:
        k = 0
        while k < min(len(common), len(p)) and common[k] == p[k]:
            k += 1
        common = common[:k]
    return "/".join(common)


def write_table(table_uri: str, rows: list[dict], classes: list[str] = CLASSES, roots: list[str] | None = None) -> str:
    """Commit ``rows`` (dicts of table columns; missing ones null) as the next version of the table. ``roots``:
    the source roots it records (rows outside them are refused by readers); default: the folder holding every
    row's file, as an ingest of that folder would record."""
    cols = {name: [r.get(name) for r in rows] for name in tf.SCHEMA.names}
    t = pa.table({name: pa.array(cols[name], tf.SCHEMA.field(name).type) for name in tf.SCHEMA.names}, tf.SCHEMA)
    if roots is None:
        folder = common_folder([r["uri"] for r in rows if r.get("uri")])
        roots = [folder] if folder else []
    write_version(table_uri, t, classes=classes, source="tests", options={"roots": list(roots)})
    return table_uri


def add_file(images_uri: str, name: str, data: bytes, label: str | None, error: str | None = None) -> dict:
    """Store ``data`` under ``images_uri/name`` and return its table row."""
    uri = io.join(images_uri, name)
    fs, path = io.filesystem(uri)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "wb") as f:
        f.write(data)
    sid = sample_id(data)
    row = {"sample_id": sid, "uri": uri, "size_bytes": len(data), "label": label, "split": split_of(sid),
           "orientation": 1, "error": error}
    if error is None:
        img = Image.open(_io.BytesIO(data))
        row.update(format=img.format, width=img.width, height=img.height, mode=img.mode, channels=len(img.getbands()))
    return row


def make_shapes_table(root_uri: str, n: int = 40, seed: int = 0, n_errors: int = 0, size=(48, 96)) -> tuple[str, list[dict]]:
    """``n`` shape JPEGs (random sizes, some with EXIF orientation) plus ``n_errors`` error rows."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        w, h = (int(v) for v in rng.integers(size[0], size[1] + 1, 2))
        img, kind = shape_image(i, w, h, seed)
        data = jpeg_bytes(img, orientation=int(rng.choice([1, 1, 3, 6, 8])))
        rows.append(add_file(io.join(root_uri, "images"), f"{kind}/{i:04d}.jpg", data, kind))
    for i in range(n_errors):
        data = b"not an image %d" % i
        error = f"{imageinfo.NOT_IMAGE}: no known image signature"
        rows.append(add_file(io.join(root_uri, "images"), f"broken/{i:04d}.jpg", data, "circle", error=error))
    return write_table(io.join(root_uri, "table"), rows), rows
