"""Generated images and metadata tables for cache tests, written through the table format contract directly
(so cache tests do not depend on ingest). Everything is generated in code: no downloaded data."""

from __future__ import annotations

import hashlib
import io as _io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from dutycycle.engine import io
from dutycycle.engine.table import format as tf
from PIL import Image, ImageDraw, ImageFilter

CLASSES = ["circle", "square", "triangle"]


def shape_image(rng: np.random.Generator, w: int, h: int, kind: str) -> Image.Image:
    """A flat-coloured shape on a contrasting background (the project's default synthetic data)."""
    bg = tuple(int(v) for v in rng.integers(0, 90, 3))
    fg = tuple(int(v) for v in rng.integers(150, 256, 3))
    img = Image.new("RGB", (w, h), bg)
    d = ImageDraw.Draw(img)
    r = min(w, h) // 3
    cx, cy = w // 2 + int(rng.integers(-r // 3, r // 3 + 1)), h // 2 + int(rng.integers(-r // 3, r // 3 + 1))
    if kind == "circle":
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fg)
    elif kind == "square":
        d.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fg)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fg)
    return img


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


def write_table(table_uri: str, rows: list[dict], classes: list[str] = CLASSES, version: int = 1) -> str:
    """Write ``rows`` (dicts of table columns; missing ones null) as one Parquet file and commit the manifest."""
    cols = {name: [r.get(name) for r in rows] for name in tf.SCHEMA.names}
    t = pa.table({name: pa.array(cols[name], tf.SCHEMA.field(name).type) for name in tf.SCHEMA.names}, tf.SCHEMA)
    rel = f"{tf.version_dir(version)}/part-00000.parquet"
    fs, path = io.filesystem(io.join(table_uri, rel))
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "wb") as f:
        pq.write_table(t, f)
    tf.commit(table_uri, tf.TableManifest(version=version, files=[rel], num_rows=len(rows), classes=classes,
                                          source="tests"))
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
        kind = CLASSES[i % len(CLASSES)]
        w, h = (int(v) for v in rng.integers(size[0], size[1] + 1, 2))
        data = jpeg_bytes(shape_image(rng, w, h, kind), orientation=int(rng.choice([1, 1, 3, 6, 8])))
        rows.append(add_file(io.join(root_uri, "images"), f"{kind}/{i:04d}.jpg", data, kind))
    for i in range(n_errors):
        data = b"not an image %d" % i
        rows.append(add_file(io.join(root_uri, "images"), f"broken/{i:04d}.jpg", data, "circle", error="unidentified"))
    return write_table(io.join(root_uri, "table"), rows), rows
